"""What an engine is told: its caps, its pacing and its share of memory."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_running: int = 64
    """Most sequences in the store at once (``--max-running-seqs``)."""
    max_step_tokens: int = 2048
    """Most tokens one step feeds (``--max-step-tokens``)."""
    prefill_time_factor: float = 1.8
    """While sequences decode, a step's prefill chunks keep its time within this many times
    a step of its decode tokens alone."""
    default_prefill_tokens: int = 64
    """The prefill chunk beside decode tokens before the step time model is fitted."""
    max_waiting: int = 1024
    """Most sequences waiting to join; beyond it ``submit`` raises ``QueueFull`` (429)."""
    headroom_fraction: float = 0.15
    """Share of what the key/value store could hold (what it holds and what is free) that it
    leaves unused."""
    priority_aging_s: float = 1.0
