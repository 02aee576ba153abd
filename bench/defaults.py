"""The thread and spin defaults, measured A/B with more than one client, interleaved.

``python -m bench.defaults`` starts a replica of the bundled model once per setting and
round (an OpenMP spin count and a thread count), in turn, round after round, so that a host
whose load drifts disturbs every setting alike; each replica gets one client and then 32
clients of the mixed-length workload, from each load generator. It prints every run and,
per setting, the median of the rounds: one-client p50, throughput at 32 clients, and the
CPUs the server kept busy meanwhile. ``--busy-cpus N`` keeps N processes spinning on the
host throughout, as a neighbour would.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .loadgen import CLIENTS, closed_loop
from .servers import die_with_parent, start_replica, stop_process
from .stats import summarize
from .workload import WorkloadSpec, make_requests


@dataclass(frozen=True, slots=True)
class Setting:
    spin_count: str
    num_threads: int | None = None
    """None: the server's default."""

    @property
    def name(self) -> str:
        threads = "default" if self.num_threads is None else str(self.num_threads)
        return f"GOMP_SPINCOUNT={self.spin_count}, threads={threads}"


@dataclass(frozen=True, slots=True)
class Run:
    setting: Setting
    round: int
    client: str
    p50_1_s: float
    inputs_per_s_32: float
    cpus_busy_32: float


def parse_setting(text: str) -> Setting:
    """``SPIN`` or ``SPIN:THREADS``."""
    spin, _, threads = text.partition(":")
    return Setting(spin, int(threads) if threads else None)


def measure(
    settings: Sequence[Setting], *, rounds: int, clients: Sequence[str], requests: int,
    singles: int, concurrency: int = 32,
) -> list[Run]:  # fmt: skip
    spec = WorkloadSpec()
    mixed = make_requests(spec, requests)
    one_by_one = make_requests(spec, singles, single_input=True)
    runs = []
    for round_ in range(rounds):
        for setting in settings:
            threads = setting.num_threads
            flags = [] if threads is None else ["--num-threads", str(threads)]
            os.environ["GOMP_SPINCOUNT"] = setting.spin_count  # the replica inherits it
            with start_replica(flags) as replica:
                asyncio.run(closed_loop(replica.url, mixed[:16], concurrency=8, max_duration_s=60))
                for client in clients:
                    idle = asyncio.run(closed_loop(replica.url, one_by_one, concurrency=1,
                                                   client=client, max_duration_s=120))  # fmt: skip
                    cpu_before = replica.cpu_seconds() or 0.0
                    busy = asyncio.run(closed_loop(replica.url, mixed, concurrency=concurrency,
                                                   client=client, max_duration_s=120))  # fmt: skip
                    cpu_s = (replica.cpu_seconds() or 0.0) - cpu_before
                    one = summarize("", "c=1", idle.outcomes, idle.wall_s)
                    many = summarize("", f"c={concurrency}", busy.outcomes, busy.wall_s)
                    runs.append(Run(setting, round_, client, one.p50_s, many.inputs_per_s,
                                    cpu_s / busy.wall_s))  # fmt: skip
                    print(_line(runs[-1]), file=sys.stderr, flush=True)
    return runs


@contextlib.contextmanager
def busy_cpus(count: int) -> Iterator[None]:
    """``count`` processes that spin on the host's CPUs until the block ends."""
    spinning = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=die_with_parent)
        for _ in range(count)
    ]
    try:
        yield
    finally:
        for process in spinning:
            process.kill()
            stop_process(process)


def _line(run: Run) -> str:
    return (
        f"round {run.round + 1} {run.setting.name} {run.client}: one-client p50 "
        f"{run.p50_1_s * 1e3:.1f} ms, 32 clients {run.inputs_per_s_32:.1f} inputs/s, "
        f"{run.cpus_busy_32:.2f} CPUs busy"
    )


def render(runs: Sequence[Run]) -> str:
    """Medians over the rounds, one row per setting and client."""
    lines = [
        "| setting | client | rounds | one-client p50 ms | inputs/s at 32 clients "
        "| CPUs busy at 32 |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    keys = list(dict.fromkeys((r.setting, r.client) for r in runs))
    for setting, client in keys:
        rows = [r for r in runs if r.setting == setting and r.client == client]
        lines.append(
            f"| {setting.name} | {client} | {len(rows)} "
            f"| {statistics.median(r.p50_1_s for r in rows) * 1e3:.1f} "
            f"| {statistics.median(r.inputs_per_s_32 for r in rows):.1f} "
            f"| {statistics.median(r.cpus_busy_32 for r in rows):.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.defaults", description=__doc__)
    parser.add_argument(
        "--settings",
        default="1000,300000",
        help="comma-separated SPIN or SPIN:THREADS (default: 1000,300000)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", default=",".join(CLIENTS))
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--singles", type=int, default=60)
    parser.add_argument("--busy-cpus", type=int, default=0,
                        help="processes that spin on the host meanwhile (default: 0)")  # fmt: skip
    args = parser.parse_args(argv)
    settings = [parse_setting(s) for s in args.settings.split(",") if s]
    with busy_cpus(args.busy_cpus):
        runs = measure(settings, rounds=args.rounds, clients=args.clients.split(","),
                       requests=args.requests, singles=args.singles)  # fmt: skip
    print("\n".join(_line(r) for r in runs))
    print()
    print(render(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
