"""A process whose event loop has stopped running (a call that never returns, a deadlock)
answers nothing, yet stays alive: nothing restarts it, and under Docker Compose, whose
restart policy sees only exits, nothing ever would.

The loop watchdog ends such a process. The event loop re-arms ``faulthandler``'s timer every
second; once it has not done so for ``timeout_s``, faulthandler's own thread (which needs
neither the loop nor the GIL) writes every thread's stack to stderr, under a
``Timeout (0:00:30)!`` line, and exits with status 1; the supervisor (Docker's restart
policy, the kubelet, ``batchfit up``, or the engine for an API process) starts it again.
NOTE: a process stopped for longer than ``timeout_s`` (SIGSTOP, ``docker pause``) exits as
soon as it runs again: the timer's thread wakes before the loop can re-arm it.

A hung device or model holds the model thread while the loop runs on: ``/health/live``
reports it (``--forward-timeout-s``) for a liveness probe to act on, and
``exit_when_forward_hangs`` ends the process later still, for supervisors that see only
exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import os
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)

PERIOD_S = 1.0
"""How often the loop re-arms the timer (more often for a timeout under 4 s). A re-arm ends
faulthandler's thread and starts another: about 40 us on the loop, measured, once a second."""


class LoopWatchdog:
    def __init__(self, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"a watchdog needs a positive timeout, not {timeout_s}")
        self.timeout_s = timeout_s
        self._period_s = min(PERIOD_S, timeout_s / 4)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._next: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """From the event loop it watches."""
        self._loop = asyncio.get_running_loop()
        self._arm()

    def _arm(self) -> None:
        assert self._loop is not None
        faulthandler.dump_traceback_later(self.timeout_s, exit=True)
        self._next = self._loop.call_later(self._period_s, self._arm)

    def stop(self) -> None:
        if self._next is not None:
            self._next.cancel()
            self._next = None
        faulthandler.cancel_dump_traceback_later()


@contextlib.contextmanager
def loop_watchdog(timeout_s: float) -> Iterator[None]:
    """Watch the running event loop for the duration of the block (0: not at all)."""
    if not timeout_s:
        yield
        return
    watchdog = LoopWatchdog(timeout_s)
    watchdog.start()
    try:
        yield
    finally:
        watchdog.stop()


async def exit_when_forward_hangs(
    running_for: Callable[[], float], exit_s: float, *, period_s: float = PERIOD_S
) -> None:
    """Look every ``period_s``; once the call on the model thread has run for ``exit_s``
    (``running_for``), write every thread's stack to stderr and end the process with status
    1. Its pass cannot be interrupted, and a process exit is all Docker Compose's restart
    policy sees."""
    while True:
        await asyncio.sleep(period_s)
        running_s = running_for()
        if running_s < exit_s:
            continue
        log.error(
            "a forward pass has run for %.0fs, past --forward-exit-s %g: the device or the "
            "model is hung; every thread's stack follows, then the process exits with status "
            "1 for its supervisor to restart it", running_s, exit_s,
        )  # fmt: skip
        faulthandler.dump_traceback(all_threads=True)
        os._exit(1)
