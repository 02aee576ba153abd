"""A generator's sequences: those waiting and those running, how a request's sequences join
them (``submit``) and how each leaves them: finished, cancelled by its client, timed out
before its first token, or failed. The step loop (``engine.py``) moves them between the two
and feeds their streams."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence as Seq

from batching import Clock, DeadlineExceeded, NeverAdmitted, QueueFull, ShuttingDown
from models import Generator

from .config import EngineConfig
from .metrics import ModelGenerationMetrics
from .sequence import SeqState, Sequence, SequenceSpec
from .stream import RequestStream


class SequenceCancelled(Exception):
    """A sequence's client went away before its end."""


class Roster:
    def __init__(
        self, *, name: str, model: Generator, clock: Clock, metrics: ModelGenerationMetrics,
        config: EngineConfig,
    ) -> None:  # fmt: skip
        self.name = name
        self.model = model
        self.config = config
        self._clock = clock
        self.metrics = metrics
        self._ids = itertools.count(1)
        self.running: list[Sequence] = []
        self.waiting: list[Sequence] = []
        self._wake = asyncio.Event()
        """Set when there is something new for the step loop."""
        self._to_free: list[int] = []
        """Sequences whose cache the next step frees first ..."""
        self._to_forget: list[int] = []
        """... and those of them whose sampling state goes too."""
        self.stopped = False

    def submit(
        self, specs: Seq[SequenceSpec], *, priority: int = 0, timeout_s: float
    ) -> tuple[RequestStream, list[Sequence]]:
        """Admit one request's sequences (its choices), or none: ``QueueFull`` where the
        waiting sequences would pass ``max_waiting`` (``NeverAdmitted`` where they alone
        would), ``ShuttingDown`` once stopped. Their
        events go to one stream, each tagged with its sequence's place in ``specs``."""
        if self.stopped:
            raise ShuttingDown("the generator stopped")
        if len(specs) > self.config.max_waiting:
            raise NeverAdmitted(len(specs), self.config.max_waiting)
        if len(self.waiting) + len(specs) > self.config.max_waiting:
            raise QueueFull(len(self.waiting), self.config.max_waiting, retry_after_s=1.0)
        now = self._clock.now()
        stream = RequestStream(len(specs))
        sequences = [
            Sequence(
                seq_id=next(self._ids),
                spec=spec,
                priority=priority,
                arrival_s=now,
                deadline_s=now + timeout_s,
                stream=stream,
                index=index,
            )
            for index, spec in enumerate(specs)
        ]
        self.waiting.extend(sequences)
        self.metrics.waiting.set(len(self.waiting))
        self._wake.set()
        return stream, sequences

    def cancel(self, sequences: Seq[Sequence]) -> None:
        """Their client went away: they leave at the next step, their cache freed."""
        for seq in sequences:
            if seq.state is not SeqState.FINISHED:
                seq.cancelled = True
        self._wake.set()

    def fail_waiting(self, error: BaseException) -> int:
        """End every sequence that has not started (a drain: 503); running ones go on."""
        unstarted = [s for s in self.waiting if s.started_s is None]
        for seq in unstarted:
            self._end(seq, error=error)
        self.waiting = [s for s in self.waiting if s.started_s is not None]
        self.metrics.waiting.set(len(self.waiting))
        return len(unstarted)

    def fail_all(self, error: BaseException) -> None:
        for seq in [*self.running, *self.waiting]:
            self._end(seq, error=error)
        self.running, self.waiting = [], []
        self.metrics.running.set(0)
        self.metrics.waiting.set(0)

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def _drop_ended(self, now: float) -> None:
        for seq in [*self.running, *self.waiting]:
            if seq.cancelled:
                self._finish(seq, "cancelled")
            elif not seq.output_ids and seq.deadline_s <= now:
                self._end(seq, error=DeadlineExceeded(now - seq.arrival_s))

    def _retire(self, seq: Sequence) -> None:
        """It has its last token: out of the steps (its cache freed), its stream ended by
        ``emit``."""
        if seq.state is SeqState.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.state = SeqState.FINISHED
        self._to_free.append(seq.seq_id)
        self._to_forget.append(seq.seq_id)
        self._show_counts()

    def _finish(self, seq: Sequence, reason: str) -> None:
        """``seq`` ended (``stop``, ``length``, or ``cancelled``: its client went away): out
        of the steps if it still is, its end counted; a cancelled one's stream ends with
        ``SequenceCancelled`` (nobody reads it, but every stream ends)."""
        if seq.state is not SeqState.FINISHED:
            self._retire(seq)
        seq.finish_reason = reason
        self.metrics.finished[reason].inc()
        if reason == "cancelled":
            seq.stream.fail(SequenceCancelled("the client went away"))

    def _end(self, seq: Sequence, *, error: BaseException) -> None:
        """End ``seq`` with ``error``: out of the steps, its stream failed."""
        if seq.state is not SeqState.FINISHED:
            self._retire(seq)
            self.metrics.finished["error"].inc()
        seq.stream.fail(error)

    def _show_counts(self) -> None:
        self.metrics.running.set(len(self.running))
        self.metrics.waiting.set(len(self.waiting))
