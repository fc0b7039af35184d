"""Config values as the bundle reads them: flags from the command line, and fail-fast checks of the whole run.

* :func:`as_bool` -- ``--resume true`` reaches a config as the *string* "true"; every on/off value is read through it.
* :func:`unset` -- a value that means "none": YAML's ``null``, or ``null``/``None``/nothing given on the command line.
* :func:`check_config` -- run first (``setup``), before any data is touched: a wrong value should cost seconds, not the
  hour it takes to cache 422 CT volumes. Each check raises :class:`ConfigError` with the id to change and a value that
  works.
"""

from __future__ import annotations

import ast
import inspect
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

from scripts.common.labels import COLLECTION, LabelError, check_labels

#: MONAI's ``str2bool`` words (tests/test_config.py proves them the same); kept here so that the CLIs that read flags
#: (``scripts.data.prepare``, the benchmarks) start without importing MONAI and torch (~4 s)
TRUE_WORDS, FALSE_WORDS = ("yes", "true", "t", "y", "1"), ("no", "false", "f", "n", "0")


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the id and what to set instead."""


def as_bool(value: bool | str | int, name: str = "flag") -> bool:
    """A config flag as a bool. ``--resume true`` reaches the config as the *string* "true" (fire only parses
    ``True``), and the string "false" is truthy, so every flag that can come from the command line goes through here.
    The rule is MONAI's ``str2bool`` (true/false, yes/no, t/f, y/n, 1/0, any case), the one the configs' ``as_bool``
    applies, with the id named when a value is neither.
    """
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word in TRUE_WORDS or word in FALSE_WORDS:
        return word in TRUE_WORDS
    raise ConfigError(f"{name}={value!r}: expected true or false.")


def unset(value: object) -> bool:
    """Whether a config value means "none": ``None`` (YAML's ``null``), or the string ``"null"``, ``"None"`` or ``""``,
    as ``--compile_cache_dir null`` reaches a config from the command line."""
    return value in (None, "", "null", "None")


def check_config(
    labels: Sequence[str],
    roi_size: Sequence[int],
    spacing: Sequence[float],
    hu_window: Sequence[float],
    collection: str = COLLECTION,
) -> bool:
    """Validate the ids that shape the whole run; returns True so it can sit in a config's list of steps."""
    if isinstance(labels, str):
        raise ConfigError(f"labels={labels!r}: give a list of structure names, e.g. \"['{labels}']\".")
    try:
        check_labels(labels, collection)
    except LabelError as err:
        raise ConfigError(str(err)) from None
    check_roi_size(roi_size)
    if len(spacing) != 3 or any(float(s) <= 0 for s in spacing):
        raise ConfigError(f"spacing={list(spacing)}: give three positive voxel sizes in mm, e.g. [1.0, 1.0, 3.0].")
    if len(hu_window) != 2 or float(hu_window[0]) >= float(hu_window[1]):
        raise ConfigError(f"hu_window={list(hu_window)}: give [lower, upper] HU with lower < upper, e.g. [-1000, 500].")
    return True


def check_roi_size(roi_size: Sequence[int]) -> None:
    """SwinUNETR halves the patch five times: each side must be a multiple of 32, and the bottleneck (side / 32 on
    each axis) must hold more than one voxel, or instance norm has nothing to normalise: [64, 64, 32] is the
    smallest patch it trains on, [32, 32, 32] fails."""
    roi = [int(r) for r in roi_size]
    if len(roi) != 3 or any(r % 32 or r < 32 for r in roi) or math.prod(r // 32 for r in roi) < 2:
        fixed = [max(32, 32 * round(r / 32)) for r in roi] if len(roi) == 3 else [96, 96, 96]
        if math.prod(r // 32 for r in fixed) < 2:
            fixed = [max(64, r) for r in fixed]
        raise ConfigError(
            f"roi_size={roi}: each side must be a multiple of 32, with more than one voxel left after SwinUNETR's five "
            f"halvings (at 32x32x32 the bottleneck is a single voxel and instance norm fails). "
            f'Try --roi_size "{fixed}".'
        )


def check_overrides(argv: Sequence[str] | None = None) -> bool:
    """A ``--<id> value`` of ``python -m monai.bundle run`` that no config of the bundle defines is a
    :class:`ConfigError` naming the closest ids (:func:`check_ids`): MONAI adds such an id to the config, where nothing
    reads it, so a typo (``--max_epoch 2``) was silently ignored and the run went on with the default. ``argv``: the
    process's (``sys.argv``); outside ``monai.bundle``'s command line (a test, MONAI Label) nothing is checked. Returns
    True so it can sit in a config's list of steps."""
    import sys

    argv = list(sys.argv if argv is None else argv)
    if not argv or Path(argv[0]).parts[-2:] != ("bundle", "__main__.py"):
        return True
    given = _option_ids(argv[1:])
    files = given.pop("config_file", None)
    if not files:
        return True
    try:
        paths = ast.literal_eval(files) if files.lstrip().startswith("[") else [files]
    except (ValueError, SyntaxError):  # MONAI reads the files itself and says what is wrong with them
        return True
    from monai.bundle.scripts import run

    check_ids([k for k in given if k not in inspect.signature(run).parameters], paths)
    return True


def check_ids(ids: Iterable[str], config_files: Sequence[str | Path]) -> None:
    """:class:`ConfigError` for each id whose first part (``train#trainer#max_epochs``: ``train``; below it a new key
    can be a component's argument) no config defines: neither ``config_files`` nor the other configs beside them (the
    bundle's tools hand an id of one config to a run of another: evaluation's ``eval_pictures`` to each
    cross-validation fold's training). The message names the closest ids."""
    import difflib

    from monai.bundle import ConfigParser

    folders = {Path(f).resolve().parent for f in config_files}
    files = {Path(f).resolve() for f in config_files}
    files |= {f for d in folders for f in d.glob("*.yaml")}
    defined: set[str] = set()
    for file in sorted(files):
        try:
            content = ConfigParser.load_config_file(str(file))
        except Exception:  # not a config (metadata, logging): MONAI says what is wrong with the run's own files
            continue
        if isinstance(content, dict):
            defined |= {_first_part(str(key)) for key in content}
    unknown = sorted({key for key in ids if _first_part(key) not in defined})
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(_first_part(key), sorted(defined), n=3, cutoff=0.6)
        hints.append(f"--{key}" + (f" (did you mean {', '.join('--' + c for c in close)}?)" if close else ""))
    raise ConfigError(
        f"{'; '.join(hints)}: no config of the bundle defines {'that id' if len(unknown) == 1 else 'those ids'}, so "
        "the setting would be ignored. The ids are the keys of the config files (configs/train.yaml, ...)."
    )


def _first_part(config_id: str) -> str:
    """The top-level id of a config id (``train#trainer#max_epochs`` or MONAI's older ``train::trainer``: ``train``)."""
    return config_id.replace("::", "#").split("#")[0]


def _option_ids(args: Sequence[str]) -> dict[str, str]:
    """``--key value`` and ``--key=value`` of a command line, as ``{key: value}`` (a flag alone: "True")."""
    found: dict[str, str] = {}
    for i, arg in enumerate(args):
        if not arg.startswith("--") or len(arg) == 2:
            continue
        key, equals, value = arg[2:].partition("=")
        if not equals:
            value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else "True"
        found[key] = value
    return found
