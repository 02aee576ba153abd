"""What the next step runs: a pure function of the sequences, the live budget and the caps.

``schedule`` reads each sequence's cached and pending tokens and returns the sequences that
decode, the chunks of prompts that are prefilled and the sequences that are preempted. It
does no I/O: the engine reads memory and the clock, and tests step it by hand.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from .sequence import Sequence

GROWTH_TOKENS = 16
"""Room every running sequence must have to grow by, or the newest give way."""


@dataclass(frozen=True, slots=True)
class StepBudget:
    max_running: int
    """Most sequences in the store at once (``--max-running-seqs``)."""
    max_step_tokens: int
    """Most tokens one step feeds (``--max-step-tokens``)."""
    max_prefill_tokens: int
    """Most prompt tokens this step prefills, beside the decode tokens (the time model's
    share, or ``max_step_tokens`` while none decode)."""
    bytes_per_token: int
    cache_bytes: float | None
    """The most the store may hold after the step (what it holds plus what is free beside
    the step's activations); None: no memory bound."""
    bytes_per_row: int = 0
    """The activations a sequence adds to a step as it joins: its row of logits."""
    window_bytes_per_token: int = 0
    """The part of ``bytes_per_token`` its sliding-window layers hold ..."""
    window_tokens: int = 0
    """... for at most this many of its tokens (0: every token holds all of it)."""
    growth_share: float = 0.0
    """Admission keeps room for every running sequence (and the one joining) to make this
    share of the tokens it may still make (at least ``GROWTH_TOKENS``): more after steps
    that preempted, less after steps that did not (``pacing.py``)."""
    slack_bytes: int = 0
    """What the store holds past its sequences' positions (capacity kept to grow into):
    held, so it counts against ``cache_bytes``, which the scheduler fills with tokens."""
    now: float = 0.0
    priority_aging_s: float = 0.0
    """A waiting sequence's priority rises by one every this many seconds (0: never)."""


@dataclass(frozen=True, slots=True)
class StepPlan:
    decode: tuple[Sequence, ...] = ()
    prefill: tuple[tuple[Sequence, int], ...] = ()
    """Sequences and how many of their pending tokens this step feeds."""
    preempt: tuple[Sequence, ...] = ()
    short_of_memory: bool = False
    """It preempts, or a waiting sequence stays out, for want of memory."""

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(count for _, count in self.prefill)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


def effective_priority(seq: Sequence, now: float, aging_s: float) -> float:
    if not aging_s:
        return seq.priority
    return seq.priority + int(max(0.0, now - seq.arrival_s) / aging_s)


def schedule(running: Seq[Sequence], waiting: Seq[Sequence], budget: StepBudget) -> StepPlan:
    """The next step.

    - Running sequences keep their places, by effective priority then arrival; where their
      next tokens (and ``GROWTH_TOKENS`` each to grow by) do not fit ``cache_bytes`` less
      the store's slack, the last of them (the newest of the lowest priority) are
      preempted, down to one.
    - Every running sequence with one pending token decodes; those still prefilling go on
      with chunks under ``max_prefill_tokens``.
    - Waiting sequences then join in the same order while a sequence slot, prefill tokens
      and memory remain: for their whole pending tokens and their row of logits, and for
      every running sequence and each joining one to grow by ``growth_share`` of the tokens
      it may still make. The first that does not fit stops the others behind it, so FIFO
      among equals holds; with nothing running it joins anyway (it can only run alone).
    """
    now, aging = budget.now, budget.priority_aging_s
    order = lambda s: (-effective_priority(s, now, aging), s.arrival_s, s.seq_id)  # noqa: E731
    running = sorted(running, key=order)
    limit = budget.cache_bytes
    preempt: list[Sequence] = []
    if limit is not None:
        limit -= budget.slack_bytes
        while len(running) > 1 and _held(running, budget) > limit:
            preempt.append(running.pop())
    decode = tuple(s for s in running if s.num_pending <= 1)
    tokens = len(decode)
    prefill_left = max(0, min(budget.max_prefill_tokens, budget.max_step_tokens - tokens))
    prefill: list[tuple[Sequence, int]] = []
    for seq in running:
        if seq.num_pending > 1 and prefill_left > 0:
            count = min(seq.num_pending, prefill_left)
            prefill.append((seq, count))
            prefill_left -= count
    used = sum(_bytes(s.num_cached + s.num_pending + _growth(s, budget), budget) for s in running)
    slots = budget.max_running - len(running)
    short = bool(preempt)
    for seq in sorted(waiting, key=order):
        if slots <= 0 or prefill_left <= 0:
            break
        need = _bytes(seq.num_pending + _growth(seq, budget), budget) + budget.bytes_per_row
        if limit is not None and used + need > limit and (running or prefill):
            short = True
            break
        count = min(seq.num_pending, prefill_left)
        prefill.append((seq, count))
        prefill_left -= count
        used += need
        slots -= 1
    return StepPlan(decode, tuple(prefill), tuple(preempt), short)


def _held(running: Seq[Sequence], budget: StepBudget) -> float:
    """What the running sequences hold after their next tokens, with room to grow."""
    return sum(
        _bytes(s.num_cached + min(s.num_pending, GROWTH_TOKENS) + GROWTH_TOKENS, budget)
        for s in running
    )


def _growth(seq: Sequence, budget: StepBudget) -> int:
    """The tokens admission keeps room for ``seq`` to make."""
    room = max(seq.room, 0)
    return min(room, max(GROWTH_TOKENS, math.ceil(budget.growth_share * room)))


def _bytes(num_tokens: int, budget: StepBudget) -> int:
    """What a sequence of ``num_tokens`` holds (its sliding-window layers capped)."""
    past_window = max(0, num_tokens - budget.window_tokens) if budget.window_tokens else 0
    return num_tokens * budget.bytes_per_token - past_window * budget.window_bytes_per_token
