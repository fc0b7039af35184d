"""Which CT series of a study is the case's CT: one rule for every input (a folder, a PACS over DICOMweb).

A study holds more than the series to segment: a scout (LOCALIZER), coronal and sagittal reformats, thick and thin
reconstructions, and in radiotherapy 4D-CT phases, their average and MIP (``DERIVED\\SECONDARY\\AXIAL``, which
treatment planning contours on). :func:`choose_series` takes, among the series that pass :class:`SeriesRules`, an
ORIGINAL series first (a ``SECONDARY`` one only when it is the best the study has; the choice then says so), then an
untilted one (a gantry tilt is resampled onto an orthogonal grid, by interpolation), then the thinnest, then the one
with most slices, then the lowest series number; every other series gets the reason it was not chosen, for the
report, and the chosen one says why (``why``).

A gantry-tilted acquisition is axial: :func:`slice_geometry` tells it from an oblique reformat by its headers and
names the angle either way (``geometry``).

A series is described (:func:`describe_series`) from its instances' headers in a form both sources give: SOP Class,
ImageType, ImageOrientationPatient and ImagePositionPatient of each instance (:class:`InstanceHeader`).
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydicom.uid import UID
from scripts.data.dicom.ct import CT_IMAGE_STORAGE, ENHANCED_CT_STORAGE

AXIAL_COS = math.cos(math.radians(10))  # a slice normal within 10 degrees of the body axis is axial
#: the order in which usable series are preferred, for the report
PREFERENCE = "the rule: a preferred ImageType (ORIGINAL), untilted, the thinnest, the most slices, the lowest number"
#: a stack whose slices step this far (degrees) or more off their normal is sheared: a gantry tilt
MIN_TILT_DEG = 0.5
#: scanners tilt their gantry by at most 30 degrees; a plane further off is a reformat whatever its positions say
MAX_TILT_DEG = 30.0
#: how far (degrees) a tilted stack's steps may lie from the body (table) axis
TABLE_TOLERANCE_DEG = 2.0


@dataclass(frozen=True)
class InstanceHeader:
    """What the rules read of one instance: its SOP Class UID, ImageType values, orientation (6), position (3) and
    GantryDetectorTilt."""

    sop_class: str
    image_types: tuple[str, ...] = ()
    orientation: tuple[float, ...] = ()
    position: tuple[float, ...] = ()
    gantry_tilt: float | None = None  # GantryDetectorTilt (degrees), where the scanner wrote it


def gantry_tilt_of(value: Any) -> float | None:
    """GantryDetectorTilt (degrees) as a number, from a header (pydicom's DS or DICOM JSON's value); None when it is
    absent, empty or not a number."""
    try:
        return None if value is None or str(value).strip() == "" else float(value)
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class SeriesRules:
    """How a study's CT series is chosen: among the series of at least ``min_slices`` classic CT images, of
    ``orientation`` (``axial``: the slice normal within 10 degrees of the body axis, or a gantry tilt of up to 30
    degrees (:func:`slice_geometry`); or ``any``), whose SeriesDescription matches the regular expression
    ``description`` (if given) and whose ImageType has none of ``exclude_image_types``: one whose ImageType holds one
    of ``prefer_image_types`` (or has no ImageType) first, then an untilted one, then the thinnest (smallest step
    between slice positions), then the one with most slices, then the lowest series number."""

    min_slices: int = 10
    orientation: str = "axial"
    description: str | None = None
    exclude_image_types: tuple[str, ...] = ("LOCALIZER",)
    prefer_image_types: tuple[str, ...] = ("ORIGINAL",)

    @classmethod
    def of(cls, rules: Mapping[str, Any] | SeriesRules | None) -> SeriesRules:
        """Rules from the config's ``series_rules`` mapping (unknown keys refused, naming them)."""
        if isinstance(rules, SeriesRules):
            return rules
        given = dict(rules or {})
        unknown = set(given) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"series_rules: unknown {sorted(unknown)}; the rules are {list(cls.__dataclass_fields__)}")
        for key in ("exclude_image_types", "prefer_image_types"):
            types = given.get(key, getattr(cls, key))
            given[key] = tuple(t.upper() for t in ((types,) if isinstance(types, str) else types or ()))
        given["orientation"] = str(given.get("orientation", cls.orientation)).lower()
        made = cls(**{**given, "min_slices": int(given.get("min_slices", cls.min_slices))})
        if made.orientation not in ("axial", "any"):
            raise ValueError(f"series_rules#orientation {made.orientation!r}: choose axial or any.")
        if made.description is not None:
            try:
                re.compile(made.description)
            except re.error as err:
                raise ValueError(
                    f"series_rules#description {made.description!r}: not a regular expression ({err})"
                ) from None
        return made


def describe_series(series: Mapping, instances: Sequence[InstanceHeader] | None) -> dict:
    """What the rules need to know of a series: ``series`` gives ``series_uid``, ``modality``, ``number``,
    ``description`` and ``images`` (a count, used when the instances were not examined); ``instances`` add the classic
    CT images, SOP classes, image types, orientation, slice step (mm) and, for a tilted or oblique stack, its angle
    (``tilt_deg``) and what it is (``geometry``: see :func:`slice_geometry`)."""
    info = {k: series.get(k) for k in ("series_uid", "modality", "number", "description", "images")}
    info.update(description=str(info["description"] or ""), images=int(info["images"] or 0))
    if instances is None:
        return info
    ct = [i for i in instances if i.sop_class == CT_IMAGE_STORAGE]
    info.update(images=len(ct), sop_classes=sorted({i.sop_class for i in instances}))
    info["image_types"] = sorted({t.upper() for i in instances for t in i.image_types})
    orientations = {tuple(round(float(v), 3) for v in i.orientation) for i in ct}
    info["orientation"], info["spacing_mm"] = "unknown", None
    if len(orientations) > 1:
        info["orientation"] = "mixed"
    elif orientations and len(next(iter(orientations))) == 6:
        tilts = {round(float(i.gantry_tilt), 2) for i in ct if i.gantry_tilt is not None}
        positions = [i.position for i in ct if len(i.position) == 3]
        info.update(slice_geometry(next(iter(orientations)), positions, next(iter(tilts)) if len(tilts) == 1 else None))
    return info


def slice_geometry(
    orientation: Sequence[float], positions: Sequence[Sequence[float]], gantry_tilt: float | None = None
) -> dict:
    """How a stack of slices lies, from ImageOrientationPatient, the slices' ImagePositionPatient and (when written)
    GantryDetectorTilt: ``orientation`` (``axial``, ``coronal``, ``sagittal`` or ``oblique``), ``spacing_mm`` (the
    median step along the slice normal), ``tilt_deg`` (the angle a gantry tilt or an oblique plane makes, else 0) and
    ``geometry``, a line for the report that names what was found.

    A slice normal within 10 degrees of a patient axis names the orientation; slices stepped sideways as well (a
    sheared stack) are a gantry tilt of that angle. A normal further off is told apart by where the slices step:

    * a **gantry tilt** as GE, Philips and Siemens write it: the planes tilted about the left-right axis (rows along x)
      and the positions stepping straight along the body axis, as the table moved (or GantryDetectorTilt giving the
      normal's angle): an axial acquisition, read onto an orthogonal grid by the reader;
    * an **oblique reformat**: positions stepping along the plane's own normal and no GantryDetectorTilt: a plane
      chosen after the scan, not the axial series.
    """
    row_col = np.asarray(orientation, float).reshape(2, 3)
    normal = np.cross(row_col[0], row_col[1])
    normal /= np.linalg.norm(normal) or 1.0
    axis = int(np.argmax(np.abs(normal)))
    off_axis = math.degrees(math.acos(min(1.0, abs(float(normal[axis])))))
    points = np.asarray(positions, float).reshape(-1, 3)
    along = points @ normal
    gaps = np.diff(np.unique(np.round(along, 3)))
    found: dict[str, Any] = {"spacing_mm": round(float(statistics.median(gaps)), 3) if len(gaps) else None}
    step = points[along.argmax()] - points[along.argmin()] if len(points) > 1 else np.zeros(3)  # first to last
    length = float(np.linalg.norm(step))
    shear = math.degrees(math.acos(min(1.0, abs(float(step @ normal)) / length))) if length > 0 else 0.0
    names = ("sagittal", "coronal", "axial")
    if math.cos(math.radians(off_axis)) >= AXIAL_COS:
        found.update(orientation=names[axis], tilt_deg=round(shear, 2) if shear >= MIN_TILT_DEG else 0.0)
        found["geometry"] = (
            f"{names[axis]} with a gantry tilt of {shear:.1f} deg (the slices step {shear:.1f} deg off their normal): "
            "read onto an orthogonal grid"
            if shear >= MIN_TILT_DEG
            else f"{names[axis]} slices (normal {off_axis:.1f} deg off the {'xyz'[axis]} axis)"
        )
        return found
    # the table moves along z: a tilted acquisition steps along z whatever its planes' angle
    table = length > 0 and abs(float(step[2])) / length >= math.cos(math.radians(TABLE_TOLERANCE_DEG))
    about_x = abs(float(row_col[0][0])) >= AXIAL_COS and abs(float(normal[0])) < 1 - AXIAL_COS
    angle = math.degrees(math.acos(min(1.0, abs(float(normal[2])))))
    tagged = gantry_tilt is not None and abs(abs(float(gantry_tilt)) - angle) <= 1.0
    if about_x and angle <= MAX_TILT_DEG and ((table and shear >= MIN_TILT_DEG) or tagged):
        tag = f"GantryDetectorTilt {float(gantry_tilt):g}" if gantry_tilt is not None else "no GantryDetectorTilt"
        found.update(orientation="axial", tilt_deg=round(angle, 2))
        found["geometry"] = (
            f"axial with a gantry tilt of {angle:.1f} deg (planes tilted about the left-right axis, slices stepping "
            f"along the body axis; {tag}): read onto an orthogonal grid"
        )
        return found
    found.update(orientation="oblique", tilt_deg=round(off_axis, 2))
    if table and shear >= MIN_TILT_DEG:
        what = "slices stepping along the body axis but the planes not tilted about the left-right axis"
    else:
        what = "slices stepping along the plane's own normal, no gantry tilt"
    found["geometry"] = f"an oblique reformat: slice normal {off_axis:.1f} deg off the {'xyz'[axis]} axis ({what})"
    return found


def choose_series(described: Sequence[Mapping], rules: SeriesRules | Mapping | None = None) -> tuple[dict | None, list]:
    """The CT series the rules choose among ``described`` (:func:`describe_series`), or None, and every other CT
    series with the reason it was not chosen. A chosen series without a preferred ImageType carries a ``note``. Each
    usable series carries ``choice``, its place in the rules' order (1: the chosen one), which inference follows when
    the chosen series fails its check."""
    rules = SeriesRules.of(rules)
    cts = [dict(s) for s in described if s.get("modality", "CT") == "CT"]
    for info in cts:
        info["reason"] = _refusal(info, rules)
    usable = sorted(
        (s for s in cts if s["reason"] is None),
        key=lambda s: (
            not _preferred(s, rules),
            _tilted(s),
            s["spacing_mm"],
            -s["images"],
            _number(s["number"]),
            s["series_uid"],
        ),
    )
    for rank, info in enumerate(usable, 1):  # the rules' order among the usable series (1: the chosen one)
        info["choice"] = rank
    chosen = usable[0] if usable else None
    if chosen is not None:
        del chosen["reason"]
        chosen["why"] = (
            "the study's only usable series"
            if len(usable) == 1
            else f"the first of {len(usable)} usable series by {PREFERENCE}"
        )
        if rules.prefer_image_types and not _preferred(chosen, rules):
            chosen["note"] = (
                f"ImageType {'/'.join(chosen['image_types']) or 'absent'}: the study has no "
                f"{'/'.join(rules.prefer_image_types)} series that passes series_rules, so this one is used"
            )
        if _tilted(chosen):
            tilt = f"{chosen['geometry']}; the study has no untilted series that passes series_rules"
            chosen["note"] = f"{chosen['note']}; {tilt}" if "note" in chosen else tilt
        for other in usable[1:]:
            if _preferred(chosen, rules) and not _preferred(other, rules):
                why = f"ImageType {'/'.join(other['image_types'])}, and the study has an {rules.prefer_image_types[0]}"
                why += " series"
            elif _tilted(other) and not _tilted(chosen):
                why = (
                    f"a gantry tilt of {other['tilt_deg']:.1f} deg (it would be resampled onto an orthogonal grid), "
                    "and the study has an untilted series"
                )
            elif other["spacing_mm"] > chosen["spacing_mm"]:
                why = f"{other['spacing_mm']:g} mm slices, thicker than the chosen {chosen['spacing_mm']:g} mm"
            elif other["images"] < chosen["images"]:
                why = f"{other['images']} slices, fewer than the chosen {chosen['images']}"
            else:
                why = "as thin and as many slices as the chosen one, which has the lower series number"
            other["reason"] = f"usable, but {why}"
    return chosen, [s for s in cts if s is not chosen]


def _tilted(info: Mapping) -> bool:
    """Whether the series is a gantry-tilted stack (read onto an orthogonal grid by interpolation)."""
    return bool(info.get("tilt_deg")) and info.get("orientation") == "axial"


def _preferred(info: Mapping, rules: SeriesRules) -> bool:
    """Whether the series' ImageType holds a preferred value; a series without ImageType (stripped by some
    anonymisers) is not known to be derived and counts as preferred."""
    types = set(info.get("image_types", ()))
    return not rules.prefer_image_types or not types or bool(types & set(rules.prefer_image_types))


def _refusal(info: Mapping, rules: SeriesRules) -> str | None:
    """Why the series cannot be the case's CT, or None when it can."""
    if "sop_classes" not in info:  # not examined: the server counted too few instances
        return f"{info['images']} images, fewer than series_rules#min_slices ({rules.min_slices})"
    if not info["images"] and set(info["sop_classes"]) & set(ENHANCED_CT_STORAGE):
        return "Enhanced (multi-frame) CT: the reader takes classic CT images (one file per slice)"
    if not info["images"]:
        kinds = ", ".join(UID(c).name if UID(c).is_valid else c for c in info["sop_classes"]) or "nothing"
        return f"no CT image ({kinds})"
    excluded = [t for t in info["image_types"] if t in rules.exclude_image_types]
    if excluded:
        return f"ImageType {'/'.join(excluded)} (series_rules#exclude_image_types)"
    if info["images"] < rules.min_slices:
        return f"{info['images']} CT images, fewer than series_rules#min_slices ({rules.min_slices})"
    if rules.orientation == "axial" and info["orientation"] != "axial":
        what = info.get("geometry") or f"{info['orientation']} slices"
        return f"{what}, not axial (series_rules#orientation)"
    if rules.description is not None and not re.search(rules.description, info["description"]):
        return f"SeriesDescription {info['description']!r} does not match series_rules#description"
    if info["spacing_mm"] is None or info["spacing_mm"] <= 0:
        return "slice positions missing or all at one place"
    return None


def _number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.inf
