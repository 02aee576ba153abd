"""Attention over packed sequences: each sequence's queries against its own cached keys.

Registered with transformers' ``AttentionInterface`` under ``IMPLEMENTATION``; a model set to
it builds no mask of its own (a custom implementation has no mask function), and its
attention layers call ``attend`` with the packed queries of every sequence of the step. Each
sequence goes through torch's scaled-dot-product attention on the shapes ``generate`` gives
it for one sequence, chosen as transformers' ``sdpa_attention_forward`` chooses: a decode
token against every cached key without a mask, a first chunk with ``is_causal``, a later
chunk with a causal mask offset by what is cached, and sliding-window layers on their window
only. The kernel is called directly: the wrapper's checks, run for every sequence of every
layer, cost more than the attention of a short sequence.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa
from transformers import AttentionInterface

from .kv import StepCache

IMPLEMENTATION = "batchfit_packed"
GQA_HEAD_DIM = 256
"""Past this head width transformers repeats the key/value heads instead of asking the
kernel for grouped-query attention (``use_gqa_in_sdpa``); so do we."""


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
    kind, slot = step.slots[layer]
    # A layer the store keeps a window of reads that window (the module's own).
    window = step.windows[layer] or sliding_window or getattr(module, "sliding_window", None)
    groups = getattr(module, "num_key_value_groups", 1)
    alone = len(step.spans) == 1
    outputs = []
    for region, first, end, mask, causal in _reads(step, kind, window or None, query.device):
        both = region[slot]
        outputs.append(
            _one(query[:, :, first:end], both[0:1], both[1:2], mask, causal, scaling, groups, alone)
        )
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
    return out.transpose(1, 2).contiguous(), None


def _one(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
    causal: bool, scaling: float | None, groups: int, alone: bool,
) -> torch.Tensor:  # fmt: skip
    """One sequence's attention, ``[1, heads, n, head_dim]``. Alone in its step, with the
    kernel options transformers' ``sdpa_attention_forward`` picks for the same shapes, so
    that its output is ``generate``'s; beside others, a decode token's query heads go in as
    its group's queries (below), which takes half the time of the kernel's own grouping and
    rounds differently only in the last bits."""
    if groups > 1:
        if mask is None and keys.shape[-1] <= GQA_HEAD_DIM and (alone or causal):
            return sdpa(query, keys, values, is_causal=causal, scale=scaling, enable_gqa=True)
        if not causal:
            # A group's query heads as that group's queries, one after the other, each row
            # with its own mask: no copy of the keys and values for every head, as repeating
            # them would make (4 copies of a deep prompt's keys, every layer, for Gemma 3).
            heads, count, dim = query.shape[1], query.shape[2], query.shape[3]
            packed = query.reshape(1, heads // groups, groups * count, dim)
            if mask is not None:
                mask = mask.repeat(1, 1, groups, 1)
            out = sdpa(packed, keys, values, attn_mask=mask, scale=scaling)
            return out.reshape(1, heads, count, dim)
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
    return sdpa(query, keys, values, attn_mask=mask, is_causal=causal, scale=scaling)


def _reads(
    step: StepCache, kind: int, window: int | None, device: torch.device
) -> list[tuple[torch.Tensor, int, int, torch.Tensor | None, bool]]:
    """For each sequence of the step: the keys and values its queries see in its buffer of
    this kind, every layer of it (``[layers, 2, kv_heads, n, head_dim]``), its rows of the
    packed step, their mask (None: none needed) and whether the kernel's own causal mask is
    the right one; computed once per step, kind and window, for every layer."""
    found = step.reads.get((kind, window))
    if found is not None:
        return found
    found = []
    for (first, end), start, seq in zip(step.spans, step.starts, step.seqs, strict=True):
        count = end - first
        stop = start + count
        lowest = 0 if window is None else max(0, start - window + 1)
        mask = None
        causal = False
        if count == 1:
            # One query sees every key from ``lowest``: no mask.
            lowest = max(0, stop - window) if window is not None else 0
        elif start == 0 and (window is None or count <= window):
            causal = True  # a first chunk: plain causal attention
        else:
            queries = torch.arange(start, stop, device=device).unsqueeze(1)
            keys = torch.arange(lowest, stop, device=device).unsqueeze(0)
            allowed = keys <= queries
            if window is not None:
                allowed &= keys > queries - window
            mask = allowed[None, None]
        buffer, base = seq.layer(kind)
        found.append((buffer[:, :, :, lowest - base : stop - base], first, end, mask, causal))
    step.reads[(kind, window)] = found
    return found


AttentionInterface.register(IMPLEMENTATION, attend)
