"""The synthetic traces of tests/trace_factory.py and the plumbing of benchmarks/bench_trace.py on small traces: every
shape is a valid trace whose statistics the generator, the full json.load reference of tests/trace_reference.py and
the summariser (each parser) agree on."""

from __future__ import annotations

import gzip
import json
import os
import re

import pytest
import trace_factory as tf
import trace_reference as tr
from benchmarks import bench_trace as bt
from scripts.profiling import summarize_trace as st

SMALL, SCALE = 400_000, 0.1  # bytes, operators per section: three steps of about 130 kB


def parsers() -> list[str]:
    """The summariser's skimming parsers available here (orjson is optional)."""
    try:
        import orjson  # noqa: F401
    except ImportError:
        return ["auto", "json"]
    return ["auto", "orjson", "json"]


@pytest.mark.parametrize("shape", tf.SHAPES)
def test_every_shape_agrees_with_a_full_load_reference(tmp_path, shape):
    path = tmp_path / f"{shape}.json"
    packed = tmp_path / f"{shape}.json.gz"
    expected = tf.write_trace(path, SMALL, shape, gz_path=packed, ops_scale=SCALE)
    assert gzip.decompress(packed.read_bytes()) == path.read_bytes()
    reference, device = tr.reference_summary(path), tr.reference_device(path)
    assert tr.compare(expected["sections"], reference) == []
    assert tr.compare_device(tr.as_summary(expected["device"]), device) == []
    assert 0 < device["busy_ms"] < device["ms"] < device["wall_ms"]  # streams overlap; the steps wait for data
    assert len(json.loads(path.read_text())["traceEvents"]) == expected["events"]
    for parser in parsers():
        for trace in (path, packed):
            summary = st.summarize(trace, parser=parser)
            assert tr.compare(summary["sections"], reference) == [], (parser, trace.name)
            assert tr.compare_device(summary, device) == [], (parser, trace.name)
            assert summary["events"] == expected["events"]
            assert summary["kernels"] == expected["kernels"]


def test_a_device_record_that_differs_is_reported():
    """compare_device names each number that differs: the event count exactly, times beyond 1 ns an event."""
    want = {"events": 10, "ms": 1.0, "wall_ms": 5.0, "busy_ms": 0.9}
    good = tr.as_summary(want)
    assert tr.compare_device(good, want) == [] and tr.compare_device(good, None) == []
    bad = tr.as_summary({**want, "events": 9, "busy_ms": 0.9001})
    assert tr.compare_device(bad, want) == ["device events 9 != 10", "device busy_ms 0.9001 != 0.9"]
    assert tr.compare_device({"sections": {}}, want)[0] == "device events None != 10"  # a summariser without it


def test_orjson_parser_is_refused_clearly_where_it_is_missing(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    tf.write_trace(path, SMALL, "cuda-after", ops_scale=SCALE)
    monkeypatch.setitem(__import__("sys").modules, "orjson", None)  # as if not installed
    with pytest.raises(st.TraceError, match="pip install orjson"):
        st.summarize(path, parser="orjson")


def test_shapes_differ_as_named(tmp_path):
    names = {}
    for shape in ("cuda-after", "hip-after", "mixed-before", "mixed-after-compact"):
        path = tmp_path / f"{shape}.json"
        tf.write_trace(path, SMALL, shape, ops_scale=SCALE)
        events = json.loads(path.read_text())["traceEvents"]
        names[shape] = {e["name"] for e in events if "Launch" in e["name"]}
        kinds = [e.get("cat") for e in events if e.get("cat") in ("kernel", "cuda_runtime")]
        first_kernel, first_launch = kinds.index("kernel"), kinds.index("cuda_runtime")
        assert (first_kernel < first_launch) == ("before" in shape), shape
        assert (path.read_text().count("\n  {\n") > 0) == ("compact" not in shape)
        tids = {e["tid"] for e in events if "Launch" in e["name"]}
        assert tf.AUTOGRAD_TID in tids and tf.MAIN_TID in tids  # backward launches on autograd's thread
        streams = {e["tid"] for e in events if e.get("cat") == "kernel"}
        assert streams == {tf.COMPUTE_STREAM, tf.SIDE_STREAM}
        assert any(e.get("cat") == "gpu_user_annotation" for e in events)
        assert any(e.get("ph") == "f" and e.get("cat") == "ac2g" for e in events)
    assert all(n.startswith("cu") for n in names["cuda-after"])
    assert all(n.startswith("hip") for n in names["hip-after"])
    assert {n[:2] for n in names["mixed-before"]} == {"cu", "hi"}


def test_child_run_reports_time_memory_and_a_table(tmp_path):
    path = tmp_path / "t.json"
    expected = tf.write_trace(path, SMALL, "mixed-after", ops_scale=SCALE)
    run = bt.run_summarizer(path, "auto")
    assert run["summary"] is not None, run["stderr"]
    assert tr.compare(run["summary"]["sections"], expected["sections"]) == []
    assert run["wall_s"] > 0 and run["cpu_s"] > 0 and 5_000 < run["maxrss_kb"] < 256_000
    row = bt._row("mixed-after", path, path.stat().st_size, expected, run, [], 0.1)
    table = bt.markdown_table([row])
    assert table.splitlines()[0].startswith("| shape | file | parser |") and "| mixed-after | .json |" in table
    if os.path.isfile("/proc/stat"):  # the hypervisor's share of CPU time while the row ran, for a noisy VM
        assert 0 <= row["steal_pct"] <= 100


def test_repeated_runs_report_the_fastest_with_every_run_and_fail_if_any_run_is_wrong(tmp_path, monkeypatch):
    """``--repeat``: runs in rounds; a row is the fastest run of its file and parser, lists every run's MB/s, and
    carries the first wrong check of any run (a fast wrong run must not hide behind the best time)."""
    walls = iter([3.0, 2.0, 1.0, 4.0, 1.5, 5.0, 2.5, 0.5])  # per run, in the order the rounds make them
    calls = []

    def fake_run(path, parser, script=None):
        calls.append((path.name, parser))
        wall = next(walls)
        summary = {"sections": {}, "parser": parser + "-skim"}
        if wall == 0.5:  # the fastest run of one file and parser gives wrong statistics
            summary["sections"] = {"step": {"count": 1, "min_s": 0, "mean_s": 0, "median_s": 0, "max_s": 0}}
        return {"summary": summary, "parser": parser, "wall_s": wall, "cpu_s": wall, "maxrss_kb": 1024, "stderr": ""}

    def fake_write(path, size, shape, gz_path):
        path.write_text("[" + " " * (10**6 - 2) + "]")  # 1 MB: MB/s = 1 / wall
        gz_path.write_bytes(gzip.compress(b"[]"))
        return {"sections": {}, "events": 0, "kernels": 0}

    monkeypatch.setattr(bt, "write_trace", fake_write)
    monkeypatch.setattr(bt, "run_summarizer", fake_run)
    rows = bt._bench_shape("mixed-after", tmp_path, 10**6, ["auto", "orjson"], keep=False, repeat=2)
    assert calls[:4] == calls[4:] and len(calls) == 8  # two rounds of every file and parser
    by = {(r["file"], r["parser"]): r for r in rows}
    assert [by[k]["wall_s"] for k in sorted(by)] == [1.5, 2.0, 1.0, 0.5]
    assert by[".json", "auto-skim"]["runs_mb_per_s"] == [round(1 / 3.0, 1), round(1 / 1.5, 1)]
    assert by[".json.gz", "orjson-skim"]["check"].startswith("step") and by[".json", "auto-skim"]["check"] == "ok"
    table = bt.markdown_table(rows)
    assert table.splitlines()[0].endswith("| MB/s of each run |") and "| 0.3, 0.7 |" in table
    assert "version" not in table  # one version: no column for it


def test_a_baseline_copy_is_timed_beside_this_one_on_the_same_files_and_labelled(tmp_path, monkeypatch):
    """``--baseline``: another copy of the summariser runs in its child exactly as this one (a file run as
    __main__), right after it on each file and parser; its rows carry its label and the table gets a version
    column."""
    path = tmp_path / "t.json"
    expected = tf.write_trace(path, SMALL, "mixed-after", ops_scale=SCALE)
    copy = tmp_path / "old" / "summarize_trace.py"
    copy.parent.mkdir()
    copy.write_text(bt.SUMMARIZER.read_text().replace('"parser": ("orjson"', '"parser": "old-" + ("orjson"'))
    run = bt.run_summarizer(path, "auto", copy)
    assert run["summary"]["parser"] == "old-json-skim", run["stderr"]
    assert tr.compare(run["summary"]["sections"], expected["sections"]) == []
    calls = []
    real = bt.run_summarizer

    def recorded(trace, parser, script=None):
        calls.append((trace.name, parser, script))
        return real(trace, parser, script)

    monkeypatch.setattr(bt, "run_summarizer", recorded)
    versions = {"new": bt.SUMMARIZER, "old": copy}
    rows = bt._bench_shape("mixed-after", tmp_path, SMALL, ["auto"], keep=False, repeat=1, versions=versions)
    files = ("mixed-after.json", "mixed-after.json.gz")
    assert [(name, script) for name, _, script in calls] == [(f, v) for f in files for v in versions.values()]
    assert {(r["file"], r["version"], r["parser"], r["check"]) for r in rows} == {
        (f, v, p, "ok") for f in (".json", ".json.gz") for v, p in (("new", "json-skim"), ("old", "old-json-skim"))
    }
    table = bt.markdown_table(rows)
    assert table.splitlines()[0].startswith("| shape | file | parser | version | trace GB |")
    assert "| mixed-after | .json.gz | old-json-skim | old | " in table


def test_kept_large_traces_are_reused_by_a_later_run_of_the_same_size(tmp_path, monkeypatch):
    written = []
    real = tf.write_trace

    def counted(path, size, shape, gz_path):
        written.append(path.name)
        return real(path, size, shape, gz_path=gz_path, ops_scale=SCALE)

    monkeypatch.setattr(bt, "write_trace", counted)
    plain, packed = tmp_path / "cuda-after.json", tmp_path / "cuda-after.json.gz"
    first = bt._large_trace("cuda-after", plain, packed, SMALL, keep=True)
    again = bt._large_trace("cuda-after", plain, packed, SMALL, keep=True)
    assert written == ["cuda-after.json"] and again[0] == first[0] and again[0]["events"] > 0
    bt._large_trace("cuda-after", plain, packed, SMALL + 1, keep=True)  # another size: written again
    packed.write_bytes(packed.read_bytes()[:-10])  # a file cut short (a run stopped while writing it)
    bt._large_trace("cuda-after", plain, packed, SMALL + 1, keep=True)
    assert written == ["cuda-after.json"] * 3


def _events_and_text(tmp_path, shape):
    path = tmp_path / f"{shape}.json"
    expected = tf.write_trace(path, SMALL, shape, ops_scale=SCALE)
    text = path.read_bytes().decode("utf-8")  # line ends as written
    return json.loads(text)["traceEvents"], text, expected


def _marked(event):
    """Whether an event holds what the summariser looks for (a kernel, a launch, a section)."""
    return event.get("cat") == "kernel" or "Launch" in event.get("name", "") or "__sec:" in event.get("name", "")


def test_kineto_shapes_use_libkinetos_own_templates(tmp_path):
    """The text of libkineto/src/output_json.cpp's templates: the current one (``kineto``) one key a line with the
    args field after a line holding only a comma, and the stream-sync row's name in the older template; the one
    before it (``kineto22``) keys sharing lines, metadata and global instants with ``name`` before ``ph``, CUPTI
    metadata whose line breaks were removed."""
    _, k26, _ = _events_and_text(tmp_path, "cuda-window-kineto")
    assert k26.startswith(' {\n    "schemaVersion": 1,\n    "deviceProperties": [{"id": 0, "name": "NVIDIA H100')
    assert '\n  {\n    "ph": "X",\n    "cat": "kernel",\n    "name": "' in k26
    assert re.search(r'\n    "dur": \d+\.\d{3}\n    ,\n    "args": \{\n      "External id": \d+,"queued": 0, ', k26)
    assert '\n    "cat": "ac2g",\n    "name": "ac2g"\n    , "bp": "e"\n  },' in k26
    assert '\n  {\n    "ph": "i",\n    \n    "s": "g",\n    "name": "Iteration Start: PyTorch Profiler",' in k26
    assert '\n  {\n    "ph": "M",\n    "name": "thread_name",\n    "ts": ' in k26
    assert re.search(r'\n  \{\n    "name": "thread_name", "ph": "M", "ts": [\d.]+, "pid": 0, "tid": 1000007,', k26)
    assert k26.endswith('\n  }\n  ],"traceName": "/runs/profiler/__sec:kernel-cudaLaunchKernel.pt.trace.json" }')
    events, k22, _ = _events_and_text(tmp_path, "hip-window-kineto22")
    assert k22.startswith(
        '\n  {\n    "schemaVersion": 1,\n    "deviceProperties": [\n    {\n      "id": 0, "name": "AMD'
    )
    assert re.search(
        r'\n  \{\n    "ph": "X", "cat": "kernel", "name": "[^\n]+", "pid": 0, "tid": \d+,\n    "ts": ', k22
    )
    assert re.search(r'\n    "cat": "ac2g", "name": "ac2g", "bp": "e"\n  },', k22)
    assert re.search(r'\n  \{\n    "name": "process_name", "ph": "M", "ts": [\d.]+, "pid": \d+, "tid": 0,\n', k22)
    assert re.search(r'"External id": \d+,      "kernel": "[^"]+", "cid": 3, "correlation": \d+,      "grid": ', k22)
    assert '\n  ],\n  "distributedInfo": {"backend": "nccl", ' in k22  # a list of objects after the events
    assert all(e["args"]["kernel"] for e in events if e.get("name") in ("hipLaunchKernel", "hipModuleLaunchKernel"))


@pytest.mark.parametrize("shape", ["cuda-window-kineto", "hip-window-kineto22", "mixed-window-jumble"])
def test_rich_shapes_hold_what_real_traces_hold(tmp_path, shape):
    events, _, expected = _events_and_text(tmp_path, shape)
    kernels = [e["name"] for e in events if e.get("cat") == "kernel"]
    assert max(map(len, kernels)) >= 700 and min(map(len, kernels)) < 200
    assert any("{lambda" in n for n in kernels) and any("(anonymous namespace)" in n for n in kernels)
    # kineto's order: the window's CPU trace, then the GPU activities (runtime calls with them), then the names
    first_gpu = next(i for i, e in enumerate(events) if e.get("cat") in ("kernel", "cuda_runtime"))
    assert all(e.get("cat") not in ("cpu_op", "user_annotation") for e in events[first_gpu:])
    assert events[-1]["name"] == "Record Window End"
    assert {e["cat"] for e in events if "cat" in e} >= {"cpu_instant_event", "python_function", "fwdbwd", "Trace"}
    runs, run = [], 0  # the longest stretch without a kernel, a launch or a section
    for event in events:
        run = 0 if _marked(event) else run + 1
        runs.append(run)
    assert max(runs) >= 1000 * SCALE / 0.1
    assert expected["events"] == len(events)


def test_jumble_mixes_layouts_and_odd_strings_in_one_file(tmp_path):
    events, text, _ = _events_and_text(tmp_path, "mixed-window-jumble")
    assert '\n    "dur": ' in text and re.search(r'"tid": \d+,\n    "ts": [\d.]+, "dur": ', text)  # both kinetos
    assert re.search(r'\n\{"ph": "X", "cat": "cpu_op", "name": ', text)  # one line
    assert re.search(r'\{"ph":"X","cat":"', text) and re.search(r'\{"name": "[^"]*", "ph": ', text)
    assert re.search(r'\{"args": \{\n', text) and "\r\n\t" in text
    assert "\\u" in text and '\\"' in text and any(ord(c) > 127 for c in text)  # escapes and raw UTF-8
    names = {e.get("name", "") for e in events}
    assert any("}, {" in n for n in names) and any("[{" in n for n in names)
    assert {} in events  # an empty list element
    assert any(
        "Concrete Inputs" in e.get("args", {}) and isinstance(e["args"]["Concrete Inputs"][0], dict) for e in events
    )  # a list of objects (one written like a kernel) inside an event's args
