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
    num_kv_heads: int | None = None
    """Key/value heads under grouped-query attention (``num_key_value_heads``); None: as
    many as ``num_heads``."""
    head_dim: int | None = None
    """Width of one attention head; None: ``hidden_size // num_heads``."""
    attention: str = "eager"
    """The attention implementation in use (``config._attn_implementation``): ``eager``
    holds every head's ``L x L`` scores; ``sdpa`` and the flash kernels do not."""
    sliding_window: int | None = None
    """Tokens a sliding-window layer attends to, where some layers have one (Gemma, Mistral,
    Qwen2, ModernBERT's local layers); such layers build an ``L x L`` mask even for one
    input."""
    gated_mlp: bool = False
    """The feed-forward multiplies a gate by an up projection (SwiGLU/GeGLU: Llama, Qwen,
    Gemma, ModernBERT), holding three ``intermediate_size`` activations instead of two."""
    token_logits: int = 0
    """Values the model's head outputs per token: a sparse (SPLADE) embedder's vocabulary
    logits, which outweigh every other activation of a small encoder; 0 for other heads."""


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
    truncation_side: str = "right"
    """The end an over-long input is cut from by default (the tokenizer's own side)."""


@runtime_checkable
class Model(Protocol):
    """A model the batcher can serve.

    ``prepare`` runs on the request path (tokenization); ``forward`` runs on the model thread
    only and returns one output per item, in order. ``forward`` raises ``ModelOutOfMemory``
    for allocation failures and nothing torch-specific. A ``prepare`` may also take a
    keyword ``prompt`` (text to put before each input); one that does not is given the
    inputs with the prompt already in front. One that takes ``truncation_direction``
    (``right`` or ``left``) cuts over-long inputs from that end.

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
