"""benchmark.yaml trains with the speed switches in force and writes a valid report; every switch that
runs on a CPU still trains when flipped."""

from __future__ import annotations

import json

from conftest import bundle_run, configs, demo_args


def benchmark(tiny_data, tmp_path, **switches) -> tuple[dict, str]:
    tmp = tiny_data
    args = demo_args(tmp_path, config_file=configs("train.yaml", "demo.yaml", "benchmark.yaml"),
                     dataset_dir=tmp / "data", prepared_dir=tmp / "prepared", benchmark_warmup=1, benchmark_steps=2,
                     **switches)  # fmt: skip
    result = bundle_run(*args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((tmp_path / "run" / "benchmark.json").read_text()), result.stdout


def test_benchmark_reports_the_defaults(tiny_data, tmp_path):
    report, stdout = benchmark(tiny_data, tmp_path)
    result = report["result"]
    assert result["timed_steps"] == 2 and result["patches_per_step"] == 1
    training = json.loads((tiny_data / "prepared" / "datalist.json").read_text())["training"]
    assert len(training) < 1 + 2 + 5 and result["epochs"] == 1, "every step in one epoch over fewer cases"
    assert result["ms_per_step_p90"] >= result["ms_per_step_median"] > 0
    assert 0 <= result["data_wait_fraction"] < 1 and result["patches_per_s"] > 0
    assert report["switches"]["cache"] == "memory" and report["switches"]["loader"] == "DataLoader"
    assert report["switches"]["compile_setting"] == "auto" and report["switches"]["compile"] is False, "auto: off here"
    assert report["switches"]["cuda_graphs"] is True and result["cuda_graphs"] is None, "on by default, off on a CPU"
    assert "compile: off (auto: the device is cpu" in stdout
    assert "cuda_graphs: off (the device is cpu; CUDA graphs (HIP graphs on ROCm) need a GPU)" in stdout
    assert report["device"]["backend"] == "cpu" and report["device"]["torch"]
    assert "benchmark:" in stdout and "patches/s" in stdout
    assert (tmp_path / "run" / "device_report.json").is_file()
    assert not (tmp_path / "run" / "checkpoints").exists(), "a benchmark writes no checkpoints"


def test_every_cpu_switch_flipped_still_trains(tiny_data, tmp_path):
    flipped = {"cache": "disk", "thread_loader": "true", "use_checkpoint": "true", "use_v2": "true",
               "channels_last": "true", "fused_attention": "true", "compile": "true", "compile_backend": "eager",
               "cpu_threads": 2, "cache_dir": tmp_path / "cache", "num_samples": 2, "cuda_graphs": "false",
               "compile_cache_dir": tmp_path / "compiled"}  # fmt: skip
    report, stdout = benchmark(tiny_data, tmp_path, **flipped)
    switches = report["switches"]
    assert switches["loader"] == "ThreadDataLoader" and switches["cache"] == "disk"
    assert switches["use_checkpoint"] and switches["use_v2"] and switches["channels_last"] and switches["compile"]
    assert switches["fused_attention"] and switches["cuda_graphs"] is False and report["result"]["cuda_graphs"] is None
    assert f"compile cache: {tmp_path / 'compiled'}" in stdout and "compile: on (compile: true)" in stdout
    assert report["device"]["settings"]["torch.num_threads"] == {"value": 2, "source": "config"}
    # PersistentDataset writes a volume when first loaded: at least the 3 loaded steps, at most the training list
    training = json.loads((tiny_data / "prepared" / "datalist.json").read_text())["training"]
    assert 3 <= len(list((tmp_path / "cache").glob("*.pt"))) <= len(training)
    assert report["result"]["timed_steps"] == 2 and report["result"]["patches_per_step"] == 2
