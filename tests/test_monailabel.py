"""MONAI Label (its ``monaibundle`` app: the server of 3D Slicer's and OHIF's MONAI Label plugins) with this bundle
copied in as it is released, under ``apps/monaibundle/model/<name>/``.

First the bundle's side of MONAI Label's contract, without MONAI Label, as MONAI Label 0.8.5's ``BundleInferTask``
and ``BundleTrainTask`` (``monailabel/tasks/{infer,train}/bundle.py``) use the configs:

* inference: MONAI Label prefers ``pre_transforms`` / ``post_transforms`` (configs/inference.yaml, above its GENERATED
  line) to ``preprocessing`` / ``postprocessing``, puts the path of a NIfTI file or DICOM folder under ``image`` and
  ``image_path``, and runs its own ``network_def`` with models/model.pt through ``inferer`` (MONAI's sliding window,
  here run by PyTorch); on the chest phantom that gives the bundle's own inference, the windows in the same thorax box;
* training: it runs ``configs/train.json`` with its own ``train#dataset#data`` and ``validate#dataset#data``, a
  ``device`` string, ``train#trainer#max_epochs`` and a CheckpointLoader inserted into ``train#handlers`` (which it
  reads as mappings); such a run prepares nothing and writes its best weights to ``model_path``.

Then the real MONAI Label 0.8.5 (skipped where it is not installed: ``pip install --no-deps -r
requirements-monailabel.txt``), in a process of its own, since it unloads and reloads the bundle's ``scripts`` package
and sets up logging: the app object its server builds (``app_instance`` on ``apps/monaibundle`` as ``monailabel apps
--download --name monaibundle`` writes it, with a studies folder of its own) serving REQUESTS inference requests in a
row -- a NIfTI file, a DICOM series, then the NIfTI again, the network in the bundle's CPU runtime (OpenVINO) -- with
one training round on two labelled studies (one to train on, one to validate) after the first half, in a process of its
own as the server runs it (``python tests/test_monailabel.py --train WORK_DIR``), whose weights the later requests run;
each request's seconds, what the runtime logged, and the process's memory, threads and children. Then, in the same
process, ``monai.bundle run inference`` of the copied bundle on REQUESTS copies of the NIfTI with its DataLoader workers
(forked after OpenVINO's threads started): the same label map as MONAI Label's, from the export MONAI Label made. The
network is SwinUNETR at feature size 12 on 64 x 64 x 32 windows at 2 x 2 x 3 mm (as tests/test_model_zoo.py and the
demo run it), set in the copy's configs; everything else is the configs as shipped. The program MONAI Label runs in is
at the bottom of this file (``python tests/test_monailabel.py WORK_DIR``), with the two workarounds MONAI Label 0.8.5
needs beside this bundle's pinned packages.

And the install lines of docs/monailabel.md (its "Install" section; requirements-monailabel.txt goes in with
``--no-deps``, so nothing it does not name comes along): every module MONAI Label's command, server and app and
pydicom-seg import at start-up comes from a package they install (from that page and the requirement files alone, no
MONAI Label needed); and, where MONAI Label is installed, `monailabel apps --download` and those imports work in a
process where nothing else can be imported (``python tests/test_monailabel.py --start-up-imports WORK_DIR``).
"""

from __future__ import annotations

import argparse
import ast
import gc
import hashlib
import importlib.util
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import zygote

ROOT = Path(__file__).resolve().parents[1]
NAME = "nsclc_swinunetr"
CANNOT_IMPORT = 77  # exit status of the MONAI Label program when monailabel cannot be imported
# the copy's settings: a network small enough for a CPU test (feature size 12 needs windows of 64 voxels in plane, as
# the demo's 64 x 64 x 32: at 32 x 32 x 32 the bottleneck is one voxel and InstanceNorm fails), on the demo's grid
SMALL = {"feature_size": 12, "roi_size": [64, 64, 32], "spacing": [2.0, 2.0, 3.0], "sw_batch_size": 2}
SMALL_TRAINING = {"val_interval": 1, "num_workers": 0, "cache": "none", "warmup_epochs": 0,
                  "gpu_monitor": False}  # fmt: skip
# the phantom's voxels (mm), also the network grid of the region test: coarse, so the test takes seconds
PHANTOM_GRID = [4.0, 4.0, 6.0]
MONAILABEL_MISSING = importlib.util.find_spec("monailabel") is None
INSTALL = "pip install --no-deps -r requirements-monailabel.txt (what CI installs; see that file)"
#: the variable that names the command starting the training process in place of ``python`` (the tests' zygote)
TRAIN_LAUNCHER = "TESTS_TRAIN_LAUNCHER"
REQUESTS = 20  # inference requests the MONAI Label program serves in one process, a training round halfway


class TumourBand(torch.nn.Module):
    """Logits of background and tumour: the tumour where the windowed HU lie within 100 HU of ``hu`` (the phantom's
    tumour; nothing else in it lies that close), so the label map shows which windows ran."""

    def __init__(self, hu: float = 300.0, window: tuple[float, float] = (-1000.0, 500.0)) -> None:
        super().__init__()
        self.low, self.high = ((hu + d - window[0]) / (window[1] - window[0]) for d in (-100.0, 100.0))

    def forward(self, x):
        inside = ((x > self.low) & (x < self.high)).float()
        return torch.cat([1.0 - inside, inside], dim=1)


def inference_parser(**overrides):
    """configs/inference.yaml alone, as MONAI Label and MONAI Deploy read it (``bundle_root`` set, as both set it)."""
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config(str(ROOT / "configs" / "inference.yaml"))
    parser.read_meta(str(ROOT / "configs" / "metadata.json"))
    parser.update({"bundle_root": str(ROOT), **overrides})
    return parser


def phantom_nifti(folder: Path) -> Path:
    """The chest phantom (scripts/data/phantom.py: lungs, mediastinum, arms, upper abdomen) with a tumour at 300 HU, as
    a NIfTI CT of 500 mm x 500 mm x 357 mm on the PHANTOM_GRID."""
    import nibabel as nib
    from scripts.data.phantom import chest

    step, slice_step = PHANTOM_GRID[0], PHANTOM_GRID[2]
    xs, zs = np.arange(-250.0, 250.0, step) + step / 2, np.arange(0.0, 357.0, slice_step) - 300.0
    hu, _, _ = chest(xs, xs, zs, "none", tumour_hu=300.0)
    lps = np.array([[step, 0, 0, xs[0]], [0, step, 0, xs[0]], [0, 0, slice_step, zs[0]], [0, 0, 0, 1]])
    path = folder / "chest.nii.gz"
    nib.save(nib.Nifti1Image(hu.astype(np.int16), np.diag([-1.0, -1.0, 1.0, 1.0]) @ lps), path)
    return path


def test_monai_label_transforms_and_inferer_give_our_inference_in_the_thorax(tmp_path):
    """What MONAI Label runs -- pre_transforms on {image, image_path}, ``inferer`` on its own network, post_transforms
    -- runs the windows in the thorax box sliding_window_inferer finds, and gives the label map of the bundle's
    inference (our preprocessing, sliding_window_inferer, MONAI's inverse_postprocessing) voxel for voxel, uint8, on the
    CT's grid, with ``image_path`` back for MONAI Label's writer."""
    from monai.transforms import Compose
    from scripts.inference.inputs import load_case

    ct = phantom_nifti(tmp_path)
    parser = inference_parser(spacing=PHANTOM_GRID, inference_backend="torch")  # TumourBand as it is: no weights
    network = TumourBand()

    theirs = {"image": str(ct), "image_path": str(ct), "device": "cpu"}  # MONAI Label's request, as it hands it over
    for transform in parser.get_parsed_content("pre_transforms").transforms:  # one at a time, as MONAI Label runs them
        theirs = transform(theirs)
    theirs_inferer = parser.get_parsed_content("inferer")
    theirs["pred"] = theirs_inferer(theirs["image"][None], network)[0]
    for transform in parser.get_parsed_content("post_transforms").transforms:
        theirs = transform(theirs)

    ours = parser.get_parsed_content("preprocessing")({"image": load_case(ct, "nifti")})
    inferer = parser.get_parsed_content("sliding_window_inferer")
    ours["pred"] = inferer(ours["image"][None], network)[0]
    ours = Compose(parser.get_parsed_content("inverse_postprocessing"))(ours)

    region = inferer.last
    assert region["method"] == "thorax" and region["windows"] < region["windows_whole_input"]
    assert {k: theirs_inferer.last[k] for k in ("start_voxel", "stop_voxel", "windows")} == {
        k: region[k] for k in ("start_voxel", "stop_voxel", "windows")}  # fmt: skip
    pred = theirs["pred"]
    assert pred.dtype == torch.uint8 and tuple(pred.shape[1:]) == tuple(load_case(ct, "nifti").shape[1:])
    assert int(pred.sum()) > 0 and set(np.unique(pred.numpy())) <= {0, 1}
    np.testing.assert_array_equal(pred.numpy(), ours["pred"].numpy().astype(np.uint8))
    assert theirs["image_path"] == str(ct) and "path_of_image" not in theirs


@pytest.mark.parametrize("config", ["train.yaml", "inference.yaml"])
@pytest.mark.parametrize("device", ["cpu", "cuda:1", "$torch.device('cpu')", "$torch.device('cuda', 0)"])
def test_the_switches_read_any_device_form(config, device):
    """MONAI Label sets ``device`` to a string ("cpu", "cuda:0"); the configs' own default is a torch.device."""
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config(str(ROOT / "configs" / config))
    parser.update({"bundle_root": str(ROOT), "device": device})
    on_cuda = "cuda" in device
    assert parser.get_parsed_content("flag#amp") is on_cuda
    if config == "train.yaml":
        assert parser.get_parsed_content("flag#fused_optimizer") is on_cuda


def monai_label_training_overrides(data: list[dict], weights: Path, max_epochs: int = 1, num_samples: int = 1) -> dict:
    """What MONAI Label 0.8.5's BundleTrainTask passes to ``monai.bundle.run`` with configs/train.json: its cases
    (``image`` and ``label`` only), the device as a string, the epochs, ``displayable_configs`` with the request's
    values (``num_samples``), and ``train#handlers`` as it reads it from the config unparsed, a CheckpointLoader of the
    served weights inserted first (``_load_checkpoint``)."""
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config(str(ROOT / "configs" / "train.json"))
    handlers = parser.get("train#handlers", [])
    if not [t for t in handlers if t.get("_target_") == "CheckpointLoader"]:  # MONAI Label's own test, on mappings
        handlers.insert(0, {"_target_": "CheckpointLoader", "load_path": str(weights),
                            "load_dict": {"model": "$@network"}, "strict": False})  # fmt: skip
    cases = [{"image": d["image"], "label": d["label"]} for d in data]
    return {"train#trainer#max_epochs": max_epochs, "train#dataset#data": cases[:-1], "device": "cpu",
            "train#handlers": handlers, "validate#dataset#data": cases[-1:],
            "displayable_configs": {"num_samples": num_samples}}  # fmt: skip


def test_training_given_its_cases_prepares_nothing_and_writes_the_served_weights(tiny_data, tmp_path):
    """A training run with MONAI Label's overrides (the network a small BasicUNet, the tests' network of mechanics):
    nothing is prepared (dataset_dir does not even exist), the CheckpointLoader loads the served weights first, the
    other handlers are the bundle's own, the learning-rate schedule spans the epochs MONAI Label asked for, and the best
    weights go to model_path with the labels beside them."""
    from conftest import MECHANICS_NETWORK
    from monai.bundle import ConfigParser, ConfigWorkflow
    from monai.handlers import CheckpointLoader, LrScheduleHandler

    datalist = json.loads((tiny_data / "prepared" / "datalist.json").read_text())
    data = [{k: str(tiny_data / "prepared" / v) for k, v in d.items() if k in ("image", "label")}
            for d in datalist["training"] + datalist["validation"]]  # fmt: skip
    network = ast.literal_eval(MECHANICS_NETWORK)
    served = tmp_path / "bundle" / "models" / "model.pt"
    served.parent.mkdir(parents=True)
    torch.save(ConfigParser({"net": network, "num_classes": 2}).get_parsed_content("net").state_dict(), served)
    workflow = ConfigWorkflow(
        config_file=str(ROOT / "configs" / "train.json"), meta_file=str(ROOT / "configs" / "metadata.json"),
        logging_file=False, workflow_type="train", bundle_root=str(ROOT), dataset_dir=str(tmp_path / "no-dicom"),
        output_dir=str(tmp_path / "run"), model_path=str(served), network_def=network, **SMALL, **SMALL_TRAINING,
        **monai_label_training_overrides(data[:3], served),
    )  # fmt: skip
    before = hashlib.sha256(served.read_bytes()).hexdigest()
    workflow.initialize()
    workflow.run()
    workflow.finalize()
    assert not (tmp_path / "no-dicom").exists(), "prepare neither read nor wrote anything"
    handlers = workflow.parser.get_parsed_content("train#handlers")
    assert isinstance(handlers[0], CheckpointLoader) and handlers[0].load_path == str(served)
    assert handlers[1] is workflow.parser.get_parsed_content("train#lr_schedule_handler")
    assert isinstance(handlers[1], LrScheduleHandler)
    schedule = workflow.parser.get_parsed_content("lr_scheduler")
    assert schedule.t_total == 1 * len(workflow.parser.get_parsed_content("train#dataloader"))
    assert hashlib.sha256(served.read_bytes()).hexdigest() != before, "the best weights replace the served ones"
    assert json.loads(served.with_suffix(".json").read_text())["labels"] == ["GTV-1"]
    assert (tmp_path / "run" / "checkpoints" / "latest.pt").is_file()


# ------------------------------------------------------------------------------------------------------------------
# the install lines of docs/monailabel.md against what MONAI Label imports
# What MONAI Label 0.8.5 imports when it starts -- its command (monailabel.main: `monailabel apps`, `start_server`;
# uvicorn brings click, and h11 once it serves), its server (monailabel.app), its datastores (a folder, DICOMweb), the
# monaibundle app -- and what pydicom-seg 0.4.1 imports (jsonschema, SimpleITK): the top-level module, and the
# distributions that must be installed for it. All of those requirements.txt does not bring, and the packages
# monailabel and pydicom-seg import directly from it. Found by importing them with nothing else importable
# (test_monai_label_starts_with_only_what_the_readme_installs keeps the list complete).
START_UP_IMPORTS = {
    "monailabel": "monailabel", "click": "click", "uvicorn": "uvicorn", "h11": "h11", "fastapi": "fastapi",
    "starlette": "starlette", "anyio": "anyio", "annotated_doc": "annotated-doc", "opentelemetry": "opentelemetry-api",
    "python_multipart": "python-multipart", "requests_toolbelt": "requests-toolbelt", "jwt": "PyJWT",
    "passlib": "passlib", "pydantic": "pydantic", "pydantic_core": "pydantic-core",
    "pydantic_settings": "pydantic-settings", "annotated_types": "annotated-types",
    "typing_inspection": "typing-inspection", "dotenv": "python-dotenv", "schedule": "schedule",
    "timeloop": "timeloop", "watchdog": "watchdog", "psutil": "psutil", "expiring_dict": "expiring-dict",
    "sortedcontainers": "sortedcontainers", "shapely": "shapely", "nrrd": "pynrrd", "girder_client": "girder-client",
    "diskcache": "diskcache", "cachetools": "cachetools", "google.auth": "google-auth", "rsa": "rsa",
    "pyasn1": "pyasn1", "pyasn1_modules": "pyasn1-modules", "itk": ("itk-core", "itk-io"), "itkConfig": "itk-core",
    "pydicom_seg": "pydicom-seg", "SimpleITK": "simpleitk", "jsonschema": "jsonschema",
    "jsonschema_specifications": "jsonschema-specifications", "referencing": "referencing", "rpds": "rpds-py",
    "attr": "attrs", "attrs": "attrs", "torchvision": "torchvision",
    # from requirements.txt (with its dependencies: typing_extensions comes with torch)
    "numpy": "numpy", "torch": "torch", "monai": "monai", "pydicom": "pydicom", "dicomweb_client": "dicomweb-client",
    "requests": "requests", "PIL": "pillow", "tqdm": "tqdm", "yaml": "pyyaml", "typing_extensions": "typing-extensions",
}  # fmt: skip


def canonical(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def readme_install_commands(root: Path = ROOT) -> list[list[str]]:
    """The arguments of every ``pip install`` in the "Install" section of docs/monailabel.md (its bash blocks)."""
    text = (root / "docs" / "monailabel.md").read_text()
    section = text.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:2] == ["pip", "install"]:
                commands.append(words[2:])
    return commands


def requirement_names(path: Path) -> list[str]:
    """The requirements a requirements file names (``-r`` followed), without versions or markers."""
    from packaging.requirements import Requirement

    names = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith(("-r ", "--requirement ")):
            names += requirement_names(path.parent / line.split()[1])
        elif line and not line.startswith("-"):
            names.append(str(Requirement(line).name) + "".join(f"[{e}]" for e in Requirement(line).extras))
    return names


def with_dependencies(names: list[str]) -> set[str]:
    """``names`` and, for those installed here, what they depend on (markers and extras as pip evaluates them),
    recursively: what ``pip install`` of them brings."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement

    brought, todo = set(), [Requirement(n) for n in names]
    while todo:
        requirement = todo.pop()
        key = (canonical(requirement.name), tuple(sorted(requirement.extras)))
        if key in brought:
            continue
        brought.add(key)
        try:
            requires = distribution(requirement.name).requires or []
        except PackageNotFoundError:
            continue
        for dependency in map(Requirement, requires):
            if dependency.marker is None or any(dependency.marker.evaluate({"extra": e})
                                                for e in (*requirement.extras, "")):  # fmt: skip
                todo.append(dependency)
    return {name for name, _ in brought}


def installed_by(commands: list[list[str]], root: Path = ROOT) -> set[str]:
    """The distributions ``commands`` install: what a ``--no-deps`` command names, and what the others name with their
    dependencies."""
    alone, with_deps = [], []
    for args in commands:
        names, words = [], iter(args)
        for word in words:
            if word in ("-r", "--requirement"):
                names += requirement_names(root / next(words))
            elif word in ("-i", "--index-url", "--extra-index-url", "-c", "--constraint", "-f", "--find-links"):
                next(words)
            elif not word.startswith("-"):
                names.append(word)
        (alone if "--no-deps" in args else with_deps).extend(names)
    from packaging.requirements import Requirement

    return {canonical(Requirement(n).name) for n in alone} | with_dependencies(with_deps)


def test_the_readme_install_lines_bring_every_module_monai_label_imports_at_start_up():
    """Each module of START_UP_IMPORTS comes from a package the install lines of docs/monailabel.md install:
    requirements-monailabel.txt names it (installed with --no-deps: nothing else comes), or requirements.txt brings it
    (installed with its dependencies). Where a module is installed here, the table's distribution is the one
    importlib.metadata names for it. No install, no MONAI Label needed."""
    from importlib.metadata import packages_distributions

    commands = readme_install_commands()
    assert ["--no-deps", "-r", "requirements-monailabel.txt"] in commands, commands
    brought = installed_by(commands)
    here = packages_distributions()
    missing = []
    for module, distributions in START_UP_IMPORTS.items():
        distributions = (distributions,) if isinstance(distributions, str) else distributions
        top = module.split(".")[0]  # google is a namespace: google.auth is google-auth's, google.protobuf protobuf's
        if top in here and ("." not in module or importlib.util.find_spec(module) is not None):
            assert {canonical(d) for d in distributions} <= {canonical(d) for d in here[top]}, module
        missing += [f"{module} ({d})" for d in distributions if canonical(d) not in brought]
    assert not missing, f"imported by MONAI Label at start-up, not installed by docs/monailabel.md: {missing}"


# ------------------------------------------------------------------------------------------------------------------
# the real MONAI Label 0.8.5
needs_monailabel = pytest.mark.skipif(MONAILABEL_MISSING, reason=f"monailabel is not installed: {INSTALL}")


@pytest.fixture(scope="module")
def monai_label(tiny_data, tmp_path_factory):
    """The MONAI Label program (bottom of this file) on two of tiny_data's cases, labelled, as the studies folder
    (NIfTI, labels in labels/final/ as MONAI Label keeps them) and the first case's DICOM series; its results."""
    work = tmp_path_factory.mktemp("monailabel")
    studies = work / "studies"
    (studies / "labels" / "final").mkdir(parents=True)
    datalist = json.loads((tiny_data / "prepared" / "datalist.json").read_text())
    cases = sorted(datalist["training"] + datalist["validation"], key=lambda d: d["image"])[:2]
    for case in cases:
        for key, folder in (("image", studies), ("label", studies / "labels" / "final")):
            source = tiny_data / "prepared" / case[key]
            shutil.copy(source, folder / f"{Path(case['image']).name.split('.')[0]}{''.join(source.suffixes)}")
    first = Path(cases[0]["image"]).name.split(".")[0]
    truth = json.loads((tiny_data / "data" / "synthetic_truth" / f"{first}.json").read_text())
    (work / "request.json").write_text(json.dumps({"nifti": str(next(studies.glob(f"{first}.nii*"))),
                                                   "dicom": truth["image_dir"]}))  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of the bundle on the path
    # the program and its training process: processes of their own forked from the tests' zygote (tests/zygote.py),
    # which has imported torch and MONAI (the training process by way of TRAIN_LAUNCHER)
    launch = zygote.launcher(env)
    if launch is not None:
        env.update(launch[1], **{TRAIN_LAUNCHER: shlex.join(launch[0])})
    started = time.perf_counter()
    done = zygote.run_python([__file__, str(work)], work, env, timeout=600)
    log = done.stdout + done.stderr
    if done.returncode == CANNOT_IMPORT:
        pytest.skip(f"monailabel cannot be imported here: {log.strip().splitlines()[-1]} ({INSTALL})")
    assert done.returncode == 0, log[-6000:]
    result = json.loads((work / "result.json").read_text())
    result["log"], result["seconds"]["program"] = log, round(time.perf_counter() - started, 1)
    print(f"MONAI Label program: {result['seconds']}")
    return work, result


@needs_monailabel
def test_monai_label_serves_the_model_named_as_the_metadata_names_its_output(monai_label):
    _, result = monai_label
    meta = json.loads((ROOT / "configs" / "metadata.json").read_text())
    channels = meta["network_data_format"]["outputs"]["pred"]["channel_def"]
    expected = {name.lower(): int(k) for k, name in channels.items() if name != "background"}  # MONAI Label's form
    assert result["info"]["labels"] == expected == {"gtv-1": 1}
    assert result["info"]["type"] == "segmentation" and result["trainer"] is True
    assert result["nifti"]["params"]["label_names"] == expected


@needs_monailabel
def test_monai_label_infers_on_a_nifti_file_and_a_dicom_series_on_their_own_grid(monai_label):
    """The label map MONAI Label writes has the input's shape and affine (for the DICOM series: the grid our reader
    gives it), is uint8 with 0 and 1 only, and the NIfTI file and the DICOM series of the same case give the same."""
    import nibabel as nib
    from scripts.data.dicom import read_ct_series

    work, result = monai_label
    request = json.loads((work / "request.json").read_text())
    image = nib.load(request["nifti"])
    ct = read_ct_series(request["dicom"])
    maps = {}
    for kind, shape, affine in (("nifti", image.shape, image.affine), ("dicom", ct.hu.shape, ct.affine_ras)):
        label = nib.load(result[kind]["file"])
        assert label.shape == tuple(shape), kind
        np.testing.assert_allclose(label.affine, affine, atol=1e-4, err_msg=kind)
        assert label.get_data_dtype() == np.uint8, kind
        maps[kind] = np.asarray(label.dataobj)
        assert set(np.unique(maps[kind])) <= {0, 1}, kind
    np.testing.assert_array_equal(maps["nifti"], maps["dicom"])


@needs_monailabel
def test_training_from_monai_label_writes_the_weights_it_then_serves(monai_label):
    """One round of MONAI Label's training (its cases, "cpu", one epoch, its CheckpointLoader; in a process of its own,
    as the server runs it): nothing prepared, the served weights loaded first, the best weights written to
    models/model.pt, and MONAI Label's later inference runs exactly those weights."""
    work, result = monai_label
    assert result["train"] == {}
    assert "Restored all variables from" in result["log"] and f"{NAME}/models/model.pt" in result["log"]
    assert result["weights"]["before"] != result["weights"]["after"]
    assert result["weights"]["served_equals_written"] is True
    assert not (work / "no-dicom").exists(), "prepare neither read nor wrote anything"
    bundle = work / "apps" / "monaibundle" / "model" / NAME
    assert (bundle / "runs" / "train" / "checkpoints" / "latest.pt").is_file()
    assert json.loads((bundle / "models" / "model.json").read_text())["labels"] == ["GTV-1"]


@needs_monailabel
def test_monai_label_serves_request_after_request_in_one_process_and_new_weights_get_a_new_export(monai_label):
    """REQUESTS inferences in one server process, a training round (in its own process, as the server runs it) after
    the first half: every request answers; on the CPU the network runs in OpenVINO, exported and compiled at the first
    request (each step logged with its seconds) and at the first after the training (the new weights: another
    SHA-256), every other request on the compiled model it has; the process's memory after the last request within
    10 % of the third's and flat within each half (no leak per request), its threads as after the third, no child
    process left."""
    _, result = monai_label
    requests = result["requests"]
    assert len(requests) == REQUESTS and all(Path(result[r["kind"]]["file"]).is_file() for r in requests)
    made = [i for i, r in enumerate(requests, 1) if any(m.startswith("exporting ") for m in r["runtime"])]
    assert made == [1, REQUESTS // 2 + 1], [r["runtime"] for r in requests]
    for i in made:
        log = " | ".join(requests[i - 1]["runtime"])
        assert re.search(r"exported in [\d.]+ s .* (bf16|f32), .* compiled in [\d.]+ s", log), log
    weights = [re.search(r"weights sha256 (\w+) ready", " ".join(requests[i - 1]["runtime"])).group(1) for i in made]
    assert weights[0] != weights[1], "the trained weights are not the first weights"
    for i, r in enumerate(requests, 1):
        if i not in made:
            assert len(r["runtime"]) == 1 and "are those it runs already" in r["runtime"][0], (i, r["runtime"])
    rss = [r["rss_mb"] for r in requests]
    assert rss[-1] <= 1.10 * rss[2], f"RSS (MB) after each request: {rss}"
    half = REQUESTS // 2
    assert max(rss[2:half]) <= 1.02 * rss[2] and max(rss[half + 1 :]) <= 1.02 * rss[half + 1], rss
    assert requests[-1]["threads"] == requests[2]["threads"], [(r["threads"], r["python_threads"]) for r in requests]
    assert not any(r["children"] for r in requests)


@needs_monailabel
def test_monai_label_gives_the_bundles_own_inference_with_the_same_weights_and_runtime(monai_label):
    """The last request's label map (the trained weights, OpenVINO) is, voxel for voxel, what ``monai.bundle run
    inference`` of the bundle copied into the app writes for the same CT; that run found MONAI Label's export and
    compiled model (loaded, not exported or compiled again)."""
    import nibabel as nib

    _, result = monai_label
    served = nib.load(result[f"request_{REQUESTS}"]["file"])
    ours = nib.load(result["bundle"]["files"][0])
    np.testing.assert_allclose(served.affine, ours.affine, atol=1e-4)
    labels = np.asarray(served.dataobj)
    assert 0 < int(labels.sum()) < labels.size, "both classes, so that the comparison means something"
    np.testing.assert_array_equal(labels, np.asarray(ours.dataobj))
    log = " | ".join(result["bundle"]["runtime"])
    assert "exporting" not in log and " loaded in " in log and " compiled in " not in log, log


@needs_monailabel
def test_an_inference_run_of_many_cases_with_forked_workers_after_the_runtime_started_answers_each_without_growing(
    monai_label,
):
    """``monai.bundle run inference`` on REQUESTS cases in the server's process, whose OpenVINO threads run already,
    with the config's DataLoader workers forked from it: every case is done and gives the same label map, the
    process's memory after the last case within 10 % of the third's and its threads the same after each case; once
    the run is dropped, no worker is left and no thread more than during it (its compiled model is kept: destroyed
    after its process forked, it would corrupt the heap; scripts.inference.backends._KEPT)."""
    import nibabel as nib

    _, result = monai_label
    run = result["bundle"]
    assert run["workers"] == 2 and run["before"]["threads"] > 1 + len(run["before"]["python_threads"])
    assert (run["done"], run["failed"]) == (REQUESTS, 0) and len(run["cases"]) == REQUESTS
    first = np.asarray(nib.load(run["files"][0]).dataobj)
    for file in run["files"][1:]:
        np.testing.assert_array_equal(np.asarray(nib.load(file).dataobj), first)
    rss = [case["rss_mb"] for case in run["cases"]]
    assert rss[-1] <= 1.10 * rss[2], f"RSS (MB) after each case: {rss}"
    assert any(case["children"] for case in run["cases"]), "the workers ran while the cases did"
    assert len({case["threads"] for case in run["cases"]}) == 1, "no thread more per case"
    assert not run["after"]["children"] and run["after"]["threads"] <= run["cases"][-1]["threads"], "nothing left"


@needs_monailabel
def test_monai_label_starts_with_only_what_the_readme_installs(tmp_path):
    """In a process where only the packages the lines of docs/monailabel.md install can be imported (everything else
    installed here, requirements-dev.txt's, hidden), `monailabel apps --download` writes the app, and MONAI Label's
    server, datastores, monaibundle app and pydicom-seg import; every module they import that requirements.txt does not
    bring is in START_UP_IMPORTS."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, __file__, "--start-up-imports", str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert (tmp_path / "apps" / "monaibundle" / "main.py").is_file()
    imported = json.loads((tmp_path / "imports.json").read_text())
    requirements = with_dependencies(["torch", *requirement_names(ROOT / "requirements.txt")])
    beyond = {module: dists for module, dists in imported.items() if not {canonical(d) for d in dists} & requirements}
    assert "click" in beyond and "jsonschema" in beyond, beyond
    assert set(beyond) <= set(START_UP_IMPORTS), f"add to START_UP_IMPORTS: {set(beyond) - set(START_UP_IMPORTS)}"


# ------------------------------------------------------------------------------------------------------------------
# The MONAI Label program: python tests/test_monailabel.py WORK_DIR (WORK_DIR holds studies/ and request.json)
def monai_label_workarounds() -> None:
    """What MONAI Label 0.8.5 needs beside this bundle's pinned packages (pydicom 3, torch 2.13.0+cpu): two modules it
    imports at the top cannot be imported. Neither is on the path this test takes, nor on a radiology app's."""
    import pydicom.uid

    # pydicom-seg 0.4.1 (imported by MONAI Label's datastore/utils/convert.py) takes SegmentationStorage from
    # pydicom._storage_sopclass_uids, which pydicom 3 removed; pydicom.uid holds the same UIDs
    sys.modules.setdefault("pydicom._storage_sopclass_uids", pydicom.uid)
    # transform/post.py imports torchvision.utils (make_grid, save_image: pathology apps only); PyPI has no torchvision
    # built for torch 2.13.0+cpu (its wheels need the CUDA build of torch): a stand-in module
    torchvision, utils = types.ModuleType("torchvision"), types.ModuleType("torchvision.utils")
    utils.make_grid = utils.save_image = None
    torchvision.utils = utils
    sys.modules.setdefault("torchvision", torchvision)
    sys.modules.setdefault("torchvision.utils", utils)


def copy_bundle(bundle: Path, no_dicom: Path, settings: dict = SMALL, weights: Path | None = None) -> None:
    """The bundle as released (configs, scripts, docs, LICENSE, large_files.yml and models/model.pt with its labels),
    with ``settings`` (the small network) in its configs, random weights of that network or ``weights`` (a file with
    its model.json beside it), and, for training, dataset_dir a folder that does not exist (prepare must not touch
    it). benchmarks/bench_inference.py copies the bundle as shipped with it too."""
    import yaml
    from monai.networks.nets import SwinUNETR

    for item in ("configs", "scripts", "docs", "LICENSE", "large_files.yml"):
        if (ROOT / item).is_dir():
            shutil.copytree(ROOT / item, bundle / item, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / item, bundle / item)
    train = json.loads((bundle / "configs" / "train.json").read_text())
    train.update(settings, **SMALL_TRAINING, dataset_dir=str(no_dicom))
    (bundle / "configs" / "train.json").write_text(json.dumps(train, indent=4))
    inference = yaml.safe_load((bundle / "configs" / "inference.yaml").read_text())
    inference.update(settings)
    (bundle / "configs" / "inference.yaml").write_text(yaml.safe_dump(inference, sort_keys=False, width=120))
    (bundle / "models").mkdir()
    if weights is not None:
        shutil.copy(weights, bundle / "models" / "model.pt")
        shutil.copy(weights.with_suffix(".json"), bundle / "models" / "model.json")
        return
    torch.manual_seed(0)
    torch.save(SwinUNETR(in_channels=1, out_channels=2, feature_size=settings["feature_size"]).state_dict(),
               bundle / "models" / "model.pt")  # fmt: skip
    (bundle / "models" / "model.json").write_text(json.dumps({"labels": ["GTV-1"]}))


def server_app(work: Path):
    """The app object of `monailabel start_server --app apps/monaibundle --studies studies --conf models <name>
    --conf zoo_source github`."""
    from monailabel.interfaces.utils.app import app_instance

    conf = {"models": NAME, "zoo_source": "github", "preload": "false", "sam2": "false"}
    return app_instance(str(work / "apps" / "monaibundle"), str(work / "studies"), conf)


def train_monai_label(work: Path) -> int:
    """One training round, as MONAI Label's server runs a POST /train in a process of its own: its cases, "cpu", one
    epoch, one patch (num_samples as 3D Slicer's Options -> Train sends it: configs/train.yaml's
    displayable_configs); the answer to WORK_DIR/train.json."""
    os.environ.update(MONAI_LABEL_DATASTORE_AUTO_RELOAD="false", MONAI_LABEL_SESSION_PATH=str(work / "sessions"))
    monai_label_workarounds()
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] [%(levelname)s] (%(name)s) %(message)s")
    answer = server_app(work).train({"model": NAME, "max_epochs": 1, "val_split": 0.5, "device": "cpu",
                                     "multi_gpu": False, "num_samples": 1})  # fmt: skip
    (work / "train.json").write_text(json.dumps(answer))
    return 0


def run_monai_label(work: Path) -> int:
    """The app object the server builds, asked as 3D Slicer asks: REQUESTS inferences (NIfTI, DICOM, then NIfTI), a
    training round after the first half; then the bundle's own inference of the same NIfTI."""
    os.environ.update(MONAI_LABEL_DATASTORE_AUTO_RELOAD="false", MONAI_LABEL_SESSION_PATH=str(work / "sessions"))
    monai_label_workarounds()
    try:
        from monailabel.main import Main
    except ImportError as err:
        print(f"{type(err).__name__}: {err}")
        return CANNOT_IMPORT

    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] [%(levelname)s] (%(name)s) %(message)s")
    clock, seconds = time.perf_counter(), {}
    request = json.loads((work / "request.json").read_text())
    # monailabel apps --download --name monaibundle --output apps; then the bundle copied in
    Main().action_apps(argparse.Namespace(download=True, name="monaibundle", output=str(work / "apps"), prefix=None))
    app_dir = work / "apps" / "monaibundle"
    bundle = app_dir / "model" / NAME
    copy_bundle(bundle, work / "no-dicom")
    app = server_app(work)
    seconds["app"] = round(time.perf_counter() - clock, 1)
    results = {"info": app.info()["models"][NAME], "trainer": NAME in app.info()["trainers"], "seconds": seconds}
    (work / "results").mkdir()

    runtime_log = RuntimeLog()  # on the runtime's logger: the training's logging set-up replaces the root's handlers
    logging.getLogger("scripts.inference.backends").addHandler(runtime_log)
    results["requests"] = []

    def infer(kind: str, image: str, **params) -> None:
        start = time.perf_counter()
        answer = app.infer({"model": NAME, "image": image, "device": "cpu", **params})
        file = work / "results" / f"{kind}{''.join(Path(answer['file']).suffixes)}"
        shutil.move(answer["file"], file)
        results[kind] = {"file": str(file), "params": answer["params"]}
        results["requests"].append({"kind": kind, "seconds": round(time.perf_counter() - start, 2),
                                    "runtime": runtime_log.take(), **process_state()})  # fmt: skip

    # REQUESTS requests in a row, a training round after the first half: 3D Slicer's clicks on a server that runs
    infer("nifti", request["nifti"])
    infer("dicom", request["dicom"], result_extension=".nii.gz")  # a folder has no extension: 3D Slicer names one
    for i in range(3, REQUESTS // 2 + 1):
        infer(f"request_{i}", request["nifti"])
    weights = bundle / "models" / "model.pt"
    before = hashlib.sha256(weights.read_bytes()).hexdigest()
    start = time.perf_counter()
    # in a process of its own, as the server's POST /train runs it (AsyncTask: python -m
    # monailabel.interfaces.utils.app -m train), which writes models/model.pt for this process to reload
    launch = shlex.split(os.environ.get(TRAIN_LAUNCHER, "")) or [sys.executable]
    subprocess.run([*launch, __file__, "--train", str(work)], cwd=work, check=True)
    results["train"] = json.loads((work / "train.json").read_text())
    seconds["train"] = round(time.perf_counter() - start, 1)
    infer("after_training", request["nifti"])
    for i in range(REQUESTS // 2 + 2, REQUESTS + 1):
        infer(f"request_{i}", request["nifti"])
    seconds["requests"] = [r["seconds"] for r in results["requests"]]
    served = app._infers[NAME]._networks["cpu"][0].state_dict()  # the network MONAI Label ran just now
    written = torch.load(weights, map_location="cpu")
    results["weights"] = {"before": before, "after": hashlib.sha256(weights.read_bytes()).hexdigest(),
                          "served_equals_written": served.keys() == written.keys()
                          and all(torch.equal(v, written[k]) for k, v in served.items())}  # fmt: skip
    # the bundle's own inference of the same CT with the weights MONAI Label served last, in the same process
    start = time.perf_counter()
    results["bundle"] = bundle_inference(bundle, Path(request["nifti"]), work / "bundle", REQUESTS)
    results["bundle"]["runtime"] = runtime_log.take()
    seconds["bundle"] = round(time.perf_counter() - start, 1)
    (work / "result.json").write_text(json.dumps(results, indent=2, default=str))
    return 0


class RuntimeLog(logging.Handler):
    """What the CPU runtime logs (scripts.inference.backends: the export, OpenVINO's compilation or load, a reuse),
    taken per request."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def take(self) -> list[str]:
        taken, self.messages = self.messages, []
        return taken


def _read(path: Path) -> str:
    """A /proc file of a thread, or "" when the thread ended between listing and reading (a pool's worker, joined)."""
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def process_state() -> dict:
    """This process's resident memory (MB), threads and child processes, from /proc. The threads: the fewest of five
    counts 20 ms apart -- a thread Python has joined (the case writers' pool, as_float32's) can stay listed in
    /proc/self/task for a moment while the kernel ends it (one more thread in one case of twenty, once); a thread
    left behind stays in every count."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    tasks = list(Path("/proc/self/task").iterdir())
    children = [c for t in tasks for c in _read(t / "children").split()]
    counts = [len(tasks)]
    for _ in range(4):
        time.sleep(0.02)
        counts.append(len(os.listdir("/proc/self/task")))
    return {"rss_mb": int(status["VmRSS"].split()[0]) / 1024, "threads": min(counts), "children": children,
            "python_threads": sorted(t.name for t in threading.enumerate())}  # fmt: skip


def bundle_inference(bundle: Path, image: Path, out: Path, cases: int) -> dict:
    """``monai.bundle run inference`` of the bundle copied into the app (its configs, its models/model.pt) on
    ``cases`` copies of one NIfTI CT, in this process, with the config's DataLoader workers (forked, here after the
    CPU runtime's threads started); per case this process's state (:func:`process_state`), its label map, and what
    the runtime logged."""
    from ignite.engine import Events
    from monai.bundle import ConfigWorkflow

    (out / "in").mkdir(parents=True)
    names = [f"case{i:02d}" for i in range(1, cases + 1)]
    for name in names:
        shutil.copy(image, out / "in" / f"{name}{''.join(image.suffixes)}")
    workflow = ConfigWorkflow(config_file=str(bundle / "configs" / "inference.yaml"), workflow_type="infer",
                              meta_file=str(bundle / "configs" / "metadata.json"), logging_file=False,
                              bundle_root=str(bundle), input_dir=str(out / "in"), output_dir=str(out / "out"),
                              write_dicom_seg=False, write_rtstruct=False, write_sr=False,
                              write_report=False)  # fmt: skip
    workflow.initialize()
    states = []
    evaluator = workflow.parser.get_parsed_content("evaluator")
    evaluator.add_event_handler(Events.ITERATION_COMPLETED, lambda _: states.append(process_state()))
    before = process_state()
    workflow.run()
    workflow.finalize()
    workers = workflow.parser.get_parsed_content("dataloader").num_workers
    del workflow, evaluator  # the run is over: what it made (its compiled model, its workers) goes with it
    gc.collect()
    report = json.loads((out / "out" / "inference_report.json").read_text())
    return {"workers": workers, "before": before, "cases": states, "after": process_state(),
            "done": report["num_done"], "failed": report["num_failed"],
            "files": [str(out / "out" / n / f"{n}_seg.nii.gz") for n in names]}  # fmt: skip


def import_only(distributions: set[str]) -> None:
    """From now on only ``distributions`` (canonical names) and the standard library can be imported, as in an
    environment where nothing else is installed: other distributions' modules are not found, not listed by
    ``pkgutil`` (MONAI imports every submodule it lists: monai.deploy is monai-deploy-app-sdk's) and not in
    ``importlib.metadata``. Modules already imported stay (this file's: numpy, torch and pytest, which MONAI Label does
    not import)."""
    import pkgutil
    from importlib.machinery import PathFinder
    from importlib.metadata import distributions as installed

    owners: dict[str, set[str]] = {}  # top-level module, and package.module -> the distributions with files in it
    for dist in installed():
        name = canonical(dist.metadata["Name"] or "")
        for line in (dist.read_text("RECORD") or "").splitlines():  # the RECORD's text: dist.files is 30 s here
            parts = line.split(",", 1)[0].split("/")
            if parts[0].endswith((".dist-info", ".data", "..")) or not parts[-1].endswith((".py", ".so")):
                continue
            owners.setdefault(parts[0].split(".")[0], set()).add(name)
            if len(parts) > 1 and not parts[1].startswith("__init__."):
                owners.setdefault(f"{parts[0]}.{parts[1].split('.')[0]}", set()).add(name)
    hidden = {module for module, names in owners.items() if not names & distributions}

    def is_hidden(name: str) -> bool:
        parts = name.split(".")
        return any(".".join(parts[:i]) in hidden for i in range(1, len(parts) + 1))

    class Finder(PathFinder):
        @classmethod
        def find_spec(cls, name, path=None, target=None):
            return None if is_hidden(name) else super().find_spec(name, path, target)

        @classmethod
        def find_distributions(cls, *args, **kwargs):
            for dist in super().find_distributions(*args, **kwargs):
                if canonical(dist.metadata["Name"] or "") in distributions:
                    yield dist

    sys.meta_path[:] = [Finder if finder is PathFinder else finder for finder in sys.meta_path]
    iter_modules = pkgutil.iter_modules
    pkgutil.iter_modules = lambda path=None, prefix="": (m for m in iter_modules(path, prefix) if not is_hidden(m.name))


def start_up_imports(work: Path) -> int:
    """`monailabel apps --download` and the imports of MONAI Label's server, datastores, monaibundle app and
    pydicom-seg with only what docs/monailabel.md installs importable; the top-level modules they imported, with
    their distributions, to WORK_DIR/imports.json."""
    from importlib.metadata import packages_distributions

    import_only(installed_by(readme_install_commands()))
    monai_label_workarounds()
    before = set(sys.modules)
    from monailabel.main import Main

    Main().action_apps(argparse.Namespace(download=True, name="monaibundle", output=str(work / "apps"), prefix=None))
    # the server that start_server runs, the datastores of --studies http://.../dicom-web and of a folder, DICOM SEG
    for module in ("monailabel.app", "monailabel.datastore.dicom", "monailabel.datastore.local", "pydicom_seg"):
        importlib.import_module(module)

    spec = importlib.util.spec_from_file_location("monaibundle_app", work / "apps" / "monaibundle" / "main.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    names = packages_distributions()
    modules = {name.split(".")[0] for name in set(sys.modules) - before} - set(sys.stdlib_module_names)
    (work / "imports.json").write_text(json.dumps({m: names[m] for m in sorted(modules) if m in names}, indent=2))
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "--start-up-imports":
        sys.exit(start_up_imports(Path(sys.argv[2])))
    if sys.argv[1] == "--train":
        sys.exit(train_monai_label(Path(sys.argv[2])))
    sys.exit(run_monai_label(Path(sys.argv[1])))
