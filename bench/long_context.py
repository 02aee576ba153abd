"""A long-context decoder on a mixed long/short workload under one cgroup limit: adaptive
batching against fixed batch sizes configured at the model's maximum length, as other servers
are configured.

The model is a random-weight Qwen3-shaped decoder with 32,768 positions (4 layers, hidden 256,
grouped-query attention), built in a scratch folder. Each replica starts in its own memory
cgroup under a loose limit; once ready the limit drops to its usage plus ``--room-mib``, and
the workload follows: ``--requests`` requests at once, one in four a long input
(``--long-tokens``), the rest a few short ones. Per setting it prints inputs/s, p99 latency,
the cgroup's peak against the limit, requests answered 507, requests lost (a dropped
connection, an error other than 507) and whether the kernel OOM-killed the replica.

    python -m bench.long_context            # as root; minutes on a CPU
    python -m bench.long_context --quick    # a short run: smaller inputs, adaptive and fixed 1

Needs the test dependencies (``pip install -e '.[test,bench]'``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

from .cgroup_limit import start_in
from .cgroups import make_child_cgroup
from .servers import stop_process, wait_ready

MiB = 2**20
MAX_TOKENS = 32768
SHORT = ["a short query about memory", "the batch budget", "one more short input"]


@dataclass
class Row:
    setting: str
    limit_mib: float | None
    peak_mib: float | None
    elapsed_s: float
    statuses: Counter
    latencies_s: list[float]
    inputs: int
    killed: bool
    proven: str

    @property
    def lost(self) -> int:
        return sum(n for status, n in self.statuses.items() if status not in (200, 507))


def settings_flags(setting: str, max_length: int) -> list[str]:
    """``adaptive`` (defaults), or ``fixed-N``: N inputs a batch at ``max_length`` tokens."""
    if setting == "adaptive":
        return []
    size = int(setting.removeprefix("fixed-"))
    return ["--sizer", "fixed", "--max-batch-size", str(size),
            "--max-batch-tokens", str(size * max_length)]  # fmt: skip


def workload(folder: Path, requests: int, long_tokens: int) -> list[list[str]]:
    from tests.long_models import text_of

    long = [text_of(folder, long_tokens, seed=seed) for seed in range(4)]
    return [
        [long[(i // 4) % len(long)]] if i % 4 == 0 else SHORT[: 1 + i % 3] for i in range(requests)
    ]


def send(url: str, bodies: list[list[str]]) -> tuple[list[object], list[float], float]:
    async def one(client: httpx.AsyncClient, inputs: list[str]) -> tuple[object, float]:
        started = time.perf_counter()
        try:
            response = await client.post("/v1/infer", json={"inputs": inputs, "timeout_s": 600})
            status: object = response.status_code
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        return status, time.perf_counter() - started

    async def main() -> list[tuple[object, float]]:
        async with httpx.AsyncClient(base_url=url, timeout=900) as client:
            return await asyncio.gather(*(one(client, inputs) for inputs in bodies))

    started = time.perf_counter()
    results = asyncio.run(main())
    elapsed = time.perf_counter() - started
    return [s for s, _ in results], [t for _, t in results], elapsed


def run(setting: str, folder: Path, args: argparse.Namespace, log_dir: Path) -> Row:
    flags = ["--model", str(folder), "--max-wait-ms", "50",
             *settings_flags(setting, args.max_length)]  # fmt: skip
    bodies = workload(folder, args.requests, args.long_tokens)
    cgroup = make_child_cgroup(f"bench-long-{setting}")
    limit = peak = None
    statuses: list[object] = []
    latencies: list[float] = []
    elapsed, proven = 0.0, "-"
    try:
        cgroup.set_limit(args.loose_mib * MiB)
        replica = start_in(cgroup, flags, log_dir)
        try:
            try:
                wait_ready(replica, args.ready_timeout_s)
            except RuntimeError:  # killed in warm-up
                statuses = ["killed in warm-up"] * len(bodies)
            else:
                for line in replica.log().splitlines():
                    if "longest proven input" in line:
                        proven = line.split("longest proven input ")[1].split(";")[0]
                limit = cgroup.usage() + args.room_mib * MiB
                cgroup.set_limit(limit)
                cgroup.reset_peak()
                statuses, latencies, elapsed = send(replica.url, bodies)
                peak = cgroup.peak()
        finally:
            killed = cgroup.oom_kills() > 0 or replica.process.poll() is not None
            stop_process(replica.process)
    finally:
        cgroup.remove()
    answered = Counter(statuses)
    inputs = sum(len(b) for b, s in zip(bodies, statuses, strict=True) if s == 200)
    return Row(
        setting, limit / MiB if limit else None, peak / MiB if peak else None, elapsed,
        answered, latencies, inputs, killed, proven,
    )  # fmt: skip


def p99(values: list[float]) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def table(rows: list[Row]) -> str:
    lines = [
        f"{'setting':<9} {'inputs/s':>8} {'p99 s':>7} {'peak MiB':>8} {'limit MiB':>9} "
        f"{'507':>4} {'lost':>4} {'killed':>6}  warm-up"
    ]
    for r in rows:
        rate = r.inputs / r.elapsed_s if r.elapsed_s else 0.0
        lines.append(
            f"{r.setting:<9} {rate:>8.2f} {p99(r.latencies_s):>7.1f} "
            f"{r.peak_mib or float('nan'):>8.0f} {r.limit_mib or float('nan'):>9.0f} "
            f"{r.statuses.get(507, 0):>4} {r.lost:>4} {'yes' if r.killed else 'no':>6}  "
            f"{r.proven}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", default="adaptive,fixed-1,fixed-4,fixed-16")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--long-tokens", type=int, default=8192)
    parser.add_argument("--max-length", type=int, default=MAX_TOKENS,
                        help="the length fixed batches are configured for")  # fmt: skip
    parser.add_argument("--room-mib", type=int, default=250, help="limit = usage + this")
    parser.add_argument("--loose-mib", type=int, default=4096, help="the limit at start-up")
    parser.add_argument("--ready-timeout-s", type=float, default=900)
    parser.add_argument("--quick", action="store_true",
                        help="12 requests, 2,048-token long inputs, fixed batches at 4,096 "
                        "tokens, adaptive and fixed-1 only: proves the benchmark runs")  # fmt: skip
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.long_tokens, args.max_length = 12, 2048, 4096
        args.settings = "adaptive,fixed-1"
    from tests.families import quiet
    from tests.long_models import build_long_decoder

    scratch = Path(tempfile.mkdtemp(prefix="batchfit-long-"))
    with quiet():
        folder = build_long_decoder(scratch / "decoder")
    rows = [run(s, folder, args, scratch) for s in args.settings.split(",")]
    print(
        f"{args.requests} requests at once (1 in 4 one input of {args.long_tokens} tokens, "
        f"the rest 1-3 short ones); fixed batches at {args.max_length} tokens; limit = usage "
        f"+ {args.room_mib} MiB once ready"
    )
    print(table(rows))
    print(f"replica logs: {scratch}")


if __name__ == "__main__":
    main()
