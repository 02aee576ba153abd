"""One connection's latency, layer by layer: what each part of the no-op replica's path adds.

``python -m bench.layers`` starts four servers and drives each with ``wrk`` in turn, round
after round, at each ``--connections`` level: the bare stack (``bench.baselines``); the bare
stack handing each answer to a model thread and back (``ModelThread``, the server's own); the
same reading the host's memory around each call as the batcher does around each batch; and
the replica serving the no-op model. It prints each one's mean latency and CPU time per
request (the event loop's thread, the others'), the median of the rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from dataclasses import dataclass

from .baselines import BARE_APP, BARE_HOP_APP, BARE_HOP_PROBE_APP
from .comparisons import NOOP_MODEL
from .profile import BODY, thread_cpu_seconds
from .servers import Replica, start_baseline, start_replica
from .wrk import run_wrk

LAYERS = {
    "bare stack": BARE_APP,
    "+ a model thread": BARE_HOP_APP,
    "+ the memory reading": BARE_HOP_PROBE_APP,
    "no-op replica": NOOP_MODEL,
}


@dataclass(frozen=True, slots=True)
class LayerRun:
    layer: str
    connections: int
    mean_s: float
    loop_cpu_s: float
    """Per request, on the event loop's thread (the process's main thread)."""
    other_cpu_s: float
    """Per request, on every other thread."""


def measure(replica: Replica, layer: str, connections: int, duration_s: float) -> LayerRun:
    pid = replica.process.pid
    before = thread_cpu_seconds(pid)
    run = run_wrk(f"{replica.url}/v1/infer", BODY, connections=connections, duration_s=duration_s)
    after = thread_cpu_seconds(pid)
    used = {tid: seconds - before.get(tid, 0.0) for tid, seconds in after.items()}
    num_requests = max(1, run.requests)  # wrk ran for exactly the measured window
    loop_s = used.pop(pid, 0.0)
    return LayerRun(layer, connections, run.mean_s, loop_s / num_requests,
                    sum(used.values()) / num_requests)  # fmt: skip


def run_layers(
    connections: tuple[int, ...], *, rounds: int, duration_s: float
) -> list[list[LayerRun]]:
    """Every layer at every level, in turn, ``rounds`` times; one list of runs per round."""
    with contextlib.ExitStack() as stack:
        servers = {layer: stack.enter_context(_start(target)) for layer, target in LAYERS.items()}
        for replica in servers.values():
            run_wrk(f"{replica.url}/v1/infer", BODY, connections=1, duration_s=1)
        return [
            [measure(servers[layer], layer, c, duration_s) for c in connections for layer in LAYERS]
            for _ in range(rounds)
        ]


def _start(target: str) -> contextlib.AbstractContextManager[Replica]:
    if target == NOOP_MODEL:
        return start_replica(["--model", NOOP_MODEL])
    return start_baseline(target)


def render(rounds: list[list[LayerRun]]) -> str:
    """Mean latency and CPU per request of each layer, the median of the rounds, in us."""
    lines = [
        "| layer | connections | mean latency us | event loop CPU us | other threads CPU us |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for i, first in enumerate(rounds[0]):
        runs = [r[i] for r in rounds]
        lines.append(
            f"| {first.layer} | {first.connections} "
            f"| {statistics.median(r.mean_s for r in runs) * 1e6:.0f} "
            f"| {statistics.median(r.loop_cpu_s for r in runs) * 1e6:.0f} "
            f"| {statistics.median(r.other_cpu_s for r in runs) * 1e6:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.layers", description=__doc__)
    parser.add_argument("--connections", type=int, action="append")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration-s", type=float, default=5.0)
    args = parser.parse_args(argv)
    connections = tuple(args.connections or [1])
    print(render(run_layers(connections, rounds=args.rounds, duration_s=args.duration_s)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
