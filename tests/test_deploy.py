"""MONAI Deploy: ``models/model.ts`` exported by MONAI's ``ckpt_export`` from ``configs/inference.yaml`` alone carries
that config, and the MONAI Deploy App SDK's ``MonaiBundleInferenceOperator`` with its DEFAULT arguments (config name
"inference"), inside a real Deploy application (holoscan's executor, on a CPU), builds ``preprocessing``, ``inferer``
and ``postprocessing`` from it alone and segments a DICOM CT series exactly as the bundle's own inference does, voxel
for voxel.

The application is at the bottom of this file and runs as its own program (``python tests/test_deploy.py``), as a
MAP runs it: from a folder outside the bundle, given only ``model.ts``, with the bundle's Python not importable.
The network is a random-initialised SwinUNETR of feature size 12 (the shipped config's is 48: only the weights inside
``model.ts`` differ, the config is the shipped one): what is compared is the path from the DICOM files to the label
map, not what the network learnt. Skipped where monai-deploy-app-sdk is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import zygote

ROOT = Path(__file__).resolve().parents[1]
INFERENCE = str(ROOT / "configs" / "inference.yaml")
CANNOT_IMPORT = 77  # exit status of the application when monai-deploy-app-sdk cannot be imported
NETWORK = {"feature_size": 12}  # a small network; every other id as configs/inference.yaml ships it

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("monai.deploy") is None,
    reason="monai-deploy-app-sdk is not installed (pip install monai-deploy-app-sdk==4.0.0, see requirements-dev.txt)",
)


def bundle_parser():
    """configs/inference.yaml alone, parsed here (the bundle's Python importable)."""
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config(INFERENCE)
    parser.read_meta(str(ROOT / "configs" / "metadata.json"))
    parser.update({"bundle_root": str(ROOT), **NETWORK})
    return parser


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """One random-initialised network exported to model.ts from inference.yaml alone, one synthetic DICOM case,
    segmented by the Deploy application (a separate process) and, at the same time, by the bundle's inference
    workflow (this process, inference.yaml alone, its network run by PyTorch as Deploy runs model.ts)."""
    import torch
    from conftest import save_weights
    from monai.bundle import ConfigWorkflow, ckpt_export
    from scripts.data.synthetic import write_case

    tmp = tmp_path_factory.mktemp("deploy")
    torch.manual_seed(0)
    parser = bundle_parser()
    network = parser.get_parsed_content("network_def")
    weights = save_weights(network, tmp / "models" / "model.pt")
    # MONAI's export, as docs/README.md runs it (the trace's own re-run check is left out: the comparison below is it)
    ckpt_export("network_def", filepath=str(tmp / "models" / "model.ts"), ckpt_file=str(weights),
                meta_file=str(ROOT / "configs" / "metadata.json"), config_file=INFERENCE, bundle_root=str(ROOT),
                use_trace=True, input_shape=[1, 1, *parser.get_parsed_content("roi_size")],
                converter_kwargs={"check_trace": False}, **NETWORK)  # fmt: skip
    # 96 x 96 mm, 16 slices: on the 1 x 1 x 3 mm grid one 96^3 window holds it all (the sliding window as shipped)
    truth = write_case(tmp / "cases", "P1", seed=1, shape=(48, 48, 16), pixel_spacing=(2.0, 2.0))

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of the bundle on the path
    # a process of its own, forked from the tests' zygote (tests/zygote.py), which has imported torch and MONAI
    app = zygote.start_python([__file__, "--input", truth["image_dir"], "--output", str(tmp / "deploy"), "--model",
                               str(tmp / "models" / "model.ts")], tmp, env)  # fmt: skip
    try:
        ours = ConfigWorkflow(config_file=INFERENCE, workflow_type="infer", logging_file=False, bundle_root=str(ROOT),
                              input_dir=str(tmp / "cases"), output_dir=str(tmp / "ours"), model_path=str(weights),
                              num_workers=0, write_dicom_seg=False, write_rtstruct=False, write_sr=False,
                              write_report=False, inference_backend="torch", **NETWORK)  # fmt: skip
        ours.initialize()
        ours.run()
        ours.finalize()
        returncode = app.wait(600)
        log = "".join(app.output())
    finally:
        app.signal(signal.SIGKILL)
    if returncode == CANNOT_IMPORT:
        pytest.skip(f"monai-deploy-app-sdk cannot be imported here: {log.strip().splitlines()[-1]}")
    assert returncode == 0, log[-4000:]
    return truth, tmp / "ours" / "P1" / "P1_seg.nii.gz", tmp / "deploy"


def test_deploy_builds_the_bundle_ids_from_model_ts_alone(deployed):
    """With its default arguments the operator reads "inference" -- the standalone inference.yaml stored in model.ts
    -- and finds preprocessing, inferer and postprocessing there, drops none of the transforms, and needs none of the
    bundle's Python, which it could not import (sliding_window_inferer)."""
    _, _, out = deployed
    built = json.loads((out / "operator.json").read_text())
    parser = bundle_parser()
    assert built["config_names"] == ["inference"], "the operator's default"
    assert built["scripts_importable"] is False
    assert built["inferer"] == "monai.inferers.inferer.SlidingWindowInferer"
    assert built["roi_size"] == parser.get_parsed_content("roi_size") == [96, 96, 96]
    for name in ("preprocessing", "postprocessing"):
        assert built[name] == [type(t).__name__ for t in parser.get_parsed_content(name).transforms], name
    assert built["preprocessing"][0] == "EnsureChannelFirstd"
    assert "Invertd" in built["postprocessing"]
    assert "Cannot locate class or function path: 'scripts.inference.inferers." in built["sliding_window_inferer"]


def test_deploy_reads_the_series_as_our_reader_does(deployed):
    """Deploy's DICOMSeriesToVolumeOperator gives the same HU on the same grid (its array is slices, rows, columns;
    its NIfTI affine is RAS) as scripts.data.dicom.read_ct_series."""
    from scripts.data.dicom import read_ct_series

    truth, _, out = deployed
    ct = read_ct_series(truth["image_dir"])
    volume = np.swapaxes(np.load(out / "volume.npy"), 0, 2)
    np.testing.assert_array_equal(volume, ct.hu)
    np.testing.assert_allclose(np.load(out / "affine.npy"), ct.affine_ras, atol=1e-4)


def test_deploy_segmentation_equals_our_inference_voxel_for_voxel(deployed):
    """The Deploy operator's label map (traced model.ts, MONAI's sliding window) is the bundle's own NIfTI output
    (eager network, sliding_window_inferer) in every voxel, on the CT's own grid."""
    import nibabel as nib

    truth, ours_file, out = deployed
    ours = np.asarray(nib.load(ours_file).dataobj)
    theirs = np.swapaxes(np.load(out / "seg.npy"), 0, 2)  # Deploy's Image is slices, rows, columns
    assert ours.shape == theirs.shape == tuple(truth["shape"])
    assert 0 < int(ours.sum()) < ours.size, "a label map with both classes, so the comparison means something"
    np.testing.assert_array_equal(theirs, ours)


# ------------------------------------------------------------------------------------------------------------------
# The MONAI Deploy application: DICOM series -> volume -> the bundle operator -> the arrays and what the operator built
# python tests/test_deploy.py --input DICOM_DIR --output OUT --model model.ts
def run_deploy_app(argv: list[str]) -> None:
    try:
        from monai.deploy.conditions import CountCondition
        from monai.deploy.core import Application, Image, IOType, Operator
        from monai.deploy.operators import (
            DICOMDataLoaderOperator,
            DICOMSeriesSelectorOperator,
            DICOMSeriesToVolumeOperator,
        )
        from monai.deploy.operators.monai_bundle_inference_operator import (
            BundleConfigNames,
            IOMapping,
            MonaiBundleInferenceOperator,
            get_bundle_config,
        )
    except ImportError as err:
        print(f"{type(err).__name__}: {err}")
        raise SystemExit(CANNOT_IMPORT) from err

    class SaveArrays(Operator):
        """The CT volume and the label map as .npy, with the volume's affine."""

        def __init__(self, fragment, *args, output_folder: Path, **kwargs) -> None:
            self.output_folder = Path(output_folder)
            super().__init__(fragment, *args, **kwargs)

        def setup(self, spec) -> None:
            spec.input("image")
            spec.input("seg")

        def compute(self, op_input, op_output, context) -> None:
            image, seg = op_input.receive("image"), op_input.receive("seg")
            self.output_folder.mkdir(parents=True, exist_ok=True)
            np.save(self.output_folder / "volume.npy", image.asnumpy())
            np.save(self.output_folder / "affine.npy", np.asarray(image.metadata()["nifti_affine_transform"]))
            np.save(self.output_folder / "seg.npy", seg.asnumpy())

    class SegmentationApp(Application):
        def compose(self) -> None:
            context = Application.init_app_context(argv)
            loader = DICOMDataLoaderOperator(self, CountCondition(self, 1), input_folder=Path(context.input_path),
                                             name="loader")  # fmt: skip
            selector = DICOMSeriesSelectorOperator(self, name="selector")
            to_volume = DICOMSeriesToVolumeOperator(self, name="to_volume")
            self.bundle = MonaiBundleInferenceOperator(  # default bundle_config_names: "inference"
                self,
                app_context=context,
                input_mapping=[IOMapping("image", Image, IOType.IN_MEMORY)],
                output_mapping=[IOMapping("pred", Image, IOType.IN_MEMORY)],
                name="bundle",
            )
            save = SaveArrays(self, output_folder=Path(context.output_path), name="save")
            self.add_flow(loader, selector, {("dicom_study_list", "dicom_study_list")})
            self.add_flow(selector, to_volume, {("study_selected_series_list", "study_selected_series_list")})
            self.add_flow(to_volume, self.bundle, {("image", "image")})
            self.add_flow(to_volume, save, {("image", "image")})
            self.add_flow(self.bundle, save, {("pred", "seg")})
            self.output_folder, self.model = Path(context.output_path), context.model_path

    def error_of(names, config_id: str) -> str | None:
        """What Deploy's config parsing says when asked for ``config_id`` with the configs ``names``."""
        try:
            get_bundle_config(app.model, names).get_parsed_content(config_id)
        except Exception as err:  # the message is the result
            return f"{type(err).__name__}: {err}"
        return None

    app = SegmentationApp()
    app.run()
    op = app.bundle
    built = {
        "inferer": f"{type(op._inferer).__module__}.{type(op._inferer).__qualname__}",
        "roi_size": [int(v) for v in op._inferer.roi_size],
        "preprocessing": [type(t).__name__ for t in op._preproc.transforms],
        "postprocessing": [type(t).__name__ for t in op._postproc.transforms],
        "scripts_importable": importlib.util.find_spec("scripts") is not None,
        "config_names": BundleConfigNames().config_names,
        "sliding_window_inferer": error_of(BundleConfigNames().config_names, "sliding_window_inferer"),
    }
    (app.output_folder / "operator.json").write_text(json.dumps(built, indent=2))


if __name__ == "__main__":
    run_deploy_app(sys.argv)
