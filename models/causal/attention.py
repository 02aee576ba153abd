"""Attention over packed sequences: each sequence's queries against its own cached keys.

Registered with transformers' ``AttentionInterface`` under ``IMPLEMENTATION``; a model set to
it builds no mask of its own (a custom implementation has no mask function), and its
attention layers call ``attend`` with the packed queries of every sequence of the step. Each
sequence then goes through transformers' own ``sdpa_attention_forward`` on the shapes
``generate`` gives it for one sequence: a decode token against every cached key without a
mask, a first chunk with ``is_causal``, a later chunk with a causal mask offset by what is
cached, and sliding-window layers on their window only.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .kv import StepCache

IMPLEMENTATION = "batchfit_packed"


def attend(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``query``: ``[1, heads, T, head_dim]``, every sequence's rows packed; returns
    ``[1, T, heads, head_dim]`` as every attention implementation does."""
    step: StepCache = kwargs.pop("batchfit_step")
    layer = module.layer_idx
    window = sliding_window or getattr(module, "sliding_window", None) or None
    outputs = []
    for index, ((first, end), start, buffer) in enumerate(
        zip(step.spans, step.starts, step.buffers, strict=True)
    ):
        count = end - first
        lowest, mask, causal = _reach(step, index, start, count, window, buffer.device)
        stop = start + count
        keys = buffer[layer, 0, :, lowest:stop].unsqueeze(0)
        values = buffer[layer, 1, :, lowest:stop].unsqueeze(0)
        out, _ = sdpa_attention_forward(
            module, query[:, :, first:end], keys, values, mask, dropout=0.0, scaling=scaling,
            is_causal=causal,
        )  # fmt: skip
        outputs.append(out)
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)), None


def _reach(
    step: StepCache, index: int, start: int, count: int, window: int | None,
    device: torch.device,
) -> tuple[int, torch.Tensor | None, bool]:  # fmt: skip
    """The first key position a sequence's queries see, their mask (None: none needed) and
    whether the kernel's own causal mask is the right one; computed once per step and
    window, for every layer."""
    found = step.masks.get((index, window))
    if found is not None:
        return found
    stop = start + count
    lowest = 0 if window is None else max(0, start - window + 1)
    if count == 1:
        # One query sees every key from ``lowest``: no mask.
        found = (max(0, stop - window) if window is not None else 0, None, False)
    elif start == 0 and (window is None or count <= window):
        found = (0, None, True)  # a first chunk: plain causal attention
    else:
        queries = torch.arange(start, stop, device=device).unsqueeze(1)
        keys = torch.arange(lowest, stop, device=device).unsqueeze(0)
        mask = keys <= queries
        if window is not None:
            mask &= keys > queries - window
        found = (lowest, mask[None, None], False)
    step.masks[(index, window)] = found
    return found


AttentionInterface.register(IMPLEMENTATION, attend)
