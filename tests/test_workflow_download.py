"""Data downloaded by either tool works with the other (monai.apps.TciaDataset <-> scripts.data.tcia), and
train.yaml's `download: true` downloads, then prepares, and stops clearly on a failed series."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from fake_nbia import COLLECTION, FAST, FakeNbia, case_dir, served_case
from scripts.data.tcia import TciaError, download

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def synthetic_source(tmp_path_factory):
    from scripts.data.synthetic import write_case

    root = tmp_path_factory.mktemp("source")
    # two segments, every frame stored: MONAI's PydicomReader needs per-frame segment ids and no omitted frames
    # (our reader does not; the real NSCLC SEGs have both)
    truths = [
        write_case(root, f"LUNG1-00{i}", seed=i, shape=(48, 48, 12), segments=["GTV-1", "Lung-Left"], sparse_seg=False)
        for i in (1, 2)
    ]
    return root, [served_case(Path(t["image_dir"]).parent) for t in truths], truths


def prepared_labels(dataset_dir: Path, out: Path) -> dict:
    from scripts.data.prepare import prepare

    report = prepare(dataset_dir, out, num_workers=1, progress=False)
    assert report["num_rejected"] == 0, report["rejected"]
    return {r["case_id"]: nib.load(out / r["label"]).get_fdata() for r in report["cases"]}


def test_a_folder_downloaded_by_monai_tciadataset_prepares_unchanged(synthetic_source, tmp_path, monkeypatch):
    """MONAI's own downloader (pointed at the fake server) builds the folder; our prepare reads it as it is."""
    pytest.importorskip("requests")
    import monai.apps.tcia.utils as tcia_utils
    from monai.apps import TciaDataset

    source, cases, _ = synthetic_source
    (tmp_path / "monai").mkdir()
    with FakeNbia(cases) as server:
        monkeypatch.setattr(tcia_utils, "BASE_URL", server.url)
        TciaDataset(tmp_path / "monai", COLLECTION, "training", download=True, val_frac=0.0, progress=False,
                    transform=lambda x: x)  # fmt: skip
    made_by_monai = tmp_path / "monai" / COLLECTION
    assert (made_by_monai / "raw").is_dir()  # TciaDataset's own leftovers, ignored by prepare
    assert (case_dir(tmp_path / "monai", cases[0]) / "image" / "LICENSE").is_file()  # getImage zips carry a LICENSE
    ours = prepared_labels(source, tmp_path / "from_source")
    theirs = prepared_labels(tmp_path / "monai", tmp_path / "from_monai")
    assert sorted(theirs) == ["LUNG1-001", "LUNG1-002"]
    for case_id, label in ours.items():
        assert label.sum() > 0
        np.testing.assert_array_equal(theirs[case_id], label)


def test_monai_tciadataset_loads_a_folder_we_downloaded(synthetic_source, tmp_path):
    """The reverse direction: TciaDataset (download=False) finds image and seg in our layout and reads the GTV."""
    from monai.apps import TciaDataset
    from monai.transforms import LoadImaged

    _, cases, truths = synthetic_source
    with FakeNbia(cases) as server:
        summary = download(tmp_path, base_url=server.url, **FAST)
    assert len(summary.downloaded) == 2 and not summary.failed
    loader = LoadImaged(keys=["image", "seg"], reader="PydicomReader", label_dict={"GTV-1": 0, "Lung-Left": 1})
    dataset = TciaDataset(tmp_path, COLLECTION, "training", transform=loader, val_frac=0.0, cache_num=0, progress=False)
    gtv_voxels = {t["patient_id"]: t["tumour"]["num_voxels"] for t in truths}
    assert len(dataset) == 2
    for item in dataset:
        assert item["image"].shape == (48, 48, 12) and item["seg"].shape == (48, 48, 12, 2)
        assert int(item["seg"][..., 0].sum()) == gtv_voxels[Path(item["image"].meta["filename_or_obj"]).parts[-3]]


def train_config(tmp_path: Path, **overrides):
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config(str(ROOT / "configs" / "train.yaml"))
    parser.update({"bundle_root": str(ROOT), "dataset_dir": str(tmp_path / "data"), "prepare_workers": 1, **overrides})
    return parser


def test_train_config_with_download_true_downloads_then_prepares(synthetic_source, tmp_path):
    """`--download true` as typed on the command line: setup's download and prepare steps, on the fake server."""
    _, cases, _ = synthetic_source
    with FakeNbia(cases) as server:
        parser = train_config(tmp_path, download="true", tcia_base_url=server.url)
        summary = parser.get_parsed_content("acquire_data")
        report = parser.get_parsed_content("prepare")
    assert sorted(r.patient_id for r in summary.downloaded) == ["LUNG1-001", "LUNG1-002"]
    assert report["num_prepared"] == 2
    datalist = json.loads((tmp_path / "data" / "NSCLC-Radiomics-prepared" / "datalist.json").read_text())
    assert sorted(d["case_id"] for k in ("training", "validation", "test") for d in datalist[k]) == [
        "LUNG1-001", "LUNG1-002",
    ]  # fmt: skip


def test_train_config_download_stops_on_a_failed_series_and_says_how_to_resume(synthetic_source, tmp_path):
    _, cases, _ = synthetic_source
    with FakeNbia(cases) as server:
        server.forbidden.add(cases[1].seg_uid)
        parser = train_config(tmp_path, download=True, tcia_base_url=server.url)
        with pytest.raises(RuntimeError) as err:  # monai.bundle wraps the error of a config expression
            parser.get_parsed_content("acquire_data")
    cause = err.value.__cause__
    assert isinstance(cause, TciaError) and "1 series could not be downloaded" in str(cause)
    assert "LUNG1-002" in str(cause) and "Run the same command again" in str(cause)
    assert (case_dir(tmp_path / "data", cases[0]) / "image").is_dir()  # the good case is complete


def test_train_config_downloads_nothing_by_default(tmp_path):
    assert train_config(tmp_path, tcia_base_url="http://127.0.0.1:9/").get_parsed_content("acquire_data") is None
