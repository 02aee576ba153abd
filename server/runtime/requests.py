"""One request's way through the replica, from its inputs to its outputs: tokenized (inline or
on the tokenizer thread), answered from the output cache or joined to an equal input in
flight, queued, and awaited until every input has its answer, its deadline passes or its
client goes away. The batcher, on the other side of the queue, runs what is queued."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from typing import Any

from batching import BatchingMetrics, Clock, ModelThread, Pending, RequestQueue
from models import Item, truncate_dimensions

from ..cache import InputCache
from ..errors import deadline_exceeded
from .slot import ModelSlot, prepare_call, tokenize_inline
from .trace import RequestTrace
from .tracking import WorkTracker
from .waiting import ClientDisconnected, ClientWatch, RequestWait


class RequestPath:
    """The request side of ``queue``: what ``Runtime.infer`` and ``Runtime.infer_items`` do
    once a request is admitted (counted in ``work``, its model chosen)."""

    def __init__(
        self, *, queue: RequestQueue, inputs: InputCache, clock: Clock, work: WorkTracker,
        tokenizer_thread: ModelThread, metrics: BatchingMetrics,
    ) -> None:  # fmt: skip
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
    ) -> tuple[list[Any], int]:  # fmt: skip
        """Tokenize ``inputs`` for ``slot``'s model, then as ``answer``."""
        assert slot.model is not None
        prepare = prepare_call(
            slot.model, inputs, name=slot.name, truncate=truncate, query=query, prompt=prompt,
            truncation_direction=truncation_direction,
        )  # fmt: skip
        alone = self._work.active_requests <= 1  # this one
        if tokenize_inline(slot, inputs, query=query, prompt=prompt, alone=alone):
            items = prepare()
        else:
            items = await self._tokenizer_thread.call(prepare)
        return await self.answer(
            slot, items, timeout_s=timeout_s, request_id=request_id, priority=priority,
            trace=trace, client=client, dimensions=dimensions,
        )  # fmt: skip

    async def answer(
        self, slot: ModelSlot, items: Sequence[Item], *, timeout_s: float, request_id: str,
        priority: int, trace: RequestTrace, client: ClientWatch | None,
        dimensions: int | None,
    ) -> tuple[list[Any], int]:  # fmt: skip
        """Every one of ``items``' outputs, in order, and their tokens: from the cache, from
        an equal input in flight, or queued here."""
        loop = asyncio.get_running_loop()
        trace.inputs, trace.tokens = len(items), sum(item.cost for item in items)
        now = self._clock.now()
        deadline = now + timeout_s
        name = slot.name

        def make_pending(item: Any, index: int) -> Pending:
            return Pending(
                item=item, future=loop.create_future(), arrival_s=now, deadline_s=deadline,
                priority=priority, request_id=request_id, index=index, model=name,
            )  # fmt: skip

        info = slot.info
        cut = dimensions if dimensions is not None and dimensions != info.output_dim else None
        admission = self._inputs.admit(
            loop, name, items, dimensions=cut, priority=priority, deadline_s=deadline,
            make_pending=make_pending, finish=_finisher(cut, bool(info.normalize)),
        )  # fmt: skip
        trace.cache_hits = admission.hits
        futures = admission.futures
        if admission.hits == len(futures):
            return [future.result() for future in futures], trace.tokens
        # NOTE: the wait is set up before the items are queued: the batcher wakes only once
        # this task yields, and a lone request's batch would otherwise start that much later.
        wait = RequestWait(
            loop, futures, timeout_s=timeout_s, client=client,
            deadline_error=functools.partial(deadline_exceeded, timeout_s),
        )  # fmt: skip
        disconnected = False
        try:
            if admission.queued:
                self._queue.put_many(admission.queued)
                self._work.track(admission.queued)
            await wait.future
        except ClientDisconnected:
            disconnected = True
            raise
        finally:
            wait.close()
            trace.record(admission.pendings)
            # Computations no other request waits for leave the queue and never run.
            left = self._queue.discard(self._inputs.release(admission))
            if disconnected:
                self._metrics.cancelled.labels("queued").inc(left)
        return [future.result() for future in futures], trace.tokens


def _finisher(dimensions: int | None, normalize: bool) -> Callable[[Any], Any] | None:
    """What a computed output becomes before it is answered (and stored: the store keeps its
    own read-only copy): cut to ``dimensions`` where given, else as it is (None)."""
    if dimensions is None:
        return None

    def cut(output: Any) -> Any:
        return truncate_dimensions(output, dimensions, normalize)

    return cut
