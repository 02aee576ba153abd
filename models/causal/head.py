"""How many rows the LM head computes at once: a few rows are padded up to a wider matrix
product where the CPU's BLAS runs that faster.

On a CPU, MKL computes a product of fewer than 16 rows with a kernel of its own, whose time
rises with every few rows, and 16 rows or more with a blocked one. For Gemma's LM head
(262,144 words by 640) here: 1 row 26 ms, 4 rows 54, 8 rows 83, 15 rows 146, and 16 rows
53. So a step whose sampled rows are between a threshold and 16 computes 16 (the last row
repeated) and keeps its own. The threshold is measured on the model's own head when it
loads: the fewest rows that take as long as ``PAD_ROWS`` do. Below it, and for a lone row
(as ``generate`` computes it, so that one sequence's output stays its output), nothing is
padded. A head too small to matter, or one on another device, is never padded.
"""

from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger(__name__)

PAD_ROWS = 16
TRIED_ROWS = (2, 4, 8)
MIN_HEAD_ELEMENTS = 16 * 1024 * 1024
"""A head of fewer weights (vocabulary by hidden size) is cheap whatever its rows: not
measured, not padded."""
REPEATS = 2


def padding_threshold(head: torch.nn.Module | None, device: torch.device) -> int | None:
    """The fewest sampled rows that are padded up to ``PAD_ROWS`` (None: none are)."""
    weight = getattr(head, "weight", None)
    if device.type != "cpu" or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    if weight.numel() < MIN_HEAD_ELEMENTS:
        return None
    with torch.inference_mode():
        wide = _time(weight, PAD_ROWS)
        for rows in TRIED_ROWS:
            took = _time(weight, rows)
            if took >= wide:
                log.info(
                    "LM head: %d to %d sampled rows are computed as %d (%.1f ms for %d rows, "
                    "%.1f ms for %d)", rows, PAD_ROWS - 1, PAD_ROWS, took * 1e3, rows,
                    wide * 1e3, PAD_ROWS,
                )  # fmt: skip
                return rows
    return None


def head_rows(count: int, threshold: int | None) -> int:
    """How many rows the head computes for ``count`` sampled rows."""
    if threshold is None or not threshold <= count < PAD_ROWS:
        return count
    return PAD_ROWS


def padded_rows(rows: list[int], threshold: int | None) -> list[int]:
    """``rows`` (indices into the step's tokens) with the last one repeated up to
    ``PAD_ROWS`` where there are at least ``threshold`` of them and fewer than that."""
    extra = head_rows(len(rows), threshold) - len(rows)
    return rows + [rows[-1]] * extra if extra else rows


def _time(weight: torch.Tensor, rows: int) -> float:
    """The best of ``REPEATS`` products of ``rows`` rows, after one to warm up."""
    hidden = torch.zeros(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
    torch.nn.functional.linear(hidden, weight)
    best = float("inf")
    for _ in range(REPEATS):
        started = time.perf_counter()
        torch.nn.functional.linear(hidden, weight)
        best = min(best, time.perf_counter() - started)
    return best
