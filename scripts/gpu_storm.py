"""Step 2 of the GPU check: a real out-of-memory storm against a real replica.

A ballast leaves about ``leave_bytes`` of device memory free; a replica starts beside it with
its batch caps lifted, so only memory bounds a batch; a burst of long inputs arrives at once.
Then the ballast is freed and single long requests follow, one batch each, until the batch
budget is back where it was when the replica turned ready.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.servers import Replica, start_replica
from server.settings import Settings

from .gpu_common import GIB, Ballast, MetricsSampler, scrape

WORDS = ["memory", "batch", "split", "token", "model", "server", "queue", "latency", "budget"]
MIN_COSINE = {"float32": 0.9999, "float16": 0.999, "bfloat16": 0.999}
GROW_BACK_BATCHES = 40
GROW_BACK_SHARE = 0.95  # of the budget before the burst; free memory moves a little on its own
"""The budget must be back within this many batches once the ballast is gone: after an OOM
the sizer's ceiling climbs by 5% of what warm-up proved per clean batch."""
CAPS = ("--max-batch-size", "4096", "--max-batch-tokens", str(4096 * 256))
HEADROOM = Settings.model_fields["memory_headroom"].default  # the replica runs with it


@dataclass(frozen=True, slots=True)
class StormPlan:
    device: str
    sizer: str
    dtype: str
    """--dtype of the replica; auto is float16 on a GPU, float32 on the CPU."""
    num_long: int
    num_short: int
    inputs_per_request: int
    leave_bytes: int = 2 * GIB
    memory_limit: str | None = None
    """The CPU's stand-in for the ballast: the replica's own --memory-limit."""


def burst_texts(num_long: int, num_short: int, seed: int) -> list[str]:
    """Long inputs (300 words, truncated to the model's 256 tokens) and short ones, shuffled."""
    rng = random.Random(seed)
    long = [" ".join(rng.choice(WORDS) for _ in range(300)) for _ in range(num_long)]
    short = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 20)))
             for _ in range(num_short)]  # fmt: skip
    texts = long + short
    rng.shuffle(texts)
    return texts


def send_burst(url: str, texts: list[str], per_request: int) -> list[httpx.Response | Exception]:
    """Every request at once; a transport error is returned in the response's place."""

    async def main() -> list[httpx.Response | Exception]:
        limits = httpx.Limits(max_connections=512)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
            return await asyncio.gather(*(
                client.post("/v1/infer", json={"inputs": texts[i : i + per_request],
                                               "timeout_s": 300})
                for i in range(0, len(texts), per_request)
            ), return_exceptions=True)  # fmt: skip

    return asyncio.run(main())


def status_of(response: httpx.Response | Exception) -> str:
    if isinstance(response, httpx.Response):
        return str(response.status_code)
    return type(response).__name__


def min_cosine(outputs: list[list[float]], expected: np.ndarray) -> float:
    got = np.asarray(outputs, dtype=np.float64)
    want = np.asarray(expected, dtype=np.float64)
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    return float(cos.min())


def run_storm(plan: StormPlan, texts: list[str], reference: np.ndarray, log_dir: Path) -> dict:
    """One replica through the storm; every figure, and ``passed`` with the reasons."""
    figures: dict[str, Any] = {"plan": asdict(plan) | {"num_inputs": len(texts)}}
    ballast = Ballast(plan.device, plan.leave_bytes)
    figures["ballast_bytes"] = ballast.held_bytes
    figures["free_after_ballast_bytes"] = ballast.free_after_bytes
    figures["nvml_free_before_ballast_bytes"] = ballast.nvml_free_before_bytes
    figures["nvml_free_after_ballast_bytes"] = ballast.nvml_free_after_bytes
    figures["ballast_seen_by_nvml"] = ballast.seen_by_nvml()
    flags = ["--device", plan.device, "--dtype", plan.dtype, "--sizer", plan.sizer, *CAPS,
             "--max-wait-ms", "50", "--max-queue-items", "1000000",
             "--max-inputs-per-request", str(plan.inputs_per_request)]  # fmt: skip
    if plan.memory_limit:
        flags += ["--memory-limit", plan.memory_limit]
    try:
        with start_replica(flags, log_dir=log_dir, ready_timeout_s=240) as replica:
            figures["independent_room_bytes"] = independent_room(plan, ballast, replica)
            figures.update(_storm(replica.url, plan, texts, reference, ballast))
    finally:
        ballast.release()
    figures["checks"] = storm_checks(plan, figures)
    figures["passed"] = all(figures["checks"].values())
    return figures


def independent_room(plan: StormPlan, ballast: Ballast, replica: Replica) -> float | None:
    """What the replica could use at most, as the check measures it itself: on CUDA, NVML's
    free memory before the ballast less the ballast's bytes (the replica's own context and
    weights come out of it too); on the CPU, ``--memory-limit`` less the replica's resident
    memory read from ``/proc`` just after it turned ready, before any request."""
    if plan.device.startswith("cuda"):
        return ballast.room_bytes
    resident = replica.rss_bytes()
    if plan.memory_limit is None or resident is None:
        return None
    return int(plan.memory_limit) - resident


BUDGET_CHECK = "budget at ready within (1 - headroom) x the room the check measured"
NO_OOM_CHECK = "no OOM beside the ballast (adaptive)"


def budget_within_room(budget_bytes: float | None, room_bytes: float | None,
                       slack_bytes: float) -> bool:  # fmt: skip
    """The replica's batch budget against the room read by the check: at most the room less
    the replica's headroom, plus ``slack_bytes`` for what moves between the two readings."""
    if budget_bytes is None or room_bytes is None or room_bytes <= 0:
        return False
    return budget_bytes <= (1 - HEADROOM) * room_bytes + slack_bytes


def budget_slack_bytes(plan: StormPlan) -> float:
    """64 MiB on CUDA, where NVML and the replica's own reading of free memory are two calls
    apart; on the CPU 1% of ``--memory-limit``, for the resident memory that moves between the
    check's reading and the replica's."""
    if plan.device.startswith("cuda") or plan.memory_limit is None:
        return 64 * 2**20
    return 0.01 * int(plan.memory_limit)


def storm_checks(plan: StormPlan, figures: dict[str, Any]) -> dict[str, bool]:
    """What must hold after the storm, from the figures alone."""
    dtype = figures["replica_dtype"]
    cosine = figures["min_cosine_vs_cpu_float32"]
    checks = {
        "no failed request": not figures["failed_requests"],
        f"cosine >= {MIN_COSINE[dtype]} ({dtype})": cosine >= MIN_COSINE[dtype],
        "still ready": figures["ready_after"],
    }
    on_cuda = plan.device.startswith("cuda")
    if on_cuda:
        checks["NVML (read by the check) sees the ballast"] = figures["ballast_seen_by_nvml"]
        # NOTE: on the CPU (the dry run) the budget follows the host's free memory, which
        # other processes move; there the figure is recorded but does not gate the check.
        checks[f"budget back within {GROW_BACK_BATCHES} batches"] = figures["grow_back"]["ok"]
        if plan.dtype == "auto":
            checks["dtype auto is float16 on CUDA"] = dtype == "float16"
    if plan.sizer == "fixed":
        # Lifted fixed caps must run out of memory beside the ballast: the split is the point.
        checks["real OOMs split (fixed caps)"] = figures["oom_splits"] > 0
    else:
        # The adaptive sizer must plan around the ballast, not split after the fact, with a
        # budget that the room measured apart from the replica bears out.
        checks[NO_OOM_CHECK] = figures["oom_splits"] == 0 == figures["oom_failed_items"]
        checks[BUDGET_CHECK] = budget_within_room(
            figures["budget_before_bytes"],
            figures["independent_room_bytes"],
            budget_slack_bytes(plan),
        )
    return checks


def _storm(
    url: str, plan: StormPlan, texts: list[str], reference: np.ndarray, ballast: Ballast
) -> dict[str, Any]:
    # One long input first, so the budget gauge holds the budget before the burst.
    long = max(texts, key=len)
    httpx.post(f"{url}/v1/infer", json={"inputs": [long]}, timeout=300).raise_for_status()
    at_ready = scrape(url)
    started = time.perf_counter()
    with MetricsSampler(url) as sampler:
        responses = send_burst(url, texts, plan.inputs_per_request)
    burst_s = time.perf_counter() - started
    after = scrape(url)
    failed = dict(Counter(status_of(r) for r in responses if status_of(r) != "200"))
    cosine = (
        float("nan")
        if failed
        else min_cosine([out for r in responses for out in r.json()["outputs"]], reference)
    )
    # What the replica said it could use when the burst began (its probes' free memory, torch's
    # own cache included, plus what it held already): recorded beside the check's own room.
    held = (
        "batchfit_torch_reserved_bytes"
        if plan.device.startswith("cuda")
        else "batchfit_host_resident_bytes"
    )
    room = at_ready.get("batchfit_memory_free_bytes", 0.0) + at_ready.get(held, 0.0)
    ready = httpx.get(f"{url}/health/ready", timeout=10).status_code == 200
    dtype = httpx.get(f"{url}/v1/models", timeout=10).json()["models"][0]["dtype"]
    figures: dict[str, Any] = {
        "burst_s": burst_s,
        "requests": len(responses),
        "failed_requests": failed,
        "oom_splits": after.get('batchfit_oom_events_total{outcome="split"}', 0.0),
        "oom_failed_items": after.get('batchfit_oom_events_total{outcome="failed"}', 0.0),
        "batches": after.get("batchfit_batch_size_count", 0.0)
        - at_ready.get("batchfit_batch_size_count", 0.0),
        "budget_before_bytes": at_ready.get("batchfit_batch_budget_bytes"),
        "budget_low_bytes": sampler.low.get("batchfit_batch_budget_bytes"),
        "room_at_ready_bytes": room,
        "held_peak_bytes": sampler.high.get(held, 0.0),
        "measured_batch_peak_high_bytes": sampler.high.get("batchfit_batch_measured_peak_bytes"),
        "min_cosine_vs_cpu_float32": cosine,
        "ready_after": ready,
        "replica_dtype": dtype,
        "metric_scrapes": sampler.num_scrapes,
    }
    ballast.release()
    figures["grow_back"] = _grow_back(url, texts, plan, figures["budget_before_bytes"])
    return figures


def _grow_back(url: str, texts: list[str], plan: StormPlan, target: float | None) -> dict:
    """Single requests of long inputs, one batch each, until the budget reaches ``target``."""
    if plan.sizer == "fixed" or not target:
        return {"ok": True, "batches": 0, "note": "no memory budget (fixed sizer)"}
    long = sorted(texts, key=len)[-plan.inputs_per_request :]
    # On the CPU the figure does not gate the check (see storm_checks): a few batches prove
    # the path; 45 cost the dry run 20 s.
    attempts = GROW_BACK_BATCHES + 5 if plan.device.startswith("cuda") else 3
    budgets = []
    with httpx.Client(base_url=url, timeout=300) as client:
        for _ in range(attempts):
            values = scrape(url)
            budgets.append(values.get("batchfit_batch_budget_bytes", 0.0))
            if budgets[-1] >= GROW_BACK_SHARE * target:
                break
            client.post("/v1/infer", json={"inputs": long}).raise_for_status()
    batches = len(budgets) - 1
    return {
        "ok": budgets[-1] >= GROW_BACK_SHARE * target and batches <= GROW_BACK_BATCHES,
        "batches": batches,
        "target_bytes": target,
        "budgets_bytes": budgets,
    }
