"""The GPU check's dry run: every step of scripts/gpu_check.sh on the CPU, as CI can run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_the_dry_run_passes_and_writes_every_figure(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        [str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--out", str(out)],
        env={**os.environ, "PYTHON": sys.executable}, cwd=tmp_path,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    log = (out / "check.log").read_text() if (out / "check.log").exists() else done.stdout
    assert done.returncode == 0, log[-6000:]
    assert sorted(p.name for p in out.iterdir()) == [
        "check.log", "logs.tar.gz", "results.json", "summary.md",
    ]  # fmt: skip
    results = json.loads((out / "results.json").read_text())
    assert results["passed"] and results["dry_run"]
    assert results["exit_status"] == {"tests": 0, "storm": 0, "throughput": 0, "workers": 0}
    assert results["machine"]["device"] == "cpu"
    assert len(results["tests"]) == 4
    peaks = results["tests"]["test_measured_peaks_agree_with_the_sizers_prediction"]
    assert any(name.endswith("_predicted_over_measured") for name in peaks)
    (storm,) = results["storm"]["runs"]
    assert all(storm["checks"].values()) and storm["replica_dtype"] == "float32"
    assert storm["min_cosine_vs_cpu_float32"] >= 0.9999
    assert storm["held_peak_bytes"] > 0 and storm["budget_before_bytes"] > 0
    runs = results["throughput"]["runs"]
    assert [run["plan"]["label"] for run in runs] == ["MiniLM float32"]
    for run in runs:
        assert run["replica"]["num_inputs"] > 0 and run["limit"]["inputs_per_s"] > 0
        assert run["vs_limit"] > 0 and run["memory"]["budget_low_bytes"] > 0
    workers = results["workers"]["runs"]
    assert [run["plan"]["api_workers"] for run in workers] == [2]
    for run in workers:
        assert run["passed"] and run["replica"]["num_requests"] > 0, run
    summary = (out / "summary.md").read_text()
    assert "dry run on the CPU" in summary and "| storm | passed |" in summary
    assert "| MiniLM float32 |" in summary and "| adaptive | float32 | 32 | 0 |" in summary
    assert "| no-op | 2 |" in summary


def test_without_wheels_the_real_check_stops_at_once(tmp_path):
    bare = tmp_path / "checkout"
    (bare / "scripts").mkdir(parents=True)
    script = bare / "scripts" / "gpu_check.sh"
    script.write_text((ROOT / "scripts" / "gpu_check.sh").read_text())
    script.chmod(0o755)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    done = subprocess.run(
        [str(script), "--out", str(tmp_path / "out")], capture_output=True, text=True,
        timeout=60, env={**os.environ, "TMPDIR": str(scratch)},
    )  # fmt: skip
    assert done.returncode == 2
    assert "make gpu-wheels" in (tmp_path / "out" / "check.log").read_text()
    assert not list(scratch.iterdir()), "the check left its work folder behind"
