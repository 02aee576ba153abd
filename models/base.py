"""The model contract the batcher drives without knowing the model."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class Item:
    """One input, ready for a forward pass. ``cost`` is its length in tokens."""

    data: Any
    cost: int


@dataclass(frozen=True, slots=True)
class ArchitectureShape:
    """What the memory sizer needs to know about a model's shape."""

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    element_bytes: int
    parameter_bytes: int
    architecture: Literal["encoder", "decoder"] = "encoder"
    """A decoder (Qwen, Llama, Mistral, Gemma) attends causally."""


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
    pooling: str | None = None
    """An embedder's pooling mode(s): cls, mean, max, mean_sqrt_len_tokens, weightedmean,
    lasttoken (several joined by +)."""
    normalize: bool | None = None
    """Whether an embedder's outputs have unit length."""
    prompts: Mapping[str, str] = field(default_factory=dict)
    """Named prompts (prepended to the text), as the model's configuration lists them."""
    default_prompt_name: str | None = None
    activation: str | None = None
    """A classifier's or cross-encoder's score function: softmax, sigmoid, identity..."""


@runtime_checkable
class Model(Protocol):
    """A model the batcher can serve.

    ``prepare`` runs on the request path (tokenization); ``forward`` runs on the model thread
    only and returns one output per item, in order. ``forward`` raises ``ModelOutOfMemory``
    for allocation failures and nothing torch-specific. A ``prepare`` may also take a
    keyword ``prompt`` (text to put before each input); one that does not is given the
    inputs with the prompt already in front.

    A model may also have ``preparer()``: an object with its ``prepare`` (and
    ``prepare_pairs``) and ``info`` but no weights, which pickles; API processes in front
    of one engine tokenize with it. Without one, the model itself is pickled for them.
    """

    info: ModelInfo

    def prepare(self, inputs: Sequence[str], *, truncate: bool) -> list[Item]: ...

    def forward(self, items: Sequence[Item]) -> list[Any]: ...

    def synthetic_items(self, num_items: int, length: int) -> list[Item]:
        """Items of exactly ``length`` tokens, for warm-up and memory calibration."""
        ...
