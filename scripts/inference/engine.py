"""An evaluator for batches of real-world cases, in which one case never ends the run.

:class:`CaseByCaseEvaluator` is MONAI's ``SupervisedEvaluator`` (same arguments, same handlers) with each iteration
-- one case: ``batch_size`` 1 -- run on its own. A case whose loading failed arrives as a failure record from
:class:`scripts.inference.inputs.CaseDataset` (stage ``read`` or ``preprocess``); a case whose prediction, inversion or
writing raises fails at stage ``predict``, ``postprocess`` or ``write`` -- or at the stage an error names itself by a
``stage`` attribute (``scripts.inference.dicomweb``'s store errors: ``store``). Either way the case is appended to
``failures`` (case id, input, stage, the error's own message), the handlers see an empty output for it (no metric, no
row), the writer has already removed its partial outputs, and the next case runs. An out-of-memory error in one case is
one failed case, not a dead run. ``on_case_done`` is called with each case once it is finished, done or failed (e.g. to
remove the temporary folder it was retrieved into).

:attr:`CaseByCaseEvaluator.stage_seconds` holds the last case's seconds per stage: ``read`` and ``preprocess`` (timed
by :class:`scripts.inference.inputs.CaseDataset`), ``region`` and ``predict`` (the inferer's, when it times itself:
:class:`scripts.inference.inferers.FallbackSlidingWindowInferer`), ``postprocess``, and ``write`` / ``store`` for the
post-processing transforms that name that ``stage``.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from ignite.engine import Engine
from ignite.metrics import Metric
from monai.engines import SupervisedEvaluator
from monai.engines.utils import IterationEvents
from monai.transforms import Compose, apply_transform
from scripts.inference.inputs import CASE_INDEX, failure_record
from scripts.inference.outputs import CaseOutputError
from scripts.inference.records import Case

logger = logging.getLogger(__name__)


class CaseByCaseEvaluator(SupervisedEvaluator):
    """``SupervisedEvaluator`` that records a failing case and goes on (see the module docstring)."""

    def __init__(self, *args: Any, on_case_done: Callable[[Case], Any] | None = None, **kwargs: Any) -> None:
        for metric in [
            *(kwargs.get("key_val_metric") or {}).values(),
            *(kwargs.get("additional_metrics") or {}).values(),
        ]:
            _count_only_cases_that_ran(metric)
        self.stage_seconds: dict[str, float] = defaultdict(float)
        self.record: Case = {}  # the case's record, as its dataset holds it (see _iteration)
        if kwargs.get("postprocessing") is not None:
            kwargs["postprocessing"] = _CasePostprocessing(kwargs["postprocessing"], self)
        super().__init__(*args, **kwargs)
        self.failures: list[Case] = []  # each failed case's identity, stage and reason
        self.on_case_done = on_case_done
        self._stage = "predict"
        self._started = 0.0
        self.add_event_handler(IterationEvents.FORWARD_COMPLETED, self._predicted)

    def _predicted(self, _engine: Engine) -> None:
        self._stage = "postprocess"
        seconds = getattr(self.inferer, "last", {}).get("seconds", {})
        forward = time.perf_counter() - self._started
        self.stage_seconds["region"] = seconds.get("region", 0.0)
        self.stage_seconds["predict"] = round(forward - self.stage_seconds["region"], 3)

    def _iteration(self, engine: Engine, batchdata: dict) -> Any:
        item = _single(batchdata)
        self.record = self._record_of(item)
        item = {**self.record, **item}
        self.stage_seconds.clear()
        for stage in ("read", "preprocess"):
            if isinstance(item.get(f"seconds_{stage}"), (float, int, torch.Tensor)):
                self.stage_seconds[stage] = round(float(item[f"seconds_{stage}"]), 3)
        self._started = time.perf_counter()
        try:
            if item.get("failure_stage"):
                return self._fail(engine, item, item["failure_stage"], item["failure_reason"])
            self._stage = "predict"
            try:
                return super()._iteration(engine, batchdata)
            except Exception as err:  # one case's failure must not end the run
                stage = _stage_of(err, self._stage)
                return self._fail(engine, item, stage, failure_record(item, stage, err)["failure_reason"])
        finally:
            self._case_done(item)

    def _record_of(self, item: dict) -> Case:
        """The case's record from its dataset (:meth:`scripts.inference.inputs.CaseDataset.record`): what stayed out of
        the DataLoader's collation, joined to the case again here, in this process."""
        dataset = getattr(self.data_loader, "dataset", None)
        index = item.get(CASE_INDEX)
        if not hasattr(dataset, "record") or index is None or int(index) < 0:
            return {}
        return dataset.record(int(index))

    def _case_done(self, item: dict) -> None:
        if self.on_case_done is None:
            return
        try:
            self.on_case_done(item)
        except Exception as err:  # tidying up after a case must not end the run either
            logger.warning("case %s: after the case: %s", item.get("case_id", "?"), err)

    def _fail(self, engine: Engine, item: dict, stage: str, reason: str) -> list:
        record: Case = {k: item[k] for k in ("case_id", "source", "image") if isinstance(item.get(k), str)}
        record.update(stage=stage, reason=reason)
        self.failures.append(record)
        logger.error("case %s failed at %s: %s", record.get("case_id", "?"), stage, reason)
        engine.state.batch, engine.state.output = [], []
        return []


class _CasePostprocessing:
    """The evaluator's post-processing applied to each case with the case's record joined under its data (the writers
    read discovery's ``slice_paths``, evaluation its ``truth_file``; the data's own keys win); a ``Compose`` is applied
    transform by transform, each one's seconds added to the evaluator's ``stage_seconds`` under the ``stage`` it names
    (``write``, ``store``), else ``postprocess``; one that is switched off (``enabled`` false) is applied but not
    counted."""

    def __init__(self, postprocessing: Callable, evaluator: CaseByCaseEvaluator) -> None:
        self.postprocessing, self.evaluator = postprocessing, evaluator

    def __call__(self, data: Any) -> Any:
        if isinstance(data, dict):
            data = {**self.evaluator.record, **data}
        compose = self.postprocessing
        if not isinstance(compose, Compose):
            return compose(data)
        seconds = self.evaluator.stage_seconds
        for transform in compose.transforms:
            clock = time.perf_counter()
            data = apply_transform(transform, data, compose.map_items, compose.unpack_items)
            if getattr(transform, "enabled", True):  # a writer switched off is no stage of this run
                stage = getattr(transform, "stage", "postprocess")
                seconds[stage] = round(seconds.get(stage, 0.0) + time.perf_counter() - clock, 3)
        return data


def _stage_of(error: BaseException | None, default: str) -> str:
    """The stage a failure belongs to: ``write`` for the writer's errors, the ``stage`` an error in the chain names
    (MONAI wraps transform errors), else ``default`` (where the case had got to)."""
    while error is not None:
        if isinstance(error, CaseOutputError):
            return "write"
        stage = getattr(error, "stage", None)
        if isinstance(stage, str) and stage:
            return stage
        error = error.__cause__
    return default


def _count_only_cases_that_ran(metric: Metric) -> None:
    """The metric skips failed cases (their output is empty) and is NaN when no case ran at all."""
    update, compute = metric.iteration_completed, metric.completed
    ran = {"count": 0}

    def iteration_completed(engine: Engine) -> None:
        if engine.state.output != []:
            ran["count"] += 1
            update(engine)

    def completed(engine: Engine, name: Any) -> None:
        if ran["count"]:
            compute(engine, name)
        else:
            engine.state.metrics[name] = float("nan")
        ran["count"] = 0

    metric.iteration_completed, metric.completed = iteration_completed, completed


def _single(batchdata: Any) -> dict:
    """The case of a one-case batch as plain values (collation wraps strings in lists)."""
    if not isinstance(batchdata, dict):
        return {}
    return {k: (v[0] if isinstance(v, (list, tuple)) and len(v) == 1 else v) for k, v in batchdata.items()}
