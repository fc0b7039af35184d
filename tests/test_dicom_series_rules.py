"""Which CT series of a study is the case's CT: the rule a folder and a PACS share
(scripts/data/dicom/series_rules.py)."""

from __future__ import annotations

import pytest
from scripts.data.dicom.series_rules import InstanceHeader, SeriesRules, choose_series, describe_series

CT = "1.2.840.10008.5.1.4.1.1.2"


def series(uid: str, images: int = 40, spacing: float | None = 1.0, orientation: str = "axial", description: str = "",
           image_types: tuple[str, ...] = ("ORIGINAL", "PRIMARY", "AXIAL"), number: int = 1,
           sop_classes: tuple[str, ...] = (CT,)) -> dict:  # fmt: skip
    """A series as describe_series reports one it examined."""
    return {"series_uid": uid, "modality": "CT", "number": number, "description": description, "images": images,
            "sop_classes": list(sop_classes), "image_types": list(image_types), "orientation": orientation,
            "spacing_mm": spacing}  # fmt: skip


def test_the_thinnest_axial_original_series_with_enough_slices_is_chosen_and_every_other_one_says_why():
    candidates = [
        series("thick", spacing=5.0, number=2),
        series("thin", spacing=1.0, number=3),
        series("scout", images=30, spacing=0.5, image_types=("ORIGINAL", "PRIMARY", "LOCALIZER"), number=1),
        series("few", images=8, spacing=0.6, number=4),
        series("coronal", spacing=0.5, orientation="coronal", number=5),
        series("mip", spacing=0.5, image_types=("DERIVED", "SECONDARY", "AXIAL", "MIP"), number=6),
        series("enhanced", images=0, spacing=None, sop_classes=("1.2.840.10008.5.1.4.1.1.2.1",), number=7),
        {"series_uid": "unexamined", "modality": "CT", "number": 8, "description": "", "images": 3},
    ]
    chosen, others = choose_series(candidates)
    assert chosen["series_uid"] == "thin" and "reason" not in chosen and "note" not in chosen
    reasons = {s["series_uid"]: s["reason"] for s in others}
    assert reasons["thick"] == "usable, but 5 mm slices, thicker than the chosen 1 mm"
    assert reasons["few"] == "8 CT images, fewer than series_rules#min_slices (10)"
    assert "coronal slices, not axial" in reasons["coronal"]
    assert reasons["mip"] == "usable, but ImageType DERIVED/SECONDARY/AXIAL/MIP, and the study has an ORIGINAL series"
    assert "Enhanced (multi-frame) CT" in reasons["enhanced"]
    assert reasons["unexamined"] == "3 images, fewer than series_rules#min_slices (10)"
    assert reasons["scout"] == "ImageType LOCALIZER (series_rules#exclude_image_types)"


def test_a_secondary_axial_series_is_taken_when_it_is_the_best_the_study_has_and_the_choice_says_so():
    """A radiotherapy study of 4D-CT phases, their average and MIP (DERIVED\\SECONDARY\\AXIAL), a scout and a coronal
    reformat: the thinnest axial SECONDARY series is used, with a note; scouts and reformats are still never used."""
    candidates = [
        series("phase", spacing=3.0, image_types=("DERIVED", "SECONDARY", "AXIAL"), number=2),
        series("average", spacing=2.0, image_types=("DERIVED", "SECONDARY", "AXIAL", "AVERAGE"), number=3),
        series("scout", spacing=1.0, image_types=("ORIGINAL", "PRIMARY", "LOCALIZER"), number=1),
        series("coronal", spacing=1.0, orientation="coronal", number=4),
    ]
    chosen, others = choose_series(candidates)
    assert chosen["series_uid"] == "average"
    assert chosen["note"].startswith("ImageType DERIVED/SECONDARY/AXIAL/AVERAGE: the study has no ORIGINAL series")
    reasons = {s["series_uid"]: s["reason"] for s in others}
    assert "LOCALIZER" in reasons["scout"] and "not axial" in reasons["coronal"]
    assert reasons["phase"] == "usable, but 3 mm slices, thicker than the chosen 2 mm"
    strict = {"exclude_image_types": ["LOCALIZER", "SECONDARY"]}  # a site that never infers derived series
    assert choose_series(candidates, strict)[0] is None


def test_the_rules_can_be_set_and_ties_go_to_more_slices_then_the_lower_series_number():
    candidates = [
        series("a", images=40, number=5),
        series("b", images=60, number=6),
        series("c", images=60, number=4),
        series("chest", spacing=2.0, description="Thorax 2mm"),
        series("few", images=8, spacing=0.6),
    ]
    assert choose_series(candidates)[0]["series_uid"] == "c"
    assert choose_series(candidates, {"description": "(?i)thorax"})[0]["series_uid"] == "chest"
    assert choose_series(candidates, {"min_slices": 5})[0]["series_uid"] == "few"
    coronal = [series("cor", orientation="coronal")]
    assert choose_series(coronal)[0] is None and choose_series(coronal, {"orientation": "any"})[0] is not None
    with pytest.raises(ValueError, match=r"unknown \['thinnest'\]"):
        SeriesRules.of({"thinnest": True})
    with pytest.raises(ValueError, match="not a regular expression"):
        SeriesRules.of({"description": "(unclosed"})


def test_a_series_is_described_from_its_instance_headers_in_millimetres():
    """Slices 2.5 mm apart along a normal tilted 5 degrees off the body axis: axial, 2.5 mm, whatever their order."""
    import math

    tilt = math.radians(5)
    row, column = (1.0, 0.0, 0.0), (0.0, math.cos(tilt), -math.sin(tilt))
    normal = (0.0, math.sin(tilt), math.cos(tilt))
    instances = [InstanceHeader(CT, ("ORIGINAL", "PRIMARY", "AXIAL"), row + column,
                                tuple(10.0 + 2.5 * k * n for n in normal)) for k in (3, 0, 2, 1)]  # fmt: skip
    instances.append(InstanceHeader("1.2.840.10008.5.1.4.1.1.7"))  # a secondary capture in the series: not an image
    info = describe_series({"series_uid": "s", "modality": "CT", "number": "2", "description": None, "images": 5},
                           instances)  # fmt: skip
    assert info["orientation"] == "axial" and info["spacing_mm"] == 2.5 and info["images"] == 4
    assert info["image_types"] == ["AXIAL", "ORIGINAL", "PRIMARY"] and info["description"] == ""


def headers_of(written) -> list[InstanceHeader]:
    """The rules' view of a series the factory wrote (tests/dicom_factory.py: no geometry shared with the rules)."""
    return [InstanceHeader(CT, tuple(ds.ImageType), tuple(float(v) for v in ds.ImageOrientationPatient),
                           tuple(float(v) for v in ds.ImagePositionPatient),
                           float(ds.GantryDetectorTilt) if "GantryDetectorTilt" in ds else None)
            for ds in written]  # fmt: skip


def described(written, uid: str, number: int = 2) -> dict:
    return describe_series({"series_uid": uid, "modality": "CT", "number": number, "description": "", "images": 0},
                           headers_of(written))  # fmt: skip


def factory_series(**options):
    from dicom_factory import Series, ct_slice

    series = Series(**options)
    return [ct_slice(series, k) for k in range(series.shape[2])]


@pytest.mark.parametrize(
    ("options", "angle"),
    [
        ({"tilt_deg": 18.5, "tilt_form": "scanner"}, 18.5),  # GE: tilted planes, positions along z, the tag
        ({"tilt_deg": -18.5, "tilt_form": "scanner", "slice_spacing": 2.5}, 18.5),  # Philips
        ({"tilt_deg": 18.5, "tilt_form": "scanner", "gantry_tag": False}, 18.5),  # the tag stripped
        ({"tilt_deg": 15.0}, 15.0),  # axial planes stepped sideways (the factory's sheared form)
    ],
    ids=["ge", "philips", "untagged", "sheared"],
)
def test_a_gantry_tilted_axial_series_is_usable_and_its_angle_named(options, angle):
    info = described(factory_series(**options), "tilted")
    assert info["orientation"] == "axial" and info["tilt_deg"] == pytest.approx(angle, abs=0.05)
    assert f"gantry tilt of {angle:.1f} deg" in info["geometry"]
    chosen, others = choose_series([info])
    assert chosen["series_uid"] == "tilted" and others == []
    assert f"gantry tilt of {angle:.1f} deg" in chosen["note"] and "no untilted series" in chosen["note"]


def test_an_oblique_reformat_is_not_a_gantry_tilt_and_is_refused_with_its_angle():
    """The same tilted planes, but the positions step along their own normal and no GantryDetectorTilt: a plane
    chosen after the scan. Refused for orientation axial, named as what it is; taken with orientation any."""
    info = described(factory_series(tilt_deg=18.5, tilt_form="reformat"), "reformat")
    assert info["orientation"] == "oblique" and info["tilt_deg"] == pytest.approx(18.5, abs=0.05)
    chosen, (other,) = choose_series([info])
    assert chosen is None
    assert other["reason"] == (
        "an oblique reformat: slice normal 18.5 deg off the z axis (slices stepping along the plane's own normal, no "
        "gantry tilt), not axial (series_rules#orientation)"
    )
    assert choose_series([info], {"orientation": "any"})[0]["series_uid"] == "reformat"
    steep = described(factory_series(tilt_deg=40.0, tilt_form="scanner"), "steep")  # beyond any gantry's 30 degrees
    assert steep["orientation"] == "oblique" and "40.0 deg" in steep["geometry"]


def test_an_untilted_axial_series_comes_before_a_thinner_tilted_one_and_the_report_says_why():
    """A Philips study: a 5 mm axial series and a 2.5 mm series tilted -18.5 degrees. The untilted one needs no
    resampling and is used; the tilted one is listed as usable, with the angle."""
    axial = described(factory_series(slice_spacing=5.0, patient_id="P"), "axial", number=2)
    tilted = described(factory_series(tilt_deg=-18.5, tilt_form="scanner", slice_spacing=2.5), "tilted", number=3)
    chosen, (other,) = choose_series([tilted, axial])
    assert chosen["series_uid"] == "axial" and "note" not in chosen and chosen["tilt_deg"] == 0.0
    assert other["reason"] == (
        "usable, but a gantry tilt of 18.5 deg (it would be resampled onto an orthogonal grid), and the study has an "
        "untilted series"
    )
