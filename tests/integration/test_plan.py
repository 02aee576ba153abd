import re
import subprocess
import sys

import pytest

from tests.servers import ROOT

pytestmark = pytest.mark.integration


def test_plan_prints_the_memory_plan_for_the_bundled_model():
    result = subprocess.run(
        [sys.executable, "-m", "server", "plan", "--memory-limit", "700MiB"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "parameters   22,713,216 (86.6 MiB)" in out
    assert "outputs      embed: mean pooling, normalised, 384 dims" in out
    assert re.search(r"after calibration\s+alpha [\d,]+ B/token", out)
    assert "memory limit 700 MiB (flag --memory-limit)" in out
    budget = re.search(r"budget\s+([\d,.]+) MiB per batch", out)
    assert budget and 0 < float(budget.group(1).replace(",", "")) < 700
    rows = re.findall(r"^\s+(\d+)\s+[\d.]+ MiB\s+[\d.]+ MiB\s+[\d.]+ MiB\s+(\d+)$", out, re.M)
    assert [int(length) for length, _ in rows] == [16, 32, 64, 128, 256]
    fits = [int(n) for _, n in rows]
    assert fits == sorted(fits, reverse=True) and fits[-1] >= 1


def test_plan_prints_a_generators_cache_plan(tmp_path):
    from tests.generators import tiny_generator

    folder = tiny_generator(tmp_path, "llama")
    result = subprocess.run(
        [sys.executable, "-m", "server", "plan", "--model", str(folder), "--memory-limit",
         "700MiB"], cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "model        llama (generate) on cpu, float32" in out
    # 2 layers x keys and values x 2 key/value heads x 16 wide x 4 bytes
    assert "cache        512 bytes a token" in out
    room = re.search(r"room\s+([\d,.]+) MiB for the cache now: ([\d,]+) tokens", out)
    assert room
    mib, tokens = (float(group.replace(",", "")) for group in room.groups())
    assert 0 < mib < 700 and abs(tokens * 512 / 2**20 - mib) < 0.1
