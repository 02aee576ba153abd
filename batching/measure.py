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
    outputs, baseline = forward_from_baseline(
        forward, items, probe=probe, oom_errors=oom_errors, settle=settle
    )
    return outputs, peak_above(probe, baseline)


def forward_from_baseline(
    forward: Forward,
    items: Sequence[Any],
    *,
    probe: MemoryProbe | None,
    oom_errors: tuple[type[BaseException], ...] = (),
    settle: bool = False,
    measure: bool = True,
) -> tuple[list[Any], int | None]:
    """``measured_forward``'s first half: the forward pass and the memory in use before it
    (the baseline, None without a probe or ``measure``). ``peak_above`` is the second, which
    may come later: the probe's peak only grows until the next ``start_batch``. Unmeasured,
    the probe still releases its cache after an OOM error."""
    settle_memory = getattr(probe, "settle", None) if settle else None
    if settle_memory is not None:
        settle_memory()
    baseline = probe.start_batch() if probe is not None and measure else None
    try:
        return forward(items), baseline
    except oom_errors:
        release = getattr(probe, "release_cache", None)
        if release is not None:
            release()
        raise


def peak_above(probe: MemoryProbe | None, baseline: int | None) -> int | None:
    """The peak since ``forward_from_baseline`` started its pass, above its baseline (None
    where either is unknown)."""
    peak = probe.batch_peak() if probe is not None and baseline is not None else None
    if baseline is None or peak is None:
        return None
    return max(0, peak - baseline)
