"""The steps of a replica's start-up that set one thing each: a model loaded, where its
requests are tokenized, the host memory limit, the output cache's bound. ``Runtime._start``
(``starting.py``) runs them in order."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace

from batching import MemoryMetrics, MemoryProbe, ModelThread, limit_address_space
from models import Model, ModelSpec

from ..cache import InputCache, default_cache_bytes, host_memory_bytes
from ..metrics import ServerMetrics
from ..settings import Settings
from .slot import ModelSlot
from .tokenize import idle_inline_limit, measure_inline_limit

log = logging.getLogger("batchfit")


def load_model(spec: ModelSpec) -> Model:
    """``models.load_model``, imported on the first load: torch comes with it, and a process
    that imports the runtime only to serve requests (an API process) never loads a model."""
    from models import load_model as load

    return load(spec)


# Until a model's own limit is measured at start-up (``tokenize.py``).
INLINE_TOKENIZE_CHARS = 4096


async def load(
    slot: ModelSlot, model_thread: ModelThread, metrics: ServerMetrics, num_threads: int
) -> None:
    """Load ``slot``'s model on the model thread (unless one was given) and say what it is."""
    started = time.perf_counter()
    if slot.model is None:
        spec = replace(slot.spec, num_threads=num_threads)
        slot.model = await model_thread.call(load_model, spec)
    info = slot.model.info
    log.info(
        "model %s loaded: task=%s device=%s dtype=%s parameters=%d max_input_tokens=%d (%.1fs)",
        slot.name, info.task, info.device, info.dtype, info.num_parameters,
        info.max_input_tokens, time.perf_counter() - started,
    )  # fmt: skip
    if info.task == "rerank" and not hasattr(slot.model, "prepare_pairs"):
        raise RuntimeError(f"model {slot.name} is a reranker but cannot encode pairs")
    metrics.model.labels(slot.name).info(
        {"name": info.name, "task": info.task, "device": info.device, "dtype": info.dtype}
    )


async def place_tokenizing(slot: ModelSlot, tokenizer_thread: ModelThread) -> None:
    """Measure up to how much text ``slot``'s requests are worth tokenizing inline."""
    assert slot.model is not None
    model = slot.model

    def prepare(texts: list[str]) -> object:
        return model.prepare(texts, truncate=True)

    try:
        limit, costs, handoff_s = await measure_inline_limit(
            prepare, lambda: tokenizer_thread.call(int)
        )
    except Exception as exc:  # a custom model that cannot tokenize plain words
        log.warning("model %s: tokenizing not measured (%s)", slot.name, exc)
        slot.inline_tokenize_chars = slot.idle_inline_chars = INLINE_TOKENIZE_CHARS
        return
    slot.inline_tokenize_chars = limit
    slot.idle_inline_chars = idle_inline_limit(costs, limit)
    log.info(
        "model %s: tokenized on the event loop %s (inline: %s; the hand-off to the "
        "tokenizer thread: %.0f us)",
        slot.name, _where(limit, slot.idle_inline_chars),
        ", ".join(f"{chars} chars {cost * 1e6:.0f} us" for chars, cost in costs.items()),
        handoff_s * 1e6,
    )  # fmt: skip


def _where(limit: float, alone: float) -> str:
    """``up to 16 characters, up to 1024 for a request alone``, as the start-up log says it."""
    if limit == float("inf"):
        return "at any size"
    return f"up to {limit:.0f} characters, up to {alone:.0f} for a request alone"


def limit_host_memory(probe: MemoryProbe, limit_bytes: int) -> None:
    """Cap the address space at ``limit_bytes`` above what the loaded models hold now."""
    resident = probe.read().used_bytes or 0
    if resident >= limit_bytes:
        raise RuntimeError(
            f"memory_limit ({limit_bytes} bytes) is below what the loaded model already "
            f"uses ({resident} bytes)"
        )
    set_to = limit_address_space(limit_bytes - resident)
    log.info(
        "memory limit %d MiB: address space capped at %d MiB (%d MiB above the model)",
        limit_bytes >> 20, set_to >> 20, (limit_bytes - resident) >> 20,
    )  # fmt: skip


def log_memory_limit(probe: MemoryProbe | None, memory_metrics: MemoryMetrics) -> None:
    """Say which limit binds before the first batch: warm-up runs under it too."""
    reading = probe.read() if probe is not None else None
    if reading is None or reading.limit is None:
        log.info("memory limit: none read (no memory probe)")
        return
    memory_metrics.set_limit(reading.limit)
    log.info(
        "memory limit: %s, %d MiB free under it",
        reading.limit.describe(), (reading.free_bytes or 0) >> 20,
    )  # fmt: skip


def bound_cache(
    inputs: InputCache, settings: Settings, slots: Sequence[ModelSlot],
    probe: MemoryProbe | None, *, on_host: bool,
) -> None:  # fmt: skip
    """The output cache's bound: ``--cache-bytes``, else a share of the host memory the
    replica may use. Its entries are resident host memory, which the host probe reads
    (resident set, cgroup usage, MemAvailable), so on a CPU host every batch's budget is
    sized with them already counted; on a GPU they take host memory, not the device's."""
    given = settings.cache_bytes
    max_bytes = int(given) if given is not None else default_cache_bytes(
        host_memory_bytes(settings.memory_limit, on_host=on_host)
    )  # fmt: skip
    inputs.set_max_bytes(max_bytes)
    for slot in slots:
        inputs.add_model(slot.name)
    if not max_bytes:
        dedup = "" if settings.deduplicate else "; no deduplication"
        log.info("output cache: off%s", dedup)
        return
    reading = probe.read() if probe is not None and on_host else None
    free = reading.free_bytes if reading is not None else None
    log.info(
        "output cache: up to %d MiB%s, counted in the memory the batch budget reads",
        max_bytes >> 20, f" (with {free >> 20} MiB free now)" if free is not None else "",
    )  # fmt: skip
    if free is not None and max_bytes > free // 2:
        log.warning(
            "the output cache may hold %d MiB, more than half of the %d MiB free now: "
            "batches will shrink as it fills (--cache-bytes lowers it)",
            max_bytes >> 20, free >> 20,
        )  # fmt: skip
