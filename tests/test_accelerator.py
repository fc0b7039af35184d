"""Backend settings and the device report: ROCm and CUDA builds are simulated on this CPU machine by monkeypatching
``torch.version`` and the ``torch.cuda`` queries, so every branch runs without a GPU."""

from __future__ import annotations

import json
import logging
import os
from types import SimpleNamespace

import pytest
import torch
from scripts.common.config import ConfigError
from scripts.training import accelerator
from scripts.training.accelerator import backend, configure

GPU_ENV_PREFIXES = ("MIOPEN_", "PYTORCH_TUNABLEOP_")
GIB = 2**30


def gpu_env() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name.startswith(GPU_ENV_PREFIXES)}


@pytest.fixture(autouse=True)
def isolated(monkeypatch):
    """No MIOPEN_*/TUNABLEOP variable or RANK going in, none leaking out; torch.backends flags restored."""
    for name in gpu_env():
        monkeypatch.delenv(name)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(accelerator, "_exported", {})
    flags = (
        torch.backends.cudnn.benchmark,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_num_threads(),
    )
    yield
    for name in gpu_env():  # exported by configure(); monkeypatch then restores the user's own values
        del os.environ[name]
    torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags[:3]
    torch.set_num_threads(flags[3])


def fake_gpu(monkeypatch, name: str, memory_gib: float, count: int, **properties) -> None:
    props = SimpleNamespace(name=name, total_memory=int(memory_gib * GIB), **properties)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 3004000)


@pytest.fixture
def rocm(monkeypatch) -> list[tuple]:
    """A ROCm build with 8 MI300X; returns the calls made to the torch.cuda.tunable API."""
    monkeypatch.setattr(torch.version, "hip", "6.4.1")
    monkeypatch.setattr(torch.version, "cuda", None)
    fake_gpu(monkeypatch, "AMD Instinct MI300X", 192, 8, gcnArchName="gfx942:sramecc+:xnack-")
    calls: list[tuple] = []
    monkeypatch.setattr(torch.cuda.tunable, "enable", lambda val=True: calls.append(("enable", val)))
    monkeypatch.setattr(
        torch.cuda.tunable,
        "set_filename",
        lambda filename, insert_device_ordinal=False: calls.append(("set_filename", filename, insert_device_ordinal)),
    )
    return calls


@pytest.fixture
def cuda(monkeypatch) -> None:
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", 79.1, 1)


def test_backend_tells_rocm_from_cuda_by_the_hip_version(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.4.1")
    assert backend("cuda") == backend(torch.device("cuda:1")) == "rocm"
    monkeypatch.setattr(torch.version, "hip", None)
    assert backend("cuda:0") == "cuda"
    assert backend(torch.device("cpu")) == "cpu"


@pytest.mark.parametrize("device", ["xpu", "hpu", torch.device("mps")])
def test_other_device_types_are_named_as_given(device):
    assert backend(device) == torch.device(device).type


def test_rocm_exports_miopen_settings_and_keeps_its_database_in_output_dir(rocm, tmp_path):
    info = configure("cuda", tmp_path, miopen_find_mode=2, miopen_find_enforce=4, cudnn_benchmark=False)

    assert os.environ["MIOPEN_FIND_MODE"] == "2"
    assert os.environ["MIOPEN_FIND_ENFORCE"] == "4"
    user_db, cache = os.environ["MIOPEN_USER_DB_PATH"], os.environ["MIOPEN_CUSTOM_CACHE_DIR"]
    for folder in (user_db, cache):
        assert os.path.isdir(folder)
        assert os.path.commonpath([folder, tmp_path]) == str(tmp_path)
    assert torch.backends.cudnn.benchmark is False
    assert info["backend"] == "rocm"
    assert info["settings"]["MIOPEN_FIND_MODE"] == {"value": "2", "source": "config"}
    assert "PYTORCH_TUNABLEOP_ENABLED" not in os.environ and rocm == []


def test_rocm_without_miopen_cache_leaves_miopen_paths_to_miopen(rocm, tmp_path):
    configure("cuda", tmp_path, miopen_cache="false")

    assert "MIOPEN_USER_DB_PATH" not in os.environ and "MIOPEN_CUSTOM_CACHE_DIR" not in os.environ
    assert not (tmp_path / "miopen").exists()
    assert os.environ["MIOPEN_FIND_MODE"] == "1"


def test_user_exported_miopen_variable_wins_and_report_says_environment(rocm, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MIOPEN_FIND_MODE", "3")

    with caplog.at_level(logging.INFO, logger="scripts.training.accelerator"):
        info = configure("cuda", tmp_path, miopen_find_mode=1)

    assert os.environ["MIOPEN_FIND_MODE"] == "3"
    assert info["settings"]["MIOPEN_FIND_MODE"] == {"value": "3", "source": "environment"}
    assert info["settings"]["MIOPEN_FIND_ENFORCE"]["source"] == "config"
    assert "MIOPEN_FIND_MODE=3 kept from the environment" in caplog.text
    saved = json.loads((tmp_path / "device_report.json").read_text())
    assert saved["settings"]["MIOPEN_FIND_MODE"] == {"value": "3", "source": "environment"}


def test_a_second_configure_moves_its_own_settings_to_the_new_output_dir(rocm, tmp_path):
    configure("cuda", tmp_path / "train")
    info = configure("cuda", tmp_path / "evaluate", miopen_find_mode=2)

    assert os.environ["MIOPEN_USER_DB_PATH"].startswith(str(tmp_path / "evaluate"))
    assert info["settings"]["MIOPEN_FIND_MODE"] == {"value": "2", "source": "config"}


def test_rocm_tunableop_writes_results_to_output_dir_via_env_and_api(rocm, tmp_path):
    info = configure("cuda:0", tmp_path, tunableop="true")

    results = str(tmp_path / "tunableop" / "results%d.csv")
    assert os.environ["PYTORCH_TUNABLEOP_ENABLED"] == "1"
    assert os.environ["PYTORCH_TUNABLEOP_FILENAME"] == results
    assert (tmp_path / "tunableop").is_dir()
    assert rocm == [("enable", True), ("set_filename", results, True)]
    assert info["settings"]["PYTORCH_TUNABLEOP_ENABLED"] == {"value": "1", "source": "config"}


def test_user_disabled_tunableop_is_not_switched_on_by_the_api(rocm, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTORCH_TUNABLEOP_ENABLED", "0")

    info = configure("cuda", tmp_path, tunableop=True)

    assert os.environ["PYTORCH_TUNABLEOP_ENABLED"] == "0"
    assert ("enable", True) not in rocm
    assert info["settings"]["PYTORCH_TUNABLEOP_ENABLED"] == {"value": "0", "source": "environment"}


@pytest.mark.parametrize(("benchmark", "tf32"), [(True, True), (False, False), ("true", "false")])
def test_cuda_sets_benchmark_and_tf32_and_no_rocm_variables(cuda, tmp_path, benchmark, tf32):
    expected_benchmark, expected_tf32 = benchmark in (True, "true"), tf32 is True
    torch.backends.cudnn.benchmark = not expected_benchmark
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not expected_tf32

    info = configure("cuda", tmp_path, cudnn_benchmark=benchmark, tf32=tf32, tunableop=True)

    assert torch.backends.cudnn.benchmark is expected_benchmark
    assert torch.backends.cuda.matmul.allow_tf32 is expected_tf32
    assert torch.backends.cudnn.allow_tf32 is expected_tf32
    assert gpu_env() == {}
    assert not (tmp_path / "miopen").exists()
    assert info["backend"] == "cuda" and info["dnn_library"] == "cuDNN"
    assert info["settings"]["torch.backends.cuda.matmul.allow_tf32"] == {"value": expected_tf32, "source": "config"}


def test_tf32_false_string_from_command_line_turns_tf32_off(cuda, tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True

    configure("cuda", tmp_path, tf32="false")

    assert torch.backends.cuda.matmul.allow_tf32 is False
    assert torch.backends.cudnn.allow_tf32 is False
    assert torch.get_float32_matmul_precision() == "highest"


def test_unparseable_flag_is_refused_with_its_name(cuda, tmp_path):
    with pytest.raises(ConfigError, match="tf32="):
        configure("cuda", tmp_path, tf32="maybe")


def test_cpu_sets_threads_and_no_gpu_variables(tmp_path):
    wanted = 1 if torch.get_num_threads() != 1 else 2
    info = configure("cpu", tmp_path, cpu_threads=str(wanted), tunableop=True)

    assert torch.get_num_threads() == wanted
    assert gpu_env() == {}
    assert info["backend"] == "cpu"
    assert info["settings"] == {"torch.num_threads": {"value": wanted, "source": "config"}}
    assert info["cpu_count"] == os.cpu_count()


@pytest.mark.parametrize("threads", [0, "-2", "many"])
def test_bad_cpu_thread_count_is_refused(tmp_path, threads):
    with pytest.raises(ConfigError, match="cpu_threads"):
        configure("cpu", tmp_path, cpu_threads=threads)


def test_device_report_json_on_rank_0_names_backend_device_and_settings(rocm, tmp_path):
    info = configure("cuda:0", tmp_path, rank=0)

    saved = json.loads((tmp_path / "device_report.json").read_text())
    assert saved == info
    assert saved["backend"] == "rocm" and saved["hip"] == "6.4.1"
    assert saved["device_name"] == "AMD Instinct MI300X"
    assert saved["total_memory_gib"] == pytest.approx(192)
    assert saved["visible_devices"] == 8
    assert saved["gcn_arch"].startswith("gfx942")
    assert saved["dnn_library"] == "MIOpen" and saved["dnn_version"] == 3004000
    assert saved["torch"] == torch.__version__
    assert saved["settings"]["MIOPEN_USER_DB_PATH"]["value"] == os.environ["MIOPEN_USER_DB_PATH"]
    assert [p.name for p in tmp_path.iterdir() if p.is_file()] == ["device_report.json"]  # no temp file left


def test_no_device_report_from_rank_1_by_argument_or_environment(rocm, tmp_path, monkeypatch):
    info = configure("cuda:1", tmp_path / "by_argument", rank=1)
    monkeypatch.setenv("RANK", "1")
    configure("cuda:1", tmp_path / "by_env")

    assert info["rank"] == 1
    assert not (tmp_path / "by_argument" / "device_report.json").exists()
    assert not (tmp_path / "by_env" / "device_report.json").exists()
    assert os.environ["MIOPEN_FIND_MODE"] == "1"  # every rank still gets the settings


def test_report_false_writes_no_file(tmp_path):
    configure("cpu", tmp_path, report="false")

    assert not (tmp_path / "device_report.json").exists()


def test_xpu_device_is_used_as_given_with_nothing_applied(tmp_path):
    torch.backends.cudnn.benchmark = torch.backends.cuda.matmul.allow_tf32 = False
    threads = torch.get_num_threads()

    info = configure("xpu", tmp_path, cudnn_benchmark=True, tf32=True, tunableop=True, cpu_threads=threads + 1)

    assert info["backend"] == "xpu" and info["settings"] == {}
    assert gpu_env() == {}
    assert torch.backends.cudnn.benchmark is False and torch.backends.cuda.matmul.allow_tf32 is False
    assert torch.get_num_threads() == threads
    assert json.loads((tmp_path / "device_report.json").read_text())["backend"] == "xpu"
