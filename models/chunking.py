"""Long inputs, as pure functions: an input past the model's maximum cut into windows that
each fit (chunked processing) and their vectors pooled back into one; character spans of a
document mapped to the tokens they overlap (late chunking). numpy only: an API process in
front of an engine cuts and pools here too."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .base import Item
from .errors import ModelError

Span = tuple[int, int]
"""A half-open range: characters of a text, or tokens of its encoding."""


class InvalidSpan(ModelError):
    """A late chunk's character span covers no token of its input."""

    def __init__(self, index: int, span: Span) -> None:
        super().__init__(
            f"late chunk [{span[0]}, {span[1]}] of input {index} covers no token; give spans "
            "that cover some of the text"
        )
        self.index = index
        self.span = span


@dataclass(frozen=True, slots=True)
class Windows:
    """A request's inputs as windows: ``items`` holds every input's windows in input order,
    ``counts`` how many each input has (1 for an input that fits the model as it is)."""

    items: list[Item]
    counts: list[int]


def cut_windows(
    content: Sequence[int], *, prefix: Sequence[int], suffix: Sequence[int], max_tokens: int
) -> list[list[int]]:
    """``content`` (token ids without special tokens) cut into consecutive windows, each with
    the ``prefix`` and ``suffix`` special tokens (and prompt) around it and at most
    ``max_tokens`` long; the last window holds what is left. Every content token is in
    exactly one window."""
    room = max_tokens - len(prefix) - len(suffix)
    if room < 1:
        raise ValueError(f"no room for content in windows of {max_tokens} tokens")
    starts = range(0, max(len(content), 1), room)
    return [[*prefix, *content[start : start + room], *suffix] for start in starts]


def pool_windows(
    outputs: Sequence[Any], windows: Windows, *, normalize: bool
) -> list[np.ndarray]:  # fmt: skip
    """One vector per input from its windows' vectors: their mean weighted by each window's
    tokens, scaled to unit length where the model normalises (as vLLM pools chunked
    inputs). An input of one window keeps that window's vector as it is."""
    pooled = []
    start = 0
    for count in windows.counts:
        vectors = np.asarray(outputs[start : start + count], dtype=np.float64)
        if count == 1:
            pooled.append(np.asarray(outputs[start], dtype=np.float32))
            start += count
            continue
        weights = np.array([item.cost for item in windows.items[start : start + count]], float)
        vector = weights @ vectors / weights.sum()
        if normalize:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        pooled.append(vector.astype(np.float32))
        start += count
    return pooled


def token_spans(
    offsets: Sequence[tuple[int, int]], special: Sequence[int], spans: Sequence[Span], *,
    shift: int = 0, index: int = 0,
) -> tuple[Span, ...]:  # fmt: skip
    """Each character span as the half-open range of the tokens that overlap it. ``offsets``
    are the tokens' character ranges in the encoded text, ``special`` marks special tokens
    (never in a span), ``shift`` is where the input starts in that text (after a prompt).
    A span covering no token raises ``InvalidSpan`` (``index``: the input's)."""
    found = []
    for span in spans:
        start, end = span[0] + shift, span[1] + shift
        first = last = None
        for position, (token_start, token_end) in enumerate(offsets):
            if special[position]:
                continue
            overlaps = token_start < end and token_end > start
            if overlaps or (token_start == token_end and start <= token_start < end):
                first = position if first is None else first
                last = position
        if first is None or last is None:
            raise InvalidSpan(index, (span[0], span[1]))
        found.append((first, last + 1))
    return tuple(found)
