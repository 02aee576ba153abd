"""The GPU check's summary: a step that failed or a run that broke is shown, never hidden."""

from __future__ import annotations

import json

from scripts.gpu_check import guarded, summary
from scripts.gpu_common import write_json
from scripts.gpu_throughput import ThroughputPlan


def broken_run(plan):
    raise RuntimeError("CUDA error: device lost")


def test_a_broken_run_is_recorded_and_the_check_fails(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    plan = ThroughputPlan("BERT-large float16", "cuda", "/tmp/big", "float16", 400, 64)
    run = guarded(broken_run, plan)
    assert run["passed"] is False and "device lost" in run["error"]
    write_json(work / "throughput.json", {"runs": [run]})
    write_json(work / "machine.json", {"device": "cuda", "name": "NVIDIA H200"})
    passed = summary(work, out, {"tests": 0, "storm": 0, "throughput": 1}, False, "cuda")
    assert passed is False
    results = json.loads((out / "results.json").read_text())
    assert results["passed"] is False and results["storm"] is None
    text = (out / "summary.md").read_text()
    assert "| throughput | FAILED (1) |" in text and "| tests | passed |" in text
    assert "throughput (BERT-large float16): RuntimeError: CUDA error: device lost" in text
    assert "NVIDIA H200" in text and "dry run" not in text


def test_a_missing_step_status_counts_as_failed(tmp_path):
    assert summary(tmp_path, tmp_path / "out", {"tests": 0, "storm": 0}, True, "cpu") is False
    assert "| throughput | FAILED (None) |" in (tmp_path / "out" / "summary.md").read_text()
