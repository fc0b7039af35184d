"""scripts.data.tcia.download against the fake NBIA server: TCIA layout, byte-identical files, every injected fault
reported, resumed transfers, completed cases skipped, and the CLI's exit status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest
from fake_nbia import (
    COLLECTION,
    FAST,
    MD5_ENDPOINT,
    FakeNbia,
    by_patient,
    case_dir,
    expected_files,
    folder_bytes,
    make_case,
    zip_name,
)
from scripts.data.tcia import MARKER, STAGING, download


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    """Seven cases: good (503s), cut CT zip, persistent bad MD5, zip-slip entry, SOP-only reference, no MD5 endpoint,
    403 on the SEG. Yields (server, dataset_dir, cases by patient, summary, request counts of the first run)."""
    cases = {
        "LUNG1-001": make_case("LUNG1-001"),
        "LUNG1-002": make_case("LUNG1-002"),
        "LUNG1-003": make_case("LUNG1-003"),
        "LUNG1-004": make_case("LUNG1-004"),
        "LUNG1-005": make_case("LUNG1-005", sop_only=True),
        "LUNG1-006": make_case("LUNG1-006"),
        "LUNG1-007": make_case("LUNG1-007"),
    }
    root = tmp_path_factory.mktemp("faulty")
    dataset_dir = root / "dataset"
    with FakeNbia(list(cases.values())) as server:
        server.listing_503 = 1
        server.fail_503[cases["LUNG1-001"].seg_uid] = 2
        server.truncate_once.add(cases["LUNG1-002"].ct_uid)
        server.bad_md5.add(cases["LUNG1-003"].ct_uid)
        server.evil.add(cases["LUNG1-004"].ct_uid)
        server.no_md5.update({cases["LUNG1-006"].seg_uid, cases["LUNG1-006"].ct_uid})
        server.forbidden.add(cases["LUNG1-007"].seg_uid)
        summary = download(dataset_dir, base_url=server.url, num_workers=3, retries=2, **FAST)
        yield server, dataset_dir, cases, summary, Counter(server.requests), list(server.ranges)


def test_good_series_complete_with_tcia_layout_and_identical_bytes(faulty):
    _, dataset_dir, cases, summary, _, _ = faulty
    assert sorted(r.patient_id for r in summary.downloaded) == ["LUNG1-001", "LUNG1-002", "LUNG1-005", "LUNG1-006"]
    for pid in ("LUNG1-001", "LUNG1-002", "LUNG1-005", "LUNG1-006"):
        case = cases[pid]
        folder = case_dir(dataset_dir, case)
        assert sorted(p.name for p in folder.iterdir()) == [MARKER, "image", "seg"]
        assert folder_bytes(folder / "seg") == expected_files(case.seg_files)
        assert folder_bytes(folder / "image") == expected_files(case.ct_files)  # no LICENSE, no md5hashes.csv
        marker = json.loads((folder / MARKER).read_text())
        assert (marker["seg_series_uid"], marker["image_series_uid"]) == (case.seg_uid, case.ct_uid)
        assert (marker["seg_files"], marker["image_files"]) == (1, 3)
    assert by_patient(summary.downloaded)["LUNG1-001"].md5_verified is True


def test_503s_and_a_cut_zip_are_retried_and_the_cut_zip_resumed_with_range(faulty):
    _, _, cases, _, counts, ranges = faulty
    assert counts[MD5_ENDPOINT, cases["LUNG1-001"].seg_uid] == 3  # two 503s, then the zip
    assert counts["getSeries", COLLECTION] == 2  # the listing's 503 was retried too
    ct = cases["LUNG1-002"].ct_uid
    assert counts[MD5_ENDPOINT, ct] == 2
    assert len([r for r in ranges if r[0] == ct and r[1] > 0]) == 1


def test_sop_only_reference_is_resolved_through_the_study_lookup(faulty):
    _, _, cases, summary, counts, _ = faulty
    case = cases["LUNG1-005"]
    assert counts["getSeries", case.study_uid] == 1
    assert counts["getSOPInstanceUIDs", case.ct_uid] == 1
    assert by_patient(summary.downloaded)["LUNG1-005"].image_series_uid == case.ct_uid


def test_missing_md5_endpoint_falls_back_to_getimage_and_says_so(faulty):
    _, _, cases, summary, counts, _ = faulty
    case = cases["LUNG1-006"]
    assert counts["getImage", case.ct_uid] == 1
    assert by_patient(summary.downloaded)["LUNG1-006"].md5_verified is False
    assert "NO MD5 CHECK  LUNG1-006" in summary.format()


def test_bad_series_are_reported_with_reasons_and_leave_nothing_behind(faulty):
    _, dataset_dir, cases, summary, counts, _ = faulty
    failed = by_patient(summary.failed)
    assert sorted(failed) == ["LUNG1-003", "LUNG1-004", "LUNG1-007"]
    bad_md5 = failed["LUNG1-003"].reason
    assert "MD5 mismatch for 00000002.dcm" in bad_md5 and cases["LUNG1-003"].ct_uid in bad_md5
    assert counts[MD5_ENDPOINT, cases["LUNG1-003"].ct_uid] == 3  # re-fetched, then given up
    assert "'../evil.dcm'" in failed["LUNG1-004"].reason
    assert counts[MD5_ENDPOINT, cases["LUNG1-004"].ct_uid] == 1  # unsafe archives are not retried
    assert "403" in failed["LUNG1-007"].reason and cases["LUNG1-007"].seg_uid in failed["LUNG1-007"].reason
    assert counts[MD5_ENDPOINT, cases["LUNG1-007"].seg_uid] == 1
    for pid in failed:
        assert not (dataset_dir / COLLECTION / pid).exists()
    assert not list(dataset_dir.parent.rglob("evil.dcm"))
    assert not list(dataset_dir.parent.rglob("*.tmp-*"))
    leftovers = [p for p in dataset_dir.rglob("*") if p.is_file() and p.suffix not in (".dcm", ".json")]
    assert leftovers == []
    assert "Re-run the same command" in summary.format()


def test_second_run_makes_no_zip_request_for_completed_or_adopted_cases(faulty):
    server, dataset_dir, cases, first, _, _ = faulty
    # a case without marker, as monai.apps.TciaDataset leaves it, and a temp folder of a killed run
    (case_dir(dataset_dir, cases["LUNG1-001"]) / MARKER).unlink()
    stale = dataset_dir / STAGING / "1.2.3.tmp-999999999"
    (stale / "seg").mkdir(parents=True)
    server.reset_counts()
    server.listing_503 = 0
    summary = download(dataset_dir, base_url=server.url, num_workers=2, retries=0, **FAST)
    completed = [cases[r.patient_id] for r in first.downloaded]
    assert sorted(r.patient_id for r in summary.skipped) == sorted(c.patient_id for c in completed)
    for case in completed:
        assert server.zip_requests(case.seg_uid) == 0 and server.zip_requests(case.ct_uid) == 0
    assert server.requests["getSeries", COLLECTION] == 1
    adopted = json.loads((case_dir(dataset_dir, cases["LUNG1-001"]) / MARKER).read_text())
    assert adopted["adopted"] is True and adopted["image_series_uid"] == cases["LUNG1-001"].ct_uid
    assert sorted(r.patient_id for r in summary.failed) == ["LUNG1-003", "LUNG1-004", "LUNG1-007"]
    assert not stale.exists()


def test_a_damaged_case_is_downloaded_again_and_replaced(faulty):
    server, dataset_dir, cases, _, _, _ = faulty
    case = cases["LUNG1-002"]
    folder = case_dir(dataset_dir, case)
    (folder / "image" / zip_name(0)).unlink()
    server.reset_counts()
    server.truncate_once.clear()
    summary = download(dataset_dir, base_url=server.url, retries=0, **FAST)
    assert "LUNG1-002" in by_patient(summary.downloaded)
    assert server.zip_requests(case.seg_uid) == 1 and server.zip_requests(case.ct_uid) == 1
    assert folder_bytes(folder / "image") == expected_files(case.ct_files)
    assert not list(folder.parent.glob(".*"))  # the replaced copy's backup is gone


def test_cut_streams_without_content_length_or_range_support_are_fetched_again(tmp_path):
    streamed, no_range = make_case("LUNG1-030"), make_case("LUNG1-031")
    with FakeNbia([streamed, no_range]) as server:
        server.cut_unannounced.add(streamed.ct_uid)  # only the zip's own structure shows the cut
        server.truncate_once.add(no_range.ct_uid)
        server.no_range.add(no_range.ct_uid)  # the resume attempt gets the whole zip: start over
        summary = download(tmp_path, base_url=server.url, retries=1, **FAST)
        assert server.zip_requests(streamed.ct_uid) == 2 and server.zip_requests(no_range.ct_uid) == 2
    assert len(summary.downloaded) == 2
    for case in (streamed, no_range):
        assert folder_bytes(case_dir(tmp_path, case) / "image") == expected_files(case.ct_files)


def test_limit_picks_by_patient_then_series_uid_whatever_the_listing_order(tmp_path):
    first = make_case("LUNG1-009", seg_number=1)
    second = make_case("LUNG1-009", seg_number=2, ct=first)  # a second SEG of the same CT
    later = make_case("LUNG1-010")
    with FakeNbia([later, second, first]) as server:
        summary = download(tmp_path, limit=2, base_url=server.url, num_workers=3, retries=0, **FAST)
        assert server.zip_requests(later.seg_uid) == 0
    picked = sorted([first, second], key=lambda c: c.seg_uid)
    assert [r.seg_series_uid for r in summary.downloaded] == [c.seg_uid for c in picked]
    for case in picked:
        assert folder_bytes(case_dir(tmp_path, case) / "image") == expected_files(first.ct_files)


def test_cli_exits_nonzero_and_names_the_failed_series(tmp_path, root):
    good, bad = make_case("LUNG1-020"), make_case("LUNG1-021")
    with FakeNbia([good, bad]) as server:
        server.bad_md5.add(bad.ct_uid)
        cmd = [
            sys.executable,
            "-m",
            "scripts.tcia",
            "download",
            "--dataset_dir",
            str(tmp_path),
            "--base_url",
            server.url,
            "--retries",
            "1",
            "--backoff",
            "0.01",
            "--num_workers",
            "2",
        ]
        env = {k: v for k, v in os.environ.items() if k != "TCIA_BASE_URL"}
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 1, proc.stderr
    assert "1 downloaded" in proc.stdout and "1 failed" in proc.stdout
    assert f"FAILED  LUNG1-021  SEG {bad.seg_uid}" in proc.stdout and "00000002.dcm" in proc.stdout
    assert (case_dir(tmp_path, good) / "image").is_dir()
