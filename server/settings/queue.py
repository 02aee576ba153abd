"""The queue: its capacity, one model's share of it, the most inputs one request brings, and
the order and sharing of what waits."""

from __future__ import annotations

from pydantic import BaseModel, Field

MAX_INPUTS_PER_REQUEST = 256
"""``max_inputs_per_request``'s default, where the queue (or one model's share of it) holds
that many."""


class QueueSettings(BaseModel):
    """The queue's group of ``Settings`` (flags of the same names)."""

    max_queue_items: int = Field(
        1024, ge=1, description="Queue capacity in items; beyond it requests get 429."
    )
    max_queue_share: float = Field(
        1.0,
        gt=0,
        le=1,
        description="With several models: the most of the queue's capacity one model's items "
        "may take (e.g. 0.5), so that a flood to one model cannot fill the queue for the "
        "others; beyond it that model's requests get 429.",
    )
    max_inputs_per_request: int = Field(
        MAX_INPUTS_PER_REQUEST,
        ge=1,
        description="Most inputs in one request; beyond it 413. At most --max-queue-items "
        "(and one model's --max-queue-share of it), so that every request can be admitted: "
        "unset, it is lowered to fit them, and the start-up log says so.",
    )
    max_rerank_documents: int = Field(
        10_000,
        ge=1,
        description="Most documents in one rerank request (/v1/rerank, /v2/rerank); beyond it "
        "413. Past --max-inputs-per-request they enter the queue --max-inputs-per-request at "
        "a time, as room frees, batched with other requests' inputs.",
    )
    deduplicate: bool = Field(
        True,
        description="An input equal to one already queued or running waits for that "
        "computation instead of being computed again.",
    )
    priority_aging_s: float = Field(
        1.0,
        gt=0,
        description="A waiting item's priority rises by one every this many seconds: work "
        "arriving more than d x this after an item d levels below it never overtakes it, so "
        "low priority is delayed, never starved.",
    )
