"""What one hand-off to the model thread and back costs, busy and after an idle spell.

``python -m bench.hop`` sends a no-op through ``ModelThread.call`` from a uvloop event loop:
back to back (the thread finds its next call waiting or is still awake), and after the loop
slept ``--idle-us`` first (both threads asleep, as at one client). Then the same as the
server's batcher hands a light forward pass over (``call_then``, the model thread and the
event loop held on one CPU: ``batching/affinity.py``), and with a model thread that polls
its queue for up to ``--spin-us`` before it sleeps: in Python the poll holds the GIL, so the
event loop waiting for the answer cannot run until it ends.
"""

from __future__ import annotations

import argparse
import contextlib
import queue
import statistics
import time
from typing import Any

import uvloop

from batching.model_thread import ModelThread, _settle

_NOTHING = object()


class PollingModelThread(ModelThread):
    """A model thread that polls its queue for ``spin_s`` before it blocks on it."""

    def __init__(self, spin_s: float) -> None:
        super().__init__("batchfit-bench-hop")
        self.spin_s = spin_s

    def _work(self) -> None:
        while True:
            # NOTE: not None: that is close()'s sentinel, which a poll must not swallow.
            job: Any = _NOTHING
            end = time.perf_counter() + self.spin_s
            while job is _NOTHING and time.perf_counter() < end:
                with contextlib.suppress(queue.Empty):
                    job = self._jobs.get_nowait()
            if job is _NOTHING:
                job = self._jobs.get()
            if job is None:
                return
            fn, args, loop, future, _ = job  # only ``call``: no second part
            self._done()
            loop.call_soon_threadsafe(_settle, future, fn(*args), None)


def _forward() -> tuple[int, None]:
    return 0, None


async def round_trips(thread: ModelThread, *, calls: int, idle_s: float) -> list[float]:
    """Each call's round trip in seconds; with ``idle_s``, the loop sleeps that long
    (blocking, so the model thread has nothing to do) before each call. A thread that
    ``colocate``s gets forward passes (``call_then``), as the batcher sends them."""
    forward = thread.colocation is not None

    async def one() -> None:
        if forward:
            await thread.call_then(_forward)
        else:
            await thread.call(int)

    for _ in range(20):  # a co-locating thread moves once it has seen a few
        await one()
    times = []
    for _ in range(calls):
        if idle_s:
            time.sleep(idle_s)
        started = time.perf_counter()
        await one()
        times.append(time.perf_counter() - started)
    return times


async def measure(calls: int, idle_s: float, spin_s: float) -> list[str]:
    lines = []
    threads = [
        ("blocking, on any CPU", ModelThread("batchfit-bench-hop")),
        (
            "blocking, on the event loop's CPU (the server's)",
            ModelThread("batchfit-bench-hop", colocate=True),
        ),
        (f"polling {spin_s * 1e6:.0f} us", PollingModelThread(spin_s)),
    ]
    for name, thread in threads:
        try:
            busy = await round_trips(thread, calls=calls, idle_s=0.0)
            idle = await round_trips(thread, calls=calls, idle_s=idle_s)
        finally:
            thread.close()
        lines.append(
            f"{name}: back to back median {statistics.median(busy) * 1e6:.0f} us; after "
            f"{idle_s * 1e6:.0f} us idle median {statistics.median(idle) * 1e6:.0f} us"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hop", description=__doc__)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--idle-us", type=float, default=300.0)
    parser.add_argument("--spin-us", type=float, default=1000.0)
    args = parser.parse_args(argv)
    for line in uvloop.run(measure(args.calls, args.idle_us * 1e-6, args.spin_us * 1e-6)):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
