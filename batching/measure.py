"""One forward pass and its peak memory, as the batcher and bulk jobs both measure it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .probes import MemoryProbe

Forward = Callable[[Sequence[Any]], list[Any]]


def measured_forward(
    forward: Forward,
    items: Sequence[Any],
    *,
    probe: MemoryProbe | None,
    oom_errors: tuple[type[BaseException], ...] = (),
    settle: bool = False,
) -> tuple[list[Any], int | None]:
    """Run ``forward(items)`` on the calling thread (the model thread); return its outputs and
    its peak memory above the baseline (None where the probe measures no peaks).

    With ``settle`` (calibration), the probe first settles memory (``settle()``, where it has
    one). NOTE: a host batch that reuses free blocks the allocator still holds adds less to
    the resident peak than it needs; calibrated on such a reading, the sizer under-predicted a
    5 x 256 batch by 28% and overshot --memory-limit. After an OOM error the probe releases
    its cache (``release_cache()``: the CUDA allocator's), then the error propagates."""
    settle_memory = getattr(probe, "settle", None) if settle else None
    if settle_memory is not None:
        settle_memory()
    baseline = probe.start_batch() if probe is not None else None
    try:
        outputs = forward(items)
    except oom_errors:
        release = getattr(probe, "release_cache", None)
        if release is not None:
            release()
        raise
    peak = probe.batch_peak() if probe is not None else None
    if baseline is None or peak is None:
        return outputs, None
    return outputs, max(0, peak - baseline)
