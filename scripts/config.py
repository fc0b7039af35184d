"""Config values as the bundle reads them: flags from the command line, and fail-fast checks of the whole run.

* :func:`as_bool` -- ``--resume true`` reaches a config as the *string* "true"; every on/off value is read through it.
* :func:`check_config` -- run first (``setup``), before any data is touched: a wrong value should cost seconds, not the
  hour it takes to cache 422 CT volumes. Each check raises :class:`ConfigError` with the id to change and a value that
  works.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from scripts.labels import COLLECTION, LabelError, check_labels

#: MONAI's ``str2bool`` words (tests/test_config.py proves them the same); kept here so that the CLIs that read flags
#: (``scripts.prepare``, the benchmarks) start without importing MONAI and torch (~4 s)
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
