"""The generation contract: what a step asks of a causal LM and what comes back. No torch here:
the engine (``generation/``) and API processes use these types without loading a model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from .base import ModelInfo

if TYPE_CHECKING:
    from .chat import PromptTokenizer


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one sequence picks its next token. ``temperature`` 0 is greedy (argmax)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0: no top-k cut."""
    seed: int | None = None
    """Seeds the sequence's own generator: its text then depends on nothing else that runs."""
    num_logprobs: int | None = None
    """None: no log probabilities; 0: the chosen token's; k: and the k likeliest tokens'."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """What a model's generation config says when a request does not: its sampling defaults
    and the tokens that end a sequence."""

    eos_token_ids: frozenset[int] = frozenset()
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """One sequence's part of a step: ``token_ids`` fed at positions ``start``, ``start + 1``,
    ... (``start`` tokens of it are cached already). ``sampling`` set: its last token's
    logits pick the sequence's next token; None: a prefill chunk short of the prompt's end."""

    seq_id: int
    token_ids: Sequence[int]
    start: int
    sampling: SamplingParams | None = None
    prefill_to: int = 0
    """The positions the sequence has once every token it is prefilling is fed (a prompt in
    chunks; a resumed sequence's prompt and outputs): its cache is sized for them at its
    first chunk instead of growing chunk by chunk (0: this chunk's end)."""


@dataclass(frozen=True, slots=True)
class StepRequest:
    """One forward pass: every chunk's tokens packed together. ``free`` names sequences whose
    cache is dropped first (preempted, cancelled or finished), ``forget`` those whose
    sampling state goes too (they will not come back)."""

    chunks: Sequence[SeqChunk]
    free: Sequence[int] = ()
    forget: Sequence[int] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(chunk.token_ids) for chunk in self.chunks)


@dataclass(frozen=True, slots=True)
class SampledToken:
    """A sequence's next token, with its log probability and the likeliest alternatives'
    where asked for (``(token_id, logprob)``, likeliest first)."""

    seq_id: int
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = field(default=())


@dataclass(frozen=True, slots=True)
class StepResult:
    """What a step returns: the sampled tokens, in the order of the chunks that sampled, and
    the bytes the key/value store holds after it."""

    tokens: list[SampledToken]
    cache_bytes: int
    slack_bytes: int = 0
    """Of ``cache_bytes``, what its buffers hold past their sequences' positions (capacity
    kept to grow into)."""
    growth_bytes: int = 0
    """What the next step would take past ``cache_bytes`` were every sequence to decode one
    more token: the capacity its buffers grow by, and the largest buffer copied meanwhile."""


@runtime_checkable
class Generator(Protocol):
    """A causal LM the generation engine drives. ``step``, ``free`` and ``forget`` run on the
    model thread only; ``step`` raises ``ModelOutOfMemory`` for allocation failures."""

    info: ModelInfo
    defaults: GenerationDefaults
    cache_bytes_per_token: int
    """Bytes of keys and values one token of one sequence holds in the store ..."""
    cache_window_bytes_per_token: int
    """... of which its sliding-window layers' part ..."""
    cache_window_tokens: int
    """... is held for at most this many tokens of a sequence (0: for every token)."""

    def step(self, request: StepRequest) -> StepResult: ...

    def free(self, seq_ids: Sequence[int], *, forget: bool = False) -> int:
        """Drop these sequences' caches (and with ``forget`` their sampling state); return
        the bytes the store holds after."""
        ...

    def preparer(self) -> PromptTokenizer: ...

    def step_bytes(self, num_tokens: int, attended: int, num_sampled: int) -> int:
        """Predicted peak bytes of a step's activations: ``num_tokens`` fed, ``attended``
        query-key pairs, ``num_sampled`` rows through the LM head."""
        ...
