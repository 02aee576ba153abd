"""`batchfit bench --quick` end to end: real replicas, the real model, a real report."""

import json
import os
import subprocess
import sys

import pytest

from bench.loadgen import IN_TURN
from tests.servers import ROOT

pytestmark = pytest.mark.integration


@pytest.mark.timeout(480)
def test_quick_bench_writes_the_report(tmp_path):
    out = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, "-m", "batchfit", "bench", "--quick", "--rates", "8", "--duration-s", "1",
         "--overhead-duration-s", "1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=450,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    figures = json.loads((out / "results.json").read_text())
    assert figures["limit"]["inputs_per_s"] > 0
    # Both plans of ideal batches ran; the faster one is the limit.
    assert figures["limit"]["plan"] in ("largest batches", "cheapest split")
    assert 0 < figures["limit"]["other_plan_inputs_per_s"] <= figures["limit"]["inputs_per_s"]
    # Measured again just before each configuration's highest load level.
    assert set(figures["limit_before_top"]) == {"off", "adaptive"}
    assert set(figures["batch1_p50_s"]) == {"off", "adaptive"}
    assert all(p50 > 0 for p50 in figures["batch1_p50_s"].values())
    rows = {(s["config"], s["load"]): s for s in figures["summaries"]}
    loads = ("c=1", "c=8", "r=8/s")
    assert set(rows) == {(c, load) for c in ("off", "adaptive") for load in loads}
    for (_, load), row in rows.items():
        assert row["errors"] == {}
        # Closed loop sends every request; open loop whatever the seeded arrivals hold.
        assert row["num_requests"] == 24 if load.startswith("c=") else row["num_requests"] > 0
        assert row["inputs_per_s"] > 0 and row["p99_s"] >= row["p50_s"] > 0
        assert row["peak_rss_bytes"] > 100 * 2**20
    # Batching off means one item per forward pass, read from the server's own metrics.
    assert rows[("off", "c=8")]["mean_batch_size"] == 1.0
    assert rows[("adaptive", "c=8")]["mean_batch_size"] > 1.0
    # A smoke test: its figures are not set against the targets.
    assert figures["options"]["quick"] is True and figures["targets"] == []
    # The limit runs on torch's default thread count: every CPU the bench may use.
    threads = figures["limit"]["num_threads"]
    assert threads == len(os.sched_getaffinity(0))
    # The no-op model's levels under wrk, beside the bare stack's: the server's own CPU per
    # request, every request answered.
    overhead = {row["load"]: row for row in figures["overhead"]}
    bare = {row["load"]: row for row in figures["bare"]}
    assert set(overhead) == set(bare) == {"c=1", "c=32"}
    for row in [*overhead.values(), *bare.values()]:
        assert row["client"] == "wrk" and row["errors"] == {} and row["num_requests"] > 0
        assert 0 < row["cpu_ms_per_input"] < 50 and row["mean_s"] > 0
    # The no-batching server: one client of each kind sending every request to it and to
    # adaptive in turn, and the highest level; adaptive's highest level again with httpx.
    assert {(r["load"], r["client"]) for r in figures["no_batching"]} == {
        (IN_TURN, "aiohttp"), (IN_TURN, "httpx"), ("c=8", "aiohttp")
    }  # fmt: skip
    beside = figures["beside_no_batching"]
    assert {(r["config"], r["load"], r["client"]) for r in beside} == {
        ("adaptive", IN_TURN, "aiohttp"), ("adaptive", IN_TURN, "httpx")
    }  # fmt: skip
    in_turn = [r for r in figures["no_batching"] if r["load"] == IN_TURN]
    assert [r["num_requests"] for r in beside] == [r["num_requests"] for r in in_turn]
    assert {(r["load"], r["client"]) for r in figures["other_clients"]} == {("c=8", "httpx")}
    every = [*figures["no_batching"], *beside, *figures["other_clients"]]
    assert all(r["errors"] == {} and r["num_requests"] > 0 for r in every)
    report = (out / "report.md").read_text()
    assert f"| limit | in-process, {threads} threads, {figures['limit']['plan']} |" in report
    assert "## Server overhead" in report and "| bare stack | c=32 |" in report
    assert "## Against a server without batching, and with another client" in report
    assert "| adaptive | c=8 |" in report
    for png in ("throughput_vs_p99.png", "timeline.png"):
        assert (out / png).read_bytes().startswith(b"\x89PNG")
    assert "a smoke test" in report and "| target | measured |" not in report
    assert "not comparable with the targets" in done.stdout
    assert "saturation throughput vs in-process limit" not in done.stdout
