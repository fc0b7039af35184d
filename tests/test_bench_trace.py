"""bench_trace's generator and plumbing on small traces: every shape it writes is a valid trace whose statistics the
generator, a full json.load reference and the summariser (each parser) agree on."""

from __future__ import annotations

import gzip
import json
import os

import pytest
from benchmarks import bench_trace as bt
from scripts import summarize_trace as st

SMALL, SCALE = 400_000, 0.1  # bytes, operators per section: three steps of about 130 kB


def parsers() -> list[str]:
    """The summariser's skimming parsers available here (orjson is optional)."""
    try:
        import orjson  # noqa: F401
    except ImportError:
        return ["auto", "json"]
    return ["auto", "orjson", "json"]


@pytest.mark.parametrize("shape", bt.SHAPES)
def test_every_shape_agrees_with_a_full_load_reference(tmp_path, shape):
    path = tmp_path / f"{shape}.json"
    packed = tmp_path / f"{shape}.json.gz"
    expected = bt.write_trace(path, SMALL, shape, gz_path=packed, ops_scale=SCALE)
    assert gzip.decompress(packed.read_bytes()) == path.read_bytes()
    reference = bt.reference_summary(path)
    assert bt.compare(expected["sections"], reference) == []
    assert len(json.loads(path.read_text())["traceEvents"]) == expected["events"]
    for parser in parsers():
        for trace in (path, packed):
            summary = st.summarize(trace, parser=parser)
            assert bt.compare(summary["sections"], reference) == [], (parser, trace.name)
            assert summary["events"] == expected["events"]
            assert summary["kernels"] == expected["kernels"]


def test_orjson_parser_is_refused_clearly_where_it_is_missing(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    bt.write_trace(path, SMALL, "cuda-after", ops_scale=SCALE)
    monkeypatch.setitem(__import__("sys").modules, "orjson", None)  # as if not installed
    with pytest.raises(st.TraceError, match="pip install orjson"):
        st.summarize(path, parser="orjson")


def test_shapes_differ_as_named(tmp_path):
    names = {}
    for shape in ("cuda-after", "hip-after", "mixed-before", "mixed-after-compact"):
        path = tmp_path / f"{shape}.json"
        bt.write_trace(path, SMALL, shape, ops_scale=SCALE)
        events = json.loads(path.read_text())["traceEvents"]
        names[shape] = {e["name"] for e in events if "Launch" in e["name"]}
        kinds = [e.get("cat") for e in events if e.get("cat") in ("kernel", "cuda_runtime")]
        first_kernel, first_launch = kinds.index("kernel"), kinds.index("cuda_runtime")
        assert (first_kernel < first_launch) == ("before" in shape), shape
        assert (path.read_text().count("\n  {\n") > 0) == ("compact" not in shape)
        tids = {e["tid"] for e in events if "Launch" in e["name"]}
        assert bt.AUTOGRAD_TID in tids and bt.MAIN_TID in tids  # backward launches on autograd's thread
        streams = {e["tid"] for e in events if e.get("cat") == "kernel"}
        assert streams == {bt.COMPUTE_STREAM, bt.SIDE_STREAM}
        assert any(e.get("cat") == "gpu_user_annotation" for e in events)
        assert any(e.get("ph") == "f" and e.get("cat") == "ac2g" for e in events)
    assert all(n.startswith("cu") for n in names["cuda-after"])
    assert all(n.startswith("hip") for n in names["hip-after"])
    assert {n[:2] for n in names["mixed-before"]} == {"cu", "hi"}


def test_child_run_reports_time_memory_and_a_table(tmp_path):
    path = tmp_path / "t.json"
    expected = bt.write_trace(path, SMALL, "mixed-after", ops_scale=SCALE)
    run = bt.run_summarizer(path, "auto")
    assert run["summary"] is not None, run["stderr"]
    assert bt.compare(run["summary"]["sections"], expected["sections"]) == []
    assert run["wall_s"] > 0 and run["cpu_s"] > 0 and 5_000 < run["maxrss_kb"] < 256_000
    row = bt._row("mixed-after", path, path.stat().st_size, expected, run, [], 0.1)
    table = bt.markdown_table([row])
    assert table.splitlines()[0].startswith("| shape | file | parser |") and "| mixed-after | .json |" in table
    if os.path.isfile("/proc/stat"):  # the hypervisor's share of CPU time while the row ran, for a noisy VM
        assert 0 <= row["steal_pct"] <= 100
