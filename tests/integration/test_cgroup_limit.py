"""The real server inside its own memory cgroup, under a real kernel limit.

Under a cgroup limit there is no allocation error to catch: the kernel kills the process. Each
test makes a child of this process's memory cgroup, starts the replica inside it and removes
it afterwards. A burst (``bench.cgroup_limit``'s) is requests of 8 inputs, 7 at the 256-token
maximum and 1 short, with the item caps lifted, so memory alone decides batch sizes: 16
requests to one model put 112 long inputs in its queue at once, twice what the room holds.
"""

from __future__ import annotations

import time

import httpx
import pytest

from bench.cgroup_limit import (
    CAPS,
    LOOSE_LIMIT,
    burst_requests,
    histogram,
    scrape_value,
    send_burst,
)
from models.spec import BUNDLED_MODEL
from tests.cgroups import ChildCgroup, child_cgroup
from tests.reference import cosine, reference_embeddings
from tests.servers import ServerProcess, run_server

pytestmark = pytest.mark.integration

MiB = 2**20
LOADED_USAGE: list[int] = []  # a loaded, warmed-up replica's cgroup usage, once measured
BURST_REQUESTS = 16  # per model


def check_answers(requests, responses) -> None:
    statuses = [getattr(r, "status_code", repr(r)) for r in responses]
    assert statuses == [200] * len(requests), statuses
    texts = sorted({text for inputs in requests for text in inputs})
    expected = dict(zip(texts, reference_embeddings(texts), strict=True))
    worst = min(
        cosine(output, expected[text])
        for inputs, response in zip(requests, responses, strict=True)
        for text, output in zip(inputs, response.json()["outputs"], strict=True)
    )
    assert worst >= 0.9999, worst


def serve_burst_under(
    cgroup: ChildCgroup,
    server: ServerProcess,
    limit: int,
    label: str,
    models: tuple[str | None, ...] = (None,),
) -> None:
    """Send the burst, ``BURST_REQUESTS`` to each model (request i to
    ``models[i % len(models)]``); the replica must live through it, answer right and stay
    under ``limit``."""
    requests = burst_requests(count=BURST_REQUESTS * len(models))
    started = time.perf_counter()
    responses = send_burst(server.url, requests, models)
    elapsed = time.perf_counter() - started
    peak, kills, alive = cgroup.peak(), cgroup.oom_kills(), server.process.poll() is None
    print(
        f"\n{label}: limit {limit / MiB:.0f} MiB, cgroup peak {peak / MiB:.0f} MiB, "
        f"oom_kill {kills}, limit hits {cgroup.limit_hits()}, {elapsed:.1f}s "
        f"({8 * len(requests) / elapsed:.1f} inputs/s)"
    )
    assert alive and kills == 0, f"killed (oom_kill {kills}):\n{server.log()[-4000:]}"
    check_answers(requests, responses)
    # Strictly below: the kernel never had to reclaim to hold the limit.
    assert peak < limit, (peak, limit)
    scrape = httpx.get(f"{server.url}/metrics").text
    assert scrape_value(scrape, "batchfit_oom_events_total", 'outcome="split"') == 0
    assert scrape_value(scrape, "batchfit_oom_events_total", 'outcome="failed"') == 0
    assert scrape_value(scrape, "batchfit_memory_limit_bytes", 'source="cgroup"') == limit
    # Memory decided: each model had 128 inputs waiting at once, yet no batch held more than 64.
    count = scrape_value(scrape, "batchfit_batch_size_count")
    sizes = histogram(scrape, "batchfit_batch_size")  # served batches only, not warm-up
    print(f"{count:.0f} batches, cumulative by size {sizes}")
    assert count and sizes[64.0] == count, sizes


def test_a_limit_set_on_a_running_replica_binds_from_the_next_batch(tmp_path):
    with child_cgroup("running") as cgroup:
        # Loose enough that the limit set once it runs binds tighter; warm-up plans within
        # it (each of its full batches fills the room: about 5 s of CPU each at 900 MiB).
        cgroup.set_limit(LOOSE_LIMIT - 200 * MiB)
        with run_server(tmp_path, *CAPS, preexec=cgroup.join) as server:
            assert cgroup.pids() == [server.process.pid]
            usage = cgroup.usage()
            LOADED_USAGE.append(usage)
            limit = usage + 250 * MiB
            cgroup.set_limit(limit)
            cgroup.reset_peak()
            serve_burst_under(cgroup, server, limit, "limit set while running")


def loaded_usage(tmp_path) -> int:
    """A loaded, warmed-up replica of the bundled model's cgroup usage (measured once)."""
    if not LOADED_USAGE:
        with child_cgroup("measure") as cgroup:
            cgroup.set_limit(LOOSE_LIMIT)
            with run_server(tmp_path, *CAPS, preexec=cgroup.join):
                LOADED_USAGE.append(cgroup.usage())
    return LOADED_USAGE[0]


def test_two_models_started_under_a_tight_limit_warm_up_within_it_and_share_it(tmp_path):
    """Both models' weights count against one cgroup limit, tight from the start: both warm
    up within it, and under a tighter one set while they run each batch is sized against
    what is free then, whichever model it runs."""
    models = (f"a={BUNDLED_MODEL}", f"b={BUNDLED_MODEL}")
    # Tight from the start, the second model's weights (87 MiB) included: both warm up
    # within it (and quicker than under a loose limit, where each warm-up took 21 s).
    start_limit = loaded_usage(tmp_path) + 100 * MiB + 300 * MiB
    with child_cgroup("two-models") as cgroup:
        cgroup.set_limit(start_limit)
        flags = [flag for model in models for flag in ("--model", model)]
        with run_server(tmp_path, *flags, *CAPS, preexec=cgroup.join) as server:
            assert f"memory limit: {start_limit / MiB:.0f} MiB (cgroup {cgroup.path})" in (
                server.log()
            )
            assert all(f"warming up model {name}" in server.log() for name in ("a", "b"))
            limit = cgroup.usage() + 250 * MiB
            cgroup.set_limit(limit)
            cgroup.reset_peak()
            serve_burst_under(cgroup, server, limit, "two models, one limit", ("a", "b"))
            scrape = httpx.get(f"{server.url}/metrics").text
            for name in ("a", "b"):  # the burst reached both
                assert scrape_value(scrape, "batchfit_inputs_total", f'model="{name}"') == (
                    8 * BURST_REQUESTS
                )


def test_the_same_burst_without_the_memory_term_is_killed_by_the_kernel(tmp_path):
    """The burst must be too big for the room, or the two tests above prove nothing: fixed
    batches under the same limit get the replica OOM-killed. (128 items: with the caps lifted
    further, the fixed sizer's warm-up alone would run 1024 x 256 tokens, minutes of CPU.)"""
    with child_cgroup("fixed") as cgroup:
        cgroup.set_limit(LOOSE_LIMIT + 300 * MiB)  # room for its 128 x 256 warm-up batch
        flags = ("--sizer", "fixed", "--max-batch-size", "128", "--max-batch-tokens", "40000")
        with run_server(tmp_path, *flags, "--max-wait-ms", "50", preexec=cgroup.join) as server:
            cgroup.set_limit(cgroup.usage() + 250 * MiB)
            responses = send_burst(server.url, burst_requests(count=BURST_REQUESTS))
            server.process.wait(30)
            assert server.process.returncode == -9, server.log()[-4000:]
            assert cgroup.oom_kills() >= 1
            assert any(not isinstance(r, httpx.Response) for r in responses)
