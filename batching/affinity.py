"""The model thread on the event loop's CPU while its forward passes are light.

Handing a call to the model thread and back wakes one thread from another twice. Where the
two threads sit on different CPUs, each wake-up reaches a CPU that went idle, which on a
virtual machine costs a trip through the hypervisor: on a 2-CPU VM a round trip took 90-110
us across CPUs against 25-30 us on one. Where the model thread needs little CPU per forward
pass (a very small model, the no-op model), that is most of what the hand-off costs, and the
two threads run Python under one GIL anyway. (On a GPU, a thread that spins in a device
synchronisation spends CPU time: an eager model's passes count as heavy there.) So while
the model thread's CPU time per forward pass stays light, both the event loop's thread and
the model thread are held on the CPU the event loop is on: the hand-off becomes a switch
between two threads on one CPU. Once forward passes grow heavy (a model computing on the
CPU), both go back to every CPU the process had.

Only forward passes move: any other call (loading a model) runs on the process's own CPUs,
so that what it reads of them (the thread count) and the threads it starts (OpenMP's) are
not held to one. A thread inherits its starter's CPUs, so every ``ModelThread`` starts by
going back to the process's own (``leave_inherited``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from collections.abc import Callable, Iterator

log = logging.getLogger("batchfit.batching")

ENTER_S = 200e-6
"""Forward passes whose CPU time on the model thread averages below this move it to the
event loop's CPU (about twice a round trip across CPUs on a VM)."""
LEAVE_S = 500e-6
"""... and back to every CPU once the average passes this."""
WEIGHT = 0.1
"""The weight of the latest forward pass in the average."""


def _find_getcpu() -> Callable[[], int] | None:
    """glibc's ``sched_getcpu`` (read from the vDSO; Python has no binding), or None."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    try:
        getcpu = ctypes.CDLL(None, use_errno=True).sched_getcpu
    except (OSError, AttributeError):
        return None
    getcpu.restype = ctypes.c_int
    getcpu.argtypes = []
    return getcpu


_getcpu = _find_getcpu()


def _process_cpus() -> frozenset[int]:
    """The CPUs the process may use, read when this module is first imported: before any
    thread is held to one. Empty where threads cannot be moved here."""
    if _getcpu is None:
        return frozenset()
    try:
        return frozenset(os.sched_getaffinity(0))
    except OSError:
        return frozenset()


HOME = _process_cpus()


def leave_inherited() -> None:
    """On a thread just started: back to ``HOME``, where it inherited fewer CPUs from a
    thread held to one."""
    if HOME:
        with contextlib.suppress(OSError):
            if os.sched_getaffinity(0) != HOME:
                os.sched_setaffinity(0, HOME)


class Colocation:
    """Where one model thread and its caller run. ``before_forward`` and ``before_other``
    run on the caller (the event loop's thread) before it hands a call over; ``note`` runs
    on the model thread after a forward pass."""

    def __init__(self) -> None:
        self.home = HOME
        self.enabled = len(self.home) > 1
        self.cpu_s: float | None = None
        """The model thread's CPU time per forward pass, a moving average."""
        self.cpu: int | None = None
        """The CPU both threads are held on; None while they run on ``home``."""
        self.worker: int | None = None
        """The model thread's native id, once it runs."""
        self._caller: int | None = None
        self._worker_home = True
        self.num_moves = 0
        """Times both threads moved to one CPU."""

    def started(self) -> None:
        """On the model thread, once it runs (and has left what it inherited)."""
        self.worker = threading.get_native_id()

    def note(self, cpu_s: float) -> None:
        """On the model thread: a forward pass took ``cpu_s`` of its CPU time."""
        last = self.cpu_s
        self.cpu_s = cpu_s if last is None else last + WEIGHT * (cpu_s - last)

    @property
    def light(self) -> bool:
        cpu_s = self.cpu_s
        if cpu_s is None:
            return False
        return cpu_s < (ENTER_S if self.cpu is None else LEAVE_S)

    def before_forward(self) -> None:
        """On the caller, before a forward pass: both on the caller's CPU while passes are
        light, both home otherwise."""
        if self.worker is None:
            return
        if not (self.enabled and self.light):
            self.release()
            return
        caller = threading.get_native_id()
        if self.cpu is not None and caller == self._caller:
            if self._worker_home:
                self._worker_home = not self._set(self.worker, {self.cpu})
            return
        if self.cpu is not None:
            self.release()  # another thread calls now
        assert _getcpu is not None  # enabled
        cpu = _getcpu()
        if cpu < 0 or cpu not in self.home:
            return
        if self._set(0, {cpu}) and self._set(self.worker, {cpu}):
            self.cpu, self._caller, self._worker_home = cpu, caller, False
            self.num_moves += 1
            log.info(
                "the model thread shares CPU %d with the event loop (%.0f us of CPU per "
                "forward pass)", cpu, (self.cpu_s or 0.0) * 1e6,
            )  # fmt: skip
        else:
            self._set(0, self.home)

    def before_other(self) -> None:
        """On the caller, before any other call: the model thread runs it on ``home``."""
        if self.cpu is not None and not self._worker_home:
            assert self.worker is not None  # held only once it runs
            self._worker_home = self._set(self.worker, self.home)

    def release(self) -> None:
        """Both threads back on ``home`` (from any thread)."""
        if self.cpu is None:
            return
        if self._caller is not None:
            self._set(self._caller, self.home)
        if self.worker is not None:
            self._set(self.worker, self.home)
        log.info("the model thread and the event loop run on every CPU again")
        self.cpu, self._caller, self._worker_home = None, None, True

    def _set(self, tid: int, cpus: set[int] | frozenset[int]) -> bool:
        """Hold thread ``tid`` (0: this one) to ``cpus``. False where the thread has ended
        (the model thread, closed meanwhile); False, and no more moves, where the system
        refuses (a CPU taken out of the process's set)."""
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            return False
        except OSError as exc:
            if self.enabled:
                log.warning("cannot set a thread's CPUs (%s); the model thread stays put", exc)
            self.enabled = False
            return False
        return True


@contextlib.contextmanager
def at_home() -> Iterator[None]:
    """This thread on ``HOME`` for the block, then back where it was held: a process
    started in the block inherits the CPUs of the thread that starts it."""
    held: set[int] | None = None
    if HOME:
        with contextlib.suppress(OSError):
            held = os.sched_getaffinity(0)
            if held == HOME:
                held = None
            else:
                os.sched_setaffinity(0, HOME)
    try:
        yield
    finally:
        if held is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, held)
