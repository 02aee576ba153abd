"""Where the CPU goes with API processes in front of the engine, process by process.

``python -m bench.processes`` starts a replica of the no-op model for each ``--api-workers``
count and drives each with ``wrk`` in turn, round after round, at each ``--connections``
level. It prints each one's requests per second, mean latency and CPU time per request
(the median of the rounds), split by process: the replica's main process (its event loop's
thread, and its other threads: the model thread's), and its API processes together, every
thread of each. With one API process the main process does everything; with two or more it
is the engine.

``--replica-cpus`` holds the replicas (every process and thread) to those CPUs and
``--client-cpus`` holds wrk to those, as ``taskset`` would: with both on one CPU, a process
waking another wakes no idle CPU, so what a lone request still pays is the work itself.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
from collections.abc import Iterator
from dataclasses import dataclass

from .comparisons import NOOP_MODEL
from .profile import BODY, thread_cpu_seconds
from .servers import Replica, child_pids, process_cpu_seconds, start_replica
from .wrk import run_wrk


@dataclass(frozen=True, slots=True)
class ProcessRun:
    api_workers: int
    connections: int
    requests_per_s: float
    mean_s: float
    loop_cpu_s: float
    """Per request, on the main process's event loop thread."""
    other_cpu_s: float
    """Per request, on the main process's other threads."""
    api_cpu_s: float
    """Per request, on every thread of the API processes (none with one API process)."""

    @property
    def total_cpu_s(self) -> float:
        return self.loop_cpu_s + self.other_cpu_s + self.api_cpu_s


@dataclass(frozen=True, slots=True)
class CpuSplit:
    """CPU seconds so far: the main process's event loop, its other threads, its children."""

    loop_s: float
    other_s: float
    children_s: dict[int, float]

    def since(self, before: CpuSplit) -> tuple[float, float, float]:
        """Seconds used since ``before``; a child that was not there yet counts whole."""
        children = sum(
            seconds - before.children_s.get(pid, 0.0) for pid, seconds in self.children_s.items()
        )
        return self.loop_s - before.loop_s, self.other_s - before.other_s, children


def cpu_split(pid: int) -> CpuSplit:
    threads = thread_cpu_seconds(pid)
    loop_s = threads.pop(pid, 0.0)
    children = {}
    for child in child_pids(pid):
        seconds = process_cpu_seconds(child)
        if seconds is not None:  # not a child that has exited meanwhile
            children[child] = seconds
    return CpuSplit(loop_s, sum(threads.values()), children)


@contextlib.contextmanager
def held(cpus: set[int] | None) -> Iterator[None]:
    """This process on ``cpus`` for the block (what it starts inherits them); None: as it is."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def measure(
    replica: Replica, api_workers: int, connections: int, duration_s: float,
    client_cpus: set[int] | None = None,
) -> ProcessRun:  # fmt: skip
    pid = replica.process.pid
    before = cpu_split(pid)
    with held(client_cpus):
        run = run_wrk(f"{replica.url}/v1/infer", BODY, connections=connections,
                      duration_s=duration_s)  # fmt: skip
    loop_s, other_s, api_s = cpu_split(pid).since(before)
    n = max(1, run.requests)  # wrk ran for exactly the measured window
    return ProcessRun(api_workers, connections, run.requests_per_s, run.mean_s,
                      loop_s / n, other_s / n, api_s / n)  # fmt: skip


def run_processes(
    api_workers: tuple[int, ...], connections: tuple[int, ...], *, rounds: int,
    duration_s: float, replica_cpus: set[int] | None = None,
    client_cpus: set[int] | None = None,
) -> list[list[ProcessRun]]:  # fmt: skip
    """Every replica at every level, in turn, ``rounds`` times; one list of runs per round."""
    with contextlib.ExitStack() as stack:
        replicas = {}
        for n in api_workers:
            with held(replica_cpus):
                replicas[n] = stack.enter_context(
                    start_replica(["--model", NOOP_MODEL, "--api-workers", str(n)])
                )
        for replica in replicas.values():  # warm-up
            run_wrk(f"{replica.url}/v1/infer", BODY, connections=1, duration_s=1)
        return [
            [
                measure(replicas[n], n, c, duration_s, client_cpus)
                for c in connections
                for n in api_workers
            ]
            for _ in range(rounds)
        ]


def render(rounds: list[list[ProcessRun]]) -> str:
    """Each replica's figures at each level, the median of the rounds; CPU in us a request."""
    lines = [
        "| API processes | connections | requests/s | mean latency us | main process: event "
        "loop CPU us | main process: other threads CPU us | API processes CPU us | total CPU "
        "us |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for i, first in enumerate(rounds[0]):
        runs = [r[i] for r in rounds]

        def median_us(field: str, runs: list[ProcessRun] = runs) -> str:
            return f"{statistics.median(getattr(r, field) for r in runs) * 1e6:.0f}"

        lines.append(
            f"| {first.api_workers} | {first.connections} "
            f"| {statistics.median(r.requests_per_s for r in runs):,.0f} "
            f"| {median_us('mean_s')} | {median_us('loop_cpu_s')} | {median_us('other_cpu_s')} "
            f"| {median_us('api_cpu_s')} | {median_us('total_cpu_s')} |"
        )
    return "\n".join(lines)


def _cpus(text: str) -> set[int]:
    return {int(cpu) for cpu in text.split(",") if cpu}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.processes", description=__doc__)
    parser.add_argument("--api-workers", type=int, action="append")
    parser.add_argument("--connections", type=int, action="append")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration-s", type=float, default=4.0)
    parser.add_argument("--replica-cpus", type=_cpus, help="e.g. 0, or 0,1")
    parser.add_argument("--client-cpus", type=_cpus, help="e.g. 1")
    args = parser.parse_args(argv)
    rounds = run_processes(
        tuple(args.api_workers or [1, 2]), tuple(args.connections or [1, 32]),
        rounds=args.rounds, duration_s=args.duration_s,
        replica_cpus=args.replica_cpus, client_cpus=args.client_cpus,
    )  # fmt: skip
    print(render(rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
