"""Settings: the one place the environment (``BATCHFIT_*``) and CLI flags are read.

``Settings`` composes its groups, each in a module of its own: the models (``models.py``), the
front end (``frontend.py``), batches (``batches.py``), memory (``memory.py``), the queue
(``queue.py``) and the process's life (``lifecycle.py``). Here: what checks or combines
several groups, and the frozen configs the other packages receive.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from batching import AdaptiveConfig, BatcherConfig
from generation import EngineConfig

from .batches import BatchSettings
from .frontend import FrontEndSettings
from .launcher import LauncherSettings
from .lifecycle import LifecycleSettings
from .memory import MemorySettings
from .models import ModelSettings
from .queue import MAX_INPUTS_PER_REQUEST, QueueSettings

__all__ = [
    "MEMORY_READING_INTERVAL_S",
    "MEMORY_READING_SHARE",
    "LauncherSettings",
    "ServerConfig",
    "Settings",
]

# After a batch the model thread reads memory for the next one at most this often; a batch in
# between is sized from the latest reading. The reading costs a serving process's model
# thread about 0.1 ms on a CPU host (``python -m bench.layers``), as much as a short batch: on
# batches shorter than this, fresh memory for each of them would cost a good part of it.
MEMORY_READING_INTERVAL_S = 0.005
# ... and, whatever that interval, at most this share of the model thread's time goes to them:
# the interval grows with what a reading costs (measured on each), up to half the age at
# which the event loop reads anew.
MEMORY_READING_SHARE = 0.01


# NOTE: pydantic orders the fields (the flags in --help, the rows of the flag table) from the
# last group listed here to the first: the models' first, the lifecycle's last.
class Settings(
    LifecycleSettings,
    QueueSettings,
    MemorySettings,
    BatchSettings,
    FrontEndSettings,
    ModelSettings,
    BaseSettings,
):
    """Every field is also a CLI flag: ``max_batch_size`` is ``--max-batch-size``."""

    model_config = SettingsConfigDict(env_prefix="BATCHFIT_", frozen=True, extra="forbid")

    @model_validator(mode="after")
    def _check_admission(self) -> Settings:
        """A request of ``max_inputs_per_request`` inputs must fit in the queue (and in one
        model's share of it); else such a request would get 429 "retry later" for ever. Left
        unset (no flag, no variable), the limit is lowered to fit instead of refused."""
        limit = self.max_inputs_per_request
        share = self.max_items_per_model()
        room = self.max_queue_items if share is None else share
        if limit <= room:
            return self
        if "max_inputs_per_request" not in self.model_fields_set:
            # NOTE: set past the frozen model's guard, and still not in model_fields_set: the
            # default, lowered, which lowered_defaults() reports.
            self.__dict__["max_inputs_per_request"] = room
            return self
        if limit > self.max_queue_items:
            raise ValueError(
                f"max_inputs_per_request ({limit}) exceeds max_queue_items "
                f"({self.max_queue_items}): such a request could never be admitted; lower "
                "--max-inputs-per-request or raise --max-queue-items"
            )
        raise ValueError(
            f"max_inputs_per_request ({limit}) exceeds one model's share of the queue "
            f"({share} = max_queue_items {self.max_queue_items} x max_queue_share "
            f"{self.max_queue_share}): such a request could never be admitted; lower "
            "--max-inputs-per-request or raise --max-queue-share (or --max-queue-items)"
        )

    def lowered_defaults(self) -> list[str]:
        """The defaults lowered to fit the settings given, one sentence each, for the
        start-up log."""
        limit = self.max_inputs_per_request
        if "max_inputs_per_request" in self.model_fields_set or limit == MAX_INPUTS_PER_REQUEST:
            return []
        room = f"--max-queue-items {self.max_queue_items}"
        if limit < self.max_queue_items:
            share = f"--max-queue-share {self.max_queue_share}"
            room = f"one model's share of the queue ({room} x {share})"
        return [
            f"--max-inputs-per-request lowered from its default {MAX_INPUTS_PER_REQUEST} to "
            f"{limit} to fit {room}: a larger request could never be admitted"
        ]

    def max_items_per_model(self, num_models: int | None = None) -> int | None:
        """What one model may hold of the queue (None: all of it), serving ``num_models``
        (default: as many as ``model`` names)."""
        if self.max_queue_share >= 1 or (num_models or len(self.model)) < 2:
            return None
        return max(1, int(self.max_queue_items * self.max_queue_share))

    def batcher_config(self) -> BatcherConfig:
        return BatcherConfig(
            max_wait_s=self.max_wait_ms / 1000,
            max_length_ratio=self.max_length_ratio,
            oom_split=self.oom_split,
            plan_by_time=self.plan_by_time,
            min_reading_interval_s=MEMORY_READING_INTERVAL_S,
            max_reading_share=MEMORY_READING_SHARE,
        )

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            max_running=self.max_running_seqs,
            max_step_tokens=self.max_step_tokens,
            prefill_time_factor=self.prefill_time_factor,
            max_waiting=self.max_queue_items,
            headroom_fraction=self.memory_headroom,
            priority_aging_s=self.priority_aging_s,
        )

    def adaptive_config(self) -> AdaptiveConfig:
        return AdaptiveConfig(
            max_items=self.max_batch_size,
            max_tokens=self.max_batch_tokens,
            headroom_fraction=self.memory_headroom,
            target_latency_s=self.target_latency_ms / 1000 if self.target_latency_ms else None,
        )

    def server_config(self) -> ServerConfig:
        return ServerConfig(
            max_inputs_per_request=self.max_inputs_per_request,
            max_rerank_documents=self.max_rerank_documents,
            max_body_bytes=self.max_body_bytes,
            default_timeout_s=self.default_timeout_s,
            max_timeout_s=self.max_timeout_s,
            max_queue_items=self.max_queue_items,
            max_batch_size=self.max_batch_size,
            max_batch_tokens=self.max_batch_tokens,
            default_truncate=self.truncate,
        )


@dataclass(frozen=True, slots=True)
class ServerConfig:
    max_inputs_per_request: int
    max_rerank_documents: int
    max_body_bytes: int
    default_timeout_s: float
    max_timeout_s: float
    max_queue_items: int
    max_batch_size: int
    max_batch_tokens: int
    default_truncate: str | None = None
    """``--truncate``: what a request that says nothing of truncation gets (None: inputs
    cut from the model's own side)."""
