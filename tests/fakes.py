"""Fakes for unit tests of the batching logic: a clock that jumps, a scripted model."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from batching import MemoryLimit, MemoryReading
from models import ArchitectureShape, DeviceError, Item, ModelInfo, ModelOutOfMemory

SHAPE = ArchitectureShape(
    hidden_size=8, num_layers=1, num_heads=1, intermediate_size=16, element_bytes=4,
    parameter_bytes=1000,
)  # fmt: skip


class FakeClock:
    """Time stands still until a wait would block; then it jumps to the deadline."""

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds

    async def wait(self, event: asyncio.Event, deadline: float) -> bool:
        if event.is_set():
            return True
        self.t = max(self.t, deadline)
        return False


STALL_THE_LOOP = "stall the loop"


def scripted_items(inputs: Sequence[str]) -> list[Item]:
    """A ``ScriptedModel``'s items. The input ``STALL_THE_LOOP`` hangs the calling thread (the
    event loop, where small requests are tokenized) for 120 s: a hung replica."""
    if STALL_THE_LOOP in inputs:
        time.sleep(120)
    return [Item(data=text, cost=len(text.split()) + 2) for text in inputs]


class ScriptedModel:
    """Cost is the number of words + 2; output is ``"out:<text>"``.

    With ``clock`` and ``seconds``, each pass advances the fake clock by ``seconds(n, L)``.
    Raises ``ModelOutOfMemory`` for batches larger than ``oom_above_items`` or with more padded
    tokens than ``oom_above_tokens``; records every batch's size. ``gate`` (if set) blocks the
    model thread until the test opens it.
    """

    def __init__(
        self,
        *,
        oom_above_items: int | None = None,
        oom_above_tokens: int | None = None,
        fail_with: Exception | None = None,
        gate: threading.Event | None = None,
        max_input_tokens: int = 64,
        clock: FakeClock | None = None,
        seconds: Callable[[int, int], float] | None = None,
    ) -> None:
        self.oom_above_items = oom_above_items
        self.oom_above_tokens = oom_above_tokens
        self.fail_with = fail_with
        self.gate = gate
        self.clock, self.seconds = clock, seconds
        self.entered = threading.Event()  # set whenever a forward pass starts
        self.batch_sizes: list[int] = []
        self.seen: list[str] = []
        self.info = ModelInfo(
            name="scripted", task="embed", device="cpu", dtype="float32",
            max_input_tokens=max_input_tokens, num_parameters=1, output_dim=1, shape=SHAPE,
        )  # fmt: skip

    def prepare(self, inputs: Sequence[str], *, truncate: bool) -> list[Item]:
        return scripted_items(inputs)

    def synthetic_items(self, num_items: int, length: int) -> list[Item]:
        return [Item(data="warm " * (length - 2), cost=length) for _ in range(num_items)]

    def forward(self, items: Sequence[Item]) -> list[Any]:
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(timeout=30)
        self.batch_sizes.append(len(items))
        if self.clock is not None and self.seconds is not None:
            self.clock.advance(self.seconds(len(items), max(item.cost for item in items)))
        if self.fail_with is not None:
            raise self.fail_with
        padded = len(items) * max(item.cost for item in items)
        too_many = self.oom_above_items is not None and len(items) > self.oom_above_items
        too_big = self.oom_above_tokens is not None and padded > self.oom_above_tokens
        if too_many or too_big:
            raise ModelOutOfMemory(f"scripted OOM at {len(items)} items", requested_bytes=2**20)
        self.seen.extend(str(item.data) for item in items)
        return [f"out:{item.data}" for item in items]


class ScriptedProbe:
    """A memory probe whose free memory the test sets; it measures no peaks."""

    name = "scripted"

    def __init__(
        self,
        free_bytes: int,
        limit: MemoryLimit | None = None,
        *,
        model: ScriptedModel | None = None,
        enforced: MemoryLimit | None = None,
        enforced_free_bytes: int | None = None,
    ) -> None:
        self.free_bytes = free_bytes
        self.limit = limit
        self.enforced = enforced
        """The enforced limit (None: none read), with ``enforced_free_bytes`` under it
        (default: ``free_bytes``)."""
        self.enforced_free_bytes = enforced_free_bytes
        self.released = 0
        self.model = model
        self.settled_before: list[int] = []
        """For each ``settle()``: how many batches ``model`` had run by then."""

    def read(self) -> MemoryReading:
        enforced_free = self.enforced_free_bytes
        return MemoryReading(
            free_bytes=self.free_bytes, used_bytes=0, limit=self.limit, sources=("scripted",),
            enforced=self.enforced,
            enforced_free_bytes=self.free_bytes if enforced_free is None else enforced_free,
        )  # fmt: skip

    def start_batch(self) -> int | None:
        return None

    def batch_peak(self) -> int | None:
        return None

    def release_cache(self) -> None:
        self.released += 1

    def settle(self) -> None:
        self.settled_before.append(len(self.model.batch_sizes) if self.model else 0)


class LoopBreakingModel(ScriptedModel):
    """Breaks the contract where the batcher loop trusts it: for the input ``BREAK_THE_LOOP``,
    ``forward`` returns None instead of a list, so the loop itself fails (not a forward pass)."""

    def forward(self, items: Sequence[Item]) -> list[Any]:
        if any(item.data == BREAK_THE_LOOP for item in items):
            return None  # type: ignore[return-value]
        return super().forward(items)


BREAK_THE_LOOP = "break the loop"


def loop_breaking_model() -> LoopBreakingModel:
    """Entry point for ``--model python:tests.fakes:loop_breaking_model``."""
    return LoopBreakingModel()


HOLD_LOAD_ENV = "BATCHFIT_TEST_HOLD_LOAD"


def held_loading_model() -> ScriptedModel:
    """Entry point whose load waits (at most 60 s) until the file named by
    ``$BATCHFIT_TEST_HOLD_LOAD`` exists: a replica caught before its model has loaded."""
    release = Path(os.environ[HOLD_LOAD_ENV])
    deadline = time.monotonic() + 60
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return ScriptedModel()


SLOW_FORWARD_ENV = "BATCHFIT_TEST_SLOW_FORWARD"


class SlowWarmUpModel(ScriptedModel):
    """Every pass of more than one short input takes ``seconds`` (a sleep on the model
    thread, which nothing interrupts); the file named by ``$BATCHFIT_TEST_SLOW_FORWARD`` is
    created as the first such pass starts."""

    def __init__(self, seconds: float = 120.0) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, items: Sequence[Item]) -> list[Any]:
        if len(items) > 1 or max(item.cost for item in items) > 8:
            Path(os.environ[SLOW_FORWARD_ENV]).touch()
            time.sleep(self.seconds)
        return super().forward(items)


def slow_warm_up_model() -> SlowWarmUpModel:
    """Entry point for ``--model python:tests.fakes:slow_warm_up_model``."""
    return SlowWarmUpModel()


class FaultyDeviceModel(ScriptedModel):
    """A device that fails on the input ``DEVICE_FAULT``: ``forward`` says it has started (the
    file ``entered`` in ``$BATCHFIT_TEST_FAULT_DIR``), waits for the test to create
    ``release`` there (so that requests can queue up behind it), then raises a CUDA error."""

    def forward(self, items: Sequence[Item]) -> list[Any]:
        if any(item.data == DEVICE_FAULT for item in items):
            folder = Path(os.environ["BATCHFIT_TEST_FAULT_DIR"])
            (folder / "entered").touch()
            deadline = time.monotonic() + 60
            while not (folder / "release").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            raise DeviceError("CUDA error: an illegal memory access was encountered")
        return super().forward(items)


DEVICE_FAULT = "device fault"


def faulty_device_model() -> FaultyDeviceModel:
    """Entry point for ``--model python:tests.fakes:faulty_device_model``."""
    return FaultyDeviceModel()


GATE_ENV = "BATCHFIT_TEST_GATE"


class ScriptedPreparer:
    """What tokenizes for a ``ScriptedModel``, without its threading state: it pickles."""

    def __init__(self, info: ModelInfo) -> None:
        self.info = info

    def prepare(self, inputs: Sequence[str], *, truncate: bool) -> list[Item]:
        return scripted_items(inputs)


class FileGatedModel(ScriptedModel):
    """A batch holding an input that starts with ``hold`` waits (at most 120 s) until the
    file named by ``$BATCHFIT_TEST_GATE`` exists; warm-up and other batches run at once.
    Each output is ``[n]``: how many inputs ran before it, so a test sees the order."""

    def __init__(self) -> None:
        super().__init__()
        self._gate_path = Path(os.environ[GATE_ENV])
        self._ran = 0

    def preparer(self) -> ScriptedPreparer:
        return ScriptedPreparer(self.info)

    def forward(self, items: Sequence[Item]) -> list[Any]:
        if any(str(item.data).startswith("hold") for item in items):
            deadline = time.monotonic() + 120
            while not self._gate_path.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        super().forward(items)
        first, self._ran = self._ran, self._ran + len(items)
        return [[float(first + i)] for i in range(len(items))]


def file_gated_model() -> FileGatedModel:
    """Entry point for ``--model python:tests.fakes:file_gated_model``."""
    return FileGatedModel()
