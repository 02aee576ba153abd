"""``batchfit plan``: the memory plan a replica would serve with, printed before serving."""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from batching import AdaptiveSizer, PeakModel, largest_batch
from models import ModelInfo

from ..settings import Settings
from .announce import outputs
from .runtime import Runtime
from .slot import ModelSlot

if TYPE_CHECKING:
    from generation import GenerationEngine

MiB = 2**20
# The settings that change the plan: the model, how it is loaded, and the sizer's limits. The
# rest (ports, auth, queue, deadlines) only matter to a serving replica.
PLAN_FIELDS = frozenset(
    {
        "model", "task", "default_prompt_name", "device", "dtype", "quantize", "num_threads",
        "max_input_tokens", "max_batch_size", "max_batch_tokens", "memory_headroom",
        "memory_limit", "warmup_timeout_s",
    }
)  # fmt: skip


def _mib(value: float | None) -> str:
    return "n/a" if value is None or math.isinf(value) else f"{value / MiB:,.1f} MiB"


async def _plan(settings: Settings) -> str:
    runtime = Runtime(settings, registry=CollectorRegistry())
    try:
        await runtime.start()
        if runtime.startup_error is not None:
            raise runtime.startup_error
        return "\n\n".join(describe(runtime, slot) for slot in runtime.slots.values())
    finally:
        await runtime.stop()


def memory_plan(settings: Settings) -> str:
    """Load the model, run the same warm-up and calibration as ``serve``, describe the plan."""
    return asyncio.run(_plan(settings.model_copy(update={"sizer": "adaptive"})))


def describe(runtime: Runtime, slot: ModelSlot | None = None) -> str:
    """One model's plan (default: the default model's)."""
    slot = slot or runtime.slot()
    engine = runtime.generators.engines.get(slot.name)
    if engine is not None:
        return _generator_plan(runtime, slot, engine)
    assert slot.model is not None and isinstance(slot.sizer, AdaptiveSizer)
    info, sizer = slot.info, slot.sizer
    reading = runtime.probe.read() if runtime.probe is not None else None
    free = reading.free_bytes if reading is not None else None
    budget = sizer.budget(reading)
    lines = [
        f"model        {slot.name} ({info.task}) on {info.device}, {info.dtype}",
        f"parameters   {info.num_parameters:,} ({_mib(info.shape.parameter_bytes)})",
        f"max input    {info.max_input_tokens} tokens",
        f"warm-up      {_warm_up(slot)}",
        f"outputs      {outputs(info)}",
        *(f"  prompt {name!r}: {text!r}" for name, text in info.prompts.items()),
        "",
        "activation peak model: alpha x n x L + beta x n x L^2 (n items padded to L tokens;",
        "  one input alone has its own line: no padding, so no attention mask under sdpa)",
        f"  prior from config   {_line(sizer.prior, 2)}   alone {_line(sizer.prior, 1)}",
        f"  after calibration   {_line(sizer.model, 2)}   alone {_line(sizer.model, 1)}"
        f"   (x{sizer.config.safety_factor} safety)",
        f"  architecture        {_architecture(info)}",
        "",
        f"memory limit {reading.limit.describe() if reading and reading.limit else 'n/a'}",
        f"memory now   free {_mib(free)} ({', '.join(reading.sources) if reading else 'no probe'})"
        f", headroom {sizer.config.headroom_fraction:.0%}",
        f"budget       {_mib(budget.max_bytes)} per batch (ceiling proven at warm-up: "
        f"{_mib(sizer.proven_bytes)}); at most {budget.max_items} items, "
        f"{budget.max_tokens} padded tokens",
        "",
    ]
    shown = (16, 32, 64, 128, 256, 512, 2048, 8192, 32768, 131072)
    lengths = sorted({min(info.max_input_tokens, n) for n in shown})
    proven = slot.report.proven_length if slot.report else None
    lines.append(f"{'length':>8} {'x1':>11} {'x8':>11} {'x32':>11} {'items in budget':>16}")
    for length in lengths:
        beyond = "  (beyond the proven length: predicted)" if proven and length > proven else ""
        lines.append(
            f"{length:>8} {_mib(sizer.predict(1, length)):>11} {_mib(sizer.predict(8, length)):>11}"
            f" {_mib(sizer.predict(32, length)):>11} {largest_batch(budget, length):>16}{beyond}"
        )
    return "\n".join(lines)


def _generator_plan(runtime: Runtime, slot: ModelSlot, engine: GenerationEngine) -> str:
    """A generator's plan: its key/value store's cost per token, and the tokens the memory
    free now holds, shared by the sequences that run."""
    info, config = slot.info, engine.config
    reading = runtime.probe.read() if runtime.probe is not None else None
    free = reading.free_bytes if reading is not None else None
    per_token = engine.model.cache_bytes_per_token
    step = engine.model.step_bytes(config.max_step_tokens, 0, config.max_running)
    room = None if free is None else max(0.0, free * (1 - config.headroom_fraction) - step)
    tokens = "n/a" if room is None else f"{room / per_token:,.0f}"
    context = info.max_input_tokens
    lines = [
        f"model        {slot.name} ({info.task}) on {info.device}, {info.dtype}",
        f"parameters   {info.num_parameters:,} ({_mib(info.shape.parameter_bytes)})",
        f"context      {context} tokens",
        f"outputs      {outputs(info)}",
        f"  architecture        {_architecture(info)}",
        "",
        f"memory limit {reading.limit.describe() if reading and reading.limit else 'n/a'}",
        f"memory now   free {_mib(free)} ({', '.join(reading.sources) if reading else 'no probe'})"
        f", headroom {config.headroom_fraction:.0%}",
        f"cache        {per_token:,} bytes a token (keys and values of every layer), allocated "
        "per sequence as it grows",
        f"step         at most {config.max_running} sequences, {config.max_step_tokens} tokens; "
        f"activations up to {_mib(step)}",
        f"room         {_mib(room)} for the cache now: {tokens} tokens, "
        + ("n/a" if room is None else f"{room / per_token / context:,.1f} full contexts"),
    ]
    return "\n".join(lines)


def _line(model: PeakModel, num_items: int) -> str:
    alpha, beta = model.line(num_items)
    return f"alpha {alpha:,.0f} B/token   beta {beta:,.1f} B/token/L"


def _architecture(info: ModelInfo) -> str:
    shape = info.shape
    heads = f"{shape.num_heads} heads"
    if shape.num_kv_heads and shape.num_kv_heads != shape.num_heads:
        heads += f" ({shape.num_kv_heads} key/value)"
    parts = [
        f"{shape.architecture}, hidden {shape.hidden_size}, {heads} of {shape.head_dim}",
        f"{shape.attention} attention",
    ]
    if shape.sliding_window:
        parts.append(f"sliding window {shape.sliding_window}")
    if shape.gated_mlp:
        parts.append("gated feed-forward")
    return ", ".join(parts)


def _warm_up(slot: ModelSlot) -> str:
    report = slot.report
    if report is None:
        return "not run"
    text = f"{report.describe()} ({report.elapsed_s:.1f}s"
    text += f" of a {report.bound_s:.0f}s bound)" if report.bound_s is not None else ")"
    if report.stopped:
        text += f"; stopped: {report.stopped}"
    return text
