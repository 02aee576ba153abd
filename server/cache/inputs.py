"""The replica's cache of outputs per input and its table of computations in flight.

``InputCache.admit`` takes a request's tokenized items and decides, input by input: answered
from the store (a hit: never queued), waiting on an equal input already queued or running
(deduplicated), or a new computation to queue. The caller queues only the new ones and
awaits one future per input, in input order; ``release`` ends the request's share of the
computations it joined, whichever way it ended.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from batching import Pending, RequestQueue
from models import Item

from .flights import Flight
from .key import CacheKey, cache_key
from .metrics import CacheMetrics
from .store import OutputStore

MakePending = Callable[[Item, int], Pending]


@dataclass(slots=True)
class Admission:
    """One request's inputs after ``admit``."""

    futures: list[asyncio.Future[Any]]
    """One per input, in input order; a hit's is already done."""
    queued: list[Pending] = field(default_factory=list)
    """The new computations: the caller puts these into the queue."""
    joined: list[tuple[Flight, asyncio.Future[Any]]] = field(default_factory=list)
    """Every computation the request waits on through a flight, with its own future there."""
    own: list[Pending] = field(default_factory=list)
    """The computations the request awaits directly, their futures its own: neither stored
    nor shared nor reshaped, they need no flight between (one turn of the loop fewer)."""
    hits: int = 0

    @property
    def pendings(self) -> list[Pending]:
        """The distinct computations the request waits on (for its trace)."""
        seen: dict[int, Pending] = {id(pending): pending for pending in self.own}
        for flight, _ in self.joined:
            seen.setdefault(id(flight.pending), flight.pending)
        return list(seen.values())


class InputCache:
    """At most ``max_bytes`` of outputs (0: no store), and with ``deduplicate`` one
    computation per key in flight. ``queue`` is the replica's, where a joined computation's
    priority is raised."""

    def __init__(
        self, registry: CollectorRegistry, *, max_bytes: int, deduplicate: bool,
        queue: RequestQueue,
    ) -> None:  # fmt: skip
        self.metrics = CacheMetrics(registry)
        self.deduplicate = deduplicate
        self._queue = queue
        self._flights: dict[CacheKey, Flight] = {}
        self.store: OutputStore | None = None
        self._put: Callable[[CacheKey, Any], bool] | None = None
        self.set_max_bytes(max_bytes)

    def set_max_bytes(self, max_bytes: int) -> None:
        """Bound the store (0: none), dropping what it held; before serving."""
        self.store = OutputStore(max_bytes, on_evict=self.metrics.evicted) if max_bytes else None
        self._put = self.store.put if self.store is not None else None

    @property
    def enabled(self) -> bool:
        return self.store is not None or self.deduplicate

    @property
    def max_bytes(self) -> int:
        return self.store.max_bytes if self.store is not None else 0

    def add_model(self, model: str) -> None:
        def held() -> float:
            return self.store.bytes_by_model.get(model, 0) if self.store is not None else 0.0

        self.metrics.add_model(model, held)

    def in_flight(self) -> int:
        return len(self._flights)

    def admit(
        self, loop: asyncio.AbstractEventLoop, model: str, items: Sequence[Item], *,
        dimensions: int | None, priority: int, deadline_s: float,
        make_pending: MakePending, finish: Callable[[Any], Any] | None,
    ) -> Admission:  # fmt: skip
        """Sort ``items`` into hits, joins and new computations (see the module). ``finish``
        shapes a computed output before it is answered and stored (None: as it is)."""
        store, flights = self.store, self._flights
        table = flights if self.deduplicate else None
        admission = Admission([])
        misses = deduplicated = 0
        enabled = self.enabled
        for index, item in enumerate(items):
            key = cache_key(model, item, dimensions) if enabled else None
            if key is None and finish is None:
                pending = make_pending(item, index)
                admission.futures.append(pending.future)
                admission.queued.append(pending)
                admission.own.append(pending)
                continue
            waiter: asyncio.Future[Any] = loop.create_future()
            admission.futures.append(waiter)
            if key is not None and store is not None:
                found, value = store.get(key)
                if found:
                    waiter.set_result(value)
                    admission.hits += 1
                    continue
                misses += 1
            flight = flights.get(key) if key is not None and table is not None else None
            if flight is not None and flight.open:
                if flight.join(waiter, priority=priority, deadline_s=deadline_s):
                    self._queue.raise_priority(flight.pending, priority)
                deduplicated += 1
            else:
                pending = make_pending(item, index)
                flight = Flight(
                    key, pending, finish=finish or _as_is, on_value=self._put,
                    table=table if key is not None else None,
                )  # fmt: skip
                flight.waiters.append(waiter)
                if key is not None and table is not None:
                    table[key] = flight
                admission.queued.append(pending)
            admission.joined.append((flight, waiter))
        if store is not None or deduplicated:
            self.metrics.count(model, hits=admission.hits, misses=misses, deduplicated=deduplicated)
        return admission

    def release(self, admission: Admission) -> list[Pending]:
        """The request is over: drop its waiters (cancelling those not done) and return the
        computations left with no waiter, now cancelled, for the caller to take out of the
        queue. Safe to call more than once."""
        joined, admission.joined = admission.joined, []
        own, admission.own = admission.own, []
        cancelled = [pending for pending in own if pending.future.cancel()]
        for flight, waiter in joined:
            if not waiter.done():
                waiter.cancel()
            if flight.leave(waiter):
                cancelled.append(flight.pending)
        return cancelled


def _as_is(output: Any) -> Any:
    return output
