"""The key/value store: buffers per sequence, allocated as it grows and freed as it ends.

A sequence's full-attention layers share one buffer ``[layers, 2, kv_heads, capacity,
head_dim]`` from position 0; attention reads a view of its first positions, with no gather
and no copy per step. Growing copies the buffer into one an eighth again as large (rounded
up), so a sequence of ``n`` tokens copies about ``8 n`` positions in all (milliseconds over
its life) and holds at most an eighth (or ``ROUND_TO`` positions) more than it uses; the
budget counts what it holds. Freeing drops it at once, so what the store holds follows the
sequences that run.

Sliding-window layers (Gemma 3's five in six) share a second buffer of the same layout that
starts at position ``base``: a query sees only the last ``window`` keys, so once a sequence
passes its window, what its earlier queries no longer need is dropped by moving the live
positions to the front (once every ``WINDOW_SLACK`` tokens) and the buffer stays at
``window_tokens`` positions, however long the sequence.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

GROWTH = 1.125
ROUND_TO = 64
"""Capacities are whole multiples of this many tokens."""
WINDOW_SLACK = 64
"""Positions a sliding-window buffer holds past its window, so that its live positions are
moved to the front once every this many tokens, not every token."""
FULL, WINDOW = 0, 1
KEEP, GROW, MOVE, FRESH = range(4)
"""What a sliding-window buffer does to take a step's positions (``KVStore._window_plan``)."""


def _rounded(tokens: int) -> int:
    return -(-tokens // ROUND_TO) * ROUND_TO


def _grown_size(capacity: int, length: int) -> int:
    """The slots a buffer of ``capacity`` grows to, to hold ``length``: ``GROWTH`` at least."""
    return _rounded(max(length, int(capacity * GROWTH)))


def _to_front(buffer: torch.Tensor, start: int, stop: int) -> None:
    """Slots ``start:stop`` of ``buffer`` to its front, in place: in copies of at most
    ``start`` slots, none of which overlaps its source or a source still to be read (a
    clone of the live slots would take as much again, a window's worth, for the copy)."""
    count = stop - start
    if start <= 0:
        return  # already there
    for first in range(0, count, start):
        last = min(first + start, count)
        buffer[:, :, :, first:last].copy_(buffer[:, :, :, start + first : start + last])


def _nbytes(buffer: torch.Tensor) -> int:
    return buffer.numel() * buffer.element_size()


class SeqBuffers:
    """One sequence's keys and values: ``full`` from position 0, ``window`` (sliding-window
    layers) from position ``base``; either is None where the model has no such layers."""

    __slots__ = ("base", "full", "length", "window")

    def __init__(self) -> None:
        self.full: torch.Tensor | None = None
        self.window: torch.Tensor | None = None
        self.base = 0
        self.length = 0
        """The positions it has (those its last step reserved)."""

    def layer(self, kind: int) -> tuple[torch.Tensor, int]:
        """The buffer of this kind of layer and the position its first slot holds."""
        if kind == FULL:
            assert self.full is not None
            return self.full, 0
        assert self.window is not None
        return self.window, self.base


class KVStore:
    def __init__(
        self, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
        device: torch.device, windows: Sequence[int | None] | None = None,
    ) -> None:  # fmt: skip
        """``windows``: each layer's sliding window (None: full attention; default: every
        layer full)."""
        self.windows = list(windows) if windows is not None else [None] * num_layers
        full = [i for i, w in enumerate(self.windows) if w is None]
        windowed = [i for i, w in enumerate(self.windows) if w is not None]
        self.slots = [(FULL, full.index(i)) if w is None else (WINDOW, windowed.index(i))
                      for i, w in enumerate(self.windows)]  # fmt: skip
        """Each layer's kind and its index in that kind's buffer."""
        self._counts = (len(full), len(windowed))
        self._window = max((w for w in self.windows if w is not None), default=0)
        self._head = (num_kv_heads, head_dim)
        self._dtype = dtype
        self._device = device
        element = torch.empty((), dtype=dtype).element_size()
        layer_bytes = 2 * num_kv_heads * head_dim * element
        self.bytes_per_token = num_layers * layer_bytes
        """What one token of a sequence holds in every layer."""
        self.window_bytes_per_token = len(windowed) * layer_bytes
        """The part of it the sliding-window layers hold ..."""
        self.window_tokens = _rounded(self._window + WINDOW_SLACK) if windowed else 0
        """... for at most this many tokens of a sequence (a longer prefill chunk excepted)."""
        self._layer_bytes = layer_bytes
        self._seqs: dict[int, SeqBuffers] = {}
        self.bytes_held = 0

    def sequence_bytes(self, num_tokens: int) -> int:
        """What a sequence of ``num_tokens`` holds once it decodes (capacity rounding aside)."""
        past_window = max(0, num_tokens - self.window_tokens) if self.window_tokens else 0
        return num_tokens * self.bytes_per_token - past_window * self.window_bytes_per_token

    def __len__(self) -> int:
        return len(self._seqs)

    def reserve(self, seq_id: int, length: int, *, keep: int, expect: int = 0) -> SeqBuffers:
        """The buffers of ``seq_id`` with room for positions up to ``length``, the first
        ``keep`` kept (what queries from ``keep`` on still see, in the sliding-window ones).
        A buffer that must grow grows to hold ``expect`` positions at once, where more (the
        rest of a prompt fed in chunks): one allocation and no copy per chunk."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = self._seqs[seq_id] = SeqBuffers()
        if self._counts[FULL]:
            capacity = 0 if seq.full is None else seq.full.shape[3]
            if length > capacity:
                size = _grown_size(capacity, max(length, expect))
                seq.full = self._replaced(seq.full, self._counts[FULL], size, 0, keep)
        if self._counts[WINDOW]:
            self._slide(seq, length, keep, expect)
        seq.length = length
        return seq

    def slack_bytes(self) -> int:
        """What the buffers hold past their sequences' positions: capacity to grow into."""
        used = sum(self.sequence_bytes(seq.length) for seq in self._seqs.values())
        return max(0, self.bytes_held - used)

    def growth_bytes(self) -> int:
        """What the next step takes past what the store holds were every sequence to take one
        more position: the capacity its buffers grow by (or move to), and the largest buffer
        copied meanwhile (the old one is held until its positions are in the new one)."""
        grown, copied = 0, 0
        for seq in self._seqs.values():
            length = seq.length + 1
            if seq.full is not None and length > seq.full.shape[3]:
                capacity = seq.full.shape[3]
                slots = _grown_size(capacity, length) - capacity
                grown += slots * self._counts[FULL] * self._layer_bytes
                copied = max(copied, _nbytes(seq.full))
            if seq.window is not None:
                capacity = seq.window.shape[3]
                kind, size, _ = self._window_plan(capacity, seq.base, length, seq.length)
                grown += max(0, size - capacity) * self._counts[WINDOW] * self._layer_bytes
                if kind in (GROW, FRESH):  # a move copies in place
                    copied = max(copied, _nbytes(seq.window))
        return grown + copied

    def _window_plan(
        self, capacity: int, base: int, length: int, keep: int, expect: int = 0
    ) -> tuple[int, int, int]:
        """What a window buffer of ``capacity`` slots from position ``base`` becomes to hold
        positions up to ``length`` (growing, up to ``expect``), its first ``keep`` kept: how
        (``KEEP``, ``GROW``, ``MOVE`` or ``FRESH``), its capacity then, and the position its
        first slot holds."""
        cap = self.window_tokens
        lowest = max(base, keep - self._window + 1)  # queries from ``keep`` on see no further
        # Past a long chunk, back to the cap as soon as what is live fits it.
        shrink = capacity > cap and lowest > base and length - lowest <= cap
        if length - base <= capacity and not shrink:
            return KEEP, capacity, base
        if not capacity or lowest == base:  # nothing to drop yet: grow, up to the cap
            reach = max(length, expect) - base
            wanted = min(max(reach, int(capacity * GROWTH)), max(length - base, cap))
            return GROW, _rounded(wanted), base
        if length - lowest <= capacity and capacity <= max(cap, _rounded(length - lowest)):
            return MOVE, capacity, lowest  # the live positions to the front, in place
        # Too small for a long chunk, or larger than the cap after one: a new one.
        return FRESH, _rounded(max(length - lowest, cap)), lowest

    def _slide(self, seq: SeqBuffers, length: int, keep: int, expect: int) -> None:
        buffer, base = seq.window, seq.base
        if buffer is not None and keep < base:  # the sequence starts again: what it held goes
            self.bytes_held -= _nbytes(buffer)
            buffer, base = None, 0
            seq.window, seq.base = None, 0
        capacity = 0 if buffer is None else buffer.shape[3]
        kind, size, lowest = self._window_plan(capacity, base, length, keep, expect)
        if kind == MOVE:
            assert buffer is not None
            _to_front(buffer, lowest - base, keep - base)
        elif kind != KEEP:
            layers = self._counts[WINDOW]
            seq.window = self._replaced(buffer, layers, size, lowest - base, keep - base)
        seq.base = lowest

    def _replaced(
        self, buffer: torch.Tensor | None, layers: int, size: int, start: int, stop: int
    ) -> torch.Tensor:
        """A new buffer of ``size`` slots holding ``buffer``'s slots ``start:stop`` at its
        front; ``buffer`` is no longer held."""
        fresh = self._new(layers, size)
        if buffer is not None:
            if stop > start:
                fresh[:, :, :, : stop - start] = buffer[:, :, :, start:stop]
            self.bytes_held -= _nbytes(buffer)
        return fresh

    def _new(self, layers: int, size: int) -> torch.Tensor:
        heads, dim = self._head
        self.bytes_held += layers * size * self._layer_bytes
        return torch.empty((layers, 2, heads, size, dim), dtype=self._dtype, device=self._device)

    def free(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            seq = self._seqs.pop(seq_id, None)
            if seq is None:
                continue
            for buffer in (seq.full, seq.window):
                if buffer is not None:
                    self.bytes_held -= _nbytes(buffer)

    def clear(self) -> None:
        self.free(list(self._seqs))


class StepCache:
    """The ``cache`` a model's forward pass gets for one step: each attention layer's
    ``update`` writes the step's new keys and values of every sequence into that sequence's
    buffer (rows ``spans[i]`` of the packed step go to positions ``starts[i]`` onwards) and
    leaves the step in ``kwargs`` for the attention function (``attention.py``)."""

    is_compileable = False

    def __init__(
        self, spans: Sequence[tuple[int, int]], starts: Sequence[int],
        seqs: Sequence[SeqBuffers], store: KVStore,
    ) -> None:  # fmt: skip
        self.spans = spans
        self.starts = starts
        self.seqs = seqs
        self.slots = store.slots
        self.windows = store.windows
        self.reads: dict[tuple[int, int | None], list[Any]] = {}
        """What each kind of layer's attention reads, per window (None: every position), for
        every sequence: built by the first such layer of the step, shared by the others
        (``attention.py``)."""
        self._writes: dict[int, list[tuple[torch.Tensor, int, int]]] = {}

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
        kwargs: dict[str, Any] | None = None, **_: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        kind, slot = self.slots[layer_idx]
        # Keys and values as one tensor, so each sequence's are written in one copy.
        both = torch.stack((key_states[0], value_states[0]))
        for region, first, end in self._regions(kind):
            region[slot].copy_(both[:, :, first:end])
        if kwargs is not None:
            kwargs["batchfit_step"] = self
        return key_states, value_states

    def _regions(self, kind: int) -> list[tuple[torch.Tensor, int, int]]:
        """Each sequence's new positions in its buffer of this kind, every layer of it
        (``[layers, 2, kv_heads, count, head_dim]``), and its rows of the packed step."""
        found = self._writes.get(kind)
        if found is None:
            found = []
            for (first, end), start, seq in zip(self.spans, self.starts, self.seqs, strict=True):
                buffer, base = seq.layer(kind)
                lowest = start - base
                found.append((buffer[:, :, :, lowest : lowest + end - first], first, end))
            self._writes[kind] = found
        return found

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0
