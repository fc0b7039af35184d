"""Speed switches: each builds what it promises, and benchmark.yaml trains with them and writes a valid report."""

from __future__ import annotations

import json

import pytest
from conftest import DEMO, bundle_run, demo_args
from monai.data import CacheDataset, DataLoader, Dataset, PersistentDataset, ThreadDataLoader

from scripts.config import ConfigError
from scripts.data import make_dataset, make_loader

DATA = [{"x": i} for i in range(4)]


@pytest.mark.parametrize(("cache", "kind"), [("none", Dataset), ("memory", CacheDataset), ("disk", PersistentDataset)])
def test_cache_modes_build_their_dataset(cache, kind, tmp_path):
    dataset = make_dataset(cache, DATA, transform=None, cache_dir=tmp_path / "cache")
    assert type(dataset) is kind
    assert [dataset[i]["x"] for i in range(4)] == [0, 1, 2, 3]


def test_unknown_cache_mode_and_disk_without_folder_are_config_errors():
    with pytest.raises(ConfigError, match=r"'ram' is not one of \['none', 'memory', 'disk', 'gpu'\]"):
        make_dataset("ram", DATA, transform=None)
    with pytest.raises(ConfigError, match="cache_dir"):
        make_dataset("disk", DATA, transform=None, cache_dir=None)


def test_loaders():
    dataset = Dataset(DATA)
    gpu = make_loader(dataset, cache="gpu", num_workers=4)
    assert type(gpu) is ThreadDataLoader and gpu.num_workers == 0, "CUDA tensors never go to worker processes"
    assert type(make_loader(dataset, thread_loader="true")) is ThreadDataLoader  # as --thread_loader true arrives
    workers = make_loader(dataset, num_workers=2, persistent_workers="true")
    assert type(workers) is DataLoader and workers.persistent_workers
    assert not make_loader(dataset, num_workers=0).persistent_workers


def benchmark(root, demo_run, tmp_path, **switches) -> tuple[dict, str]:
    tmp, _, _ = demo_run
    args = demo_args(tmp_path, dataset_dir=tmp / "data", prepared_dir=tmp / "prepared", benchmark_warmup=1,
                     benchmark_steps=2, **switches)  # fmt: skip
    args[args.index("--config_file") + 1] = DEMO[:-1] + ",'configs/benchmark.yaml']"
    result = bundle_run(root, *args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((tmp_path / "run" / "benchmark.json").read_text()), result.stdout


def test_benchmark_reports_the_defaults(root, demo_run, tmp_path):
    report, stdout = benchmark(root, demo_run, tmp_path)
    result = report["result"]
    assert result["timed_steps"] == 2 and result["patches_per_step"] == 1
    assert result["ms_per_step_p90"] >= result["ms_per_step_median"] > 0
    assert 0 <= result["data_wait_fraction"] < 1 and result["patches_per_s"] > 0
    assert report["switches"]["cache"] == "memory" and report["switches"]["loader"] == "DataLoader"
    assert report["device"]["backend"] == "cpu" and report["device"]["torch"]
    assert "benchmark:" in stdout and "patches/s" in stdout
    assert (tmp_path / "run" / "device_report.json").is_file()
    assert not (tmp_path / "run" / "checkpoints").exists(), "a benchmark writes no checkpoints"


def test_every_cpu_switch_flipped_still_trains(root, demo_run, tmp_path):
    flipped = {"cache": "disk", "thread_loader": "true", "use_checkpoint": "true", "use_v2": "true",
               "channels_last": "true", "compile": "true", "compile_backend": "eager", "cpu_threads": 2,
               "cache_dir": tmp_path / "cache", "num_samples": 2}  # fmt: skip
    report, _ = benchmark(root, demo_run, tmp_path, **flipped)
    switches = report["switches"]
    assert switches["loader"] == "ThreadDataLoader" and switches["cache"] == "disk"
    assert switches["use_checkpoint"] and switches["use_v2"] and switches["channels_last"] and switches["compile"]
    assert report["device"]["settings"]["torch.num_threads"] == {"value": 2, "source": "config"}
    # PersistentDataset writes a volume when first loaded: at least the 3 loaded steps, at most the training list
    training = json.loads((demo_run[0] / "prepared" / "datalist.json").read_text())["training"]
    assert 3 <= len(list((tmp_path / "cache").glob("*.pt"))) <= len(training)
    assert report["result"]["timed_steps"] == 2 and report["result"]["patches_per_step"] == 2
