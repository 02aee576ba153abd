"""The key/value store: one buffer per sequence, allocated as it grows and freed as it ends.

A sequence's buffer is ``[layers, 2, kv_heads, capacity, head_dim]``; attention reads a view
of its first positions, with no gather and no copy per step. Growing copies the buffer into
one half again as large (rounded up), so a sequence of ``n`` tokens is copied O(n) times in
all; freeing drops it at once, so what the store holds follows the sequences that run.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

GROWTH = 1.5
ROUND_TO = 64
"""Capacities are whole multiples of this many tokens."""


class KVStore:
    def __init__(
        self, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
        device: torch.device,
    ) -> None:  # fmt: skip
        self._shape = (num_layers, 2, num_kv_heads)
        self._head_dim = head_dim
        self._dtype = dtype
        self._device = device
        element = torch.empty((), dtype=dtype).element_size()
        self.bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * element
        self._buffers: dict[int, torch.Tensor] = {}
        self._held_tokens = 0

    @property
    def bytes_held(self) -> int:
        return self._held_tokens * self.bytes_per_token

    def __len__(self) -> int:
        return len(self._buffers)

    def capacity(self, seq_id: int) -> int:
        buffer = self._buffers.get(seq_id)
        return 0 if buffer is None else buffer.shape[3]

    def reserve(self, seq_id: int, length: int, *, keep: int) -> torch.Tensor:
        """The buffer of ``seq_id`` with room for ``length`` positions, its first ``keep``
        kept (grown, or allocated for a new sequence)."""
        buffer = self._buffers.get(seq_id)
        capacity = 0 if buffer is None else buffer.shape[3]
        if length <= capacity:
            assert buffer is not None
            return buffer
        wanted = max(length, int(capacity * GROWTH))
        wanted = -(-wanted // ROUND_TO) * ROUND_TO
        grown = torch.empty(
            (*self._shape, wanted, self._head_dim), dtype=self._dtype, device=self._device
        )
        if buffer is not None and keep:
            grown[:, :, :, :keep] = buffer[:, :, :, :keep]
        self._buffers[seq_id] = grown
        self._held_tokens += wanted - capacity
        return grown

    def free(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            buffer = self._buffers.pop(seq_id, None)
            if buffer is not None:
                self._held_tokens -= buffer.shape[3]

    def clear(self) -> None:
        self.free(list(self._buffers))


class StepCache:
    """The ``cache`` a model's forward pass gets for one step: each attention layer's
    ``update`` writes the step's new keys and values of every sequence into that sequence's
    buffer (rows ``spans[i]`` of the packed step go to positions ``starts[i]`` onwards) and
    leaves the step in ``kwargs`` for the attention function (``attention.py``)."""

    is_compileable = False

    def __init__(
        self, spans: Sequence[tuple[int, int]], starts: Sequence[int],
        buffers: Sequence[torch.Tensor],
    ) -> None:  # fmt: skip
        self.spans = spans
        self.starts = starts
        self.buffers = buffers
        self.masks: dict[tuple[int, int | None], tuple[int, torch.Tensor | None, bool]] = {}
        """What each sequence attends to, per window (None: every position): the first key
        position, the mask, and whether it is causal without one; shared by its layers."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
        kwargs: dict[str, Any] | None = None, **_: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        for (first, end), start, buffer in zip(self.spans, self.starts, self.buffers, strict=True):
            stop = start + end - first
            buffer[layer_idx, 0, :, start:stop] = key_states[0, :, first:end]
            buffer[layer_idx, 1, :, start:stop] = value_states[0, :, first:end]
        if kwargs is not None:
            kwargs["batchfit_step"] = self
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0
