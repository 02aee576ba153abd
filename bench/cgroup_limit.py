"""One burst against a replica inside its own memory cgroup: under a cgroup limit, and with none.

The burst is 48 requests of 8 inputs (7 cut to the 256-token maximum, 1 short), all at once,
with the item caps lifted (``--max-batch-size 1024 --max-batch-tokens 1000000``) so memory
alone decides the batch sizes. Under the limit the replica starts in a loose cgroup limit (so
warm-up takes seconds), then the limit drops to its usage plus ``--room-mib`` and the burst
follows. Prints the limit, the cgroup's peak, OOM kills, the batch sizes and throughput.
Run as root: ``python -m bench.cgroup_limit`` (loopback only; two replicas, one burst each).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .cgroups import ChildCgroup, make_child_cgroup
from .servers import ROOT, Replica, free_port, stop_process, wait_ready

MiB = 2**20
CAPS = ["--max-batch-size", "1024", "--max-batch-tokens", "1000000", "--max-wait-ms", "50"]
LOOSE_LIMIT = 900 * MiB  # at start-up, so that warm-up plans within it: seconds, not minutes
WORDS = ["memory", "batch", "split", "token", "model", "server", "queue", "latency", "budget"]


def burst_requests(seed: int = 12, count: int = 48) -> list[list[str]]:
    """``count`` requests x 8 inputs from 24 long texts (cut to 256 tokens) and 12 short
    ones."""
    rng = random.Random(seed)
    long = [" ".join(rng.choice(WORDS) for _ in range(300)) for _ in range(24)]
    short = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(12)]
    requests = []
    for i in range(count):
        inputs = [long[(7 * i + j) % len(long)] for j in range(7)]
        inputs.insert(i % 8, short[i % len(short)])
        requests.append(inputs)
    return requests


def send_burst(
    url: str, requests: list[list[str]], models: Sequence[str | None] = (None,)
) -> list[httpx.Response | Exception]:
    """Every request at once, request i to ``models[i % len(models)]`` (None: the default);
    a refused or dropped connection comes back as its exception."""

    def body(i: int, inputs: list[str]) -> dict[str, object]:
        model = models[i % len(models)]
        return {"inputs": inputs, "timeout_s": 300, **({"model": model} if model else {})}

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            return await asyncio.gather(
                *(client.post("/v1/infer", json=body(i, r)) for i, r in enumerate(requests)),
                return_exceptions=True,
            )

    return asyncio.run(main())


def _samples(
    scrape: str, name: str, keep: frozenset[str] = frozenset()
) -> list[tuple[dict[str, str], float]]:
    """``name``'s samples with their labels, the ``model`` label left out unless kept."""
    return [
        ({k: v for k, v in sample.labels.items() if k != "model" or k in keep}, sample.value)
        for family in text_string_to_metric_families(scrape)
        for sample in family.samples
        if sample.name == name
    ]


def scrape_value(scrape: str, name: str, labels: str = "") -> float | None:
    """The sample of ``name`` with ``labels`` (``k="v",...``), summed over the models it
    serves unless ``labels`` names one; None when the scrape has none."""
    wanted = dict(re.findall(r'(\w+)="([^"]*)"', labels))
    found = [value for got, value in _samples(scrape, name, frozenset(wanted)) if got == wanted]
    return sum(found) if found else None


def histogram(scrape: str, name: str) -> dict[float, float]:
    """Cumulative bucket counts of a histogram by upper bound (+Inf left out), summed over
    the models."""
    counts: dict[float, float] = {}
    for labels, value in _samples(scrape, f"{name}_bucket"):
        if labels.keys() == {"le"} and labels["le"] != "+Inf":
            bound = float(labels["le"])
            counts[bound] = counts.get(bound, 0.0) + value
    return counts


def start_in(cgroup: ChildCgroup, flags: list[str], log_dir: Path) -> Replica:
    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "server", "serve", "--host", "127.0.0.1", "--port", str(port),
             *flags],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, preexec_fn=cgroup.join,
        )  # fmt: skip
    return Replica(f"http://127.0.0.1:{port}", process, log_path)


@dataclass
class Row:
    setting: str
    limit_mib: float | None
    usage_mib: float
    peak_mib: float
    oom_kills: int
    statuses: Counter
    elapsed_s: float
    batches: float
    mean_items: float
    max_items: float  # the smallest batch-size bucket bound holding every batch
    worst_ratio: float | None  # the smallest measured/predicted bucket bound holding every batch


def run(setting: str, room_bytes: int, log_dir: Path) -> Row:
    cgroup = make_child_cgroup(f"bench-{setting}")
    try:
        if setting == "limit":
            cgroup.set_limit(LOOSE_LIMIT)
        replica = start_in(cgroup, CAPS, log_dir)
        try:
            wait_ready(replica, 600)
            usage = cgroup.usage()
            limit = usage + room_bytes if setting == "limit" else None
            if limit is not None:
                cgroup.set_limit(limit)
            cgroup.reset_peak()
            requests = burst_requests()
            started = time.perf_counter()
            responses = send_burst(replica.url, requests)
            elapsed = time.perf_counter() - started
            peak, kills = cgroup.peak(), cgroup.oom_kills()
            scrape = (
                ""
                if replica.process.poll() is not None
                else httpx.get(f"{replica.url}/metrics").text
            )
        finally:
            stop_process(replica.process)
    finally:
        cgroup.remove()
    sizes = histogram(scrape, "batchfit_batch_size")
    count = scrape_value(scrape, "batchfit_batch_size_count") or 0
    ratios = histogram(scrape, "batchfit_batch_peak_ratio")
    return Row(
        setting=setting, limit_mib=limit / MiB if limit else None, usage_mib=usage / MiB,
        peak_mib=peak / MiB, oom_kills=kills,
        statuses=Counter(getattr(r, "status_code", type(r).__name__) for r in responses),
        elapsed_s=elapsed, batches=count,
        mean_items=(scrape_value(scrape, "batchfit_batch_size_sum") or 0) / count if count else 0,
        max_items=min((b for b, c in sizes.items() if c == count), default=float("nan")),
        worst_ratio=min((b for b, c in ratios.items() if c == count), default=None),
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--room-mib", type=int, default=250, help="limit = usage + this")
    parser.add_argument("--settings", default="limit,none", help="limit and/or none")
    args = parser.parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="batchfit-cgroup-"))
    rows = [run(s, args.room_mib * MiB, log_dir) for s in args.settings.split(",")]
    print(f"48 requests x 8 inputs (7 x 256 tokens + 1 short), caps {' '.join(CAPS)}")
    print(
        f"{'setting':<8} {'limit MiB':>9} {'usage MiB':>9} {'peak MiB':>8} {'oom_kill':>8} "
        f"{'time s':>7} {'inputs/s':>8} {'batches':>7} {'mean':>6} {'max<=':>6} {'ratio<=':>7}  "
        "statuses"
    )
    for r in rows:
        inputs = sum(r.statuses.values()) * 8
        print(
            f"{r.setting:<8} {r.limit_mib or float('nan'):>9.0f} {r.usage_mib:>9.0f} "
            f"{r.peak_mib:>8.0f} {r.oom_kills:>8} {r.elapsed_s:>7.1f} {inputs / r.elapsed_s:>8.1f} "
            f"{r.batches:>7.0f} {r.mean_items:>6.1f} {r.max_items:>6.0f} "
            f"{r.worst_ratio if r.worst_ratio is not None else float('nan'):>7.2f}  "
            f"{dict(r.statuses)}"
        )
    print(f"replica logs: {log_dir}")


if __name__ == "__main__":
    main()
