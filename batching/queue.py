"""Bounded request queue ordered by priority, then arrival. Owned by the event loop.

Starvation of low priority is bounded by aging: with ``priority_aging_s`` set, an item's
effective priority is its priority plus one for every ``priority_aging_s`` seconds it has
waited. Work that arrives more than ``d * priority_aging_s`` after an item ``d`` levels below
it can never overtake that item, so however much high-priority work keeps coming, a low item
waits at most for what arrived before it or within that window after it. FIFO within a
priority holds (an older item has always aged at least as much).

With several models, every entry carries its model's name; the capacity is shared, and
``max_items_per_model`` (optional) caps what one model may hold, so that a flood to one model
cannot fill the queue for the others.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import NeverAdmitted, QueueFull


@dataclass(eq=False, slots=True)
class BatchRun:
    """One forward pass, as each of its items remembers it (one object the batch shares):
    what the response headers and a request's trace spans report."""

    number: int
    """Counts the batcher's passes from 1."""
    size: int
    tokens: int
    """Its items' tokens."""
    padded_tokens: int
    """``size`` x its longest item: what the forward pass computes."""
    started_s: float
    finished_s: float | None = None
    """When its outputs came back (None: it failed, or runs still)."""


@dataclass(eq=False, slots=True)
class Pending:
    """One input waiting for the model, with the future its request awaits."""

    item: Any  # has an int ``cost``
    future: asyncio.Future[Any]
    arrival_s: float
    deadline_s: float
    priority: int = 0
    request_id: str = ""
    index: int = 0
    model: str = ""
    """Which model runs this item; batch-mates always share it."""
    seq: int = field(default=0, init=False)
    started_s: float | None = field(default=None, init=False)
    """When its first forward pass started (set by the batcher; the queue wait ends here)."""
    batch: tuple[int, int] | None = field(default=None, init=False)
    """(number, items) of the last forward pass it ran in; an OOM split runs it again."""
    run: BatchRun | None = field(default=None, init=False)
    """The last forward pass it ran in (as ``batch``), with its times and tokens."""

    @property
    def cost(self) -> int:
        return self.item.cost

    @property
    def cancelled(self) -> bool:
        return self.future.done()

    def sort_key(self) -> tuple[int, int]:
        return (-self.priority, self.seq)


class RequestQueue:
    """Holds at most ``max_items`` live items; a full queue rejects a whole request at once."""

    def __init__(
        self,
        max_items: int,
        *,
        retry_after_s: float = 1.0,
        priority_aging_s: float | None = None,
        max_items_per_model: int | None = None,
    ) -> None:
        if max_items < 1:
            raise ValueError(f"max_items must be at least 1, got {max_items}")
        if max_items_per_model is not None and not 1 <= max_items_per_model <= max_items:
            raise ValueError(
                f"max_items_per_model must be in [1, {max_items}], got {max_items_per_model}"
            )
        self.max_items_per_model = max_items_per_model
        if priority_aging_s is not None and not priority_aging_s > 0:
            raise ValueError(f"priority_aging_s must be positive, got {priority_aging_s}")
        self.priority_aging_s = priority_aging_s
        self.max_items = max_items
        self.retry_after_s = retry_after_s
        self.changed = asyncio.Event()
        self._items: list[Pending] = []
        self._seq = itertools.count()
        self.on_drop: Callable[[list[Pending]], None] | None = None
        """Called with the entries ``purge`` dropped (the batcher counts them)."""
        self._room_waiters: list[asyncio.Future[None]] = []

    def __len__(self) -> int:
        return len(self._items)

    def put_many(self, pendings: Sequence[Pending]) -> None:
        """Admit all of ``pendings`` or none of them: ``QueueFull`` while the queue (or the
        model's share of it) has no room for them now, ``NeverAdmitted`` when it never can."""
        share = self.max_items_per_model
        model = pendings[0].model if pendings else ""
        if len(pendings) > self.max_items:
            raise NeverAdmitted(len(pendings), self.max_items)
        if share is not None and len(pendings) > share:
            raise NeverAdmitted(len(pendings), share, model=model)
        self.purge()
        if len(self._items) + len(pendings) > self.max_items:
            raise QueueFull(len(self._items), self.max_items, self.retry_after_s)
        if share is not None and pendings:
            held = sum(1 for p in self._items if p.model == model)
            if held + len(pendings) > share:
                raise QueueFull(held, share, self.retry_after_s, model=model)
        for pending in pendings:
            pending.seq = next(self._seq)
            bisect.insort(self._items, pending, key=Pending.sort_key)
        self.changed.set()

    def has_room(self, count: int, model: str) -> bool:
        """Whether ``count`` more items of ``model`` would be admitted now."""
        self.purge()
        if len(self._items) + count > self.max_items:
            return False
        share = self.max_items_per_model
        return share is None or sum(1 for p in self._items if p.model == model) + count <= share

    def room_freed(self) -> asyncio.Future[None]:
        """A future that ends the next time entries leave the queue (taken into a batch,
        discarded or purged): a request admitted in pieces awaits it for room for the next."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._room_waiters.append(waiter)
        return waiter

    def _freed(self) -> None:
        waiters, self._room_waiters = self._room_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def purge(self) -> list[Pending]:
        """Drop entries whose future already ended (cancelled, timed out); return them."""
        dropped = [p for p in self._items if p.cancelled]
        if dropped:
            self._items = [p for p in self._items if not p.cancelled]
            if self.on_drop is not None:
                self.on_drop(dropped)
            self._freed()
        return dropped

    def waiting(
        self, limit: int | None = None, *, now: float | None = None, model: str | None = None
    ) -> list[Pending]:
        """Live entries, highest priority first, FIFO within a priority; only ``model``'s
        when given.

        Given ``now`` (and aging), the order is by effective priority at ``now``.
        """
        self.purge()
        items = self._items
        if model is not None:
            items = [p for p in items if p.model == model]
        # Sorted by base priority, so the ends differ exactly when priorities are mixed.
        mixed = bool(items) and items[0].priority != items[-1].priority
        if now is not None and self.priority_aging_s and mixed:
            items = sorted(items, key=lambda p: (-self.effective_priority(p, now), p.seq))
        return items[:limit] if limit is not None else list(items)

    def effective_priority(self, pending: Pending, now: float) -> int:
        if not self.priority_aging_s:
            return pending.priority
        return pending.priority + int(max(0.0, now - pending.arrival_s) / self.priority_aging_s)

    def discard(self, pendings: Iterable[Pending]) -> int:
        """Remove those of ``pendings`` still waiting; return how many were."""
        before = len(self._items)
        self.remove(pendings)
        return before - len(self._items)

    def raise_priority(self, pending: Pending, priority: int) -> None:
        """Give ``pending`` (queued or not) a higher ``priority``; a queued entry moves to
        its new place, keeping its arrival (so its place among equals and its aging)."""
        if priority <= pending.priority:
            return
        queued = any(p is pending for p in self._items)
        if queued:
            self.remove((pending,))
        pending.priority = priority
        if queued:
            bisect.insort(self._items, pending, key=Pending.sort_key)
            self.changed.set()

    def remove(self, pendings: Iterable[Pending]) -> None:
        taken = {id(p) for p in pendings}
        if taken:
            self._items = [p for p in self._items if id(p) not in taken]
            if self._room_waiters:
                self._freed()

    async def wait_not_empty(self) -> None:
        while not self.waiting(1):
            self.changed.clear()
            await self.changed.wait()
