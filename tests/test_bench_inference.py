"""The CPU inference benchmark runs the inference config per case and backend and prints a row for each with numbers
that add up (the ONNX Runtime rows are measured for docs/performance.md; here a small network and case keep it to
seconds, with PyTorch, whose network needs no export)."""

from __future__ import annotations

from benchmarks.bench_inference import format_report, main, window_gflop


def test_the_benchmark_prints_a_row_per_case_and_backend(tmp_path, monkeypatch):
    """Each run is the child's function, called here in this process (the child process only isolates its RSS). What
    it prints goes to a buffer of this test's own, not to pytest's capsys: the workflow's logging set-up (and torch's,
    when it first logs) binds handlers to the stdout of the moment, and capsys closes its stream when the test ends,
    under the handlers the next test logs through ("I/O operation on closed file")."""
    import contextlib
    import io
    import json

    import benchmarks.bench_inference as bench

    printed = io.StringIO()  # left open: handlers bound to it stay harmless

    def in_this_process(inputs, out, weights, backend, threads, network) -> dict:
        start = printed.tell()
        bench.infer(str(inputs), str(out), str(weights), backend, str(threads or ""), json.dumps(network))
        return json.loads(printed.getvalue()[start:].strip().splitlines()[-1])

    monkeypatch.setattr(bench, "_child", in_this_process)
    with contextlib.redirect_stdout(printed):
        report = main(cases="tiny", backends="torch", regions="body,thorax", feature_size=12, roi_size=(64, 64, 32),
                      spacing=(4.0, 4.0, 9.0), output_dir=str(tmp_path))  # fmt: skip
    body, thorax = report["rows"]
    assert (body["region"], thorax["region"]) == ("body", "thorax") and body["vs_torch"] == thorax["vs_torch"] == 1.0
    for row in (body, thorax):
        assert 0 < row["network_s"] <= row["s_per_case"] and row["windows"] >= 1 and row["peak_rss_mb"] > 100
        assert row["gflop_per_s"] > 0 and row["stage_seconds"]["predict"] > 0
    assert thorax["method"] == "thorax" and thorax["holds_tumour"] is True
    assert thorax["windows"] < body["windows"] == body["windows_whole_input"], "the arms and abdomen are left out"
    agreement = report["agreement"]["tiny"]  # random weights: the windows' placement changes their output
    assert agreement["backends"] is None and 0.5 < agreement["regions_in_box"] <= 1.0
    from scripts.inference.int8 import GUARD

    assert GUARD["agreement"] == 0.99 and GUARD["tumour_dice"] == 0.99, "int8's guard is the product's again after it"
    assert "| tiny (128x128x40) | torch | thorax |" in printed.getvalue()
    assert (tmp_path / "out" / "tiny_torch_thorax" / "P1" / "P1_seg.nii.gz").is_file()


def test_the_flops_of_a_window_are_counted_and_the_table_compares_the_regions():
    import benchmarks.bench_inference as bench

    assert 6.5 < window_gflop(12, (64, 64, 32)) < 7.8, "the demo's window (f48 on 96^3, measured: 636 GFLOP)"
    stages = {"read": 9.0, "preprocess": 4.0, "region": 0.4, "predict": 180.0, "postprocess": 5.0, "write": 1.0}
    rows = [{"case": "chest", "shape": "512x512x120", "backend": "onnxruntime", "region": region, "s_per_case": s,
             "network_s": s - 20, "windows": w, "windows_whole_input": 56, "gflop_per_s": 140, "peak_rss_mb": 3000,
             "stage_seconds": stages, "network_setup_s": 1.0, "holds_tumour": holds}
            for region, s, w, holds in (("body", 380.0, 56, None), ("thorax", 210.0, 30, True))]  # fmt: skip
    bench._relative(rows)
    table = format_report({"cpus": 2, "feature_size": 48, "roi_size": [96, 96, 96], "gflop_per_window": 636.0,
                           "rows": rows, "agreement": {"chest": {"backends": 0.9999}}})  # fmt: skip
    assert ("| chest (512x512x120) | onnxruntime | thorax | 210.0 | 9.0 | 4.0 | 0.4 | 180.0 | 5.0 | 1.0 | 190.0 | "
            "30 of 56 | 140 | 3000 | 0.55x |  | yes |") in table  # fmt: skip
    assert "chest: the backends' label maps agree on 99.990 % of voxels" in table
