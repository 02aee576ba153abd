"""Saturation without HTTP: how far the batches alone take the server from the in-process limit.

``python -m bench.engine`` starts a ``Runtime`` serving the bundled model with the server's
settings (the output cache off, as ``batchfit bench``'s replicas run) and drives it from the
same process: ``--concurrency`` clients, each sending the workload's requests one after another
through ``Runtime.infer``. No HTTP, no JSON and no load generator process: what is left is the
queue, the batches the batcher forms and the model thread. After ``--warm-up-s`` it records
every batch for ``--duration-s`` and prints inputs per second, the batches (mean inputs,
padded tokens per real token) and the CPUs the process kept busy.

- ``--limit`` first measures the in-process limit (``bench.limit``) over the same workload.
- ``--replay`` then runs the recorded batches, each one's token ids as the replica padded
  them, through plain transformers calls (``bench.plain``'s model, mean pooling), one after
  another. Against the replica, it tells whether the forward passes or the batches are what
  the limit beats. The replay skips the tokenizer, which the limit runs on every batch.

``python -m bench.saturation`` measures the same concurrency over HTTP.
"""

from __future__ import annotations

# First: the model thread in this process runs with the server's OpenMP spin.
import server.openmp  # noqa: F401  # isort: skip

import argparse
import asyncio
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvloop

from .inprocess import started_runtime
from .workload import WorkloadSpec, make_requests

LIMIT_REQUESTS = 400
"""Requests whose inputs the limit runs (``bench.saturation`` uses as many)."""


@dataclass(frozen=True, slots=True)
class EngineRun:
    concurrency: int
    wall_s: float
    inputs: int
    """Inputs of the requests answered within the recorded window."""
    batch_lengths: list[list[int]]
    """Each recorded batch's inputs, in tokens."""
    cpus: float
    """The process's CPU seconds per second of the window."""
    forward_s: float
    """Seconds in the recorded batches' forward passes (passes side by side summed)."""
    rss_mib: tuple[float, float] = (0.0, 0.0)
    """The process's resident memory as the window began and as it ended."""

    @property
    def inputs_per_s(self) -> float:
        return self.inputs / self.wall_s

    @property
    def mean_batch(self) -> float:
        return self.batched_inputs / len(self.batch_lengths) if self.batch_lengths else 0.0

    @property
    def batched_inputs(self) -> int:
        return sum(len(batch) for batch in self.batch_lengths)

    @property
    def padding(self) -> float:
        """Padded tokens per real token over the recorded batches."""
        real = sum(sum(batch) for batch in self.batch_lengths)
        padded = sum(len(batch) * max(batch) for batch in self.batch_lengths if batch)
        return padded / real if real else 1.0


class _Recorder:
    """A lane's forward passes (``wrap`` each: alone and side by side), recording each
    batch's items while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.batches: list[list[Any]] = []
        self.forward_s = 0.0
        """Seconds in passes, summed: two passes side by side count twice."""
        self._lock = threading.Lock()

    def wrap(self, forward: Callable[[Sequence[Any]], list[Any]]) -> Callable[..., list[Any]]:
        def recorded(items: Sequence[Any]) -> list[Any]:
            if not self.on:
                return forward(items)
            started = time.perf_counter()
            try:
                return forward(items)
            finally:
                with self._lock:
                    self.batches.append(list(items))
                    self.forward_s += time.perf_counter() - started

        return recorded


async def drive(
    concurrency: int,
    *,
    duration_s: float,
    warm_up_s: float,
    requests: Sequence[Sequence[str]],
) -> tuple[EngineRun, list[list[Any]]]:
    """Run the clients for ``warm_up_s``, then record ``duration_s``; the run and every
    recorded batch's items."""
    from models.spec import BUNDLED_MODEL

    async with started_runtime(BUNDLED_MODEL, cache_bytes=0, deduplicate=False) as runtime:
        assert runtime.batcher is not None  # started
        (lane,) = runtime.batcher.lanes.values()
        recorder = _Recorder()
        lane.forward = recorder.wrap(lane.forward)
        if lane.side_forward is not None:
            lane.side_forward = recorder.wrap(lane.side_forward)
        answered = 0
        stop = False

        async def client(first: int) -> None:
            nonlocal answered
            index = first
            while not stop:
                inputs = requests[index % len(requests)]
                index += concurrency
                await runtime.infer(inputs, truncate=True, timeout_s=300, request_id="engine")
                answered += len(inputs)

        clients = [asyncio.create_task(client(k)) for k in range(concurrency)]
        try:
            await asyncio.sleep(warm_up_s)
            recorder.on = True
            before, cpu_before, started = answered, os.times(), time.perf_counter()
            rss_before = _rss_mib()
            await asyncio.sleep(duration_s)
            recorder.on = False
            inputs, cpu_after, wall = answered - before, os.times(), time.perf_counter() - started
            rss = (rss_before, _rss_mib())
        finally:
            stop = True
            await asyncio.gather(*clients)
    cpu_s = (cpu_after.user - cpu_before.user) + (cpu_after.system - cpu_before.system)
    lengths = [[item.cost for item in batch] for batch in recorder.batches]
    run = EngineRun(concurrency, wall, inputs, lengths, cpu_s / wall, recorder.forward_s, rss)
    return run, recorder.batches


def _rss_mib() -> float:
    from batching.procfs import kib_field

    return (kib_field(Path("/proc/self/status").read_bytes(), b"VmRSS") or 0) / 2**20


def replay(batches: Sequence[Sequence[Any]], encoder: Any, *, warm_up: int = 5) -> float:
    """Inputs per second of ``batches`` (each item's ``data`` has its token ids, ``cost``
    their count) run one after another through plain transformers calls: padded, the model,
    mean pooling and normalisation."""
    import torch

    pad_id = encoder.tokenizer.pad_token_id or 0

    def run(items: Sequence[Any]) -> None:
        longest = max(item.cost for item in items)
        ids = torch.full((len(items), longest), pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), longest), dtype=torch.long)
        for row, item in enumerate(items):
            ids[row, : item.cost] = torch.tensor(item.data.ids)
            mask[row, : item.cost] = 1
        with torch.inference_mode():
            hidden = encoder.model(input_ids=ids, attention_mask=mask).last_hidden_state
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
            torch.nn.functional.normalize(pooled, dim=1)

    for items in batches[:warm_up]:
        run(items)
    started = time.perf_counter()
    for items in batches:
        run(items)
    return sum(len(items) for items in batches) / (time.perf_counter() - started)


def limit_inputs_per_s(requests: Sequence[Sequence[str]], encoder: Any) -> float:
    from .limit import measure_limit
    from .runner import BenchOptions

    options = BenchOptions()
    texts = [text for request in requests[:LIMIT_REQUESTS] for text in request]
    result = measure_limit(encoder, texts, max_items=options.max_batch_size,
                           max_tokens=options.max_batch_tokens)  # fmt: skip
    return result.inputs_per_s


def after_the_run(
    batches: Sequence[Sequence[Any]], requests: Sequence[Sequence[str]], *, limit: bool,
    rounds: int,
) -> tuple[float | None, float | None]:  # fmt: skip
    """The median of ``rounds`` of the replay (with ``batches``) and of the limit (with
    ``limit``), taking turns in one process after the replica has stopped, so that the two
    meet the same moments of the host."""
    from .plain import load_plain_encoder

    encoder = load_plain_encoder()
    replays: list[float] = []
    limits: list[float] = []
    if limit:
        limit_inputs_per_s(requests[:16], encoder)  # warm-up
    for _ in range(rounds):
        if batches:
            replays.append(replay(batches, encoder))
        if limit:
            limits.append(limit_inputs_per_s(requests, encoder))
    return (
        statistics.median(replays) if replays else None,
        statistics.median(limits) if limits else None,
    )


def describe(run: EngineRun, limit: float | None, replayed: float | None) -> str:
    line = (
        f"{run.concurrency} clients, no HTTP: {run.inputs_per_s:.1f} inputs/s over "
        f"{run.wall_s:.1f} s; {len(run.batch_lengths)} batches, mean {run.mean_batch:.1f} "
        f"inputs, padding {run.padding:.3f}; the process kept {run.cpus:.2f} CPUs busy; the "
        f"forward passes {run.forward_s / run.wall_s:.0%} of the time (side by side: summed), "
        f"{run.batched_inputs / run.forward_s:.1f} inputs per second of pass; resident "
        f"memory {run.rss_mib[0]:.0f} MiB as the window began, {run.rss_mib[1]:.0f} MiB at its end"
    )
    if limit is not None:
        ratio = run.inputs_per_s / limit
        line += f"\nin-process limit: {limit:.1f} inputs/s; the replica {ratio:.2f} of it"
    if replayed is not None:
        line += (
            f"\nits batches through plain calls: {replayed:.1f} inputs/s; the replica "
            f"{run.inputs_per_s / replayed:.2f} of it"
        )
        if limit is not None:
            line += f", the replayed batches {replayed / limit:.2f} of the limit"
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.engine", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--duration-s", type=float, default=15.0)
    parser.add_argument("--warm-up-s", type=float, default=3.0)
    parser.add_argument("--limit", action="store_true", help="then, the in-process limit")
    parser.add_argument("--replay", action="store_true",
                        help="then, the recorded batches through plain calls")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3,
                        help="of the replay and the limit, taking turns")  # fmt: skip
    args = parser.parse_args(argv)
    requests = make_requests(WorkloadSpec(), 3000)
    run, batches = uvloop.run(drive(args.concurrency, duration_s=args.duration_s,
                                    warm_up_s=args.warm_up_s, requests=requests))  # fmt: skip
    replayed, limit = None, None
    if args.limit or args.replay:
        replayed, limit = after_the_run(batches if args.replay else [], requests,
                                        limit=args.limit, rounds=args.rounds)  # fmt: skip
    print(describe(run, limit, replayed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
