"""The evaluation stage: per-case metrics on each CT's own grid, and cross-validation."""

from scripts import lazy_submodules

__getattr__ = lazy_submodules(__name__)
