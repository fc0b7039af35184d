"""k-fold cross-validation as one command: the folds trained one after another (resumably), every training case
predicted by the fold model that did not see it, the post-processing chosen on those out-of-fold predictions, the
folds described as one ensemble for inference, and fold 0 vs the ensemble vs the ensemble + TTA on the test split::

    python -m scripts.cross_validation run --config_file configs/train.yaml --dataset_dir /data/tcia
    python -m scripts.cross_validation run --config_file "['configs/train.yaml','configs/demo.yaml']"
    python -m scripts.cross_validation train|evaluate ...     # the two halves of run, same arguments

The folds are those of prepare's datalist (each training case's ``fold``); the datalist is prepared first when it
does not exist, and never changed while the folds train. Fold k is ``monai.bundle run`` of the config files with
``--fold k --output_dir <output_dir>/fold_k --model_path <output_dir>/fold_k/model.pt --resume true`` plus every
other ``--id value`` given here, in its own process (``--launcher "torchrun --standalone --nproc_per_node=8"`` runs
it with DDP; add ``configs/multi_gpu_train.yaml`` to the configs: the evaluation, in this process, leaves it out). A
fold whose checkpoint reached ``max_epochs`` is skipped; an interrupted one resumes from its last epoch. One fold per
process or GPU: under ``torchrun --nproc_per_node=N -m scripts.cross_validation run`` rank r trains folds r, r + N,
... on its own GPU and rank 0 evaluates when all are done; in a SLURM array job, ``train`` trains fold
``$SLURM_ARRAY_TASK_ID`` (then ``evaluate``).

Outputs under ``<output_dir>`` (default ``<the config's output_dir>/crossval``):

* ``fold_<k>/`` -- the fold's run (``checkpoints/latest.pt``, ``model.pt`` + ``model.json``, TensorBoard logs) and
  ``oof/``: its held-out cases evaluated as ``configs/evaluate.yaml`` does, in each CT's own space, with the
  largest-component step (``oof/``) and without it (``oof/raw/``), from one prediction per case;
* ``cv/metrics.csv`` (every training case once, with its ``fold`` and the chosen post-processing, plus its Dice with
  and without the largest component), ``cv/summary.json`` (mean, median, std per fold and overall; the decision),
  ``cv/pictures/`` (the worst cases), ``cv/test_comparison.csv`` and ``cv/test/<variant>/`` (the test split);
* ``model.json`` -- the ensemble: labels, each fold's model, ``keep_largest_components`` as chosen with both mean
  Dice values. ``configs/inference.yaml --model_paths <output_dir>`` runs the ensemble with that post-processing.
"""

from __future__ import annotations

import ast
import csv
import gc
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from scripts.common.files import csv_text, write_json, write_text
from scripts.evaluation.metrics import summarize

logger = logging.getLogger(__name__)

SET_PER_FOLD = ("fold", "model_path", "resume", "eval_dir", "eval_split", "model_paths")
# what torchrun gives each process; a fold's own run must not take it for DDP of its own
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")  # fmt: skip
POLL_S = 30.0


class CrossValidationError(RuntimeError):
    """A fold could not be trained or evaluated; the message names the fold, its folder and what to do."""


@dataclass
class Plan:
    """The settings every step reads: config files, the user's overrides, and ids resolved from them."""

    files: list[str]
    overrides: dict[str, Any]
    root: Path
    datalist_file: Path
    max_epochs: int
    labels: list[str]
    keep: int  # keep_largest_components compared against the raw argmax (the config's value, at least 1)
    pictures: int
    parser: Any = field(repr=False, default=None)
    # the files evaluation layers evaluate.yaml on, in this process: those of ``files`` that join no torchrun group
    eval_files: list[str] = field(default_factory=list)

    def fold_dir(self, fold: int) -> Path:
        return self.root / f"fold_{fold}"


def run(
    config_file: str | Sequence[str],
    output_dir: str | None = None,
    folds: int | Sequence[int] | None = None,
    launcher: str | None = None,
    compare_test: bool | str = True,
    **overrides: Any,
) -> dict:
    """Train the folds (:func:`train`), then evaluate them (:func:`evaluate`). Under torchrun, rank 0 evaluates once
    every fold has finished; in a SLURM array task, only this task's fold is trained (run ``evaluate`` after).

    Args:
        config_file: the configs, as ``monai.bundle run`` takes them (``"['configs/train.yaml']"``).
        output_dir: where the folds and the summary go (default ``<output_dir>/crossval``).
        folds: the folds to run, e.g. ``0`` or ``"[0,1]"`` (default: every fold prepare made).
        launcher: the command that starts each fold's training instead of ``python``, e.g. ``"torchrun
            --standalone --nproc_per_node=8"``.
        compare_test: also compare fold 0, the ensemble and the ensemble with TTA on the test split.
        overrides: any ``--id value``, given to every fold (``--max_epochs 100``).
    """
    states = train(config_file, output_dir, folds, launcher, **overrides)
    if _array_task() is not None:
        logger.info("SLURM array task: fold(s) %s done; run `evaluate` once every task has ended", states["trained"])
        return states
    if _torchrun_rank() not in (None, 0):
        return states
    plan = make_plan(config_file, output_dir, overrides)
    _wait_for_folds(plan, states["folds"])
    return evaluate(config_file, output_dir, folds, compare_test, **overrides)


def train(
    config_file: str | Sequence[str],
    output_dir: str | None = None,
    folds: int | Sequence[int] | None = None,
    launcher: str | None = None,
    **overrides: Any,
) -> dict:
    """Train this process's folds one after another, each in its own ``monai.bundle run``: a finished fold is
    skipped, an interrupted one resumes. Returns ``{"folds": all folds, "trained": this process's folds}``."""
    plan = make_plan(config_file, output_dir, overrides)
    parallel = _array_task() is not None or _torchrun_rank() is not None
    datalist = _ensure_datalist(plan, prepare=not parallel)
    all_folds = fold_ids(datalist, folds, plan.datalist_file)
    mine = _share(all_folds)
    for fold in mine:
        train_fold(plan, fold, launcher)
    return {"folds": all_folds, "trained": mine, "output_dir": str(plan.root)}


def train_fold(plan: Plan, fold: int, launcher: str | None = None) -> str:
    """Train one fold in its own process unless its checkpoint already reached ``max_epochs``; returns
    ``"skipped"`` or ``"trained"``."""
    folder = plan.fold_dir(fold)
    epoch = checkpoint_epoch(folder)
    if epoch >= plan.max_epochs:
        _check_finished(plan, fold)
        logger.info("fold %d: finished (epoch %d of %d), skipped -> %s", fold, epoch, plan.max_epochs, folder)
        return "skipped"
    logger.info("fold %d: %s -> %s", fold, f"resuming after epoch {epoch}" if epoch else "training", folder)
    settings = {**plan.overrides, "fold": fold, "output_dir": str(folder), "model_path": str(folder / "model.pt"),
                "resume": "true", "prepare_data": "false", "download": "false"}  # fmt: skip
    command = [*(shlex.split(launcher) if launcher else [sys.executable]), "-m", "monai.bundle", "run",
               "--config_file", str(plan.files), *_cli_args(settings)]  # fmt: skip
    status = subprocess.run(command, env=_fold_environment()).returncode
    if status:
        raise CrossValidationError(
            f"fold {fold}: training ended with status {status} (see its log above; state in {folder}). Run the same "
            "command again to resume it."
        )
    _check_finished(plan, fold)
    return "trained"


def evaluate(
    config_file: str | Sequence[str],
    output_dir: str | None = None,
    folds: int | Sequence[int] | None = None,
    compare_test: bool | str = True,
    **overrides: Any,
) -> dict:
    """Out-of-fold evaluation of finished folds, the post-processing decision, the ensemble's ``model.json`` and
    (``compare_test``) fold 0 vs the ensemble vs the ensemble + TTA on the test split. Returns the summary."""
    from scripts.common.config import as_bool

    plan = make_plan(config_file, output_dir, overrides)
    datalist = _ensure_datalist(plan, prepare=False)
    all_folds = fold_ids(datalist, folds, plan.datalist_file)
    for fold in all_folds:
        _check_finished(plan, fold)
    left_out = [f for f in plan.files if f not in plan.eval_files]
    if left_out:
        logger.info("evaluating in this process without %s: they join a torchrun process group (distributed_setup), "
                    "which only the folds' launcher starts", ", ".join(left_out))  # fmt: skip
    for fold in all_folds:
        evaluate_fold(plan, fold)
    summary = pool_out_of_fold(plan, datalist, all_folds)
    write_ensemble(plan, all_folds, summary)
    if as_bool(compare_test, "compare_test") and datalist.get("test"):
        summary["test"] = compare_on_test(plan, all_folds[0], summary["postprocessing"]["keep_largest_components"])
    summary["output_dir"] = str(plan.root)
    write_json(plan.root / "cv" / "summary.json", summary)
    return summary


def make_plan(config_file: str | Sequence[str], output_dir: str | None, overrides: dict[str, Any]) -> Plan:
    """Read the config files with the overrides (as ``monai.bundle run`` would) and resolve what cross-validation
    needs: the datalist, ``max_epochs``, the labels and the post-processing to compare."""
    from monai.bundle import ConfigParser

    if isinstance(config_file, str) and config_file.strip().startswith("["):  # "['a.yaml','b.yaml']", unparsed
        config_file = ast.literal_eval(config_file)
    files = [config_file] if isinstance(config_file, (str, Path)) else list(config_file)
    refused = sorted(set(overrides) & set(SET_PER_FOLD))
    if refused:
        raise ValueError(f"--{refused[0]} is set per fold by cross-validation; leave it out.")
    parser = ConfigParser()
    parser.read_config([str(f) for f in files])
    parser.update(overrides)
    root = Path(output_dir) if output_dir else Path(parser.get_parsed_content("output_dir")) / "crossval"
    return Plan(
        files=[str(f) for f in files],
        overrides=dict(overrides),
        root=root,
        datalist_file=Path(parser.get_parsed_content("datalist_file")),
        max_epochs=int(parser.get_parsed_content("max_epochs")),
        labels=list(parser.get_parsed_content("labels")),
        keep=max(int(parser.get_parsed_content("keep_largest_components") or 1), 1),
        pictures=int(overrides.get("eval_pictures", 5)),
        parser=parser,
        eval_files=[str(f) for f in files if not joins_process_group(f)],
    )


def joins_process_group(config_file: str | Path) -> bool:
    """Whether a config file joins torchrun's process group: it sets ``distributed_setup`` (train.yaml leaves it
    null; multi_gpu_train.yaml and multi_gpu_evaluate.yaml set it). The folds' trainings run such files under the
    launcher; the evaluation runs in this process, which no launcher started, and leaves them out (with them it would
    fail once every fold had trained: here there is no RANK or WORLD_SIZE). Read as written, nothing resolved."""
    from monai.bundle import ConfigParser

    content = ConfigParser.load_config_file(str(config_file))
    return isinstance(content, dict) and content.get("distributed_setup") is not None


def fold_ids(datalist: dict, folds: int | Sequence[int] | None, source: Path) -> list[int]:
    """The folds to run: ``folds`` if given (each must hold training cases), else every fold of the datalist."""
    present = sorted({int(d["fold"]) for d in datalist.get("training", []) if d.get("fold") is not None})
    if len(present) < 2:
        raise CrossValidationError(f"{source}: the training cases fall into {len(present)} fold(s); cross-validation "
                                   "needs at least 2 (prepare's num_folds, and more training cases).")  # fmt: skip
    if folds is None:
        return present
    wanted = [int(f) for f in ([folds] if isinstance(folds, (int, str)) else folds)]
    missing = [f for f in wanted if f not in present]
    if missing:
        raise ValueError(f"--folds {wanted}: fold(s) {missing} hold no training case in {source} (folds: {present}).")
    return wanted


def checkpoint_epoch(fold_dir: Path) -> int:
    """The last epoch saved in ``fold_dir/checkpoints/latest.pt`` (0: none), read without loading the tensors."""
    from scripts.training.checkpoint import read_epoch

    latest = fold_dir / "checkpoints" / "latest.pt"
    return read_epoch(latest) if latest.is_file() else 0


def _check_finished(plan: Plan, fold: int) -> None:
    """A fold is finished when its checkpoint reached ``max_epochs`` and its best weights exist."""
    folder = plan.fold_dir(fold)
    epoch = checkpoint_epoch(folder)
    if epoch < plan.max_epochs:
        raise CrossValidationError(f"fold {fold}: trained {epoch} of {plan.max_epochs} epochs ({folder}); run "
                                   "`python -m scripts.cross_validation train` with the same arguments.")  # fmt: skip
    if not (folder / "model.pt").is_file():
        raise CrossValidationError(f"fold {fold}: trained {epoch} epochs but wrote no {folder / 'model.pt'}: "
                                   "validation never ran; set --val_interval to at most max_epochs.")  # fmt: skip


def _ensure_datalist(plan: Plan, prepare: bool) -> dict:
    """The datalist; when missing and ``prepare``, the config's own data steps make it first (check, acquire,
    prepare, in setup's order). Folds never prepare again, so their split cannot change under them."""
    if not plan.datalist_file.is_file():
        if not prepare:
            raise CrossValidationError(
                f"{plan.datalist_file} does not exist: prepare the data once before folds run in parallel "
                "(python -m scripts.prepare ..., or `python -m scripts.cross_validation train` in one process)."
            )
        for step in ("scripts", "check_config", "acquire_data", "prepare"):
            plan.parser.get_parsed_content(step)
    return json.loads(plan.datalist_file.read_text())


def _cli_args(settings: dict[str, Any]) -> list[str]:
    """``--id value`` pairs as ``monai.bundle run`` reads them back (lists as Python literals)."""
    return [part for key, value in settings.items() for part in (f"--{key}", str(value))]


def _torchrun_rank() -> int | None:
    """This process's rank when torchrun started several (None otherwise)."""
    if "LOCAL_RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return int(os.environ["RANK"])
    return None


def _array_task() -> int | None:
    """The SLURM array task id, when this process is one."""
    task = os.environ.get("SLURM_ARRAY_TASK_ID")
    return int(task) if task not in (None, "") else None


def _share(folds: list[int]) -> list[int]:
    """This process's folds: a SLURM array task trains the fold of its task id, torchrun rank r of N trains folds
    r, r + N, ...; a single process trains them all."""
    task, rank = _array_task(), _torchrun_rank()
    if task is not None:
        if task not in folds:
            raise ValueError(f"SLURM_ARRAY_TASK_ID={task} is not one of the folds {folds}; submit --array=<folds>.")
        return [task]
    if rank is not None:
        return folds[rank :: int(os.environ["WORLD_SIZE"])]
    return folds


def _fold_environment() -> dict[str, str]:
    """The environment of a fold's run: under torchrun without its variables (the fold is no DDP rank) and with
    only this rank's GPU visible."""
    env = dict(os.environ)
    if _torchrun_rank() is None:
        return env
    local = int(env["LOCAL_RANK"])
    for name in [*TORCHRUN_VARIABLES, *(k for k in env if k.startswith("TORCHELASTIC_"))]:
        env.pop(name, None)
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    env["CUDA_VISIBLE_DEVICES"] = visible[local] if local < len(visible) else str(local)
    return env


def _wait_for_folds(plan: Plan, folds: list[int]) -> None:
    """Rank 0 under torchrun: wait until the other ranks' folds have finished (torchrun ends every rank if one
    fails)."""
    waiting = [f for f in folds if checkpoint_epoch(plan.fold_dir(f)) < plan.max_epochs]
    if waiting:
        logger.info("waiting for fold(s) %s to finish", waiting)
    while waiting:
        time.sleep(POLL_S)
        waiting = [f for f in waiting if checkpoint_epoch(plan.fold_dir(f)) < plan.max_epochs]


def evaluate_fold(plan: Plan, fold: int) -> Path:
    """The fold's held-out cases predicted once by its model and scored with and without the largest-component
    step (``evaluate.yaml`` with ``--fold k``: the fold's cases); skipped when newer than the weights."""
    folder = plan.fold_dir(fold)
    out = folder / "oof"
    summaries = [out / "metrics_summary.json", out / "raw" / "metrics_summary.json"]
    weights = (folder / "model.pt").stat().st_mtime
    if all(s.is_file() and s.stat().st_mtime > weights for s in summaries):
        logger.info("fold %d: out-of-fold evaluation up to date -> %s", fold, out)
        return out
    logger.info("fold %d: predicting its held-out cases -> %s", fold, out)
    evaluate_in_process(plan, out, fold=fold, model_path=str(folder / "model.pt"), compare_raw=True,
                        keep_largest_components=plan.keep, eval_pictures=plan.pictures)  # fmt: skip
    return out


def evaluate_in_process(plan: Plan, eval_dir: Path, **ids: Any) -> float:
    """``evaluate.yaml`` over the plan's configs in this process (no start-up per run; those that join a torchrun
    group left out: :func:`joins_process_group`); returns its seconds. A case that failed fails cross-validation,
    naming the report."""
    from monai.bundle import ConfigWorkflow

    files = [*plan.eval_files, str(Path(plan.files[0]).parent / "evaluate.yaml")]
    settings = {**plan.overrides, "prepare_data": False, "download": False, "output_dir": str(eval_dir),
                "eval_dir": str(eval_dir), **ids}  # fmt: skip
    start = time.perf_counter()
    workflow = ConfigWorkflow(config_file=files, workflow_type=None, **settings)
    try:
        workflow.initialize()
        workflow.run()
    except SystemExit as err:  # evaluate.yaml ends with status 1 when a case failed
        raise CrossValidationError(f"evaluation into {eval_dir} failed: {err}") from None
    finally:
        workflow.finalize()
        del workflow
        gc.collect()
    return time.perf_counter() - start


def _read_rows(path: Path) -> list[dict]:
    """Rows of a ``metrics.csv`` with numbers as floats."""
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    return [{k: (v if k == "case_id" else float(v or "nan")) for k, v in row.items()} for row in rows]


def case_dice(row: dict, labels: Sequence[str]) -> float:
    """A case's Dice averaged over the structures (NaN structures -- nothing to find, nothing found -- left out)."""
    return _nanmean([row[f"{name}_dice"] for name in labels])


def pool_out_of_fold(plan: Plan, datalist: dict, folds: list[int]) -> dict:
    """Every fold's held-out rows pooled, checked to cover each training case once (predicted by the fold that did
    not see it); the post-processing chosen on them; ``cv/metrics.csv``, ``cv/pictures/``; returns the summary."""
    largest, raw = [], []
    for fold in folds:
        out = plan.fold_dir(fold) / "oof"
        rows, rows_raw = _read_rows(out / "metrics.csv"), _read_rows(out / "raw" / "metrics.csv")
        expected = sorted(d["case_id"] for d in datalist["training"] if int(d["fold"]) == fold)
        if sorted(r["case_id"] for r in rows) != expected or sorted(r["case_id"] for r in rows_raw) != expected:
            raise CrossValidationError(f"fold {fold}: {out} does not hold exactly the fold's {len(expected)} cases; "
                                       "delete it and run `evaluate` again.")  # fmt: skip
        largest += [{**r, "fold": fold} for r in rows]
        raw += [{**r, "fold": fold} for r in rows_raw]
    decision = choose_postprocessing(largest, raw, plan.labels, plan.keep)
    chosen = largest if decision["keep_largest_components"] else raw
    variants = {"raw": {r["case_id"]: r for r in raw}, "largest_component": {r["case_id"]: r for r in largest}}
    rows = [dict(r, **{f"{n}_dice_{v}": by_case[r["case_id"]][f"{n}_dice"] for v, by_case in variants.items()
                       for n in plan.labels}) for r in chosen]  # fmt: skip
    columns = [c for c in rows[0] if c not in ("case_id", "fold")]
    write_text(plan.root / "cv" / "metrics.csv", csv_text(rows, ["case_id", "fold", *columns]))
    _copy_worst_pictures(plan, chosen, "" if decision["keep_largest_components"] else "raw")
    per_fold = {}
    for fold in folds:
        members = [r for r in rows if r["fold"] == fold]
        per_fold[str(fold)] = {"num_cases": len(members), "metrics": summarize(members, columns)}
    return {"num_folds": len(folds), "folds": folds, "num_cases": len(rows), "labels": plan.labels,
            "metrics": summarize(rows, columns), "per_fold": per_fold, "postprocessing": decision}  # fmt: skip


def choose_postprocessing(largest: list[dict], raw: list[dict], labels: Sequence[str], keep: int) -> dict:
    """Keep each structure's ``keep`` largest components only if that raises the mean out-of-fold Dice (per case the
    mean over structures, then the mean over cases), as nnU-Net decides; both numbers and each structure's."""
    mean_raw = float(np.nanmean([case_dice(r, labels) for r in raw]))
    mean_largest = float(np.nanmean([case_dice(r, labels) for r in largest]))
    per_structure = {
        n: {"raw": float(np.nanmean([r[f"{n}_dice"] for r in raw])),
            "largest_component": float(np.nanmean([r[f"{n}_dice"] for r in largest]))} for n in labels
    }  # fmt: skip
    return {
        "keep_largest_components": keep if mean_largest > mean_raw else 0,
        "candidate": keep,
        "mean_dice_raw": mean_raw,
        "mean_dice_largest_component": mean_largest,
        "per_structure": per_structure,
        "num_cases": len(raw),
        "rule": f"keep the {keep} largest 3D component(s) of each structure only if it raises the mean out-of-fold "
        "Dice (per case the mean over structures)",
    }


def _copy_worst_pictures(plan: Plan, rows: list[dict], variant: str) -> None:
    """``cv/pictures/``: the worst cases overall, drawn by their fold's evaluation (each drew its own worst)."""
    target = plan.root / "cv" / "pictures"
    shutil.rmtree(target, ignore_errors=True)
    worst = sorted(rows, key=lambda r: (np.nan_to_num(case_dice(r, plan.labels), nan=2.0), r["case_id"]))
    for row in worst if plan.pictures < 0 else worst[: plan.pictures]:
        picture = plan.fold_dir(row["fold"]) / "oof" / variant / "pictures" / f"{row['case_id']}.png"
        if picture.is_file():
            target.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(picture, target / picture.name)


def write_ensemble(plan: Plan, folds: list[int], summary: dict) -> Path:
    """``<output_dir>/model.json``: the ensemble of the folds with the post-processing chosen for it."""
    models = []
    for fold in folds:
        sidecar = plan.fold_dir(fold) / "model.json"
        info = json.loads(sidecar.read_text()) if sidecar.is_file() else {}
        models.append({"fold": fold, "path": f"fold_{fold}/model.pt", "epoch": info.get("epoch"),
                       "validation_metric": info.get("metric")})  # fmt: skip
    decision = summary["postprocessing"]
    chosen = "largest_component" if decision["keep_largest_components"] else "raw"
    cv = {"num_folds": len(folds), "num_cases": summary["num_cases"], "summary": "cv/summary.json"}
    info = {
        "labels": plan.labels,
        "models": models,
        "keep_largest_components": decision["keep_largest_components"],
        "postprocessing": decision,
        "cross_validation": {**cv, "mean_dice": decision[f"mean_dice_{chosen}"]},
    }
    return write_json(plan.root / "model.json", info)


def compare_on_test(plan: Plan, fold: int, keep: int) -> list[dict]:
    """Fold ``fold``'s model, the ensemble of all folds, and the ensemble with mirror TTA, evaluated on the test
    split with the same post-processing; ``cv/test_comparison.csv`` and the rows."""
    variants = [(f"fold {fold}", f"fold_{fold}", {"model_path": str(plan.fold_dir(fold) / "model.pt")}),
                ("ensemble", "ensemble", {"model_paths": str(plan.root)}),
                ("ensemble + TTA", "ensemble_tta", {"model_paths": str(plan.root), "tta": True})]  # fmt: skip
    rows = []
    for name, slug, ids in variants:
        out = plan.root / "cv" / "test" / slug
        seconds = evaluate_in_process(plan, out, eval_split="test", keep_largest_components=keep, eval_pictures=0,
                                      **ids)  # fmt: skip
        rows.append(_test_row(plan, name, out, seconds, ids))
    write_text(plan.root / "cv" / "test_comparison.csv", csv_text(rows, list(rows[0])))
    return rows


def _test_row(plan: Plan, name: str, out: Path, seconds: float, ids: dict) -> dict:
    """One line of the test comparison from an evaluation's ``metrics.csv``."""
    from scripts.inference.ensemble import find_models, mirror_flips

    rows = _read_rows(out / "metrics.csv")
    dice = [case_dice(r, plan.labels) for r in rows]
    columns = {m: [r[f"{n}_{m}"] for r in rows for n in plan.labels] for m in ("hd95_mm", "surface_dice")}
    models = find_models(ids.get("model_path", ""), ids.get("model_paths"), plan.labels).paths
    axes = plan.overrides.get("tta_axes", [0, 1, 2])
    passes = len(mirror_flips((json.loads(axes) if isinstance(axes, str) else axes) if ids.get("tta") else None))
    return {"variant": name, "models": len(models), "passes_per_window": len(models) * passes, "cases": len(rows),
            "mean_dice": float(np.nanmean(dice)), "median_dice": float(np.nanmedian(dice)),
            "mean_hd95_mm": _nanmean(columns["hd95_mm"]), "mean_surface_dice": _nanmean(columns["surface_dice"]),
            "seconds_per_case": seconds / max(len(rows), 1)}  # fmt: skip


def _nanmean(values: Sequence[float]) -> float:
    finite = [v for v in values if np.isfinite(v)]
    return float(np.mean(finite)) if finite else float("nan")


def format_summary(summary: dict) -> str:
    """The cross-validation table (per fold and overall), the decision, and the test comparison, as Markdown."""
    labels = summary["labels"]
    lines = [f"cross-validation: {summary['num_folds']} folds, {summary['num_cases']} out-of-fold cases",
             "| fold | cases | " + " | ".join(f"{n} Dice mean | median | std" for n in labels) + " |",
             "|---|---|" + "---|---|---|" * len(labels)]  # fmt: skip
    groups = [(f, s["num_cases"], s["metrics"]) for f, s in summary["per_fold"].items()]
    for fold, cases, metrics in [*groups, ("all", summary["num_cases"], summary["metrics"])]:
        cells = [f"{metrics[f'{n}_dice'].get(k, float('nan')):.4f}" for n in labels for k in ("mean", "median", "std")]
        lines.append(f"| {fold} | {cases} | " + " | ".join(cells) + " |")
    d = summary["postprocessing"]
    lines.append(f"post-processing: mean out-of-fold Dice {d['mean_dice_raw']:.4f} raw, "
                 f"{d['mean_dice_largest_component']:.4f} keeping the {d['candidate']} largest component(s) -> "
                 f"keep_largest_components {d['keep_largest_components']}")  # fmt: skip
    if summary.get("test"):
        lines += ["test split:", "| variant | models | passes/window | cases | mean Dice | median Dice | mean HD95 mm "
                  "| mean surface Dice | s/case |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in summary["test"]:
            lines.append(f"| {r['variant']} | {r['models']} | {r['passes_per_window']} | {r['cases']} | "
                         f"{r['mean_dice']:.4f} | {r['median_dice']:.4f} | {r['mean_hd95_mm']:.2f} | "
                         f"{r['mean_surface_dice']:.4f} | {r['seconds_per_case']:.1f} |")  # fmt: skip
    return "\n".join(lines)


def print_summary(summary: dict) -> None:
    if "postprocessing" in summary:
        print(format_summary(summary))
        print(f"-> {Path(summary.get('output_dir', '.'))}")
    else:
        print(f"trained fold(s) {summary['trained']} of {summary['folds']} -> {summary['output_dir']}")
