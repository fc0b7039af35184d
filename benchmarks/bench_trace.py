"""Benchmark of ``scripts.summarize_trace`` on a large synthetic torch.profiler chrome trace.

Writes a CUDA-style trace of at least ``size_gb`` GB (10^9 bytes) in the layout torch/kineto writes (one
pretty-printed event after another: ``user_annotation`` sections, ``cpu_op``, ``cuda_runtime`` launches with
``ac2g`` flows, ``kernel`` and ``gpu_memcpy`` events on the GPU pid), streamed to disk step by step so the
benchmark itself stays small. Then it runs ``python -m scripts.summarize_trace TRACE --format json`` in a child
process, checks the section statistics against the values the generator recorded, and prints one line with the
trace size, the child's wall time, throughput (MB/s, 10^6 bytes) and peak resident memory (``ru_maxrss`` of that
child, from ``os.wait4``)::

    python -m benchmarks.bench_trace [--size_gb 1.0] [--output_dir DIR] [--keep false] [--json_out FILE]
                                  [--parser auto|json|ijson]

Without ``--output_dir`` the trace goes to a temporary folder that is removed afterwards (unless ``--keep true``).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PID, TID, GPU_PID, STREAM = 31337, 31337, 0, 7
KERNEL_NAMES = (
    "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, "
    "at::native::GeluType)::{lambda()#2}::operator()() const::{lambda()#2}::operator()() const::{lambda(float)#1}, "
    "at::detail::Array<char*, 2> >(int, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, "
    "at::native::GeluType)::{lambda()#2}::operator()() const::{lambda()#2}::operator()() const::{lambda(float)#1}, "
    "at::detail::Array<char*, 2>)",
    "sm90_xmma_fprop_implicit_gemm_indexed_f16f16_f16f32_f32_ndhwc_kt3x3x3_nhwc_tilesize128x128x64_warpgroupsize1x1x1",
    "void cudnn::ops::nchwToNhwcKernel<__half, __half, float, false, true, (cudnnKernelDataType_t)0>"
    "(cudnn::ops::nchw2nhwc_params_t<float>, __half const*, __half*)",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::Half, float>(int, float, "
    "c10::Half const*, c10::Half const*, c10::Half const*, float*, float*, c10::Half*)",
)
CPU_OPS = ("aten::conv3d", "aten::layer_norm", "aten::gelu", "aten::add", "aten::mm", "aten::softmax")
OPS_PER_SECTION = {"forward": 300, "backward": 600, "optimizer": 30}


def main(
    size_gb: float = 1.0,
    output_dir: str | None = None,
    keep: bool | str = False,
    json_out: str | None = None,
    parser: str = "auto",
) -> None:
    """Generate the trace, summarise it in a child process, print one line (and the result as JSON to json_out)."""
    keep = _as_bool(keep)
    folder = Path(output_dir) if output_dir else Path(tempfile.mkdtemp(prefix="bench_trace_"))
    folder.mkdir(parents=True, exist_ok=True)
    trace = folder / "bench_trace.json"
    try:
        t0 = time.perf_counter()
        expected = write_trace(trace, int(size_gb * 1e9))
        gen_s = time.perf_counter() - t0
        size = trace.stat().st_size
        run = _run_summarizer(trace, parser)
    finally:
        if not keep and not output_dir:
            shutil.rmtree(folder, ignore_errors=True)
        elif not keep:
            trace.unlink(missing_ok=True)
    problems = _check(run["summary"], expected) if run["summary"] else [run["stderr"].strip() or "no output"]
    result = {
        "trace_bytes": size,
        "trace_events": expected["events"],
        "kernels": expected["kernels"],
        "steps": expected["steps"],
        "parser": (run["summary"] or {}).get("parser", parser),
        "wall_s": round(run["wall_s"], 2),
        "mb_per_s": round(size / 1e6 / run["wall_s"], 1),
        "peak_rss_mb": round(run["maxrss_kb"] / 1024, 1),
        "generate_s": round(gen_s, 1),
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "check": "ok" if not problems else "; ".join(problems),
    }
    print(
        f"bench_trace: {size / 1e9:.2f} GB trace ({result['trace_events']} events, {result['kernels']} kernels), "
        f"parser={result['parser']}: {result['wall_s']} s, {result['mb_per_s']} MB/s, "
        f"peak RSS {result['peak_rss_mb']} MB, check {result['check']}"
    )
    if json_out:
        Path(json_out).write_text(json.dumps(result, indent=2) + "\n")
    if problems:
        raise SystemExit(1)


def write_trace(path: Path, min_bytes: int) -> dict[str, Any]:
    """Stream a synthetic CUDA trace of at least ``min_bytes`` to ``path``; return the statistics it was built with."""
    gen = _TraceWriter()
    with open(path, "w", encoding="utf-8") as f:
        f.write(gen.header())
        written, step = 0, 0
        while written < min_bytes:
            chunk = gen.step(step)
            f.write(chunk)
            written += len(chunk)
            step += 1
        f.write(gen.footer())
    return gen.expected()


class _TraceWriter:
    """Writes one training step at a time and records the durations a correct summariser must report (µs)."""

    def __init__(self) -> None:
        self.t = 4_499_287_129_934.027  # µs, as kineto's absolute timestamps
        self.gpu_t = self.t
        self.corr = 1
        self.ext = 1
        self.events = 0
        self.kernels = 0
        self.steps = 0
        self.durations: dict[str, list[float]] = {}
        self.first = True

    def header(self) -> str:
        return (
            '{\n  "schemaVersion": 1,\n  "deviceProperties": [\n    {\n      "id": 0, "name": "NVIDIA H100 80GB HBM3", '
            '"totalGlobalMem": 85045559296,\n      "computeMajor": 9, "computeMinor": 0\n    }\n  ],\n'
            '  "cupti_version": 24,\n  "cuda_runtime_version": 12080,\n  "cuda_driver_version": 12080,\n'
            '  "displayTimeUnit": "ms",\n  "baseTimeNanoseconds": 1700000000000000000,\n  "traceEvents": [\n'
        )

    def footer(self) -> str:
        return '\n  ],\n  "traceName": "bench_trace.json"\n}\n'

    def _emit(self, out: list[str], text: str) -> None:
        out.append(text if self.first else ",\n" + text)
        self.first = False
        self.events += 1

    def _range(self, out: list[str], name: str, ts: float, dur: float) -> None:
        self._emit(
            out,
            f'  {{\n    "ph": "X", "cat": "user_annotation", "name": "__sec:{name}", "pid": {PID}, "tid": {TID},\n'
            f'    "ts": {ts:.3f}, "dur": {dur:.3f},\n    "args": {{\n      "External id": {self.ext}, '
            f'"Record function id": 0, "Ev Idx": {self.ext}\n    }}\n  }}',
        )
        self.durations.setdefault(name, []).append(round(dur, 3))
        self.ext += 1

    def _op(self, out: list[str], gpu: list[str], i: int, launch: str = "cudaLaunchKernel") -> tuple[float, float]:
        """A cpu_op with one launch inside and its kernel; returns the kernel's (start, end)."""
        ts, corr = self.t, self.corr
        self._emit(
            out,
            f'  {{\n    "ph": "X", "cat": "cpu_op", "name": "{CPU_OPS[i % len(CPU_OPS)]}", '
            f'"pid": {PID}, "tid": {TID},\n'
            f'    "ts": {ts:.3f}, "dur": 14.250,\n    "args": {{\n      "External id": {self.ext},'
            f'"Record function id": 0, "Sequence number": {i}, "Fwd thread id": 0, "Ev Idx": {self.ext}\n    }}\n  }}',
        )
        self._emit(
            out,
            f'  {{\n    "ph": "X", "cat": "cuda_runtime", "name": "{launch}", "pid": {PID}, "tid": {TID},\n'
            f'    "ts": {ts + 4.5:.3f}, "dur": 6.125,\n    "args": {{\n      "External id": {self.ext}, '
            f'"cbid": 211, "correlation": {corr}\n    }}\n  }}',
        )
        self._emit(
            out,
            f'  {{\n    "ph": "s", "id": {corr}, "pid": {PID}, "tid": {TID}, "ts": {ts + 4.5:.3f},\n'
            f'    "cat": "ac2g", "name": "ac2g"\n  }}',
        )
        start = max(ts + 9.0, self.gpu_t + 1.0)
        dur = 3.0 + (self.kernels * 7919 % 200) / 8.0
        self._emit(
            gpu,
            f'  {{\n    "ph": "X", "cat": "kernel", "name": "{KERNEL_NAMES[i % len(KERNEL_NAMES)]}", "pid": {GPU_PID}, '
            f'"tid": {STREAM},\n    "ts": {start:.3f}, "dur": {dur:.3f},\n    "args": {{\n      "External id": '
            f'{self.ext},\n      "queued": 0, "device": 0, "context": 1,\n      "stream": {STREAM}, "correlation": '
            f'{corr},\n      "registers per thread": 72,\n      "shared memory": 16384,\n      "blocks per SM": 1.6,\n'
            f'      "warps per SM": 6.4,\n      "grid": [216, 1, 1],\n      "block": [128, 1, 1],\n'
            f'      "est. achieved occupancy %": 12\n    }}\n  }}',
        )
        self._emit(
            gpu,
            f'  {{\n    "ph": "f", "id": {corr}, "pid": {GPU_PID}, "tid": {STREAM}, "ts": {start:.3f},\n'
            f'    "cat": "ac2g", "name": "ac2g", "bp": "e"\n  }}',
        )
        self.kernels += 1
        self.gpu_t = start + dur
        self.t += 16.0
        self.corr += 1
        self.ext += 1
        return round(start, 3), round(start, 3) + round(dur, 3)

    def _memcpy(self, out: list[str], gpu: list[str]) -> None:
        ts, corr = self.t, self.corr
        self._emit(
            out,
            f'  {{\n    "ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "pid": {PID}, "tid": {TID},\n'
            f'    "ts": {ts:.3f}, "dur": 8.000,\n    "args": {{\n      "External id": {self.ext}, '
            f'"cbid": 41, "correlation": {corr}\n    }}\n  }}',
        )
        start = max(ts + 3.0, self.gpu_t + 1.0)
        self._emit(
            gpu,
            f'  {{\n    "ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "pid": {GPU_PID}, '
            f'"tid": {STREAM},\n    "ts": {start:.3f}, "dur": 180.000,\n    "args": {{\n      "External id": '
            f'{self.ext},\n      "device": 0, "context": 1,\n      "stream": {STREAM}, "correlation": {corr},\n'
            f'      "bytes": 16777216, "memory bandwidth (GB/s)": 93.2\n    }}\n  }}',
        )
        self.gpu_t = start + 180.0
        self.t += 10.0
        self.corr += 1
        self.ext += 1

    def _section(self, out: list[str], gpu: list[str], name: str, ops: int) -> None:
        """A kernel-timed section: CPU range around the launches; records first-kernel-start to last-kernel-end."""
        ts = self.t
        self.t += 2.0
        if name == "forward":  # an input copy first: a copy is not a kernel, so it must not stretch the span
            self._memcpy(out, gpu)
        spans = [self._op(out, gpu, i) for i in range(ops)]
        self.t += 2.0
        cpu_dur = self.t - ts
        self._emit(
            out,
            f'  {{\n    "ph": "X", "cat": "user_annotation", "name": "__sec:{name}", "pid": {PID}, "tid": {TID},\n'
            f'    "ts": {ts:.3f}, "dur": {cpu_dur:.3f},\n    "args": {{\n      "External id": {self.ext}, '
            f'"Record function id": 0, "Ev Idx": {self.ext}\n    }}\n  }}',
        )
        self._emit(  # the GPU-timeline copy of the range: must not add a second instance
            gpu,
            f'  {{\n    "ph": "X", "cat": "gpu_user_annotation", "name": "__sec:{name}", "pid": {GPU_PID}, '
            f'"tid": {STREAM},\n    "ts": {spans[0][0]:.3f}, "dur": {spans[-1][1] - spans[0][0]:.3f},\n'
            f'    "args": {{\n      "External id": {self.ext}\n    }}\n  }}',
        )
        self.ext += 1
        self.durations.setdefault(name, []).append(max(e for _, e in spans) - min(s for s, _ in spans))

    def step(self, index: int) -> str:
        out: list[str] = []
        gpu: list[str] = []
        loader = "loader_first" if index == 0 else "loader_next"
        loader_dur = 1500.0 + (index * 37 % 1000)
        self._range(out, loader, self.t, loader_dur)
        self.t += loader_dur + 10.0
        step_ts = self.t
        self.t += 5.0
        self._section(out, gpu, "forward", OPS_PER_SECTION["forward"] + index % 3)
        self._section(out, gpu, "backward", OPS_PER_SECTION["backward"] + index % 5)
        opt_ts = self.t
        for i in range(OPS_PER_SECTION["optimizer"]):  # launched outside forward/backward: ignored for them
            self._op(out, gpu, i, launch="cudaLaunchKernelExC")
        self._range(out, "optimizer", opt_ts, self.t - opt_ts)
        self.t += 5.0
        self._range(out, "step", step_ts, self.t - step_ts)
        self.t = max(self.t, self.gpu_t) + 20.0
        self.steps += 1
        return "".join(out) + "".join(gpu)

    def expected(self) -> dict[str, Any]:
        return {
            "events": self.events,
            "kernels": self.kernels,
            "steps": self.steps,
            "sections": {
                name: {"count": len(v), "mean_s": statistics.fmean(v) / 1e6, "max_s": max(v) / 1e6}
                for name, v in self.durations.items()
            },
        }


def _run_summarizer(trace: Path, parser: str) -> dict[str, Any]:
    """Run the CLI in a child process; its wall time, peak RSS (KiB) and parsed JSON output."""
    cmd = [sys.executable, "-m", "scripts.summarize_trace", str(trace), "--format", "json", "--parser", parser]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err)
        if hasattr(os, "wait4"):
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            maxrss = usage.ru_maxrss
        else:  # pragma: no cover - non-Unix
            proc.wait()
            maxrss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    summary = json.loads(stdout) if proc.returncode == 0 else None
    return {"wall_s": wall, "maxrss_kb": maxrss, "summary": summary, "stderr": stderr}


def _check(summary: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    problems = []
    for name, want in expected["sections"].items():
        got = summary["sections"].get(name)
        if got is None:
            problems.append(f"{name} missing")
            continue
        if got["count"] != want["count"]:
            problems.append(f"{name} count {got['count']} != {want['count']}")
        for key in ("mean_s", "max_s"):
            if abs(got[key] - want[key]) > 1e-8 + 1e-6 * abs(want[key]):
                problems.append(f"{name} {key} {got[key]} != {want[key]}")
    return problems


def _as_bool(value: bool | str) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


if __name__ == "__main__":
    import fire

    fire.Fire(main)
