"""Faults the tests put into the bundle's configs (as ``_target_: faults.<name>``, with this folder on PYTHONPATH):
each fails the one case it names, at one stage of inference, so that a test can prove the other cases still run; or,
:class:`OutOfMemoryOnce`, runs the first case out of device memory, so that a test can prove the sliding window's
fallback.

Only the fault is made up; what handles it is the bundle's own code, run as users run it (``monai.bundle run``,
DataLoader worker processes, the case-by-case evaluator, the writer's staging folder, the inferer's fallback).
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path
from typing import Any

from scripts.inference.inferers import OUT_OF_MEMORY, FallbackSlidingWindowInferer
from scripts.inference.outputs import SaveCased

#: the message of the out-of-memory error :class:`OutOfMemoryOnce` raises (the fallback's warning quotes it)
INJECTED_OOM = "out of memory (injected by tests/faults.py)"


class InjectedFault(RuntimeError):
    """The error a fault raises; its message names the stage it was put at."""


class FailCased:
    """A transform that raises for the case ``case_id`` (and passes every other case through)."""

    def __init__(self, case_id: str, stage: str) -> None:
        self.case_id, self.where = case_id, stage

    def __call__(self, data: Mapping[Hashable, Any]) -> Mapping[Hashable, Any]:
        if data.get("case_id") == self.case_id:
            raise InjectedFault(f"a fault injected in {self.where}")
        return data


class UncollatableCased:
    """A preprocessing step that leaves a value no collation can batch (None) in the case ``case_id``'s data."""

    def __init__(self, case_id: str) -> None:
        self.case_id = case_id

    def __call__(self, data: Mapping[Hashable, Any]) -> dict:
        d = dict(data)
        if d.get("case_id") == self.case_id:
            d["scanner_note"] = None
        return d


class FailingInferer:
    """The evaluator's inferer, raising for the case whose image came from a path holding ``marker``."""

    def __init__(self, inferer: Callable, marker: str) -> None:
        self.inferer, self.marker = inferer, marker

    def __call__(self, inputs: Any, network: Callable, *args: Any, **kwargs: Any) -> Any:
        source = getattr(inputs, "meta", {}).get("filename_or_obj", "")
        if self.marker in str(source):
            raise InjectedFault("a fault injected in the network's forward pass")
        return self.inferer(inputs, network, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # the evaluator reads the inferer's own timing (``last``)
        return getattr(self.inferer, name)


class SaveCasedFailingFor(SaveCased):
    """The bundle's writer, its disk full for the case ``fail_case`` once that case's NIfTI is written."""

    def __init__(self, *args: Any, fail_case: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail_case = fail_case

    def _write(self, d: dict, tensor: Any, case_id: str, folder: Path) -> Any:
        written = super()._write(d, tensor, case_id, folder)
        if case_id == self.fail_case:
            raise OSError(errno.ENOSPC, "No space left on device", str(folder / f"{case_id}_seg.dcm"))
        return written


class OutOfMemoryOnce(FallbackSlidingWindowInferer):
    """The bundle's sliding-window inferer whose network runs out of device memory at the first window of each of the
    first ``cases`` inputs, as on a card too small for the CT: the inferer's own fallback must run the input again."""

    def __init__(self, *args: Any, cases: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cases = int(cases)

    def __call__(self, inputs: Any, network: Callable, *args: Any, **kwargs: Any) -> Any:
        if self.cases <= 0:
            return super().__call__(inputs, network, *args, **kwargs)
        self.cases -= 1
        raised: list[bool] = []

        def runs_out(window: Any, *a: Any, **k: Any) -> Any:
            if not raised:
                raised.append(True)
                raise OUT_OF_MEMORY(INJECTED_OOM)
            return network(window, *a, **k)

        return super().__call__(inputs, runs_out, *args, **kwargs)


def killed() -> None:
    """``kill -9`` of the run: this process, or from a DataLoader worker the run that started it."""
    import torch.utils.data

    os.kill(os.getppid() if torch.utils.data.get_worker_info() is not None else os.getpid(), signal.SIGKILL)


class KilledReading(FailCased):
    """The run killed as the case ``case_id`` is read."""

    def __init__(self, case_id: str) -> None:
        super().__init__(case_id, "read")

    def __call__(self, data: Mapping[Hashable, Any]) -> Mapping[Hashable, Any]:
        if data.get("case_id") == self.case_id:
            killed()
        return data


class KilledPredicting(FailingInferer):
    """The run killed as the network runs on the case whose image came from a path holding ``marker``."""

    def __call__(self, inputs: Any, network: Callable, *args: Any, **kwargs: Any) -> Any:
        if self.marker in str(getattr(inputs, "meta", {}).get("filename_or_obj", "")):
            killed()
        return self.inferer(inputs, network, *args, **kwargs)


class SaveCasedKilledFor(SaveCased):
    """The bundle's writer, the run killed once the case ``kill_case``'s outputs are staged, before they move."""

    def __init__(self, *args: Any, kill_case: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kill_case = kill_case

    def _write(self, d: dict, tensor: Any, case_id: str, folder: Path) -> Any:
        written = super()._write(d, tensor, case_id, folder)
        if case_id == self.kill_case:
            killed()
        return written
