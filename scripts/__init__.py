"""The Python of the NSCLC-Radiomics SwinUNETR bundle: what its configs and CLIs use, one job per module.

The configs reach it as ``@scripts.<module>`` (``train.yaml`` imports the package from ``bundle_root``, so a run
works from any working directory); a module is imported when it is first named, so a config that never names
``writers`` never imports highdicom. ``docs/architecture.md`` maps each module to its step of the pipeline.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def __getattr__(name: str) -> ModuleType:
    """``scripts.<module>`` imported on first use (PEP 562)."""
    if name.startswith("_"):
        raise AttributeError(name)
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as err:
        if err.name == f"{__name__}.{name}":
            raise AttributeError(f"module {__name__!r} has no module {name!r}") from None
        raise
