"""The training iteration replayed as one CUDA graph (``cuda_graphs: true``; a HIP graph on ROCm, the same API).

Why: on an H200 (docs/performance.md) the GPU sat idle 17-19 % of every training step, between the
~2,500 small kernels Python launches one by one; compiling made the kernels faster but not the gaps smaller. A CUDA
graph records the kernels of one step once and replays all of them with one launch.

:class:`GraphedIteration` is the trainer's ``iteration_update`` (MONAI's ``SupervisedTrainer`` calls it instead of its
own ``_iteration``). Each step it copies the batch into static input buffers and replays the graph of
:meth:`GraphedIteration.step` -- forward, loss and the (under AMP, GradScaler-scaled) backward, the work MONAI's
iteration does between ``zero_grad`` and the optimiser -- then steps the optimiser as MONAI does, eagerly
(``scaler.step`` + ``scaler.update`` under AMP): a few fused kernels, and it leaves as they are the learning rate the
scheduler sets each step (a Python float), GradScaler's dynamic loss scale (the found-inf check, the skipped step, the
scale's update: with the fused AdamW all on the device, no host sync; with the plain AdamW one sync a step, as in
eager training) and the optimiser's state in checkpoints. The graph's backward writes the gradients into the same
tensors at every replay (they are set to None once, before the capture, so the graph allocates them).

The first ``warmup`` steps run the same step function eagerly on the capture stream (cuDNN's algorithm search, lazy
initialisation and the compiled regions' compilation happen there); the next one is captured and replayed, and every
later step is a replay. The capture runs in ``thread_local`` mode (as PyTorch's own CUDA-graph trees do): the data
loader's thread keeps cropping the next batch on the GPU meanwhile, and its allocations must not end the capture.

A step the graph cannot replay runs eagerly, logged once per reason: a batch of another shape or dtype (e.g. a last,
smaller batch of an epoch), a new GradScaler (MONAI makes one per ``run()``: warmed up and captured again), a capture
that failed (the rest of the run is eager, with the error in the log). Known at the start, and then the trainer keeps
MONAI's own iteration, logged by :func:`training_iteration`: a CPU; DDP (its gradient all-reduce would have to be
captured: NCCL's graph-safe mode, PyTorch's 11 warm-up steps under DDP, not built here); gradient checkpointing (its
recomputation rewinds the CUDA RNG state, which captures refused until recently: pytorch#162504; not tried here);
gradient accumulation. ``compile_mode:
reduce-overhead`` captures each compiled region itself: it and ``cuda_graphs`` are one or the other.

Handlers see ``engine.state.output`` as MONAI fills it. ``pred`` and ``loss`` are the graph's static outputs, valid
until the next step (as with ``torch.compile(mode="reduce-overhead")``), and FORWARD_COMPLETED, LOSS_COMPLETED and
BACKWARD_COMPLETED fire after the step function, in MONAI's order (no Python runs inside a replay).
tests/test_graphs.py proves the step run eagerly equal to MONAI's iteration (loss, gradients, weights after N steps,
the random-number stream) and the capture's bookkeeping with a stand-in graph; the kit's ``cuda_graphs`` step proves
the replayed training equal to the eager one on a GPU.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from monai.data import MetaTensor
from monai.engines.utils import IterationEvents
from monai.utils.enums import CommonKeys as Keys
from scripts.common.config import ConfigError, as_bool

logger = logging.getLogger(__name__)

#: eager steps on the capture stream before the capture (PyTorch's CUDA-graph notes warm up with 3)
WARMUP_STEPS = 3


class Graph(Protocol):
    """What :class:`GraphedIteration` asks of a graph: the device types it records, a context for the warm-up steps,
    a capture, a replay."""

    DEVICES: tuple[str, ...]

    def warming(self) -> contextlib.AbstractContextManager:
        """The context the warm-up steps run in (a side stream for CUDA graphs)."""

    def capture(self, function: Callable[[], Any]) -> Any:
        """``function`` run once and recorded; what it returned (its outputs, in the graph's static memory)."""

    def replay(self) -> None:
        """The recorded work run again, on whatever the static inputs now hold."""


class CudaGraph:
    """One ``torch.cuda.CUDAGraph`` and the side stream its warm-up steps run on and its capture records."""

    DEVICES = ("cuda",)  # ROCm's devices are "cuda" too

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        self.graph = torch.cuda.CUDAGraph()

    @contextlib.contextmanager
    def warming(self) -> Iterator[None]:
        """Run the block on the capture stream, after the work already queued on the current one (the batch)."""
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            yield
        current.wait_stream(self.stream)

    def capture(self, function: Callable[[], Any]) -> Any:
        """Record ``function``'s kernels (none runs); its outputs are the graph's static tensors."""
        with torch.cuda.graph(self.graph, stream=self.stream, capture_error_mode="thread_local"):
            return function()

    def replay(self) -> None:
        self.graph.replay()


def training_iteration(
    enabled: bool | str,
    device: torch.device | str,
    network: torch.nn.Module,
    use_checkpoint: bool = False,
    compile_on: bool = False,
    compile_mode: str | None = "default",
    warmup: int = WARMUP_STEPS,
) -> GraphedIteration | None:
    """The trainer's ``iteration_update``: a :class:`GraphedIteration` when ``enabled`` and the run allows a capture,
    else None (MONAI's own iteration), with the reason logged. ``compile_mode: reduce-overhead`` with compilation on
    is a :class:`~scripts.common.config.ConfigError` (both capture graphs: choose one)."""
    if not as_bool(enabled, "cuda_graphs"):
        return None
    if compile_on and str(compile_mode).lower() == "reduce-overhead":
        raise ConfigError(
            "cuda_graphs: true captures the whole training step, and compile_mode: reduce-overhead captures each "
            "compiled region itself: set compile_mode: default (the regions compiled, the step captured) or "
            "cuda_graphs: false."
        )
    kind = torch.device(device).type
    why = None
    if kind != "cuda":
        why = f"the device is {kind}; CUDA graphs (HIP graphs on ROCm) need a GPU"
    elif isinstance(network, torch.nn.parallel.DistributedDataParallel):
        why = ("DDP: its gradient all-reduce would be captured too (NCCL's graph-safe mode, 11 warm-up steps under "
               "DDP), which this bundle does not do")  # fmt: skip
    elif as_bool(use_checkpoint, "use_checkpoint"):
        why = ("gradient checkpointing (use_checkpoint) rewinds the CUDA RNG state to recompute, which captures "
               "refused until recently (pytorch#162504); not tried here")  # fmt: skip
    if why:
        logger.info("cuda_graphs: off (%s): MONAI's own training iteration runs", why)
        return None
    logger.info(
        "cuda_graphs: on: %d eager warm-up step(s), then forward, loss and backward captured as one graph and "
        "replayed every step; the optimiser steps eagerly after each replay (scripts/training/graphs.py)",
        int(warmup),
    )
    return GraphedIteration(warmup)


class GraphedIteration:
    """MONAI's ``SupervisedTrainer`` iteration with forward, loss and backward replayed as one graph (see the module
    docstring). ``graph_factory`` makes the graph for a device (:class:`CudaGraph`; the tests give a stand-in)."""

    def __init__(self, warmup: int = WARMUP_STEPS, graph_factory: Callable[[torch.device], Graph] = CudaGraph) -> None:
        self.warmup = int(warmup)
        self.graph_factory = graph_factory
        self.graph: Graph | None = None  # the captured graph, once there is one
        self.pending: Graph | None = None  # the graph being warmed up (its stream) until it is captured
        self.static: tuple[torch.Tensor, torch.Tensor] | None = None  # the input buffers the graph reads
        self.outputs: tuple[torch.Tensor, torch.Tensor] | None = None  # pred and loss, the buffers it writes
        self.scaler: Any = None  # the GradScaler whose scale tensor the graph reads
        self.warm = 0  # warm-up steps run for the pending graph
        self.disabled: str | None = None  # why the whole run is MONAI's own iteration, once known
        self.captured_at: int | None = None
        self.counts: Counter[str] = Counter()  # warmup, captured, replayed, eager steps
        self.eager_reasons: Counter[str] = Counter()

    # ------------------------------------------------------------------ the step the graph holds
    def step(self, engine: Any, inputs: torch.Tensor, targets: torch.Tensor, *args: Any, **kwargs: Any) -> tuple:
        """Forward, loss and backward of one batch as MONAI's ``SupervisedTrainer._iteration`` computes them (autocast
        and the GradScaler-scaled loss under AMP): the function a capture records and every eager step runs."""
        if engine.amp and engine.scaler is not None:
            with torch.autocast("cuda", **engine.amp_kwargs):
                pred = engine.inferer(inputs, engine.network, *args, **kwargs)
                loss = engine.loss_function(pred, targets).mean()
            engine.scaler.scale(loss).backward()
        else:
            pred = engine.inferer(inputs, engine.network, *args, **kwargs)
            loss = engine.loss_function(pred, targets).mean()
            loss.backward()
        return pred, loss

    # ------------------------------------------------------------------ one iteration
    def __call__(self, engine: Any, batchdata: Any) -> dict:
        if batchdata is None:
            raise ValueError("Must provide batch data for current iteration.")
        if self.disabled is None and getattr(engine, "accumulation_steps", 1) > 1:
            self._disable("gradient accumulation (accumulation_steps > 1) steps the optimiser every few batches")
        if self.disabled is not None:
            return engine._iteration(engine, batchdata)
        batch = engine.prepare_batch(batchdata, engine.state.device, engine.non_blocking, **engine.to_kwargs)
        inputs, targets = batch[:2]
        args, kwargs = (batch[2], batch[3]) if len(batch) == 4 else ((), {})
        engine.state.output = {Keys.IMAGE: inputs, Keys.LABEL: targets}
        inputs, targets = _plain(inputs), _plain(targets)
        engine.network.train()
        why = self._why_eager(engine, inputs, targets, bool(args or kwargs))
        if why is None and self.graph is not None:
            self.static[0].copy_(inputs)
            self.static[1].copy_(targets)
            self.graph.replay()
            pred, loss = self.outputs
            self.counts["replayed"] += 1
        elif why is None and self.warm < self.warmup:
            pred, loss = self._warm_up(engine, inputs, targets)
        elif why is None:
            pred, loss = self._capture(engine, inputs, targets)
        else:
            self._note(why)
            pred, loss = self._eager(engine, inputs, targets, *args, **kwargs)
        engine.state.output[Keys.PRED] = pred
        engine.state.output[Keys.LOSS] = loss
        for event in (IterationEvents.FORWARD_COMPLETED, IterationEvents.LOSS_COMPLETED,
                      IterationEvents.BACKWARD_COMPLETED):  # fmt: skip
            engine.fire_event(event)
        if engine.amp and engine.scaler is not None:
            engine.scaler.step(engine.optimizer)
            engine.scaler.update()
        else:
            engine.optimizer.step()
        engine.fire_event(IterationEvents.MODEL_COMPLETED)
        return engine.state.output

    def _why_eager(self, engine: Any, inputs: torch.Tensor, targets: torch.Tensor, extra: bool) -> str | None:
        """Why this step cannot be warmed up for, captured or replayed (None: it can)."""
        if inputs.device.type not in getattr(self.graph_factory, "DEVICES", CudaGraph.DEVICES):
            return f"the batch is on {inputs.device.type}: CUDA graphs need a GPU"
        if extra:
            return "the network is given arguments besides the image"
        if self.graph is not None and engine.scaler is not self.scaler:
            self._drop("a new GradScaler (a new run() of the trainer): captured again after a warm-up")
            return None
        if self.static is not None:
            for name, new, old in (("image", inputs, self.static[0]), ("label", targets, self.static[1])):
                if new.shape != old.shape or new.dtype != old.dtype or new.device != old.device:
                    return (f"a batch {name} of {tuple(new.shape)} {new.dtype} on {new.device}, the graph's is "
                            f"{tuple(old.shape)} {old.dtype} on {old.device}")  # fmt: skip
        return None

    def _eager(self, engine: Any, inputs: torch.Tensor, targets: torch.Tensor, *args: Any, **kwargs: Any) -> tuple:
        """One step without the graph: MONAI's ``zero_grad``, then the step function. Once captured, the gradients are
        zeroed in place (the graph writes into those very tensors)."""
        set_to_none = engine.optim_set_to_none and self.graph is None
        engine.optimizer.zero_grad(set_to_none=set_to_none)
        self.counts["eager"] += 1
        return self.step(engine, inputs, targets, *args, **kwargs)

    def _warm_up(self, engine: Any, inputs: torch.Tensor, targets: torch.Tensor) -> tuple:
        """An eager step on the stream the capture will use."""
        if self.pending is None:
            self.pending = self.graph_factory(inputs.device)
        with self.pending.warming():
            engine.optimizer.zero_grad(set_to_none=engine.optim_set_to_none)
            pred, loss = self.step(engine, inputs, targets)
        self.warm += 1
        self.counts["warmup"] += 1
        return pred, loss

    def _capture(self, engine: Any, inputs: torch.Tensor, targets: torch.Tensor) -> tuple:
        """Capture the step on static copies of this batch, then replay it once to compute this step."""
        graph = self.pending or self.graph_factory(inputs.device)
        self.pending = None
        self.static = (inputs.clone(), targets.clone())
        engine.optimizer.zero_grad(set_to_none=True)  # the graph allocates the gradients it writes every replay
        try:
            pred, loss = graph.capture(lambda: self.step(engine, *self.static))
        except Exception as error:  # a capture that cannot work must not end the training: the rest is eager
            self.static = None
            engine.optimizer.zero_grad(set_to_none=True)
            self._disable(f"the capture failed ({type(error).__name__}: {str(error).splitlines()[0][:300]})")
            self.counts["eager"] += 1
            return self.step(engine, inputs, targets)
        self.graph, self.outputs, self.scaler = graph, (pred.detach(), loss.detach()), engine.scaler
        self.captured_at = int(engine.state.iteration)
        graph.replay()
        self.counts["captured"] += 1
        logger.info("cuda_graphs: training step captured at iteration %d (batch %s); every later step replays it",
                    self.captured_at, tuple(inputs.shape))  # fmt: skip
        return self.outputs

    # ------------------------------------------------------------------ bookkeeping
    def _note(self, why: str) -> None:
        if not self.eager_reasons[why]:
            logger.info("cuda_graphs: this step runs eagerly: %s", why)
        self.eager_reasons[why] += 1

    def _drop(self, why: str) -> None:
        """Forget the graph (its memory with it) and warm up again for a new capture."""
        logger.info("cuda_graphs: %s", why)
        self.graph = self.pending = self.static = self.outputs = None
        self.warm = 0

    def _disable(self, why: str) -> None:
        logger.warning("cuda_graphs: %s: MONAI's own iteration runs from here on", why)
        self.graph = self.pending = self.static = self.outputs = None
        self.disabled = why

    def summary(self) -> dict[str, Any]:
        """What the iteration did: steps warmed up, captured, replayed and run eagerly (with why), or why none was."""
        return {"captured_at_iteration": self.captured_at, "warmup_steps": self.counts["warmup"],
                "captures": self.counts["captured"], "replayed": self.counts["replayed"],
                "eager": self.counts["eager"], "eager_reasons": dict(self.eager_reasons),
                "disabled": self.disabled}  # fmt: skip


def _plain(x: Any) -> Any:
    """A MetaTensor as the plain tensor it wraps (a graph's static buffers are plain tensors)."""
    return x.as_tensor() if isinstance(x, MetaTensor) else x
