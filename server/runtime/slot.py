"""One served model in a replica: its name, the model, its sizer, and its warm-up.

A replica holds one slot per ``--model``. Every slot shares the replica's queue, batcher,
model thread and memory probe; each has its own sizer (peak model) and, in the batcher, its
own time model and metric series.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from batching import (
    AdaptiveSizer,
    Batcher,
    FixedSizer,
    Lane,
    MemoryProbe,
    MemoryReading,
    Sizer,
    largest_batch,
    prior_peak_model,
    tune_host_allocator,
)
from models import BatchProfiler, Model, ModelInfo, ModelOutOfMemory, ModelSpec

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
        self.inline_tokenize_chars: float = 0.0
        """Requests with at most this much text are tokenized on the event loop; measured
        at start-up (``runtime/tokenize.py``)."""

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
        }

    async def warm_up(self, batcher: Batcher) -> None:
        """Run the largest batches the sizer would plan (short and longest inputs), lowering
        the ceiling after each OOM until they pass, so the server never says ready with a
        budget it cannot run. The adaptive sizer calibrates its memory model on them."""
        assert self.model is not None and self.sizer is not None
        on_host = self.model.info.device == "cpu"
        if on_host:
            tune_host_allocator(measuring=True)
        try:
            await self._calibrate(batcher)
        finally:
            if on_host:
                tune_host_allocator(measuring=False)

    async def _calibrate(self, batcher: Batcher) -> None:
        assert self.model is not None and self.sizer is not None
        max_len = self.model.info.max_input_tokens
        lengths = sorted({min(max_len, 32), max_len})
        if not isinstance(self.sizer, AdaptiveSizer):
            budget = self.sizer.budget()
            lengths = [min(max_len, max(2, budget.max_tokens // budget.max_items))]
        for length in lengths:
            cap = self.settings.max_batch_size
            scouted = False
            while True:
                reading = self.probe.read() if self.probe else None
                budget = self.sizer.budget(reading)
                fits = largest_batch(budget, length)
                num_items = max(1, min(cap, fits))
                # NOTE: past a cgroup's limit (or the host's memory) the kernel kills the
                # process: no error comes back to lower the ceiling on. Where memory, not a
                # cap, sets this batch's size, a quarter of it runs first, so the full one is
                # planned by a model corrected at this length, not by the prior alone.
                scout = not scouted and fits < cap and num_items >= 4 and _kills(reading)
                if scout:
                    num_items //= 4
                items = self.model.synthetic_items(num_items, length)
                try:
                    outcome = await batcher.run_calibration(items, self.name)
                except ModelOutOfMemory:
                    self.sizer.on_oom(num_items, length)
                    if num_items == 1:
                        log.warning("one input of %d tokens does not fit in memory", length)
                        break
                    log.info("warm-up batch of %d x %d ran out of memory", num_items, length)
                    cap = num_items // 2  # a fixed sizer has no ceiling to lower
                    continue
                if isinstance(self.sizer, AdaptiveSizer):
                    self.sizer.calibrate(outcome)
                log.info(
                    "warm-up batch of %d x %d tokens: %.3fs, peak %s",
                    num_items, length, outcome.elapsed_s,
                    f"{outcome.peak_bytes / 2**20:.1f} MiB" if outcome.peak_bytes else "n/a",
                )  # fmt: skip
                if scout:
                    scouted = True
                    continue
                break
        if isinstance(self.sizer, AdaptiveSizer):
            self.sizer.finish_warm_up()
            model = self.sizer.model
            ceiling = self.sizer.ceiling_bytes
            log.info(
                "memory model: %.0f bytes/token + %.1f bytes/token x length; ceiling %s",
                model.alpha, model.beta,
                "none" if ceiling == float("inf") else f"{ceiling / 2**20:.0f} MiB",
            )  # fmt: skip


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
    )
    return AdaptiveSizer(prior, settings.adaptive_config())


def _kills(reading: MemoryReading | None) -> bool:
    """Whether going past the binding limit gives no allocation error to lower the ceiling
    on: the kernel kills (cgroup, host memory), or nothing enforces it at its value
    (``--memory-limit`` is a promise: its address-space cap leaves room for thread stacks, so
    resident memory can pass it silently). The address space and a device fail an
    allocation instead."""
    return reading is not None and reading.limit is not None and reading.limit.source in (
        "cgroup", "host", "flag",
    )  # fmt: skip
