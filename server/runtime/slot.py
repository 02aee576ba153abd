"""One served model in a replica: its name, the model, its sizer, and its warm-up.

A replica holds one slot per ``--model``. Every slot shares the replica's queue, batcher,
model thread and memory probe; each has its own sizer (peak model) and, in the batcher, its
own time model and metric series.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from batching import (
    AdaptiveSizer,
    Batcher,
    CalibrationStep,
    FixedSizer,
    Lane,
    MemoryProbe,
    Sizer,
    WarmUpPlanner,
    WarmUpReport,
    prior_peak_model,
    scouts,
    tune_host_allocator,
)
from models import BatchProfiler, Model, ModelInfo, ModelOutOfMemory, ModelSpec

from ..errors import ApiError
from ..settings import Settings

log = logging.getLogger("batchfit")


class ModelSlot:
    """A model and what sizes its batches. ``name`` is the one clients route by: the name
    given with ``name=`` or else the model's own."""

    def __init__(
        self,
        settings: Settings,
        spec: ModelSpec,
        *,
        name: str | None = None,
        model: Model | None = None,
        sizer: Sizer | None = None,
    ) -> None:
        self.settings = settings
        self.spec = spec
        self.given_name = name
        self.model = model
        self.sizer = sizer  # built from the model's shape once it is loaded, unless given
        self.probe: MemoryProbe | None = None  # the replica's, shared by every slot
        self.report: WarmUpReport | None = None
        """What warm-up proved; None until it has run."""
        self.step: CalibrationStep | None = None
        """The warm-up batch running now, if any (said when stopped mid-way)."""

    @property
    def name(self) -> str:
        if self.given_name is not None:
            return self.given_name
        assert self.model is not None, "a slot is named by its model until the model loads"
        return self.model.info.name

    @property
    def info(self) -> ModelInfo:
        assert self.model is not None
        return self.model.info

    def lane(self, profiler: BatchProfiler) -> Lane:
        assert self.model is not None and self.sizer is not None
        return Lane(self.name, profiler.wrap(self.model.forward), self.sizer)

    def card(self) -> dict[str, object]:
        """How ``/v1/models`` describes this model."""
        info = self.info
        return {
            "name": self.name,
            "task": info.task,
            "device": info.device,
            "dtype": info.dtype,
            "max_input_tokens": info.max_input_tokens,
            "output_dim": info.output_dim,
            "architecture": info.shape.architecture,
            "pooling": info.pooling,
            "normalize": info.normalize,
            "prompts": dict(info.prompts),
            "default_prompt_name": info.default_prompt_name,
            "activation": info.activation,
            "truncation_direction": info.truncation_side,
        }

    async def warm_up(self, batcher: Batcher) -> WarmUpReport:
        """Run calibration batches within the memory budget and the time bound
        (``WarmUpPlanner``), lowering the ceiling after each OOM, so the server never says
        ready with a budget it cannot run. The adaptive sizer calibrates its memory model on
        them; the report says the longest length proven."""
        assert self.model is not None and self.sizer is not None
        on_host = self.model.info.device == "cpu"
        if on_host:
            tune_host_allocator(measuring=True)
        try:
            if isinstance(self.sizer, AdaptiveSizer):
                self.report = await self._calibrate(batcher, self.sizer)
            else:
                self.report = await self._run_fixed(batcher)
        finally:
            if on_host:
                tune_host_allocator(measuring=False)
        log.info(
            "warm-up of %s: %s in %.1fs%s%s", self.name, self.report.describe(),
            self.report.elapsed_s,
            f" (bound {self.report.bound_s:.0f}s)" if self.report.bound_s is not None else "",
            f"; stopped: {self.report.stopped}" if self.report.stopped else "",
        )  # fmt: skip
        return self.report

    async def _calibrate(self, batcher: Batcher, sizer: AdaptiveSizer) -> WarmUpReport:
        assert self.model is not None
        clock = batcher.clock
        started = clock.now()
        planner = WarmUpPlanner(
            max_length=self.model.info.max_input_tokens,
            max_items=self.settings.max_batch_size,
            timeout_s=self.settings.warmup_timeout_s,
        )
        while True:
            reading = self.probe.read() if self.probe else None
            # NOTE: past a cgroup's limit (or the host's memory) the kernel kills the
            # process: no error comes back to lower the ceiling on. Where memory, not a
            # cap, sets a batch's size, a quarter of it runs first, so the full one is
            # planned by a model corrected at this length, not by the prior alone.
            step = planner.next_step(
                sizer.budget(reading), elapsed_s=clock.now() - started, scout=scouts(reading)
            )
            if step is None:
                break
            # NOTE: left set if warm-up is cancelled here: the log says where it stopped.
            self.step = step
            items = self.model.synthetic_items(step.num_items, step.length)
            try:
                outcome = await batcher.run_calibration(items, self.name)
            except ModelOutOfMemory:
                self.step = None
                sizer.on_oom(step.num_items, step.length)
                planner.ran_out_of_memory(step)
                log.info(
                    "warm-up batch of %d x %d tokens ran out of memory",
                    step.num_items, step.length,
                )  # fmt: skip
                continue
            self.step = None
            sizer.calibrate(outcome)
            planner.ran(step, outcome.elapsed_s)
            log.info(
                "warm-up batch of %d x %d tokens%s: %.3fs, peak %s", step.num_items,
                step.length, "" if step.kind == "batch" else f" ({step.kind})",
                outcome.elapsed_s,
                f"{outcome.peak_bytes / 2**20:.1f} MiB" if outcome.peak_bytes else "n/a",
            )  # fmt: skip
        sizer.finish_warm_up()
        model, ceiling = sizer.model, sizer.ceiling_bytes
        log.info(
            "memory model: %.0f bytes/token + %.1f bytes/token x length (alone: %.0f + %.1f);"
            " ceiling %s", model.alpha, model.beta, *model.line(1),
            "none" if ceiling == float("inf") else f"{ceiling / 2**20:.0f} MiB",
        )  # fmt: skip
        return planner.report(clock.now() - started)

    async def _run_fixed(self, batcher: Batcher) -> WarmUpReport:
        """A fixed sizer's warm-up, as other servers do theirs: its largest batch, halved
        after each OOM."""
        assert self.model is not None and self.sizer is not None
        started = batcher.clock.now()
        max_len = self.model.info.max_input_tokens
        budget = self.sizer.budget()
        length = min(max_len, max(2, budget.max_tokens // budget.max_items))
        num_items, proven = budget.max_items, None
        while True:
            items = self.model.synthetic_items(num_items, length)
            self.step = CalibrationStep(num_items, length)
            try:
                outcome = await batcher.run_calibration(items, self.name)
            except ModelOutOfMemory:
                self.step = None
                if num_items == 1:
                    log.warning("one input of %d tokens does not fit in memory", length)
                    break
                log.info("warm-up batch of %d x %d ran out of memory", num_items, length)
                num_items //= 2
                continue
            self.step = None
            proven = length
            log.info("warm-up batch of %d x %d tokens: %.3fs", num_items, length, outcome.elapsed_s)
            break
        return WarmUpReport(proven, max_len, batcher.clock.now() - started, None)


def make_slots(
    settings: Settings,
    *,
    model: Model | None,
    models: Mapping[str, Model] | None,
    sizer: Sizer | None,
) -> list[ModelSlot]:
    """One slot per served model, the default first: ``models`` by name, else the settings'
    ``--model`` list with ``model`` (if given) in place of the default's loading."""
    if models is not None:
        spec = settings.model_spec()
        slots = [ModelSlot(settings, spec, name=name, model=m) for name, m in models.items()]
    else:
        slots = [ModelSlot(settings, spec, name=name) for name, spec in settings.model_specs()]
        slots[0].model = model
    slots[0].sizer = sizer
    return slots


def by_name(slots: Sequence[ModelSlot]) -> dict[str, ModelSlot]:
    """The loaded slots by the name clients route by; two alike are a start-up error."""
    by_name: dict[str, ModelSlot] = {}
    for slot in slots:
        if slot.name in by_name:
            raise RuntimeError(
                f"two models serve under the name {slot.name!r}; name them: --model NAME=SOURCE"
            )
        by_name[slot.name] = slot
    return by_name


def make_sizer(settings: Settings, info: ModelInfo) -> Sizer:
    if settings.sizer == "fixed":
        return FixedSizer(settings.max_batch_size, settings.max_batch_tokens)
    shape = info.shape
    prior = prior_peak_model(
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_heads=shape.num_heads,
        element_bytes=shape.element_bytes,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        attention=shape.attention,
        sliding_window=shape.sliding_window,
        gated_mlp=shape.gated_mlp,
    )
    return AdaptiveSizer(prior, settings.adaptive_config())


def prepare_call(
    model: Model, inputs: Sequence[str], *, truncate: bool, query: str | None, prompt: str | None,
    truncation_direction: str | None = None,
) -> Callable[[], list[Any]]:  # fmt: skip
    """The tokenization of a request's inputs, to run inline or off the event loop. A model
    whose ``prepare`` takes no ``prompt`` gets the prompt already in front of each text; one
    that takes no ``truncation_direction`` cannot be asked for one (400)."""
    prepare = model.prepare_pairs if query is not None else model.prepare  # type: ignore[attr-defined]
    parameters = inspect.signature(prepare).parameters
    options: dict[str, Any] = {"truncate": truncate}
    if truncation_direction is not None:
        if "truncation_direction" not in parameters:
            raise ApiError(
                400, "unsupported_parameter",
                f"model {model.info.name!r} cannot truncate from a chosen side; leave "
                "truncation_direction out",
            )  # fmt: skip
        options["truncation_direction"] = truncation_direction
    if query is not None:
        if prompt and "prompt" in parameters:
            return functools.partial(prepare, query, inputs, prompt=prompt, **options)
        query = prompt + query if prompt else query
        return functools.partial(prepare, query, inputs, **options)
    if prompt and "prompt" in parameters:
        return functools.partial(prepare, inputs, prompt=prompt, **options)
    texts = [prompt + text for text in inputs] if prompt else inputs
    return functools.partial(prepare, texts, **options)
