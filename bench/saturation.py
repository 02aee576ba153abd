"""Where the host's CPUs go while the bundled model's replica is saturated.

``python -m bench.saturation`` starts a replica with the server's defaults, drives it with
the benchmark's mixed-length workload at 128 clients (each load generator in turn), and
meanwhile reads every thread's CPU time from ``/proc``, the load generator's own (this
process's), the host's from ``/proc/stat``, and samples the replica's threads with py-spy
(idle ones included) to tell how much of the wall time the model thread spent inside a
forward pass. So it tells a model thread that waits for work (the front end or the batcher
binds) from forward passes that run slower than in-process (their threads get less CPU).
"""

from __future__ import annotations

# First, as ``batchfit bench`` does: the in-process limit runs with the server's OpenMP spin.
import server.openmp  # noqa: F401  # isort: skip

import argparse
import asyncio
import os
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .loadgen import CLIENTS, RunResult, closed_loop
from .profile import record, thread_cpu_seconds
from .servers import Replica, start_replica
from .stages import LOOP_THREAD, Frame, parse_raw
from .workload import WorkloadSpec, make_requests

MODEL_THREAD, TOKENIZER_THREAD = "batchfit-model", "batchfit-tokenize"
SIDE_THREAD = "batchfit-side"
"""The threads that run passes beside the model thread's (``batching/side.py``)."""
IN_FORWARD = "forward_from_baseline"
"""The function that calls the model's forward pass on the model thread (after reading the
memory baseline: the probe's frames below it are not the pass)."""
PROBES = "batching/probes.py"


@dataclass(frozen=True, slots=True)
class CpuShare:
    """CPUs kept busy over the sampled window (1.0 is one CPU all the time)."""

    server: dict[str, float]
    """By role: event loop, model thread, side passes, OpenMP workers, tokenizer, other
    threads."""
    client: float
    host_busy: float
    host_cpus: int


@dataclass(frozen=True, slots=True)
class SaturationRun:
    client: str
    concurrency: int
    inputs_per_s: float
    errors: int
    cpus: CpuShare
    in_forward: float
    """Share of the model thread's samples (idle ones included) inside a forward pass."""


def host_cpu_seconds() -> tuple[float, int]:
    """Busy CPU seconds of the whole host (everything but idle and iowait), and its CPUs."""
    ticks = os.sysconf("SC_CLK_TCK")
    cpus, busy = 0, 0
    for line in Path("/proc/stat").read_text().splitlines():
        name, *values = line.split()
        if name == "cpu":
            fields = [int(v) for v in values]
            busy = sum(fields) - fields[3] - fields[4]  # idle, iowait
        elif name.startswith("cpu"):
            cpus += 1
    return busy / ticks, cpus


def _role(name: str) -> str:
    if name.startswith(MODEL_THREAD):
        return "model thread"
    if name.startswith(SIDE_THREAD):
        return "side passes"
    if name.startswith(TOKENIZER_THREAD):
        return "tokenizer"
    if name == LOOP_THREAD:
        return "event loop"
    return "other threads"


def measure(
    replica: Replica, requests: list[list[str]], *, client: str, concurrency: int,
    duration_s: float, rate_hz: int = 100,
) -> SaturationRun:  # fmt: skip
    """Load for ``duration_s`` + 4 s; sample the middle ``duration_s`` of it."""
    done: list[RunResult] = []
    load = threading.Thread(target=lambda: done.append(asyncio.run(closed_loop(
        replica.url, requests, concurrency=concurrency, client=client,
        max_duration_s=duration_s + 4,
    ))))  # fmt: skip
    load.start()
    time.sleep(2.0)
    pid = replica.process.pid
    threads_before, own_before = thread_cpu_seconds(pid), time.process_time()
    host_before, host_cpus = host_cpu_seconds()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        raw = Path(folder) / "samples.txt"
        record(pid, raw, rate_hz=rate_hz, duration_s=duration_s, idle=True)
        samples = parse_raw(raw.read_text().splitlines())
    wall = time.perf_counter() - started
    threads_after, own_after = thread_cpu_seconds(pid), time.process_time()
    host_after, _ = host_cpu_seconds()
    load.join()
    names = {s.tid: s.thread for s in samples}
    server: dict[str, float] = {}
    for tid, seconds in threads_after.items():
        # Threads py-spy never saw run no Python: torch's OpenMP workers.
        role = _role(names[tid]) if tid in names else "OpenMP workers"
        used = (seconds - threads_before.get(tid, 0.0)) / wall
        server[role] = server.get(role, 0.0) + used
    model = [s for s in samples if s.thread.startswith(MODEL_THREAD)]
    total = sum(s.count for s in model)
    inside = sum(s.count for s in model if in_forward(s.frames))
    run = done[0]
    ok = [o for o in run.outcomes if o.status == 200]
    client_cpus, host_busy = (own_after - own_before) / wall, (host_after - host_before) / wall
    return SaturationRun(
        client=client,
        concurrency=concurrency,
        inputs_per_s=sum(o.num_inputs for o in ok) / run.wall_s,
        errors=len(run.outcomes) - len(ok),
        cpus=CpuShare(server, client_cpus, host_busy, host_cpus),
        in_forward=inside / total if total else float("nan"),
    )


def in_forward(frames: Sequence[Frame]) -> bool:
    """Whether a model thread's sample (outermost frame first) is inside a forward pass: in
    what ``IN_FORWARD`` calls, other than the memory probe."""
    for i, frame in enumerate(frames[:-1]):
        if frame.function == IN_FORWARD:
            return frames[i + 1].file != PROBES
    return False


def describe(run: SaturationRun) -> str:
    cpus = run.cpus
    server = sum(cpus.server.values())
    roles = ", ".join(f"{role} {used:.2f}" for role, used in
                      sorted(cpus.server.items(), key=lambda kv: -kv[1]))  # fmt: skip
    rest = cpus.host_busy - server - cpus.client
    return (
        f"{run.client}, {run.concurrency} clients: {run.inputs_per_s:.1f} inputs/s, "
        f"{run.errors} errors. CPUs busy of {cpus.host_cpus}: the server {server:.2f} "
        f"({roles}); the load generator {cpus.client:.2f}; the rest of the host (py-spy "
        f"included) {rest:.2f}; idle {cpus.host_cpus - cpus.host_busy:.2f}. The model thread "
        f"was inside a forward pass {run.in_forward:.0%} of the time."
    )


def measure_limit_cpus(requests: list[list[str]], *, rounds: int = 2) -> list[str]:
    """The in-process limit (``bench.limit``) over the same inputs, and the host's CPUs busy
    meanwhile: what the plain calls leave idle with nothing else running."""
    from .limit import measure_limit
    from .plain import load_plain_encoder
    from .runner import BenchOptions

    options = BenchOptions()
    encoder = load_plain_encoder()
    texts = [text for r in requests for text in r]
    lines = []
    for i in range(rounds + 1):  # the first warms up
        busy_before, cpus = host_cpu_seconds()
        started = time.perf_counter()
        limit = measure_limit(encoder, texts, max_items=options.max_batch_size,
                              max_tokens=options.max_batch_tokens)  # fmt: skip
        busy = (host_cpu_seconds()[0] - busy_before) / (time.perf_counter() - started)
        if i:
            lines.append(f"in-process limit: {limit.inputs_per_s:.1f} inputs/s; CPUs busy of "
                         f"{cpus} (its planning included): {busy:.2f}")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.saturation", description=__doc__)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--duration-s", type=float, default=15.0)
    parser.add_argument("--requests", type=int, default=3000, help="at most, per client")
    parser.add_argument("--clients", default=",".join(CLIENTS))
    parser.add_argument("--server-flag", action="append", default=[], dest="flags")
    parser.add_argument("--limit", action="store_true",
                        help="also run the in-process limit over 400 requests' inputs")  # fmt: skip
    args = parser.parse_args(argv)
    requests = make_requests(WorkloadSpec(), args.requests)
    if args.limit:
        for line in measure_limit_cpus(requests[:400]):
            print(line, flush=True)
    with start_replica(args.flags) as replica:
        asyncio.run(closed_loop(replica.url, requests[:200], concurrency=32, max_duration_s=30))
        for client in args.clients.split(","):
            run = measure(replica, requests, client=client, concurrency=args.concurrency,
                          duration_s=args.duration_s)  # fmt: skip
            print(describe(run), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
