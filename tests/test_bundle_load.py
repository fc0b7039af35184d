"""``monai.bundle.load`` on this bundle, as MONAI 1.6.1 implements it.

``load`` builds a network only from ``configs/<workflow_type>.json``; a YAML bundle has none, so without a ``model``
it warns and returns the bare state dict. A JSON beside the YAML would have to repeat ``network_def`` (two sources of
truth) or take it from ``train.yaml`` through a ``%`` macro, whose path MONAI resolves from the working directory,
not from the bundle. So the bundle keeps ``train.yaml`` as the one source, and ``load`` gives a ready network in the
two ways that need no JSON:

* ``load(name, bundle_dir=..., load_ts_module=True, config_files=(...))``: the TorchScript that ``ckpt_export`` wrote,
  with the metadata and the configs it was exported with (the YAML's content, stored as JSON inside ``model.ts``);
* ``load(name, bundle_dir=..., model=<network_def of train.yaml>)``: the eager network with ``models/model.pt`` loaded
  (MONAI's own advice: with ``model=`` it evaluates no config of the bundle).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ROOT

NAME = "nsclc_swinunetr"
DEMO = ["train.yaml", "demo.yaml"]  # a demo-sized network (feature_size 12, 64^3 patches)


def network_of(config_names: list[str]) -> torch.nn.Module:
    """``network_def`` of the layered configs, built as the bundle builds it (from any working directory)."""
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config([str(ROOT / "configs" / name) for name in config_names])
    parser["bundle_root"] = str(ROOT)
    return parser.get_parsed_content("network_def")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """``<bundle_dir>/nsclc_swinunetr/``: the bundle's configs, random-initialised demo weights as models/model.pt
    and their export models/model.ts (MONAI's ckpt_export, as the README runs it); the eager network's output on a
    batch of patches."""
    from monai.bundle import ckpt_export

    bundle_dir = tmp_path_factory.mktemp("bundles")
    folder = bundle_dir / NAME
    (folder / "models").mkdir(parents=True)
    (folder / "configs").symlink_to(ROOT / "configs", target_is_directory=True)
    torch.manual_seed(0)
    eager = network_of(DEMO).eval()
    torch.save(eager.state_dict(), folder / "models" / "model.pt")
    # the trace's own re-run check is left out: the tests below compare the traced output with the eager one
    ckpt_export("network_def", filepath=str(folder / "models" / "model.ts"), ckpt_file=str(folder / "models" /
                "model.pt"), meta_file=str(ROOT / "configs" / "metadata.json"),
                config_file=[str(ROOT / "configs" / n) for n in [*DEMO, "inference.yaml"]], bundle_root=str(ROOT),
                use_trace=True, input_shape=[1, 1, 64, 64, 64], converter_kwargs={"check_trace": False})  # fmt: skip
    # two patches in a batch, as the sliding window sends them (sw_batch_size): traced on one, it takes any number
    patch = torch.rand(2, 1, 64, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = eager(patch)
    return bundle_dir, eager, patch, expected


def test_load_ts_module_returns_the_exported_network_with_its_metadata_and_configs(bundle):
    from monai.bundle import ConfigParser, load

    bundle_dir, _, patch, expected = bundle
    names = ("train.json", "demo.json", "inference.json")
    network, metadata, configs = load(NAME, bundle_dir=str(bundle_dir), load_ts_module=True, config_files=names,
                                      device="cpu")  # fmt: skip
    with torch.no_grad():
        torch.testing.assert_close(network(patch), expected, rtol=1e-4, atol=1e-4)
    meta_file = json.loads((ROOT / "configs" / "metadata.json").read_text())
    assert metadata["version"] == meta_file["version"]
    assert metadata["network_data_format"] == meta_file["network_data_format"]
    for name in names:  # the YAML's own content, written into model.ts at export: nothing to keep in step by hand
        yaml_file = ROOT / "configs" / name.replace(".json", ".yaml")
        assert json.loads(configs[name]) == ConfigParser.load_config_file(str(yaml_file)), name


def test_load_with_the_network_of_train_yaml_returns_it_with_the_weights(bundle):
    from monai.bundle import load

    bundle_dir, _, patch, expected = bundle
    torch.manual_seed(1)  # other initial weights than those saved
    network = network_of(DEMO)
    loaded = load(NAME, bundle_dir=str(bundle_dir), model=network, device="cpu")
    assert loaded is network
    with torch.no_grad():
        assert torch.equal(loaded.eval()(patch), expected)


def test_load_without_a_network_finds_no_json_config_and_returns_the_weights(bundle):
    """MONAI 1.6 looks for configs/train.json only; this bundle's one source is train.yaml, so ``load`` says so and
    returns the state dict, which is exactly the saved weights."""
    from monai.bundle import load

    bundle_dir, eager, _, _ = bundle
    assert sorted(p.name for p in (ROOT / "configs").glob("*.json")) == ["metadata.json"]
    with pytest.warns(UserWarning, match=r"Cannot find the config file: .*configs/train\.json, return state dict"):
        weights = load(NAME, bundle_dir=str(bundle_dir), device="cpu")
    expected = eager.state_dict()
    assert list(weights) == list(expected)
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
