"""Late chunking inside the forward pass: the rows of a batch whose items carry spans become
one row per span, masked to that span's tokens, so the model's own postprocess (its pooling,
Dense layers and normalisation) pools each span from the document's single pass."""

from __future__ import annotations

from collections.abc import Sequence
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

    def expand(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor, prompt_lengths: torch.Tensor
    ) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """The token states, attention mask and prompt lengths with a row per span (an item
        without spans keeps its one row): what the postprocess reads instead."""
        rows: list[int] = []
        masks = []
        lengths = []
        for row, spans in enumerate(self.spans):
            if spans is None:
                rows.append(row)
                masks.append(attention_mask[row])
                lengths.append(prompt_lengths[row])
                continue
            for start, end in spans:
                mask = torch.zeros_like(attention_mask[row])
                mask[start:end] = 1
                rows.append(row)
                masks.append(mask)
                lengths.append(torch.zeros_like(prompt_lengths[row]))  # spans skip the prompt
        index = torch.tensor(rows, device=hidden.device)
        output = SimpleNamespace(last_hidden_state=hidden.index_select(0, index))
        return output, torch.stack(masks), torch.stack(lengths)

    def regroup(self, results: Sequence[Any]) -> list[Any]:
        """The postprocess's rows back as one output per item: a ``spans x dim`` array for an
        item with spans."""
        outputs: list[Any] = []
        position = 0
        for spans in self.spans:
            if spans is None:
                outputs.append(results[position])
                position += 1
            else:
                outputs.append(np.stack(results[position : position + len(spans)]))
                position += len(spans)
        return outputs
