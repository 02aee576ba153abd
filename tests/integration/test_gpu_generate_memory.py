"""The GPU check's generation-under-pressure step, dry run: scripts/gpu_check.sh
--generate-memory on the CPU (the tiny Gemma, 8 streams, a second process taking 200 MiB of
RAM a quarter of the way through the second run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]


def test_the_dry_run_of_the_memory_step_passes_and_writes_its_figures(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        [str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--generate-memory", "--out",
         str(out)],
        env={**os.environ, "PYTHON": sys.executable}, cwd=tmp_path,
        capture_output=True, text=True, timeout=560,
    )  # fmt: skip
    log = (out / "check.log").read_text() if (out / "check.log").exists() else done.stdout
    assert done.returncode == 0, log[-6000:]
    results = json.loads((out / "results.json").read_text())
    assert results["passed"] and results["exit_status"] == {"generate-memory": 0}
    figures = results["generate_memory"]
    assert figures["replica_alive"] and figures["streams"] == 8
    for label in ("alone", "with_second_process"):
        assert (figures[label]["finished"], figures[label]["failed"]) == (8, 0), figures
        assert figures[label]["output_tokens_per_s"] > 0
    assert figures["second_process"] == [f"took {200 * 2**20} bytes"]
    assert "batchfit_generation_preemptions_total" in figures["counters"]
    summary = (out / "summary.md").read_text()
    assert "## 6. Generation while a second process takes device memory" in summary
    assert "| with second process | 8 | 0 |" in summary
