"""``batchfit bench --generate --memory-limit --quick`` end to end on a tiny random-weight
causal LM: real replicas in real memory cgroups (a sibling taking 200 MiB of one halfway),
transformers' continuous batching at its defaults beside them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cgroups import child_cgroup
from tests.generators import tiny_llama

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parent.parent.parent
MiB = 2**20


def test_the_memory_phase_reports_each_peer_under_the_limit(tmp_path):
    with child_cgroup("probe"):  # fails under CI where none can be made, else skips
        pass
    folder, _ = tiny_llama(tmp_path / "tiny-lm")
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "batchfit", "bench", "--generate", "--memory-limit", "--quick",
         "--peers", "batchfit,transformers", "--model", str(folder), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=800, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads((out / "memory.json").read_text())
    runs = {(r["peer"], r["case"]): r for r in figures["runs"]}
    cases = ("no limit", "limit", "limit + sibling")
    assert set(runs) == {("batchfit", c) for c in cases} | {("transformers", c) for c in cases[1:]}
    for case in cases:
        run = runs["batchfit", case]
        assert (run["finished"], run["failed"], run["killed"]) == (8, 0, 0), run
        assert run["output_tokens_per_s"] > 0
        # Its own counters, read before and after the run.
        assert run["preempted"] >= 0 and run["resumed"] >= 0, run
    for case in cases[1:]:
        limit = runs["batchfit", case]["limit_bytes"]
        assert 0 < runs["batchfit", case]["peak_bytes"] <= limit
        # transformers runs at batchfit's limit (each start of batchfit measures its own);
        # whatever befalls it is counted.
        run = runs["transformers", case]
        assert abs(run["limit_bytes"] - limit) < 64 * MiB and run["finished"] + run["failed"] == 8
    # The sibling's 200 MiB show in the peak.
    assert runs["batchfit", "limit + sibling"]["peak_bytes"] >= 200 * MiB
    assert "| batchfit | limit + sibling |" in (out / "memory.md").read_text()
