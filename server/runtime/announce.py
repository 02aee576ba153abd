"""What the replica tells its operator at start-up: one line when it is ready to serve."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from batching import AdaptiveSizer, MemoryReading, Sizer
from models import ModelInfo

if TYPE_CHECKING:
    from generation import GenerationEngine

    from .runtime import Runtime

MiB = 2**20


def base_url(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def _mib(value: float) -> str:
    return f"{value / MiB:,.0f} MiB"


def memory_budget(sizer: Sizer, reading: MemoryReading | None) -> str:
    """A sizer's limits for the next batch, as an operator reads them."""
    budget = sizer.budget(reading)
    caps = f"at most {budget.max_items} items, {budget.max_tokens} padded tokens"
    if not isinstance(sizer, AdaptiveSizer):
        return f"fixed batches ({caps})"
    if budget.max_bytes is None or math.isinf(budget.max_bytes):
        return f"memory budget unlimited ({caps})"
    free = reading.free_bytes if reading is not None else None
    headroom = f"{sizer.config.headroom_fraction:.0%} headroom"
    if free is None:
        source = "the ceiling proven at warm-up"
    elif budget.max_bytes >= sizer.ceiling_bytes:
        source = f"the ceiling proven at warm-up; free {_mib(free)} less {headroom} is more"
    else:
        source = f"free {_mib(free)} less {headroom}"
    return f"memory budget {_mib(budget.max_bytes)} per batch ({source}; {caps})"


def cache_budget(engine: GenerationEngine, reading: MemoryReading | None) -> str:
    """A generator's key/value store as an operator reads it: what a token costs, and how
    many the memory free now would hold."""
    per_token = engine.model.cache_bytes_per_token
    free = reading.free_bytes if reading is not None else None
    held = "" if free is None else (
        f", {free * (1 - engine.config.headroom_fraction) / per_token:,.0f} tokens in the "
        f"{_mib(free)} free now, less {engine.config.headroom_fraction:.0%} headroom"
    )  # fmt: skip
    return (
        f"key/value store {per_token / 1024:,.1f} KiB a token, allocated as sequences grow"
        f"{held}; at most {engine.config.max_running} sequences, "
        f"{engine.config.max_step_tokens} tokens a step"
    )


def outputs(info: ModelInfo) -> str:
    """What a model answers: ``embed: mean pooling, normalised, 384 dims; prompts query,
    passage (default query)``, ``rerank: sigmoid``, ``classify: softmax``."""
    if info.task in ("embed", "sparse"):
        normalised = None if info.normalize is None else "normalised"
        if info.normalize is False:
            normalised = "not normalised"
        parts = [
            f"{info.pooling} pooling" if info.pooling else None,
            normalised,
            f"{info.output_dim} dims" if info.output_dim else None,
        ]
        text = ", ".join(p for p in parts if p)
    elif info.task == "generate":
        text = f"context {info.max_input_tokens} tokens"
    else:
        text = info.activation or ""
    if info.prompts:
        default = info.default_prompt_name or "none"
        text += f"; prompts {', '.join(info.prompts)} (default {default})"
    return f"{info.task}: {text}" if text else info.task


def ready_line(runtime: Runtime, elapsed_s: float) -> str:
    """``ready in 4.7s: http://127.0.0.1:8000 serves <model> (embed: mean pooling, normalised,
    384 dims) on cpu, float32; ...``; with several models, each by name and what it answers,
    the default first, and each one's budget (every model has its own sizer, read against the
    same free memory)."""
    slots = list(runtime.slots.values())
    info = slots[0].info  # every model shares the device
    served = ", ".join(f"{slot.name} ({outputs(slot.info)})" for slot in slots)
    settings = runtime.settings
    url = base_url(settings.host, settings.port)
    where = " (all interfaces)" if settings.host in ("0.0.0.0", "::") else ""
    reading = runtime.probe.read() if runtime.probe is not None else None
    budgets = []
    for slot in slots:
        engine = runtime.generators.engines.get(slot.name)
        if engine is not None:
            budget = cache_budget(engine, reading)
            budgets.append(f"{slot.name}: {budget}" if len(slots) > 1 else budget)
            continue
        assert slot.sizer is not None
        budget = memory_budget(slot.sizer, reading)
        if slot.report is not None:
            budget += f"; {slot.report.describe()}"
        budgets.append(f"{slot.name}: {budget}" if len(slots) > 1 else budget)
    return (
        f"ready in {elapsed_s:.1f}s: {url}{where} serves {served} on {info.device}, "
        f"{info.dtype}; {'; '.join(budgets)}; status page {url}/status"
    )
