"""From sampled tokens to what a sequence's stream gets: text pieces, stop strings, log
probabilities, the end; and the latency metrics of each token."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from models import PromptTokenizer, SampledToken

from .metrics import ModelGenerationMetrics
from .sequence import Sequence
from .stops import StopText
from .stream import TokenEvent, TokenLogprob


class SequenceText:
    """A sequence's detokenizer and stop strings, and how it ends."""

    __slots__ = ("detokenizer", "eos", "finish_reason", "stops")

    def __init__(self, prompts: PromptTokenizer, seq: Sequence) -> None:
        self.detokenizer = prompts.detokenizer(seq.spec.prompt_ids)
        self.stops = StopText(seq.spec.stop, include=seq.spec.include_stop_text)
        self.finish_reason: str | None = None
        """Set once its last token is in: ``stop`` or ``length``."""
        self.eos = False
        """Its last token is an end-of-sequence token, which has no text."""


def emit(
    fresh: Iterable[tuple[Sequence, list[SampledToken]]],
    prompts: PromptTokenizer,
    now: float,
    metrics: ModelGenerationMetrics,
    finish: Callable[[Sequence, str], None],
) -> None:
    """Put each sequence's new tokens into its stream as one event; ``finish(seq, reason)``
    ends a sequence that a stop string ended (and counts every end)."""
    for seq, tokens in fresh:
        if seq.stream.closed:
            continue  # its request ended meanwhile (its client went away, or it failed)
        state = seq.text
        pieces = []
        ids = []
        logprobs = []
        stopped = False
        for position, token in enumerate(tokens):
            ids.append(token.token_id)
            if token.logprob is not None:
                logprobs.append(_logprob(prompts, token))
            last = position == len(tokens) - 1
            piece = "" if (state.eos and last) else state.detokenizer.add(token.token_id)
            out, stopped = state.stops.feed(piece)
            pieces.append(out)
            if stopped:
                state.finish_reason = "stop"
                break
        if state.finish_reason is not None and not stopped:
            pieces.append(state.stops.flush())
        if tokens:
            if seq.first_token_s is None:
                seq.first_token_s = now
                metrics.time_to_first_token.observe(now - seq.arrival_s)
            elif seq.last_token_s is not None:
                metrics.time_between_tokens.observe(now - seq.last_token_s)
            seq.last_token_s = now
            metrics.generated_tokens.inc(len(tokens))
        seq.stream.put(
            TokenEvent(
                index=seq.index,
                text="".join(pieces),
                token_ids=tuple(ids),
                logprobs=tuple(logprobs),
                finish_reason=state.finish_reason,
                num_prompt_tokens=len(seq.spec.prompt_ids),
                num_output_tokens=len(seq.output_ids),
            )
        )
        if state.finish_reason is not None:
            metrics.request_duration.observe(now - seq.arrival_s)
            finish(seq, state.finish_reason)


def _logprob(prompts: PromptTokenizer, token: SampledToken) -> TokenLogprob:
    assert token.logprob is not None
    return TokenLogprob(
        token_id=token.token_id,
        text=prompts.token_text(token.token_id),
        logprob=token.logprob,
        top=tuple((i, prompts.token_text(i), lp) for i, lp in token.top_logprobs),
    )
