"""What an OOM inside a step teaches: a ceiling on the sequences and tokens of a step.

A step that ran out of memory halves the step that may run next (the engine preempts the
newer half of its sequences); the ceiling keeps the preempted ones from joining again at
once, and rises back, one sequence and a quarter more tokens at a time, after clean steps
at it, until it no longer binds.
"""

from __future__ import annotations

from dataclasses import dataclass

CLEAN_STEPS = 8
"""Clean steps at the ceiling before it rises."""


@dataclass(slots=True)
class StepCeiling:
    max_sequences: int | None = None
    max_tokens: int | None = None
    _clean: int = 0

    def out_of_memory(self, num_sequences: int, num_tokens: int) -> None:
        self.max_sequences = max(1, num_sequences // 2)
        self.max_tokens = max(16, num_tokens // 2)
        self._clean = 0

    def ran(self, num_sequences: int, num_tokens: int, *, max_running: int,
            max_step_tokens: int) -> None:  # fmt: skip
        """A clean step: after ``CLEAN_STEPS`` of them near the ceiling, it rises."""
        if self.max_sequences is None or self.max_tokens is None:
            return
        near = num_sequences >= self.max_sequences or num_tokens >= self.max_tokens // 2
        self._clean += 1 if near else 0
        if self._clean < CLEAN_STEPS:
            return
        self._clean = 0
        self.max_sequences += 1
        self.max_tokens = int(self.max_tokens * 1.25) + 1
        if self.max_sequences >= max_running and self.max_tokens >= max_step_tokens:
            self.max_sequences = self.max_tokens = None
