"""The Python of the NSCLC-Radiomics SwinUNETR bundle: one package per pipeline stage, in the order data flows.

``common`` (what every stage uses), ``data`` (download, find and read DICOM, prepare, the training dataset),
``training``, ``inference`` (networks on GPU and CPU, inputs, outputs, DICOM writers, a PACS), ``evaluation`` and
``profiling``; beside them only the commands users type (``python -m scripts.prepare`` and the like). The configs reach
a module as ``@scripts.<stage>.<module>`` (``train.yaml`` imports the package from ``bundle_root``, so a run works from
any working directory); a module is imported when it is first named, so a config that never names the DICOM writers
never imports highdicom. ``docs/architecture.md`` maps each module to its step of the pipeline.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType


def lazy_submodules(package: str) -> Callable[[str], ModuleType]:
    """A module ``__getattr__`` that imports ``<package>.<name>`` on first use (PEP 562)."""

    def module_on_first_use(name: str) -> ModuleType:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as err:
            if err.name == f"{package}.{name}":
                raise AttributeError(f"module {package!r} has no module {name!r}") from None
            raise

    return module_on_first_use


__getattr__ = lazy_submodules(__name__)
