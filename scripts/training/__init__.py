"""The training stage: the accelerator's settings, compilation, CUDA graphs, fused attention, DDP, checkpoints and
exact resume, the best weights, the loss log."""

from scripts import lazy_submodules

__getattr__ = lazy_submodules(__name__)
