"""One request's way through the replica, from its inputs to its outputs: tokenized (inline or
on the tokenizer thread), answered from the output cache or joined to an equal input in
flight, queued, and awaited until every input has its answer, its deadline passes or its
client goes away. The batcher, on the other side of the queue, runs what is queued.

A request's deadline counts from its arrival, before it is tokenized: a burst of large
requests holds the one tokenizer thread, and a request behind them must not get that wait
for free on top of its ``timeout_s``."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from typing import Any

from batching import BatchingMetrics, Clock, ModelThread, Pending, RequestQueue
from models import Item, Span, truncate_dimensions

from ..cache import Admission, InputCache
from ..errors import deadline_exceeded
from ..long_inputs import pool_answer, unwindow
from .pieces import PieceFeeder
from .slot import ModelSlot, prepare_call, tokenize_inline
from .trace import RequestTrace
from .tracking import WorkTracker
from .waiting import ClientWatch, RequestWait


class RequestPath:
    """The request side of ``queue``: what ``Runtime.infer`` and ``Runtime.infer_items`` do
    once a request is admitted (counted in ``work``, its model chosen)."""

    def __init__(
        self, *, queue: RequestQueue, inputs: InputCache, clock: Clock, work: WorkTracker,
        tokenizer_thread: ModelThread, metrics: BatchingMetrics, piece_items: int,
    ) -> None:  # fmt: skip
        self._piece_items = piece_items
        """The most inputs of one request the queue takes at once (``pieces``)."""
        self._queue = queue
        self._inputs = inputs
        self._clock = clock
        self._work = work
        self._tokenizer_thread = tokenizer_thread
        self._metrics = metrics

    async def infer(
        self, slot: ModelSlot, inputs: Sequence[str], *, truncate: bool, timeout_s: float,
        request_id: str, priority: int, query: str | None, trace: RequestTrace,
        client: ClientWatch | None, prompt: str | None = None,
        truncation_direction: str | None = None, dimensions: int | None = None,
        max_tokens_per_doc: int | None = None,
        chunk: bool = False, late_chunks: Sequence[Sequence[Span]] | None = None,
    ) -> tuple[list[Any], int]:  # fmt: skip
        """Tokenize ``inputs`` for ``slot``'s model, then as ``answer``; the deadline counts
        from now, the wait for the tokenizer thread included. ``chunk``: each input's windows
        are queued as inputs of their own, and answered pooled."""
        # NOTE: this clock read is all that counting from the arrival costs the lone
        # request's inline path: no timer, task or allocation of its own.
        arrival_s = self._clock.now()
        assert slot.model is not None
        prepare = prepare_call(
            slot.model, inputs, name=slot.name, truncate=truncate, query=query, prompt=prompt,
            truncation_direction=truncation_direction, max_tokens_per_doc=max_tokens_per_doc,
            chunk=chunk, late_chunks=late_chunks,
        )  # fmt: skip
        alone = self._work.active_requests <= 1  # this one
        if tokenize_inline(slot, inputs, query=query, prompt=prompt, alone=alone):
            prepared = prepare()
        else:
            remaining_s = arrival_s + timeout_s - self._clock.now()
            prepared = await tokenize_on(self._tokenizer_thread, prepare,
                                         remaining_s=remaining_s, timeout_s=timeout_s)  # fmt: skip
        trace.tokenize_s = self._clock.now() - arrival_s
        items, windows = unwindow(prepared)
        outputs, tokens = await self.answer(
            slot, items, timeout_s=timeout_s, request_id=request_id, priority=priority,
            trace=trace, client=client, dimensions=None if windows else dimensions,
            arrival_s=arrival_s,
        )  # fmt: skip
        if windows is not None:
            outputs = pool_answer(outputs, windows, slot.info, dimensions)
        return outputs, tokens

    async def answer(
        self, slot: ModelSlot, items: Sequence[Item], *, timeout_s: float, request_id: str,
        priority: int, trace: RequestTrace, client: ClientWatch | None,
        dimensions: int | None, arrival_s: float | None = None,
    ) -> tuple[list[Any], int]:  # fmt: skip
        """Every one of ``items``' outputs, in order, and their tokens: from the cache, from
        an equal input in flight, or queued here (more than ``piece_items`` of them, a
        piece at a time: ``pieces``). The deadline is ``timeout_s`` after ``arrival_s``
        (None: now); already past, the request ends 504 before it is queued."""
        loop = asyncio.get_running_loop()
        trace.inputs, trace.tokens = len(items), sum(item.cost for item in items)
        now = self._clock.now()
        deadline = (now if arrival_s is None else arrival_s) + timeout_s
        if now >= deadline:  # it waited its whole deadline to be tokenized
            raise deadline_exceeded(timeout_s)
        name = slot.name
        info = slot.info
        cut = dimensions if dimensions is not None and dimensions != info.output_dim else None
        finish = _finisher(cut, bool(info.normalize))

        def admit(part: Sequence[Item], start: int, fed_s: float) -> Admission:
            def make_pending(item: Any, index: int) -> Pending:
                return Pending(
                    item=item, future=loop.create_future(), arrival_s=fed_s,
                    deadline_s=deadline, priority=priority, request_id=request_id,
                    index=start + index, model=name,
                )  # fmt: skip

            return self._inputs.admit(
                loop, name, part, dimensions=cut, priority=priority, deadline_s=deadline,
                make_pending=make_pending, finish=finish,
            )  # fmt: skip

        piece = self._piece_items
        first = admit(items[:piece], 0, now)
        admissions = [first]
        trace.cache_hits = first.hits
        if len(items) <= piece and first.hits == len(first.futures):
            return [future.result() for future in first.futures], trace.tokens
        # NOTE: the wait is set up before the items are queued: the batcher wakes only once
        # this task yields, and a lone request's batch would otherwise start that much later.
        wait = RequestWait(
            loop, first.futures, timeout_s=deadline - now, client=client, count=len(items),
            deadline_error=functools.partial(deadline_exceeded, timeout_s),
        )  # fmt: skip
        feeder = None
        if len(items) > piece:
            feeder = PieceFeeder(self._queue, model=name, piece=piece)
            self._work.track_wait(wait.future)
        try:
            self._queue_admitted(first, feeder)
            for start in range(piece, len(items), piece):
                part = items[start : start + piece]
                assert feeder is not None
                if not await feeder.ready(len(part), wait.future):
                    break  # the wait is over: awaiting it raises why
                admission = admit(part, start, self._clock.now())
                admissions.append(admission)
                trace.cache_hits += admission.hits
                wait.add(admission.futures)
                self._queue_admitted(admission, feeder)
            await wait.future
        finally:
            wait.close()
            trace.record([p for admission in admissions for p in admission.pendings], now)
            # Computations no other request waits for leave the queue and never run: the
            # client went away, the deadline passed, or another input of the request failed.
            left = sum(
                self._queue.discard(self._inputs.release(admission)) for admission in admissions
            )
            if left:
                self._metrics.cancelled.labels("queued").inc(left)
        return [future.result() for a in admissions for future in a.futures], trace.tokens

    def _queue_admitted(self, admission: Admission, feeder: PieceFeeder | None) -> None:
        if admission.queued:
            self._queue.put_many(admission.queued)
            self._work.track(admission.queued)
            if feeder is not None:
                feeder.fed(admission.queued)


async def tokenize_on(
    thread: ModelThread, prepare: Callable[[], Any], *, remaining_s: float, timeout_s: float
) -> Any:
    """``prepare()``'s items, run on ``thread`` (the tokenizer's), awaited at most
    ``remaining_s``: the request's deadline (of ``timeout_s``) ends its wait for its turn
    there too, with 504 ``deadline_exceeded``. A job still queued then is skipped; one
    already running finishes and its items are dropped."""
    if remaining_s <= 0:
        raise deadline_exceeded(timeout_s)
    # NOTE: asyncio.timeout, not wait_for: wait_for wraps the wait in a task of its own.
    scope = asyncio.timeout(remaining_s)
    try:
        async with scope:
            return await thread.call(prepare)
    except TimeoutError:
        if scope.expired():
            raise deadline_exceeded(timeout_s) from None
        raise  # the tokenizer's own


def _finisher(dimensions: int | None, normalize: bool) -> Callable[[Any], Any] | None:
    """What a computed output becomes before it is answered (and stored: the store keeps its
    own read-only copy): cut to ``dimensions`` where given, else as it is (None)."""
    if dimensions is None:
        return None

    def cut(output: Any) -> Any:
        return truncate_dimensions(output, dimensions, normalize)

    return cut
