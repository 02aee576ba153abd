"""A sequence: one choice of one generation request, from its prompt to its last token."""

from __future__ import annotations

import enum
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from models import SamplingParams

from .stream import RequestStream


class SeqState(enum.Enum):
    WAITING = "waiting"
    """Not in the store: new, or preempted (then it has generated tokens to prefill again)."""
    RUNNING = "running"
    """Its cache is in the store; it decodes, or is still prefilling its prompt in chunks."""
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class SequenceSpec:
    """What a request asks of one of its sequences."""

    prompt_ids: Seq[int]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    include_stop_text: bool = False


@dataclass(eq=False, slots=True)
class Sequence:
    seq_id: int
    spec: SequenceSpec
    priority: int
    arrival_s: float
    deadline_s: float
    """The first token is due by then: a sequence with none at its deadline ends with 504."""
    stream: RequestStream
    """Where its events go: its request's stream, shared with the request's other
    sequences."""
    index: int = 0
    """Its place among its request's sequences (the choice's ``index``)."""
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = 0
    """Tokens of the sequence whose keys and values are in the store."""
    state: SeqState = SeqState.WAITING
    finish_reason: str | None = None
    started_s: float | None = None
    """When it first joined a step."""
    first_token_s: float | None = None
    last_token_s: float | None = None
    num_preemptions: int = 0
    cancelled: bool = False
    """Its client went away: it leaves at the next step."""
    text: Any = None
    """The engine's text state for it (detokenizer, stop strings), from its first token."""

    @property
    def num_tokens(self) -> int:
        return len(self.spec.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Known tokens not yet in the store: the prompt (and, once preempted, what it
        generated) before its first token; 1 while it decodes."""
        return self.num_tokens - self.num_cached

    def tokens(self, start: int, stop: int) -> list[int]:
        """Its tokens from position ``start`` to ``stop``, prompt and generated alike."""
        prompt = self.spec.prompt_ids
        if stop <= len(prompt):
            return list(prompt[start:stop])
        head = list(prompt[start:]) if start < len(prompt) else []
        return head + self.output_ids[max(0, start - len(prompt)) : stop - len(prompt)]

    @property
    def room(self) -> int:
        """Tokens it may still generate."""
        return self.spec.max_tokens - len(self.output_ids)
