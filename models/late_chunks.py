"""Late chunking inside the forward pass: the rows of a batch whose items carry spans become
one row per span, that span's token states, so the model's own postprocess (its pooling,
Dense layers and normalisation) pools each span from the document's single pass."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from .base import Item
from .chunking import Span


@dataclass(frozen=True, slots=True)
class SpanRows:
    """Each item's spans (None: the item answers one vector, as usual)."""

    spans: tuple[tuple[Span, ...] | None, ...]

    @classmethod
    def of(cls, items: Sequence[Item]) -> SpanRows | None:
        """The batch's spans; None where no item has any (the usual path, untouched)."""
        spans = tuple(getattr(item.data, "spans", None) for item in items)
        return None if all(s is None for s in spans) else cls(spans)

    def pool(
        self, postprocess: Any, hidden: torch.Tensor, attention_mask: torch.Tensor,
        prompt_lengths: torch.Tensor,
    ) -> list[Any]:  # fmt: skip
        """One output per item: the usual one for an item without spans, a ``spans x dim``
        array for one with spans, each span's tokens pooled by ``postprocess`` as a row of
        their own (its first token the row's first, as pooling reads it).

        NOTE: the span rows are cut from the token states and padded only to the longest
        span, in groups no larger than the batch itself: a request of many overlapping
        spans costs time, never more memory than its own batch already holds."""
        plain = [row for row, spans in enumerate(self.spans) if spans is None]
        results: list[Any] = []
        if plain:
            index = torch.tensor(plain, device=hidden.device)
            rows = SimpleNamespace(last_hidden_state=hidden.index_select(0, index))
            results = list(
                postprocess(rows, attention_mask.index_select(0, index),
                            prompt_lengths.index_select(0, index))
            )  # fmt: skip
        pieces = [
            (row, start, end)
            for row, spans in enumerate(self.spans)
            if spans is not None
            for start, end in spans
        ]
        width = max(end - start for _, start, end in pieces)
        group = max(1, hidden.shape[0] * hidden.shape[1] // width)
        pooled: list[Any] = []
        for first in range(0, len(pieces), group):
            chunk = pieces[first : first + group]
            local = hidden.new_zeros((len(chunk), width, hidden.shape[-1]))
            mask = attention_mask.new_zeros((len(chunk), width))
            for k, (row, start, end) in enumerate(chunk):
                local[k, : end - start] = hidden[row, start:end]
                mask[k, : end - start] = 1
            lengths = prompt_lengths.new_zeros(len(chunk))  # spans leave the prompt out
            pooled += list(postprocess(SimpleNamespace(last_hidden_state=local), mask, lengths))
        return self._regroup(iter(results), iter(pooled))

    def _regroup(self, plain: Iterator[Any], pooled: Iterator[Any]) -> list[Any]:
        outputs: list[Any] = []
        for spans in self.spans:
            if spans is None:
                outputs.append(next(plain))
            else:
                outputs.append(np.stack([next(pooled) for _ in spans]))
        return outputs
