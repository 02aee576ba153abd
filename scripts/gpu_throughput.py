"""Step 3 of the GPU check: throughput of a replica against the in-process limit.

A short ``batchfit bench``: the same seeded workload through ideal in-process batches (the
limit, ``bench.limit.measure_limit``) and then through a real replica at one closed-loop load
level, with the batch sizes the replica chose and the memory it used against its budget.
"""

from __future__ import annotations

import asyncio
import gc
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.limit import measure_limit
from bench.loadgen import closed_loop
from bench.plain import load_plain_encoder
from bench.servers import start_replica
from bench.stats import parse_scrape, summarize
from bench.workload import WorkloadSpec, make_requests

from .gpu_common import MetricsSampler


@dataclass(frozen=True, slots=True)
class ThroughputPlan:
    label: str
    device: str
    model: str
    dtype: str
    num_requests: int
    concurrency: int
    max_batch_size: int = 256
    max_batch_tokens: int = 32768
    memory_limit: str | None = None


def run_throughput(plan: ThroughputPlan, log_dir: Path) -> dict[str, Any]:
    import torch

    spec = WorkloadSpec(seed=0)
    requests = make_requests(spec, plan.num_requests)
    texts = [text for request in requests for text in request]
    on_cuda = plan.device.startswith("cuda")
    model = load_plain_encoder(plan.model, device=plan.device, dtype=plan.dtype)
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(plan.device)
    limit = measure_limit(model, texts, max_items=plan.max_batch_size,
                          max_tokens=plan.max_batch_tokens)  # fmt: skip
    figures: dict[str, Any] = {
        "plan": asdict(plan),
        "model_info": {"dtype": model.dtype, "parameters": model.num_parameters},
        "limit": asdict(limit),
        "limit_peak_allocated_bytes": (
            torch.cuda.max_memory_allocated(plan.device) if on_cuda else None
        ),
    }
    del model
    gc.collect()
    if on_cuda:
        torch.cuda.empty_cache()  # leave the device to the replica
    flags = ["--device", plan.device, "--model", plan.model, "--dtype", plan.dtype,
             "--max-batch-size", str(plan.max_batch_size),
             "--max-batch-tokens", str(plan.max_batch_tokens),
             "--max-queue-items", "100000"]  # fmt: skip
    if plan.memory_limit:
        flags += ["--memory-limit", plan.memory_limit]
    with start_replica(flags, log_dir=log_dir, ready_timeout_s=300) as replica:
        warm = requests[: min(len(requests), 4 * plan.concurrency)]
        asyncio.run(closed_loop(replica.url, warm, concurrency=plan.concurrency,
                                max_duration_s=60))  # fmt: skip
        before = parse_scrape(httpx.get(f"{replica.url}/metrics", timeout=10).text)
        with MetricsSampler(replica.url, every_s=0.1) as sampler:
            run = asyncio.run(closed_loop(replica.url, requests, concurrency=plan.concurrency,
                                          max_duration_s=120))  # fmt: skip
        after = parse_scrape(httpx.get(f"{replica.url}/metrics", timeout=10).text)
        info = httpx.get(f"{replica.url}/v1/models", timeout=10).json()["models"][0]
    summary = summarize(plan.label, f"c={plan.concurrency}", run.outcomes, run.wall_s,
                        metrics_before=before, metrics_after=after)  # fmt: skip
    budget_low = sampler.low.get("batchfit_batch_budget_bytes")
    peak_high = sampler.high.get("batchfit_batch_measured_peak_bytes")
    figures.update(
        replica=asdict(summary),
        replica_dtype=info["dtype"],
        vs_limit=summary.inputs_per_s / limit.inputs_per_s,
        memory={
            "budget_low_bytes": budget_low,
            "budget_high_bytes": sampler.high.get("batchfit_batch_budget_bytes"),
            "measured_batch_peak_high_bytes": peak_high,
            "predicted_batch_peak_high_bytes": sampler.high.get(
                "batchfit_batch_predicted_peak_bytes"
            ),
            "torch_reserved_high_bytes": sampler.high.get("batchfit_torch_reserved_bytes"),
            "resident_high_bytes": sampler.high.get("batchfit_host_resident_bytes"),
            "peak_vs_budget": peak_high / budget_low if peak_high and budget_low else None,
        },
    )
    figures["checks"] = {
        "no failed request": not summary.errors,
        "replica reports the dtype asked for": info["dtype"] == model_dtype(plan),
    }
    figures["passed"] = all(figures["checks"].values())
    return figures


def model_dtype(plan: ThroughputPlan) -> str:
    import torch

    from models.loading import resolve_dtype

    return resolve_dtype(plan.dtype, torch.device(plan.device))
