"""Memory: how batches are sized from it, the most the replica may use, the warm-up's
calibration, what an idle replica hands back, and the output cache's share."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ByteSize, Field


class MemorySettings(BaseModel):
    """The memory's group of ``Settings`` (flags of the same names)."""

    sizer: Literal["adaptive", "fixed"] = Field(
        "adaptive",
        description="adaptive sizes each batch from live memory readings; fixed uses only "
        "--max-batch-size and --max-batch-tokens.",
    )
    memory_headroom: float = Field(
        0.15,
        ge=0,
        lt=1,
        description="Share of the free memory the adaptive sizer leaves unused.",
    )
    memory_limit: ByteSize | None = Field(
        None,
        description="Most memory the server lets itself use (e.g. 2GiB): caps the batch budget, "
        "and on CPU also sets an address-space limit once the model is loaded, so a runaway "
        "batch gets a real allocation failure instead of swapping the host.",
    )
    warmup_timeout_s: float | None = Field(
        None,
        gt=0,
        description="Time bound of the warm-up's calibration: it proves the longest input "
        "length it can within this many seconds (and the memory budget), and the fitted "
        "memory model predicts beyond it. Default: 20 times its first full batch, at least "
        "10 s.",
    )
    memory_release_idle_s: float = Field(
        10.0,
        ge=0,
        description="Once no inference request has been in progress for this long, hand the "
        "free memory the C allocator holds back to the OS (glibc malloc_trim), so a quiet "
        "replica's resident memory is what it uses, not what its last burst left behind. "
        "0 turns it off.",
    )
    cache_bytes: ByteSize | None = Field(
        None,
        description="Most bytes of outputs the replica keeps, per input, to answer a repeated "
        "input without computing it again (least recently used evicted first). Default: 1/20 "
        "of the host memory the replica may use (the smallest of the host's total, its "
        "memory cgroup's limit and, on CPU, --memory-limit), in whole MiB; 0 turns it off.",
    )
