"""The CPU inference benchmark runs the inference config per case and backend and prints a row for each with numbers
that add up (the ONNX Runtime rows are measured for docs/performance.md; here a small network and case keep it to
seconds, with PyTorch, whose network needs no export)."""

from __future__ import annotations

from benchmarks.bench_inference import format_report, main, window_gflop


def test_the_benchmark_prints_a_row_per_case_and_backend(tmp_path, capsys, monkeypatch):
    """Each run is the child's function, called here in this process (the child process only isolates its RSS)."""
    import json

    import benchmarks.bench_inference as bench

    def in_this_process(inputs, out, weights, backend, threads, network) -> dict:
        bench.infer(str(inputs), str(out), str(weights), backend, str(threads or ""), json.dumps(network))
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    monkeypatch.setattr(bench, "_child", in_this_process)
    report = main(cases="tiny", backends="torch", feature_size=12, roi_size=(64, 64, 32), output_dir=str(tmp_path))
    (row,) = report["rows"]
    assert row["case"] == "tiny" and row["backend"] == "torch" and row["vs_torch"] == 1.0
    assert 0 < row["network_s"] <= row["s_per_case"] and row["windows"] >= 1 and row["peak_rss_mb"] > 100
    assert row["gflop_per_s"] > 0 and report["agreement"] == {"tiny": None}
    assert "| tiny (64x64x24) | torch |" in capsys.readouterr().out
    assert (tmp_path / "out" / "tiny_torch" / "P1" / "P1_seg.nii.gz").is_file()


def test_the_flops_of_a_window_are_counted_and_the_table_names_the_slower_backend():
    assert 6.5 < window_gflop(12, (64, 64, 32)) < 7.8, "the demo's window (f48 on 96^3, measured: 636 GFLOP)"
    rows = [{"case": "chest", "shape": "512x512x120", "backend": b, "s_per_case": s, "network_s": s - 10, "windows": 32,
             "gflop_per_s": 80, "peak_rss_mb": 3000, "vs_torch": v, "network_setup_s": 1.0}
            for b, s, v in (("torch", 330.0, 1.0), ("onnxruntime", 200.0, 0.61))]  # fmt: skip
    table = format_report({"cpus": 2, "feature_size": 48, "roi_size": [96, 96, 96], "gflop_per_window": 636.0,
                           "rows": rows, "agreement": {"chest": 0.9999}})  # fmt: skip
    assert "| chest (512x512x120) | onnxruntime | 200.0 | 190.0 | 32 | 80 | 3000 | 0.61x |" in table
    assert "chest: label maps agree on 99.990 % of voxels" in table
