"""The profiling stage: the profiler handler, the GPU monitor, the benchmark timer, the trace summariser."""

from scripts import lazy_submodules

__getattr__ = lazy_submodules(__name__)
