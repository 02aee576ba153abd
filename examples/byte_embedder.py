"""A custom model: any torch module behind Batchfit's model contract.

Serve it with ``batchfit serve --model python:examples.byte_embedder:create``. It embeds text
from its UTF-8 bytes (a byte embedding table, one transformer encoder layer, mean pooling),
with random but seeded weights: a stand-in for your own module and tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from models import (
    ArchitectureShape,
    InputTooLong,
    Item,
    ModelInfo,
    ModelSpec,
    resolve_device,
    translate_error,
)

DIM = 64
MAX_BYTES = 512


class ByteEncoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(257, DIM, padding_idx=256)  # 256 is padding
        self.layer = torch.nn.TransformerEncoderLayer(
            DIM, nhead=4, dim_feedforward=4 * DIM, batch_first=True
        )

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = self.layer(self.embed(ids), src_key_padding_mask=~mask)
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)
        return torch.nn.functional.normalize(pooled, dim=-1)


class ByteEmbedder:
    """Implements ``models.Model``: ``prepare`` (request path), ``forward`` (model thread)."""

    def __init__(self, device: torch.device) -> None:
        torch.manual_seed(0)
        self.module = ByteEncoder().eval().to(device)
        self.device = device
        num_parameters = sum(p.numel() for p in self.module.parameters())
        self.info = ModelInfo(
            name="byte-embedder",
            task="embed",
            device=str(device),
            dtype="float32",
            max_input_tokens=MAX_BYTES,
            num_parameters=num_parameters,
            output_dim=DIM,
            shape=ArchitectureShape(
                hidden_size=DIM,
                num_layers=1,
                num_heads=4,
                intermediate_size=4 * DIM,
                element_bytes=4,
                parameter_bytes=4 * num_parameters,
            ),
        )

    def prepare(self, inputs: Sequence[str], *, truncate: bool) -> list[Item]:
        items = []
        for index, text in enumerate(inputs):
            ids = list(text.encode("utf-8"))
            if len(ids) > MAX_BYTES:
                if not truncate:
                    raise InputTooLong(index, len(ids), MAX_BYTES)
                ids = ids[:MAX_BYTES]
            items.append(Item(data=ids, cost=len(ids)))
        return items

    def synthetic_items(self, num_items: int, length: int) -> list[Item]:
        length = max(1, min(length, MAX_BYTES))
        return [Item(data=[97] * length, cost=length) for _ in range(num_items)]

    def forward(self, items: Sequence[Item]) -> list[Any]:
        longest = max(item.cost for item in items)
        ids = torch.full((len(items), longest), 256, dtype=torch.long)
        mask = torch.zeros((len(items), longest), dtype=torch.bool)
        for row, item in enumerate(items):
            ids[row, : item.cost] = torch.tensor(item.data, dtype=torch.long)
            mask[row, : item.cost] = True
        try:
            with torch.inference_mode():
                vectors = self.module(ids.to(self.device), mask.to(self.device))
        except Exception as exc:
            # Our OOM type lets the batcher split the batch; other errors pass through.
            raise translate_error(exc) from None
        return list(vectors.float().cpu().numpy())


def create(spec: ModelSpec) -> ByteEmbedder:
    """The factory ``--model python:examples.byte_embedder:create`` calls."""
    return ByteEmbedder(resolve_device(spec.device))
