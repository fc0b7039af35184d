"""scripts.training.graphs: the training step a CUDA graph captures, run eagerly, is MONAI's SupervisedTrainer iteration
(the same losses, gradients, weights after N steps and random-number stream); around the capture, with a stand-in graph
that keeps a CUDA graph's contract on the CPU, the warm-up, the static buffers, the replays and every fallback to eager
train the same weights as MONAI and say why. The capture itself needs a GPU: the kit's cuda_graphs step proves it."""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import ClassVar

import pytest
import torch
from ignite.engine import Events
from monai.engines import SupervisedTrainer
from monai.handlers import LrScheduleHandler
from monai.losses import DiceCELoss
from monai.networks.nets import BasicUNet
from monai.optimizers import WarmupCosineSchedule
from scripts.common.config import ConfigError
from scripts.training.graphs import GraphedIteration, training_iteration

SHAPE = (2, 1, 32, 32, 16)


def batches(count: int, shape: tuple = SHAPE, seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    return [{"image": torch.rand(shape, generator=generator),
             "label": (torch.rand(shape, generator=generator) > 0.7).float()} for _ in range(count)]  # fmt: skip


def network(dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    return BasicUNet(spatial_dims=3, in_channels=1, out_channels=2, features=(4, 4, 8, 8, 16, 4), dropout=dropout)


class Run:
    """A SupervisedTrainer as train.yaml builds it (DiceCE, AdamW, warm-up + cosine per iteration) with MONAI's own
    iteration, or the one ``iteration`` makes for this run's network; per step the loss and the gradients, at the end
    the weights and the RNG state."""

    def __init__(self, net: torch.nn.Module, data: list[dict], iteration=None, amp: bool = False, **kwargs) -> None:
        self.network = copy.deepcopy(net)
        self.iteration = iteration(self.network) if iteration else None
        self.optimizer = torch.optim.AdamW(self.network.parameters(), lr=1e-2, weight_decay=1e-5)
        schedule = WarmupCosineSchedule(self.optimizer, warmup_steps=2, t_total=len(data))
        self.trainer = SupervisedTrainer(
            device=torch.device("cpu"), max_epochs=1, train_data_loader=data, network=self.network,
            optimizer=self.optimizer, loss_function=DiceCELoss(to_onehot_y=True, softmax=True, batch=True),
            amp=amp, iteration_update=self.iteration, train_handlers=[LrScheduleHandler(schedule, print_lr=False)],
            **kwargs)  # fmt: skip
        self.losses: list[float] = []
        self.grads: list[list[torch.Tensor]] = []
        self.grad_ptrs: list[list[int]] = []
        self.trainer.add_event_handler(Events.ITERATION_COMPLETED, self._record)

    def _record(self, engine) -> None:
        self.losses.append(float(engine.state.output[0]["loss"]))
        grads = [p.grad for p in self.network.parameters()]
        self.grads.append([g.detach().clone() for g in grads])
        self.grad_ptrs.append([g.data_ptr() for g in grads])

    def run(self, seed: int = 1) -> Run:
        torch.manual_seed(seed)
        self.trainer.run()
        self.rng = torch.get_rng_state()
        return self


def assert_same_training(run: Run, reference: Run) -> None:
    assert run.losses == reference.losses
    for step, (grads, expected) in enumerate(zip(run.grads, reference.grads, strict=True)):
        for a, b in zip(grads, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"gradient at step {step + 1}")
    for a, b in zip(run.network.parameters(), reference.network.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert torch.equal(run.rng, reference.rng), "the same random numbers drawn"


class StandInGraph:
    """A CUDA graph's contract on the CPU: the capture records the function (its outputs are the static outputs); a
    replay runs it again on what it captured (the static input buffers) and writes the results into those same output
    tensors, overwriting the gradients rather than adding to them; the warm-up is counted."""

    DEVICES = ("cpu",)
    made: ClassVar[list] = []
    fail_with: ClassVar[Exception | None] = None

    def __init__(self, device: torch.device) -> None:
        self.function, self.outputs, self.warmups, self.replays = None, None, 0, 0
        StandInGraph.made.append(self)

    @contextlib.contextmanager
    def warming(self):
        self.warmups += 1
        yield

    def capture(self, function):
        if StandInGraph.fail_with is not None:
            raise StandInGraph.fail_with
        self.function = function
        self.outputs = function()
        self.grads = [p.grad for p in self.parameters]
        return self.outputs

    def replay(self) -> None:
        self.replays += 1
        for grad in self.grads:
            grad.zero_()
        pred, loss = self.function()
        with torch.no_grad():
            self.outputs[0].copy_(pred)
            self.outputs[1].copy_(loss)


@pytest.fixture
def stand_in():
    StandInGraph.made, StandInGraph.fail_with = [], None
    yield StandInGraph
    StandInGraph.made, StandInGraph.fail_with = [], None


def graphed(stand_in, warmup: int = 2):
    """What makes a GraphedIteration with the stand-in graph for a run's network."""

    def make(net: torch.nn.Module) -> GraphedIteration:
        stand_in.parameters = list(net.parameters())
        return GraphedIteration(warmup, graph_factory=stand_in)

    return make


@pytest.mark.parametrize("amp", [False, True])
def test_the_step_run_eagerly_is_monais_iteration(amp, caplog):
    """On a CPU every step is eager: the step function and the optimiser step, against MONAI's iteration on the same
    batches from the same seed, with dropout drawing from the RNG and the learning rate changing every step (amp:
    autocast and GradScaler are off without CUDA, but their code path runs)."""
    net, data = network(dropout=0.2), batches(4)
    reference = Run(net, data, amp=amp).run()
    with caplog.at_level(logging.INFO, logger="scripts.training.graphs"):
        run = Run(net, data, lambda _: GraphedIteration(), amp=amp).run()
    iteration = run.iteration
    assert_same_training(run, reference)
    assert iteration.summary() == {"captured_at_iteration": None, "warmup_steps": 0, "captures": 0, "replayed": 0,
                                   "eager": 4, "eager_reasons": {"the batch is on cpu: CUDA graphs need a GPU": 4},
                                   "disabled": None}  # fmt: skip
    assert caplog.text.count("this step runs eagerly: the batch is on cpu") == 1, "logged once"


def test_warm_up_capture_and_replays_train_monais_weights(stand_in):
    """Two eager warm-up steps on the capture stream, the third captured (on static copies of its batch, the
    gradients set to None first so the graph owns them) and replayed, every later one a replay reading the static
    buffers: losses, gradients and weights as MONAI's, the gradients the same tensors from the capture on."""
    net, data = network(), batches(6)
    reference = Run(net, data).run()
    run = Run(net, data, graphed(stand_in))
    iteration = run.iteration
    run.run()
    assert_same_training(run, reference)
    assert iteration.summary() == {"captured_at_iteration": 3, "warmup_steps": 2, "captures": 1, "replayed": 3,
                                   "eager": 0, "eager_reasons": {}, "disabled": None}  # fmt: skip
    (graph,) = stand_in.made
    assert graph.warmups == 2 and graph.replays == 4, "the captured step's own replay, then three"
    assert run.grad_ptrs[2] == run.grad_ptrs[3] == run.grad_ptrs[5], "the graph writes the same gradient tensors"
    assert iteration.static[0] is not data[-1]["image"] and torch.equal(iteration.static[0], data[-1]["image"])


def test_another_shape_runs_eagerly_and_a_new_grad_scaler_is_captured_again(stand_in, caplog):
    """A smaller batch after the capture runs eagerly (said once), the graph stays and replays the next batch; a new
    GradScaler (MONAI makes one per run()) drops the graph: warmed up and captured again. Still MONAI's weights."""
    data = batches(4)
    data[3:3] = batches(2, shape=(1, 1, 32, 32, 16), seed=1)
    data += batches(4, seed=2)
    net = network()
    reference = Run(net, data).run()
    run = Run(net, data, graphed(stand_in))
    iteration = run.iteration

    def new_scaler(engine) -> None:
        if engine.state.iteration == 7:
            engine.scaler = object()  # amp is off: the scaler is only compared, never used

    run.trainer.add_event_handler(Events.ITERATION_COMPLETED, new_scaler)
    with caplog.at_level(logging.INFO, logger="scripts.training.graphs"):
        run.run()
    assert_same_training(run, reference)
    summary = iteration.summary()
    assert summary["eager"] == 2 and list(summary["eager_reasons"].values()) == [2]
    assert next(iter(summary["eager_reasons"])).startswith("a batch image of (1, 1, 32, 32, 16) torch.float32 on cpu")
    assert (summary["captures"], summary["warmup_steps"], summary["captured_at_iteration"]) == (2, 4, 10)
    assert caplog.text.count("this step runs eagerly: a batch image") == 1
    assert "a new GradScaler (a new run() of the trainer): captured again" in caplog.text


def test_a_failed_capture_leaves_monais_own_iteration(stand_in, caplog):
    net, data = network(), batches(5)
    reference = Run(net, data).run()
    run = Run(net, data, graphed(stand_in))
    iteration = run.iteration
    stand_in.fail_with = RuntimeError("CUDA error: operation not permitted when stream is capturing")
    with caplog.at_level(logging.WARNING, logger="scripts.training.graphs"):
        run.run()
    assert_same_training(run, reference)
    assert iteration.summary()["disabled"] == (
        "the capture failed (RuntimeError: CUDA error: operation not permitted when stream is capturing)"
    )
    assert "MONAI's own iteration runs from here on" in caplog.text


def test_gradient_accumulation_keeps_monais_iteration(stand_in):
    net, data = network(), batches(4)
    reference = Run(net, data, accumulation_steps=2).run()
    run = Run(net, data, graphed(stand_in), accumulation_steps=2)
    iteration = run.iteration
    run.run()
    assert_same_training(run, reference)
    assert iteration.summary()["disabled"].startswith("gradient accumulation") and not stand_in.made


def test_what_is_known_at_the_start_decides_and_is_logged(caplog):
    net = network()
    with caplog.at_level(logging.INFO, logger="scripts.training.graphs"):
        assert training_iteration("false", "cuda", net) is None
        assert not caplog.text
        assert training_iteration("true", "cpu", net) is None
        assert "cuda_graphs: off (the device is cpu; CUDA graphs (HIP graphs on ROCm) need a GPU)" in caplog.text
        ddp = object.__new__(torch.nn.parallel.DistributedDataParallel)
        assert training_iteration(True, "cuda", ddp) is None and "cuda_graphs: off (DDP:" in caplog.text
        assert training_iteration(True, "cuda:0", net, use_checkpoint="true") is None
        assert "gradient checkpointing (use_checkpoint)" in caplog.text
        assert isinstance(training_iteration("true", torch.device("cuda"), net, compile_on=True), GraphedIteration)
        assert "cuda_graphs: on: 3 eager warm-up step(s)" in caplog.text
    with pytest.raises(ConfigError, match="compile_mode: reduce-overhead captures each compiled region itself"):
        training_iteration(True, "cuda", net, compile_on=True, compile_mode="reduce-overhead")
    assert isinstance(training_iteration(True, "cuda", net, compile_on=False, compile_mode="reduce-overhead"),
                      GraphedIteration), "reduce-overhead matters only where compilation is on"  # fmt: skip
