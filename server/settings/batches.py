"""How batches form: their caps, how long an input waits for batch-mates, which inputs go
together, and how the passes run."""

from __future__ import annotations

from pydantic import BaseModel, Field


class BatchSettings(BaseModel):
    """The batches' group of ``Settings`` (flags of the same names)."""

    max_batch_size: int = Field(
        128,
        ge=1,
        description="Most items in one forward pass. A generous cap: within it the memory "
        "budget and the time model choose each batch.",
    )
    max_batch_tokens: int = Field(
        4096,
        ge=1,
        description="Most padded tokens (items x longest input) in one forward pass. On a CPU "
        "larger passes cost more per token (they outgrow the caches), which the time model "
        "cannot see; within the cap the memory budget and the time model choose.",
    )
    max_wait_ms: float = Field(
        0.0,
        ge=0,
        le=1000,
        description="How long the oldest waiting item may wait for batch-mates while the model "
        "is idle. Batches mostly form while the model runs the previous one.",
    )
    max_length_ratio: float | None = Field(
        2.0,
        ge=1,
        description="Longest / shortest input in one batch (plus 16 tokens of slack); a short "
        "input padded to a long one's length wastes compute. A large value lifts the bound. "
        "Applies while --plan-by-time is off or has no fitted model yet.",
    )
    plan_by_time: bool = Field(
        True,
        description="Choose batch-mates with a model of forward time (a + b*n*L + c*n*L^2 for n "
        "inputs padded to L tokens) fitted to the last 256 batches: the oldest input's batch "
        "spans its lengths in the split of the queue that takes least time in all.",
    )
    target_latency_ms: float | None = Field(
        None,
        gt=0,
        description="Optional cap on a batch's compute time: padded tokens shrink after a "
        "slower batch and grow back after faster ones (AIMD).",
    )
    oom_split: bool = Field(
        True,
        description="Retry a batch that ran out of memory as two halves, down to one input; "
        "off fails the whole batch with 507, as most servers do.",
    )
    cpu_passes: int = Field(
        0,
        ge=0,
        le=16,
        description="Forward passes at once on a CPU while work waits, each on its share of "
        "the threads (1: one pass at a time, on every thread). Default 0: one per thread, up "
        "to 4, where memory cannot bind them (that many of the largest batch the caps allow fit in "
        "half the memory budget) and the passes are heavy; a batch planned while nothing "
        "else waits still runs alone on every thread.",
    )
