"""A model that does no work, for measuring what the server itself costs per request.

``batchfit serve --model python:bench.noop:create``: ``prepare`` counts whitespace-separated
words as tokens, ``forward`` returns a fixed 4-float vector per input. Everything else (HTTP,
validation, queue, batcher, the hop to the model thread and back, JSON) is the real server.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from models import ArchitectureShape, Item, ModelInfo

OUTPUT = [0.5, 0.5, 0.5, 0.5]
MAX_TOKENS = 512


class NoopModel:
    def __init__(self) -> None:
        shape = ArchitectureShape(
            hidden_size=4, num_layers=1, num_heads=1, intermediate_size=4,
            element_bytes=4, parameter_bytes=0,
        )  # fmt: skip
        self.info = ModelInfo(
            name="noop",
            task="embed",
            device="cpu",
            dtype="float32",
            max_input_tokens=MAX_TOKENS,
            num_parameters=0,
            output_dim=len(OUTPUT),
            shape=shape,
        )

    def prepare(self, inputs: Sequence[str], *, truncate: bool) -> list[Item]:
        return [Item(data=None, cost=min(MAX_TOKENS, len(text.split()) or 1)) for text in inputs]

    def synthetic_items(self, num_items: int, length: int) -> list[Item]:
        return [Item(data=None, cost=max(1, min(length, MAX_TOKENS))) for _ in range(num_items)]

    def forward(self, items: Sequence[Item]) -> list[Any]:
        return [OUTPUT for _ in items]


def create() -> NoopModel:
    """The factory ``--model python:bench.noop:create`` calls."""
    return NoopModel()
