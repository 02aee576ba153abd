"""``python -m bench.engine``: the bundled model's runtime driven without HTTP, its batches
recorded and replayed through plain calls."""

from __future__ import annotations

import pytest

from bench.engine import EngineRun, after_the_run, describe, drive
from bench.workload import WorkloadSpec, make_requests
from server.runtime.threads import MAX_SIDE_PASSES


def test_mean_batch_and_padding_come_from_the_recorded_batches():
    run = EngineRun(4, 2.0, 10, [[5, 5, 10], [8]], cpus=1.5, forward_s=1.6)
    assert run.inputs_per_s == 5.0
    assert run.mean_batch == 2.0
    assert run.padding == pytest.approx((3 * 10 + 8) / 28)
    text = describe(run, limit=10.0, replayed=8.0)
    assert "5.0 inputs/s" in text and "0.50 of it" in text and "0.62 of it" in text
    assert (
        "forward passes 80% of the time (side by side: summed), 2.5 inputs per second of pass"
        in text
    )


async def test_clients_batch_together_and_every_recorded_batch_replays():
    requests = make_requests(WorkloadSpec(), 64)
    run, batches = await drive(8, duration_s=1.5, warm_up_s=0.5, requests=requests)
    # Passes side by side (at most MAX_SIDE_PASSES at once) each count their own time.
    assert run.inputs > 0 and run.cpus > 0 and 0 < run.forward_s <= run.wall_s * MAX_SIDE_PASSES
    assert len(batches) == len(run.batch_lengths) > 0
    assert [[item.cost for item in b] for b in batches] == run.batch_lengths
    # Eight clients that wait while a pass runs: their inputs share passes.
    assert run.mean_batch > 1
    assert run.padding >= 1
    # Every input answered in the window ran in a recorded batch (requests that straddle
    # the window's edges may add a few more recorded ones).
    assert sum(len(b) for b in batches) >= run.inputs - max(len(r) for r in requests) * 8
    replayed, limit = after_the_run(batches[:6], requests, limit=False, rounds=1)
    assert replayed is not None and replayed > 0 and limit is None
