"""Synthetic torch.profiler chrome traces of any size, written as a CUDA/HIP training run records them, and the
statistics each was built with: the fixture of the trace summariser's tests and of ``python -m benchmarks.bench_trace``.

A trace is written independently of the summariser (plain string templates, no code from it): ``__sec:`` ranges
(loader, step, forward, backward, optimizer), ``cpu_op`` events with recorded shapes, runtime launch events whose
names are CUDA-only, HIP-only or mixed (``cudaLaunchKernel``, ``cuLaunchKernel``, ``hipExtModuleLaunchKernel``, ...),
``kernel`` events on two streams tied to their launches by ``args.correlation``, ``ac2g`` flows,
``gpu_user_annotation`` copies of the section names, memcpys inside the loader ranges (and one inside every forward),
backward launches on autograd's own thread, ``ProfilerStep#N`` ranges around the steps. A shape is named
``NAMES-ORDER[-LAYOUT]``:

* order: a step's GPU events written after (``after``) or before (``before``) its CPU events, or kineto's own order
  (``window``): every CPU event of the profiling window, the CPU trace's span, then the GPU activities (runtime
  calls with them, each followed by its flow start, kernels by their flow end), then thread and process names, the
  GPU span, the ``gpu_user_annotation`` copies and ``Record Window End`` (GPU events held in a spool file meanwhile);
* layout: one key a line (no suffix: ``"dur": ...\\n    ,\\n    "args": {``), one event a line (``compact``, as
  another tool re-saves a trace), or libkineto's ``output_json.cpp`` templates verbatim: ``kineto`` (the current
  template: one key a line; metadata with ``ph`` first; the stream-sync row's name in the older template; instants
  with an empty line where ``cat`` would be; flow ends with ``\\n    , "bp": "e"``), ``kineto22`` (the template before
  it, as the torch releases that used it write it: keys sharing lines, ``"ts"``/``"dur"`` on the next; metadata and
  global instants with ``name`` before ``ph``; CUPTI/roctracer metadata whose line breaks were removed;
  ``distributedInfo`` with a list of objects after the events), or ``jumble`` (adversarial: each event in one of
  eight layouts drawn at random with odd whitespace around separators; names holding ``}, {"ph": ...``, ``[{``,
  escaped quotes, backslashes, raw and ``\\u``-escaped non-ASCII characters, and sometimes markers written with
  ``\\u`` escapes; lists of objects, one written like a kernel, inside operators' args; empty objects in the event
  list; one-line metadata events first).

The ``kineto``, ``kineto22`` and ``jumble`` shapes also hold what real CUDA/HIP traces hold beyond that: kernel
names that are C++ signatures of 50 to 760 characters (``{lambda()#1}``, ``(anonymous namespace)``, ``<...>``), CUPTI
occupancy objects in kernel args, HIP launch args naming their kernel, ``[memory]`` instants, ``python_function``
frames, ``fwdbwd`` flows, ``Stream Sync`` events, trace spans with string pids, and every 8th step a loader stretch of
13,000 to 27,000 events without any kernel, launch or section.
"""

from __future__ import annotations

import gzip
import json
import random
import shutil
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any, TextIO

from trace_reference import stats

PID, MAIN_TID, AUTOGRAD_TID, GPU_PID = 31337, 31337, 31402, 0
COMPUTE_STREAM, SIDE_STREAM, COPY_STREAM = 7, 20, 13
LAUNCHES = {  # (name, category) of the runtime/driver calls that launch kernels
    "cuda": (
        ("cudaLaunchKernel", "cuda_runtime"),
        ("cudaLaunchKernelExC", "cuda_runtime"),
        ("cuLaunchKernel", "cuda_driver"),
    ),
    "hip": (
        ("hipLaunchKernel", "cuda_runtime"),
        ("hipExtModuleLaunchKernel", "cuda_runtime"),
        ("hipModuleLaunchKernel", "cuda_runtime"),
    ),
}
LAUNCHES["mixed"] = tuple(x for pair in zip(LAUNCHES["cuda"], LAUNCHES["hip"], strict=True) for x in pair)
COPIES = {"cuda": ("cudaMemcpyAsync", "cudaStreamSynchronize"), "hip": ("hipMemcpyAsync", "hipStreamSynchronize")}
COPIES["mixed"] = COPIES["cuda"]
KERNEL_NAMES = (
    "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, "
    "at::native::GeluType)::{lambda()#2}::operator()() const::{lambda()#2}::operator()() const::{lambda(float)#1}, "
    "at::detail::Array<char*, 2> >(int, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, "
    "at::native::GeluType)::{lambda()#2}::operator()() const::{lambda()#2}::operator()() const::{lambda(float)#1}, "
    "at::detail::Array<char*, 2>)",
    "sm90_xmma_fprop_implicit_gemm_indexed_f16f16_f16f32_f32_ndhwc_kt3x3x3_nhwc_tilesize128x128x64_warpgroupsize1x1x1",
    "void cudnn::ops::nchwToNhwcKernel<__half, __half, float, false, true, (cudnnKernelDataType_t)0>"
    "(cudnn::ops::nchw2nhwc_params_t<float>, __half const*, __half*)",
    "Cijk_Ailk_Bljk_HHS_BH_MT128x128x32_MI32x32x8x1_SN_1LDSB0_APM1_ABV0_ACED0_AF0EM1_AF1EM1_AMAS3_ASE_ASGT"
    "_ASAE01_ASCE01",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::Half, float>(int, float, "
    "c10::Half const*, c10::Half const*, c10::Half const*, float*, float*, c10::Half*)",
)
FORWARD_OPS = (("aten::conv3d", "aten::convolution"), ("aten::layer_norm", "aten::native_layer_norm"))
FORWARD_OPS += (("aten::gelu", "aten::gelu"), ("aten::linear", "aten::addmm"))
BACKWARD_OPS = ("ConvolutionBackward0", "NativeLayerNormBackward0", "GeluBackward0", "AddmmBackward0")
OPS_PER_SECTION = {"forward": 160, "backward": 320, "optimizer": 24}
# Long C++ signatures (200-700 characters) as CUPTI and rocprofiler demangle them, for the kineto-layout shapes
_ADD = (
    "at::native::gpu_kernel_impl_nocast<at::native::CUDAFunctor_add<c10::Half> >(at::TensorIteratorBase&, "
    "at::native::CUDAFunctor_add<c10::Half> const&)::{lambda(int)#1}"
)
_SUM = (
    "at::native::ReduceOp<float, at::native::func_wrapper_t<float, at::native::sum_functor<float, float, float>::"
    "operator()(at::TensorIterator&)::{lambda(float, float)#1}>, unsigned int, float, 4, 4>"
)
_ADAM = "at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, false>"
_CAST = (
    "at::detail::Array<char*, 3>, TrivialOffsetCalculator<2, unsigned int>, TrivialOffsetCalculator<1, "
    "unsigned int>, at::native::memory::LoadWithCast<2>, at::native::memory::StoreWithCast<1>"
)
_UNROLLED = f"void at::native::unrolled_elementwise_kernel<{_ADD}, {_CAST} >(int, {_ADD}, {_CAST})"
CUDA_KERNEL_NAMES = (
    _UNROLLED,
    f"void at::native::elementwise_kernel<128, 2, {_ADD}>(int, {_ADD})",
    f"void at::native::reduce_kernel<512, 1, {_SUM} >({_SUM})",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    f"TensorListMetadata<4>, {_ADAM}, float*, float, float, float, float, float, float, bool, float*, float*>("
    f"at::native::(anonymous namespace)::TensorListMetadata<4>, {_ADAM}, float*, float, float, float, float, float, "
    "float, bool, float*, float*)",
    "sm90_xmma_fprop_implicit_gemm_indexed_f16f16_f16f32_f32_ndhwc_kt3x3x3_nhwc_tilesize128x128x64_warpgroupsize1x1x1",
    *KERNEL_NAMES[::2],
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_f16_s161616gemm_f16_32x32_128x2_tn_align8>("
    "cutlass_80_wmma_tensorop_f16_s161616gemm_f16_32x32_128x2_tn_align8::Params)",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous "
    "namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)",
)
HIP_KERNEL_NAMES = (
    f"void at::native::elementwise_kernel<128, 2, {_ADD}>(int, {_ADD})",
    "Cijk_Ailk_Bljk_HHS_BH_MT128x128x32_MI32x32x8x1_SN_1LDSB0_APM1_ABV0_ACED0_AF0EM1_AF1EM1_AMAS3_ASE_ASGT"
    "_ASAE01_ASCE01_ASEM1_AAC0_BL1_BS1_DTL0_DTVA0_DVO0_ETSP_EPS1_FL0_GRPM1_GRVW8_GSU1_GSUASB_GLS0_ISA942_IU1_K1_KLA"
    "_LBSPPA128",
    "naive_conv_ab_nonpacked_fwd_ndhwc_half_double_half",
    f"void at::native::reduce_kernel<512, 1, {_SUM} >({_SUM})",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::Half, float>(int, float, "
    "c10::Half const*, c10::Half const*, c10::Half const*, float*, float*, c10::Half*)",
    "igemm_fwd_gtcx35_nhwc_fp16_bx0_ex1_bt256x128x32_wt32x32x8_ws2x1_wr2x2_ta1x8x2x1_1x4x1x64_tb1x8x1x1_1x4x1x64_pta",
    _UNROLLED,
)
PYTHON_FRAMES = (
    "torch/nn/modules/module.py(1784): _call_impl",
    "monai/networks/nets/swin_unetr.py(1027): forward",
    "torch/nn/modules/conv.py(717): forward",
    "torch/utils/data/_utils/collate.py(171): collate",
    "monai/data/utils.py(488): list_data_collate",
)
CPU_STRETCH_EVENTS = 20_000  # a marker-free loader stretch every 8th step of the kineto-layout shapes (x 2/3 to 4/3)
SYNC_ROW_OFFSET = 1_000_000  # kineto's kSyncStreamTidOffset: the Stream Sync row of a stream
ORDERS = ("after", "before", "window")
LAYOUTS = ("keys", "compact", "kineto", "kineto22", "jumble")
SHAPES = tuple(f"{names}-{order}" for names in ("cuda", "hip", "mixed") for order in ("after", "before"))
SHAPES += ("mixed-after-compact", "mixed-before-compact")
SHAPES += ("cuda-window-kineto", "hip-window-kineto", "cuda-window-kineto22", "hip-window-kineto22")
SHAPES += ("mixed-window-jumble", "mixed-after-jumble")


def write_trace(
    path: Path, min_bytes: int, shape: str = "mixed-after", gz_path: Path | None = None, ops_scale: float = 1.0
) -> dict[str, Any]:
    """Stream a synthetic trace of ``shape`` of at least ``min_bytes`` to ``path`` (and gzipped to ``gz_path``).

    ``ops_scale`` scales the operators per section and the long CPU-only stretches (small steps for quick tests).
    ``window`` shapes hold a step's GPU activities in a spool file until every CPU event is written, as kineto
    writes a profiling window.

    Returns the statistics the trace was built with (:meth:`_TraceWriter.expected`).
    """
    gen = _TraceWriter(shape, ops_scale)
    with ExitStack() as stack:
        out = stack.enter_context(open(path, "w", encoding="utf-8", newline=""))
        out.write(gen.header())
        events = _EventList(out)
        spool = None
        if gen.window:
            spool = _EventList(stack.enter_context(tempfile.TemporaryFile("w+", encoding="utf-8", newline="")))
        events.add(gen.opening())
        step = 0
        while events.written + (spool.written if spool else 0) < min_bytes:
            cpu, gpu = gen.step(step)
            if spool is not None:
                events.add(cpu)
                spool.add(gpu)
            else:
                events.add(gpu + cpu if gen.kernels_first else cpu + gpu)
            step += 1
        events.add(gen.cpu_closing())
        if spool is not None and spool.written:
            spool.out.seek(0)
            out.write(",\n" if events.written else "")
            shutil.copyfileobj(spool.out, out, 1 << 22)
            events.written += spool.written
            events.first = False
        events.add(gen.closing())
        out.write(gen.footer())
    if gz_path is not None:
        with open(path, "rb") as plain, gzip.open(gz_path, "wb", compresslevel=6) as packed:
            shutil.copyfileobj(plain, packed, 1 << 22)
    return gen.expected()


class _EventList:
    """Events written to a text stream, separated as kineto separates them (``},\\n  {``)."""

    def __init__(self, out: TextIO) -> None:
        self.out, self.first, self.written = out, True, 0

    def add(self, events: list[str]) -> None:
        """Append the events' texts (each an object, without the separator)."""
        if not events:
            return
        text = ("" if self.first else ",\n") + ",\n".join(events)
        self.first = False
        self.out.write(text)
        self.written += len(text)


# kineto's templates (libkineto/src/output_json.cpp). An event is (kind, fields, args): fields maps keys to JSON
# texts in the writer's key order, args is the text inside ``"args": {...}`` (None: no args).
_PH = {"X": '"X"', "M": '"M"', "M-inline": '"M"', "i": '"i"'}


def _k26(kind: str, f: dict[str, str], args: str | None) -> str:
    """Kineto's current template (since ``refactor JSON chrome trace writing``): one key a line, ``"dur": ...\\n    ,\\n
    "args": {``; metadata with ``ph`` first; instants keep an empty line where their ``cat`` would be."""
    field = "" if args is None else f',\n    "args": {{\n      {args}\n    }}'
    if kind == "X":
        return (
            f'  {{\n    "ph": "X",\n    "cat": {f["cat"]},\n    "name": {f["name"]},\n    "pid": {f["pid"]},\n'
            f'    "tid": {f["tid"]},\n    "ts": {f["ts"]},\n    "dur": {f["dur"]}\n    {field}\n  }}'
        )
    if kind == "flow":
        bp = ', "bp": "e"' if "bp" in f else ""
        return (
            f'  {{\n    "ph": {f["ph"]},\n    "id": {f["id"]},\n    "pid": {f["pid"]},\n    "tid": {f["tid"]},\n'
            f'    "ts": {f["ts"]},\n    "cat": {f["cat"]},\n    "name": {f["name"]}\n    {bp}\n  }}'
        )
    if kind == "M":
        return (
            f'  {{\n    "ph": "M",\n    "name": {f["name"]},\n    "ts": {f["ts"]},\n    "pid": {f["pid"]},\n'
            f'    "tid": {f["tid"]},\n    "args": {{\n      {args}\n    }}\n  }}'
        )
    if kind == "M-inline":  # the stream-sync row's thread name: the older template, kept inline
        return (
            f'  {{\n    "name": {f["name"]}, "ph": "M", "ts": {f["ts"]}, "pid": {f["pid"]}, "tid": {f["tid"]},\n'
            f'    "args": {{\n      {args}\n    }}\n  }}'
        )
    cat = f'\n    "cat": {f["cat"]},' if "cat" in f else ""  # kind "i"
    return (
        f'  {{\n    "ph": "i",\n    {cat}\n    "s": {f["s"]},\n    "name": {f["name"]},\n    "pid": {f["pid"]},\n'
        f'    "tid": {f["tid"]},\n    "ts": {f["ts"]}\n    {field}\n  }}'
    )


def _k22(kind: str, f: dict[str, str], args: str | None) -> str:
    """Kineto's template before it (commits 1679e50e to c51fcfea): keys share lines (``"ph": "X", "cat": ...,
    "name": ..., "pid": ..., "tid": ...,`` then ``"ts": ..., "dur": ...,``); metadata and global instants with
    ``name`` first."""
    field = "" if args is None else f',\n    "args": {{\n      {args}\n    }}'
    if kind == "X" and f["cat"] == '"Trace"':
        return (
            f'  {{\n    "ph": "X", "cat": "Trace", "ts": {f["ts"]}, "dur": {f["dur"]},\n    "pid": {f["pid"]}, '
            f'"tid": {f["tid"]},\n    "name": {f["name"]}{field}\n  }}'
        )
    if kind == "X":
        return (
            f'  {{\n    "ph": "X", "cat": {f["cat"]}, "name": {f["name"]}, "pid": {f["pid"]}, "tid": {f["tid"]},\n'
            f'    "ts": {f["ts"]}, "dur": {f["dur"]}{field}\n  }}'
        )
    if kind == "flow":
        bp = ', "bp": "e"' if "bp" in f else ""
        return (
            f'  {{\n    "ph": {f["ph"]}, "id": {f["id"]}, "pid": {f["pid"]}, "tid": {f["tid"]}, "ts": {f["ts"]},\n'
            f'    "cat": {f["cat"]}, "name": {f["name"]}{bp}\n  }}'
        )
    if kind in ("M", "M-inline"):
        return (
            f'  {{\n    "name": {f["name"]}, "ph": "M", "ts": {f["ts"]}, "pid": {f["pid"]}, "tid": {f["tid"]},\n'
            f'    "args": {{\n      {args}\n    }}\n  }}'
        )
    if "cat" in f:  # an instant of the CPU trace ([memory])
        return (
            f'  {{\n    "ph": "i", "cat": {f["cat"]}, "s": {f["s"]}, "name": {f["name"]},\n    "pid": {f["pid"]}, '
            f'"tid": {f["tid"]},\n    "ts": {f["ts"]}{field}\n  }}'
        )
    return (  # global instants: iteration start, record window end
        f'  {{\n    "name": {f["name"]}, "ph": "i", "s": {f["s"]},\n    "pid": {f["pid"]}, "tid": {f["tid"]}, '
        f'"ts": {f["ts"]}\n  }}'
    )


def _one_line(kind: str, f: dict[str, str], args: str | None, sep: str = ", ", colon: str = ": ") -> str:
    """The event on one line (as tools re-save traces), keys in the writer's order."""
    items = [f'"{k}"{colon}{v}' for k, v in f.items()]
    if args is not None:
        items.append(f'"args"{colon}{{{args}}}')
    return "{" + sep.join(items) + "}"


class _Jumble:
    """Each event in a layout drawn at random: both kineto templates, one line, minified, name first, args first,
    one key a line with CRLF and tabs, spaces around colons; separators with odd whitespace around them."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def __call__(self, kind: str, f: dict[str, str], args: str | None) -> str:
        """One event's text."""
        r = self.rng.random()
        if r < 0.25:
            text = _k26(kind, f, args)
        elif r < 0.45:
            text = _k22(kind, f, args)
        elif r < 0.6:
            text = _one_line(kind, f, args)
        elif r < 0.7:
            text = _one_line(kind, f, args, ",", ":")
        elif r < 0.78:
            text = _one_line(kind, {"name": f.get("name", '""'), **f}, args)
        elif r < 0.84 and args is not None:
            text = "{" + f'"args": {{\n  {args}\n}},\n' + ", ".join(f'"{k}": {v}' for k, v in f.items()) + "}"
        elif r < 0.92:
            items = [f'\t"{k}" : {v}' for k, v in f.items()] + ([] if args is None else [f'\t"args" : {{ {args} }}'])
            text = "{\r\n" + " ,\r\n".join(items) + "\r\n}"
        else:
            text = _one_line(kind, f, args, " ,  ", " :\n ")
        pad = self.rng.random()
        if pad < 0.1:
            return "\n\n   " + text + " "
        if pad < 0.15:
            return "\t" + text + "\r\n"
        return text


# Adversarial texts for the jumble shape: braces, brackets, quotes, escapes and separator-like text inside strings
ODD_NAMES = (
    "aten::_foreach_add_ (lambda [{x}, {y}])",
    'torch/_dynamo/eval_frame.py(632): _fn {"device": "cuda:0"}',
    'void k<"a", \'b\'>() }, {"ph": "X", "cat": "kernel"} ]',
    "µs-timer ünïcødé 操作 \u2028 {[(",
    'back\\slash \\u0041 and \\"quoted\\"',
    '}},{{ [[ ]] ,{ ,[{ "x": 1}]',
)
NESTED_ARGS = (
    '"Concrete Inputs": [{"dtype": "c10::Half", "shape": [1, {"n": 2}]}, {"ph": "X", "cat": "kernel", "ts": 0, '
    '"dur": 9e9, "args": {"correlation": 1}}], "Input type": ["", "ScalarList"]'
)


class _TraceWriter:
    """Writes one training step at a time and records the durations a correct summariser must report (µs)."""

    def __init__(self, shape: str, ops_scale: float = 1.0) -> None:
        parts = shape.split("-")
        if len(parts) not in (2, 3) or parts[0] not in LAUNCHES or parts[1] not in ORDERS:
            raise ValueError(f"unknown shape {shape!r}; use one of {', '.join(SHAPES)}")
        self.layout = parts[2] if len(parts) == 3 else "keys"
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout in shape {shape!r}; use one of {', '.join(LAYOUTS)}")
        self.launches, self.copies = LAUNCHES[parts[0]], COPIES[parts[0]]
        self.hip = parts[0] == "hip"
        self.kernels_first, self.window = parts[1] == "before", parts[1] == "window"
        self.compact = self.layout == "compact"
        self.rich = self.layout in ("kineto", "kineto22", "jumble")  # kineto's other events, long kernel names
        self.rng = random.Random(sum(map(ord, shape)))
        self.render = {"kineto": _k26, "kineto22": _k22, "jumble": _Jumble(self.rng)}.get(self.layout)
        self.legacy_args = self.layout == "kineto22"
        self.kernel_names = (HIP_KERNEL_NAMES if self.hip else CUDA_KERNEL_NAMES) if self.rich else KERNEL_NAMES
        self.t = 4_499_287_129_934.027  # µs, as kineto's absolute timestamps
        self.t0 = self.t
        self.gpu_free = {COMPUTE_STREAM: self.t, SIDE_STREAM: self.t, COPY_STREAM: self.t}
        self.corr, self.ext, self.events, self.kernels, self.launch_index = 1, 1, 0, 0, 0
        self.durations: dict[str, list[float]] = {}
        self.on_device: list[tuple[float, float]] = []  # this step's kernels and copies (start, end), µs
        self.device = {"events": 0, "us": 0.0, "wall_us": 0.0, "busy_us": 0.0}  # every step's, for expected()
        self.ops = {name: max(1, round(n * ops_scale)) for name, n in OPS_PER_SECTION.items()}
        self.stretch = max(2, round(CPU_STRETCH_EVENTS * ops_scale))
        self.annotations: list[str] = []  # window shapes: the GPU copies of the ranges, written at the end
        self.synced: set[int] = set()

    # ----------------------------------------------------------------------------------------- header and footer
    def header(self) -> str:
        """The top-level keys before the events, as torch writes them."""
        if self.layout == "kineto":
            meta = "".join(f'\n      "{k}": {v},' for k, v in self._metadata())
            return (
                ' {\n    "schemaVersion": 1,\n    "deviceProperties": ['
                + self._device_json(False)
                + "],\n    "
                + meta
                + '\n    "displayTimeUnit": "ms",\n    "baseTimeNanoseconds": 1700000000000000000,\n'
                '    "traceEvents": [\n    \n'
            )
        if self.layout in ("kineto22", "jumble"):
            meta = "".join(f'\n      "{k}": {v},' for k, v in self._metadata())
            return (
                '\n  {\n    "schemaVersion": 1,\n    "deviceProperties": ['
                + self._device_json(True)
                + "\n    ],"
                + meta
                + '\n  "displayTimeUnit": "ms",\n  "baseTimeNanoseconds": 1700000000000000000,\n  "traceEvents": [\n'
            )
        return (
            '{\n  "schemaVersion": 1,\n  "deviceProperties": [\n    {\n      "id": 0, "name": "NVIDIA H100 80GB HBM3", '
            '"totalGlobalMem": 85045559296,\n      "computeMajor": 9, "computeMinor": 0\n    }\n  ],\n'
            '  "cupti_version": 24,\n  "cuda_runtime_version": 12080,\n  "cuda_driver_version": 12080,\n'
            '  "trace_id": "D14660C0FEE8493FB51EFB2C3B281A75",\n  "record_shapes": 1,\n'
            '  "displayTimeUnit": "ms",\n  "baseTimeNanoseconds": 1700000000000000000,\n  "traceEvents": [\n'
        )

    def _metadata(self) -> list[tuple[str, str]]:
        """Trace-level metadata torch and kineto add (``metadataToJSON``), a path holding marker texts included."""
        if self.hip:
            version = [("roctracer_version", "4"), ("hip_runtime_version", "60342134")]
        else:
            version = [("cupti_version", "26"), ("cuda_runtime_version", "12090"), ("cuda_driver_version", "13000")]
        return [
            ("trace_id", '"D14660C0FEE8493FB51EFB2C3B281A75"'),
            ("with_stack", "1"),
            ("record_shapes", "1"),
            ("profile_memory", "1"),
            ("PT_PROFILER_DIR", '"/runs/train/profiler/__sec:kernel cudaLaunchKernel"'),
            *version,
        ]

    def _device_json(self, legacy: bool) -> str:
        """``deviceProperties`` as each kineto template writes it (over lines in ``kineto22``, on one in ``kineto``)."""
        name, mem, sms = (
            ("AMD Instinct MI300X", 205822885888, 304) if self.hip else ("NVIDIA H100 80GB HBM3", 85045559296, 132)
        )
        extra = (
            [("maxSharedMemoryPerMultiProcessor", "65536")]
            if self.hip
            else [
                ("regsPerMultiprocessor", "65536"),
                ("sharedMemPerBlockOptin", "232448"),
                ("sharedMemPerMultiprocessor", "233472"),
            ]
        )
        if not legacy:
            fields = [("id", "0"), ("name", f'"{name}"'), ("totalGlobalMem", str(mem)), ("computeMajor", "9")]
            fields += [("computeMinor", "0"), ("maxThreadsPerBlock", "1024"), ("maxThreadsPerMultiprocessor", "2048")]
            fields += [("regsPerBlock", "65536"), ("warpSize", "64" if self.hip else "32")]
            fields += [("sharedMemPerBlock", "49152"), ("numSms", str(sms)), *extra]
            return "{" + ", ".join(f'"{k}": {v}' for k, v in fields) + "}"
        tail = ", ".join(f'"{k}": {v}' for k, v in extra)
        return (
            f'\n    {{\n      "id": 0, "name": "{name}", "totalGlobalMem": {mem},\n      "computeMajor": 9, '
            '"computeMinor": 0,\n      "maxThreadsPerBlock": 1024, "maxThreadsPerMultiprocessor": 2048,\n'
            f'      "regsPerBlock": 65536, "warpSize": {64 if self.hip else 32},\n      "sharedMemPerBlock": 49152, '
            f'"numSms": {sms}\n    , {tail}\n    }}'
        )

    def footer(self) -> str:
        """The end of the event list and the top-level keys after it (marker texts and a list of objects among
        them: not events)."""
        name = '"/runs/profiler/__sec:kernel-cudaLaunchKernel.pt.trace.json"'
        if self.layout == "kineto":
            return f'\n  ],"traceName": {name} }}'
        if self.layout in ("kineto22", "jumble"):
            dist = (
                '\n  "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 2, "pg_count": 2, "pg_config": '
                '[{"pg_name": "0", "pg_desc": "default_pg", "backend_config": "cuda:nccl", "pg_size": 2, "ranks": '
                '[0, 1]},{"pg_name": "1", "pg_desc": "undefined", "backend_config": "cuda:nccl", "pg_size": 2, '
                '"ranks": [0, 1]}], "nccl_version": "2.21.5"},'
            )
            warn = '\n      "WARNING": ["cudaLaunchKernel on __sec:forward: \\"kernel\\" {x}, {y}"],'
            return f'\n  ],{dist}{warn}\n  "traceName": {name}\n}}'
        return '\n  ],\n  "traceName": "/runs/profiler/__sec:kernel-cudaLaunchKernel.json"\n}\n'

    def opening(self) -> list[str]:
        """Events before the first step: none from kineto; the jumble shape starts with metadata events, one a
        line, some with ``name`` before ``ph``."""
        if self.layout != "jumble":
            return []
        out: list[str] = []
        for pid, label in ((PID, "CPU"), (GPU_PID, "GPU 0")):
            fields = {"name": '"process_name"', "ph": '"M"', "ts": self._ts(self.t0), "pid": str(pid), "tid": "0"}
            self._put(out, "M", fields, f'"name": "{label}"', _one_line)
            fields = {"ph": '"M"', "name": '"process_labels"', "pid": str(pid), "tid": "0", "ts": self._ts(self.t0)}
            self._put(out, "M", fields, f'"labels": "{label}"', _one_line)
        return out

    def cpu_closing(self) -> list[str]:
        """After the CPU events of the window: kineto's span of the CPU trace, its sort index, the iteration
        marker."""
        if not self.rich:
            return []
        out: list[str] = []
        start, dur = self._ts(self.t0), self._ts(self.t - self.t0)
        span = {"cat": '"Trace"', "name": '"PyTorch Profiler (0)"', "pid": '"Spans"', "tid": '"PyTorch Profiler"'}
        self._put(out, "X", {**span, "ts": start, "dur": dur}, '"Op count": 0')
        meta = {"name": '"process_sort_index"', "ts": start, "pid": '"Spans"', "tid": "0"}
        self._put(out, "M", meta, '"sort_index": 536870912')
        marker = {"s": '"g"', "name": '"Iteration Start: PyTorch Profiler"', "pid": '"Traces"'}
        self._put(out, "i", {**marker, "tid": '"Trace PyTorch Profiler"', "ts": start}, None)
        return out

    def closing(self) -> list[str]:
        """After the GPU activities: thread and process names, the GPU copies of the ranges (window shapes) and
        the record window's end, as kineto's ``finalizeTrace`` writes them."""
        if not self.rich:
            return []
        out: list[str] = []
        start = self._ts(self.t0)
        for pid, tid, name in (
            (PID, MAIN_TID, "thread 31337 (python3)"),
            (PID, AUTOGRAD_TID, "thread 31402 (pt_autograd_0)"),
        ):
            self._put(
                out, "M", {"name": '"thread_name"', "ts": start, "pid": str(pid), "tid": str(tid)}, f'"name": "{name}"'
            )
            self._put(
                out,
                "M",
                {"name": '"thread_sort_index"', "ts": start, "pid": str(pid), "tid": str(tid)},
                f'"sort_index": {tid}',
            )
        for stream in (COMPUTE_STREAM, SIDE_STREAM, COPY_STREAM):
            fields = {"name": '"thread_name"', "ts": start, "pid": str(GPU_PID), "tid": str(stream)}
            self._put(out, "M", fields, f'"name": "stream {stream}"')
        for pid in (PID, *range(16)):
            label = "CPU" if pid == PID else f"GPU {pid}"
            for key, arg in (("process_name", '"name": "python3"'), ("process_labels", f'"labels": "{label}"')):
                self._put(out, "M", {"name": f'"{key}"', "ts": start, "pid": str(pid), "tid": "0"}, arg)
            self._put(
                out,
                "M",
                {"name": '"process_sort_index"', "ts": start, "pid": str(pid), "tid": "0"},
                f'"sort_index": {pid}',
            )
        span = {"cat": '"Trace"', "name": '"GPU: PyTorch Profiler (0)"', "pid": '"Spans"', "tid": '"PyTorch Profiler"'}
        self._put(out, "X", {**span, "ts": start, "dur": self._ts(self.t - self.t0)}, f'"Op count": {self.kernels}')
        out += self.annotations
        self.annotations = []
        end = {"s": '"g"', "name": '"Record Window End"', "pid": '""', "tid": '""', "ts": self._ts(self.t + 50.0)}
        self._put(out, "i", end, None)
        return out

    # ------------------------------------------------------------------------------------------------ one event
    @staticmethod
    def _ts(value: float) -> str:
        return f"{value:.3f}"

    def _put(self, out: list[str], kind: str, fields: dict[str, str], args: str | None, render: Any = None) -> None:
        """Append one event of a rich layout, rendered by that layout's template (or ``render``)."""
        if "ph" not in fields:
            fields = {"ph": _PH[kind], **fields}
        out.append((render or self.render)(kind, fields, args))
        self.events += 1

    def _emit(self, out: list[str], fields: list[tuple[str, str]], args: str | None) -> None:
        """Append one event; ``fields`` are (key, JSON text) pairs, ``args`` the JSON text inside ``args: {}``."""
        if self.render is not None:
            kind = "flow" if fields[0][1] in ('"s"', '"f"') else "X"
            self._put(out, kind, dict(fields), args)
            return
        if self.compact:
            body = ", ".join(f'"{k}": {v}' for k, v in fields)
            text = "{" + body + (f', "args": {{{args}}}' if args is not None else "") + "}"
        else:
            body = ",\n".join(f'    "{k}": {v}' for k, v in fields)
            tail = f'\n    ,\n    "args": {{\n      {args}\n    }}' if args is not None else "\n    "
            text = "  {\n" + body + tail + "\n  }"
        out.append(text)
        self.events += 1

    def _name(self, name: str) -> str:
        """A name as JSON text; the jumble shape sometimes escapes characters that need no escape (a reader must
        decode, not match bytes)."""
        if self.layout == "jumble" and self.rng.random() < 0.004:
            return '"' + "".join(f"\\u{ord(c):04x}" if c in "Lkeo_" else json.dumps(c)[1:-1] for c in name) + '"'
        return json.dumps(name, ensure_ascii=self.layout != "jumble" or self.rng.random() < 0.5)

    def _x(
        self, out: list[str], cat: str, name: str, tid: int, ts: float, dur: float, args: str, pid: int = PID
    ) -> None:
        """A complete (``ph: X``) event with its fields in kineto's order."""
        cat_text = (
            '"\\u006bernel"'
            if cat == "kernel" and self.layout == "jumble" and self.rng.random() < 0.003
            else f'"{cat}"'
        )
        fields = [("ph", '"X"'), ("cat", cat_text), ("name", self._name(name) if self.rich else json.dumps(name))]
        fields += [("pid", str(pid)), ("tid", str(tid))]
        self._emit(out, [*fields, ("ts", f"{ts:.3f}"), ("dur", f"{dur:.3f}")], args)

    def _flow(self, out: list[str], ph: str, pid: int, tid: int, ts: float, corr: int, cat: str = "ac2g") -> None:
        """An ``ac2g`` flow start (``s``, at the launch) or end (``f``, at the kernel); ``fwdbwd`` between ops."""
        fields = [("ph", f'"{ph}"'), ("id", str(corr)), ("pid", str(pid)), ("tid", str(tid)), ("ts", f"{ts:.3f}")]
        fields += [("cat", f'"{cat}"'), ("name", f'"{cat}"')] + ([("bp", '"e"')] if ph == "f" else [])
        self._emit(out, fields, None)

    def _args(self, pairs: list[tuple[str, Any]], legacy_breaks: tuple[int, ...] = ()) -> str:
        """``External id`` and an activity's metadata as kineto joins them: ``,`` after the external id, ``, ``
        between the rest. The ``kineto22`` templates start the metadata on a new line and break lines before the
        fields at ``legacy_breaks`` (indices into ``pairs``); ``sanitizeStrForJSON`` removed the breaks and left
        their indentation."""
        head = f'"External id": {pairs[0][1]},'
        if not self.legacy_args:
            return head + ", ".join(f'"{k}": {v}' for k, v in pairs[1:])
        text = ""
        for i, (k, v) in enumerate(pairs[1:], 1):
            text += ("      " if i == 1 else ",      " if i in legacy_breaks else ", ") + f'"{k}": {v}'
        return head + text

    # ----------------------------------------------------------------------------------------- events of a step
    def _range(self, out: list[str], gpu: list[str], name: str, ts: float, dur: float, span: tuple | None) -> None:
        """A ``__sec:`` range on the main thread (and its GPU-timeline copy over ``span`` when given)."""
        args = f'"External id": {self.ext},"Record function id": 0, "Ev Idx": {self.ext}'
        self._x(out, "user_annotation", f"__sec:{name}", MAIN_TID, ts, dur, args)
        if span is not None:
            args = f'"External id": {self.ext}'
            copy: list[str] = self.annotations if self.window and self.rich else gpu
            self._x(copy, "gpu_user_annotation", f"__sec:{name}", COMPUTE_STREAM, span[0], span[1] - span[0], args, 0)
        self.ext += 1

    def _cpu_op(self, out: list[str], name: str, tid: int, ts: float, dur: float) -> None:
        """An operator with recorded shapes (sizes vary from op to op, as in a real network)."""
        c, d = 24 * (1 + self.ext % 5), 96 >> (self.ext % 4)
        args = (
            f'"External id": {self.ext},"Sequence number": {self.ext % 977}, "Fwd thread id": 0, '
            f'"Record function id": 0, "Concrete Inputs": ["", "", "", "[{d % 3}, 1, 1]", "[1, 1, 1]"], '
            '"Input type": ["c10::Half", "c10::Half", "c10::Half", "ScalarList", "ScalarList"], '
            f'"Input Strides": [[{c * d**3}, 1, {c * d * d}, {c * d}, 1], [{c * 27}, 1, {c * 9}, {c * 3}, {c}], '
            f'[1], [], []], "Input Dims": [[1, {c}, {d}, {d}, {d}], [{c}, {c}, 3, 3, 3], [{c}], [], []], '
            f'"Ev Idx": {self.ext}'
        )
        if self.layout == "jumble":
            r = self.rng.random()
            if r < 0.01:
                args = f'"External id": {self.ext},' + NESTED_ARGS
            if 0.01 <= r < 0.04:
                name = self.rng.choice(ODD_NAMES)
        self._x(out, "cpu_op", name, tid, ts + (self.ext % 7) * 0.001, dur + (self.ext % 13) * 0.37, args)
        if self.rich and self.ext % 4 == 0:  # profile_memory: the allocator's instant events
            fields = {"cat": '"cpu_instant_event"', "s": '"t"', "name": '"[memory]"', "pid": str(PID), "tid": str(tid)}
            mem = (
                f'"Total Reserved": {2097152 * (1 + self.ext % 97)}, "Total Allocated": '
                f'{1048576 * (1 + self.ext % 89)}, "Bytes": {512 * (1 + self.ext % 31)}, "Addr": '
                f'{139872512 + self.ext * 512}, "Device Id": 0, "Device Type": 1'
            )
            self._put(out, "i", {**fields, "ts": self._ts(ts + 0.5)}, mem)
        self.ext += 1

    def _python(self, out: list[str], name: str, tid: int, ts: float, dur: float) -> None:
        """A Python frame (``with_stack``): no marker in it."""
        args = f'"Python parent id": {self.ext - 1}, "Python id": {self.ext}, "Python thread": 0'
        self._x(out, "python_function", name, tid, ts, dur, args)
        self.ext += 1

    def _launch_args(self, name: str, corr: int, copy: bool, stream: int) -> str:
        """The runtime call's args: CUDA's cbid, or HIP's cid with the kernel's name, grid and block."""
        if not self.rich:
            return f'"External id": {self.ext}, "cbid": {211 if not copy else 41}, "correlation": {corr}'
        if not self.hip:
            return self._args([("External id", self.ext), ("cbid", 211 if not copy else 41), ("correlation", corr)])
        if copy:
            pairs = [("External id", self.ext), ("cid", 52), ("correlation", corr), ("src", '"0x7f3a2c000000"')]
            return self._args([*pairs, ("dst", '"0x7f3a10000000"'), ("bytes", '"16777216"'), ("kind", '"1"')])
        kernel = json.dumps(self.kernel_names[corr % len(self.kernel_names)])
        grid, block = f"[{corr % 997}, {1 + corr % 3}, 1]", f"[{128 << corr % 3}, 1, 1]"
        pairs = [("External id", self.ext), ("kernel", kernel), ("cid", 3), ("correlation", corr)]
        return self._args([*pairs, ("grid", grid), ("block", block), ("shared memory", corr % 5 * 4096)], (1, 4, 5, 6))

    def _kernel_args(self, corr: int, stream: int) -> str:
        """A kernel's args as the tracer writes them (CUPTI's occupancy fields; HIP's queue and kind)."""
        if not self.rich:
            return (
                f'"External id": {self.ext}, "queued": 0, "device": 0, "context": 1, "stream": {stream}, '
                f'"correlation": {corr}, "registers per thread": {32 + corr % 7 * 8}, "shared memory": '
                f'{corr % 5 * 4096}, "blocks per SM": {corr % 23 / 10}, "warps per SM": {corr % 67 / 10}, "grid": '
                f'[{corr % 997}, {1 + corr % 3}, 1], "block": [{128 << corr % 3}, 1, 1], "est. achieved occupancy %": '
                f"{corr % 100}"
            )
        grid, block = f"[{corr % 997}, {1 + corr % 3}, 1]", f"[{128 << corr % 3}, 1, 1]"
        if self.hip:
            pairs = [("External id", self.ext), ("device", 0), ("stream", stream), ("hsa_queue", 94021 + stream)]
            pairs += [("correlation", corr), ("kind", '"KERNEL_DISPATCH"'), ("grid", grid), ("block", block)]
            return self._args(pairs, (1, 4, 6))
        sep = ",        " if self.legacy_args else ", "
        occupancy = sep.join(
            f'"{k}": {v}'
            for k, v in (
                ("activeBlocksPerMultiprocessor", 8 + corr % 8),
                ("limitingFactors", '"WARPS|REGS"' if corr % 3 else '"SMEM"'),
                ("blockLimitRegs", 8),
                ("blockLimitSharedMem", 32),
                ("blockLimitWarps", 16),
                ("blockLimitBlocks", 32),
                ("blockLimitBarriers", 32),
                ("allocatedRegistersPerBlock", 8192),
                ("allocatedSharedMemPerBlock", corr % 5 * 4096),
            )
        )
        occupancy = "{        " + occupancy + "      }" if self.legacy_args else "{" + occupancy + "}"
        pairs = [("External id", self.ext), ("queued", 0), ("device", 0), ("context", 1), ("stream", stream)]
        pairs += [
            ("correlation", corr),
            ("registers per thread", 32 + corr % 7 * 8),
            ("shared memory", corr % 5 * 4096),
        ]
        pairs += [("blocks per SM", f"{corr % 23 / 10:.6f}"), ("warps per SM", f"{corr % 67 / 10:.6f}")]
        pairs += [("grid", grid), ("block", block), ("est. achieved occupancy %", corr % 100), ("occupancy", occupancy)]
        return self._args(pairs, (1, 4, 6, 7, 8, 9, 10, 11, 12, 13))

    def _launch(self, out: list[str], gpu: list[str], tid: int, stream: int, copy: bool = False) -> tuple[float, float]:
        """A runtime call on ``tid`` and its kernel (or memcpy) on ``stream``; returns the kernel's (start, end)."""
        ts, corr = self.t + 1.5, self.corr
        if copy:
            name, cat = self.copies[0], "cuda_runtime"
        else:
            name, cat = self.launches[self.launch_index % len(self.launches)]
            self.launch_index += 1
        runtime = gpu if self.window else out  # kineto writes runtime calls with the GPU activities
        self._x(runtime, cat, name, tid, ts, 6.125, self._launch_args(name, corr, copy, stream))
        self._flow(runtime, "s", PID, tid, ts, corr)
        start = round(max(ts + 9.0, self.gpu_free[stream] + 1.0), 3)
        dur = round(180.0 if copy else 3.0 + (corr * 7919 % 200) / 8.0, 3)
        if copy:
            args = (
                f'"External id": {self.ext}, "device": 0, "context": 1, "stream": {stream}, "correlation": {corr}, '
                '"bytes": 16777216, "memory bandwidth (GB/s)": 93.2'
            )
            name = "Memcpy HtoD (Pinned -> Device)" if not self.hip else "Memcpy CopyHostToDevice (Host -> Device)"
            self._x(gpu, "gpu_memcpy", name, stream, start, dur, args, GPU_PID)
        else:
            name = self.kernel_names[corr % len(self.kernel_names)]
            self._x(gpu, "kernel", name, stream, start, dur, self._kernel_args(corr, stream), GPU_PID)
            self.kernels += 1
        self._flow(gpu, "f", GPU_PID, stream, start, corr)
        self.gpu_free[stream] = start + dur
        self.corr += 1
        self.ext += 1
        self.t += 10.0
        self.on_device.append((start, round(start + dur, 3)))
        return start, round(start + dur, 3)

    def _sync(self, out: list[str], gpu: list[str]) -> None:
        """``cudaStreamSynchronize`` and CUPTI's ``Stream Sync`` (the current kineto moves it to its own row and writes
        that row's name, in the older template, before the first one)."""
        corr, stream = self.corr, COMPUTE_STREAM
        args = self._args([("External id", self.ext), ("cbid", 131), ("correlation", corr)])
        self._x(gpu if self.window else out, "cuda_runtime", self.copies[1], MAIN_TID, self.t, 40.0, args)
        if not self.hip:
            row = stream + (SYNC_ROW_OFFSET if self.layout == "kineto" else 0)
            if self.layout == "kineto" and row not in self.synced:
                self.synced.add(row)
                fields = {"name": '"thread_name"', "ts": self._ts(self.t), "pid": str(GPU_PID), "tid": str(row)}
                self._put(gpu, "M-inline", fields, f'"name": "stream {stream} (sync)"')
            pairs = [("External id", self.ext), ("cuda_sync_kind", '"stream_synchronize"'), ("stream", stream)]
            args = self._args([*pairs, ("correlation", corr), ("device", 0), ("context", 1)], (2, 4))
            self._x(gpu, "cuda_sync", "Stream Sync", row, self.t + 2.0, 36.0, args, GPU_PID)
        self.corr += 1
        self.ext += 1

    def _section(self, out: list[str], gpu: list[str], name: str, ops: int) -> None:
        """A kernel-timed section; records first kernel start to last kernel end (copies do not count)."""
        ts = self.t
        self.t += 2.0
        if name == "forward":  # an input copy first: a copy is not a kernel, so it must not stretch the span
            self._cpu_op(out, "aten::to", MAIN_TID, self.t, 200.0)
            self._launch(out, gpu, MAIN_TID, COMPUTE_STREAM, copy=True)
        spans = []
        for i in range(ops):
            if name == "forward":
                outer, inner = FORWARD_OPS[i % len(FORWARD_OPS)]
                tid = MAIN_TID
            else:  # autograd's device thread runs the backward ops and launches their kernels
                inner = BACKWARD_OPS[i % len(BACKWARD_OPS)]
                outer, tid = f"autograd::engine::evaluate_function: {inner}", AUTOGRAD_TID
            if self.rich and name == "forward" and i % 4 == 0:
                self._python(out, PYTHON_FRAMES[i % len(PYTHON_FRAMES)], tid, self.t, 30.0)
            self._cpu_op(out, outer, tid, self.t, 24.0)
            self._cpu_op(out, inner, tid, self.t + 1.0, 20.0)
            if self.rich and i % 16 == 0:  # torch links a forward op to its backward op
                self._flow(out, "s" if name == "forward" else "f", PID, tid, self.t + 1.0, 9000 + i, "fwdbwd")
            spans.append(self._launch(out, gpu, tid, SIDE_STREAM if i % 7 == 3 else COMPUTE_STREAM))
        self.t += 2.0
        span = (min(s for s, _ in spans), max(e for _, e in spans))
        self._range(out, gpu, name, ts, self.t - ts, span)
        self.durations.setdefault(name, []).append(span[1] - span[0])

    def _stretch(self, out: list[str], index: int) -> None:
        """Every 8th step of a rich shape (the second first), the loader collates on the main thread: tens of
        thousands of Python frames, operators and allocator events without any marker (section, launch, kernel)."""
        for i in range(self.stretch * (2 + index % 3) // 3):
            if i % 3 == 0:
                self._python(out, PYTHON_FRAMES[-1 - i % 2], MAIN_TID, self.t, 3.0)
            else:
                self._cpu_op(out, ("aten::stack", "aten::cat")[i % 2], MAIN_TID, self.t, 2.0)
            self.t += 0.25

    def step(self, index: int) -> tuple[list[str], list[str]]:
        """One training step's CPU events and GPU events."""
        out: list[str] = []
        gpu: list[str] = []
        loader = "loader_first" if index == 0 else "loader_next"
        loader_ts = self.t
        self.t += 5.0
        if self.rich and index % 8 == 1:
            self._stretch(out, index)
        for _ in range(2):  # the batch's copies to the device, inside the loader range
            self._cpu_op(out, "aten::copy_", MAIN_TID, self.t, 20.0)
            self._launch(out, gpu, MAIN_TID, COPY_STREAM, copy=True)
        self.t += 1000.0 + (index * 37 % 1000)
        self._cpu_record(out, loader, loader_ts, self.t - loader_ts)
        self.t += 10.0
        step_ts = self.t
        self.t += 5.0
        self._section(out, gpu, "forward", self.ops["forward"] + index % 3)
        self._section(out, gpu, "backward", self.ops["backward"] + index % 5)
        opt_ts = self.t
        for _ in range(self.ops["optimizer"]):  # launched outside forward/backward: not theirs
            self._cpu_op(out, "aten::_foreach_add_", MAIN_TID, self.t, 8.0)
            self._launch(out, gpu, MAIN_TID, COMPUTE_STREAM)
        if self.rich:
            self._sync(out, gpu)
        self._cpu_record(out, "optimizer", opt_ts, self.t - opt_ts)
        self.t += 5.0
        self._cpu_record(out, "step", step_ts, self.t - step_ts)
        self.t = max(self.t, *self.gpu_free.values()) + 20.0
        self._profiler_step(out, index, loader_ts)
        if self.layout == "jumble" and index % 5 == 0:
            out.append("{}")  # an empty object is a list element too: counted, not an event of interest
            self.events += 1
        return out, gpu

    def _profiler_step(self, out: list[str], index: int, ts: float) -> None:
        """torch.profiler's ``ProfilerStep#<n>`` range around the step, from its loader's start to past its last device
        activity; records the step's device time, and its busy time: the union of its kernels and copies (they
        overlap on the three streams), all inside the range."""
        args = f'"External id": {self.ext},"Record function id": 0, "Ev Idx": {self.ext}'
        self._x(out, "user_annotation", f"ProfilerStep#{index}", MAIN_TID, ts, self.t - ts, args)
        self.ext += 1
        reach = busy = 0.0
        for start, end in sorted(self.on_device):
            busy += max(0.0, end - max(start, reach))
            reach = max(reach, end)
        self.device["events"] += len(self.on_device)
        self.device["us"] += sum(end - start for start, end in self.on_device)
        self.device["wall_us"] += round(self.t - ts, 3)
        self.device["busy_us"] += busy
        self.on_device = []

    def _cpu_record(self, out: list[str], name: str, ts: float, dur: float) -> None:
        """A CPU-timed range: its duration as the summariser must read it back (3 decimals)."""
        self._range(out, [], name, ts, dur, None)
        self.durations.setdefault(name, []).append(round(dur, 3))

    def expected(self) -> dict[str, Any]:
        """Events and kernels written, count/min/mean/median/max (s) of every section, and the device's kernels and
        copies: their number, their time and the busy and wall time of the profiled steps (ms)."""
        device = self.device
        return {
            "events": self.events,
            "kernels": self.kernels,
            "device": {
                "events": device["events"],
                "ms": device["us"] / 1e3,
                "wall_ms": device["wall_us"] / 1e3,
                "busy_ms": device["busy_us"] / 1e3,
            },
            "sections": {name: stats(values) for name, values in self.durations.items()},
        }
