"""The replica's generators: one ``GenerationEngine`` per generating model, on the replica's
model thread, and one ``GenerationRun`` per request, from admission to its stream's end."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry

from batching import Clock, MemoryProbe, ModelThread
from generation import (
    EngineConfig,
    GenerationEngine,
    GenerationMetrics,
    RequestStream,
    SequenceSpec,
    TokenEvent,
)
from generation import Sequence as GenSequence
from models import Generator

from .tracking import WorkTracker
from .waiting import ClientDisconnected, ClientWatch

log = logging.getLogger("batchfit")


class GenerationRun:
    """One request's sequences, from their admission until their stream is read to its end
    (or abandoned): counted as work in progress (a drain waits for it), and cancelled on
    ``close`` if still running (the client went away, or an error ended the request)."""

    def __init__(
        self, engine: GenerationEngine, stream: RequestStream, sequences: list[GenSequence],
        work: WorkTracker, client: ClientWatch | None,
    ) -> None:  # fmt: skip
        self.model = engine.name
        self._engine = engine
        self.stream = stream
        self.sequences = sequences
        self._work = work
        self._closed = False
        self.client_gone = False
        work.request().__enter__()
        self._unsubscribe = client.subscribe(self._client_gone) if client is not None else None

    def _client_gone(self) -> None:
        self.client_gone = True
        self.stream.fail(ClientDisconnected())
        self._engine.cancel(self.sequences)

    async def next_events(self) -> list[TokenEvent]:
        """As ``RequestStream.next_events``."""
        return await self.stream.next_events()

    def close(self) -> None:
        """The request is done with its sequences: any still running are cancelled."""
        if self._closed:
            return
        self._closed = True
        if self._unsubscribe is not None:
            self._unsubscribe()
        self._engine.cancel(self.sequences)
        self._work.request().__exit__(None, None, None)


class Generators:
    """The replica's generation engines by model name, and their tasks."""

    def __init__(
        self, registry: CollectorRegistry, *, max_step_tokens: int, max_latency_s: float,
        clock: Clock, work: WorkTracker,
    ) -> None:  # fmt: skip
        self.metrics = GenerationMetrics(
            registry, max_step_tokens=max_step_tokens, max_latency_s=max_latency_s
        )
        self._clock = clock
        self._work = work
        self.engines: dict[str, GenerationEngine] = {}
        self._tasks: list[asyncio.Task[None]] = []

    def add(
        self, name: str, model: Generator, *, model_thread: ModelThread, config: EngineConfig,
        probe: MemoryProbe | None,
    ) -> GenerationEngine:  # fmt: skip
        engine = GenerationEngine(
            name=name, model=model, model_thread=model_thread, clock=self._clock,
            metrics=self.metrics.for_model(name), config=config, probe=probe,
        )  # fmt: skip
        self.engines[name] = engine
        return engine

    def start(self, on_done: Callable[[asyncio.Task[None]], None]) -> None:
        for name, engine in self.engines.items():
            task = asyncio.create_task(engine.run(), name=f"batchfit-generate-{name}")
            task.add_done_callback(on_done)
            self._tasks.append(task)

    @property
    def healthy(self) -> bool:
        return all(engine.healthy for engine in self.engines.values()) and not any(
            task.done() for task in self._tasks
        )

    def generate(
        self, name: str, specs: Sequence[SequenceSpec], *, priority: int, timeout_s: float,
        client: ClientWatch | None,
    ) -> GenerationRun:  # fmt: skip
        """Admit one request's sequences to ``name``'s engine (``QueueFull``: none were)."""
        engine = self.engines[name]
        stream, sequences = engine.submit(specs, priority=priority, timeout_s=timeout_s)
        return GenerationRun(engine, stream, sequences, self._work, client)

    def fail_waiting(self, error: BaseException) -> int:
        return sum(engine.fail_waiting(error) for engine in self.engines.values())

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
