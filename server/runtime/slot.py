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
    FixedSizer,
    Lane,
    MemoryProbe,
    Sizer,
    WarmUp,
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
            "architecture": info.shape.architecture,
            "pooling": info.pooling,
            "normalize": info.normalize,
            "prompts": dict(info.prompts),
            "default_prompt_name": info.default_prompt_name,
            "activation": info.activation,
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
        warm_up = WarmUp(
            self.sizer,
            max_input_tokens=self.model.info.max_input_tokens,
            max_items=self.settings.max_batch_size,
        )
        while (batch := warm_up.next_batch(self.probe.read() if self.probe else None)) is not None:
            items = self.model.synthetic_items(*batch)
            try:
                outcome = await batcher.run_calibration(items, self.name)
            except ModelOutOfMemory:
                warm_up.out_of_memory()
                continue
            warm_up.ran(outcome)
        warm_up.finish()


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


def prepare_call(
    model: Model, inputs: Sequence[str], *, truncate: bool, query: str | None, prompt: str | None
) -> Callable[[], list[Any]]:
    """The tokenization of a request's inputs, to run inline or off the event loop. A model
    whose ``prepare`` takes no ``prompt`` gets the prompt already in front of each text."""
    if query is not None:
        pairs = model.prepare_pairs  # type: ignore[attr-defined]
        if prompt and "prompt" in inspect.signature(pairs).parameters:
            return functools.partial(pairs, query, inputs, truncate=truncate, prompt=prompt)
        query = prompt + query if prompt else query
        return functools.partial(pairs, query, inputs, truncate=truncate)
    if prompt and "prompt" in inspect.signature(model.prepare).parameters:
        return functools.partial(model.prepare, inputs, truncate=truncate, prompt=prompt)
    texts = [prompt + text for text in inputs] if prompt else inputs
    return functools.partial(model.prepare, texts, truncate=truncate)
