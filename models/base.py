"""The model contract the batcher drives without knowing the model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class Item:
    """One input, ready for a forward pass. ``cost`` is its length in tokens."""

    data: Any
    cost: int


@dataclass(frozen=True, slots=True)
class ArchitectureShape:
    """What the memory sizer needs to know about an encoder's shape."""

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    element_bytes: int
    parameter_bytes: int


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    task: str
    device: str
    dtype: str
    max_input_tokens: int
    num_parameters: int
    output_dim: int | None
    shape: ArchitectureShape
    quantize: str = "none"


@runtime_checkable
class Model(Protocol):
    """A model the batcher can serve.

    ``prepare`` runs on the request path (tokenization); ``forward`` runs on the model thread
    only and returns one output per item, in order. ``forward`` raises ``ModelOutOfMemory``
    for allocation failures and nothing torch-specific.
    """

    info: ModelInfo

    def prepare(self, inputs: Sequence[str], *, truncate: bool) -> list[Item]: ...

    def forward(self, items: Sequence[Item]) -> list[Any]: ...

    def synthetic_items(self, num_items: int, length: int) -> list[Item]:
        """Items of exactly ``length`` tokens, for warm-up and memory calibration."""
        ...
