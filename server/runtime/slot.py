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
    WarmUp,
    WarmUpReport,
    prior_for,
    tune_host_allocator,
)
from models import BatchProfiler, Model, ModelInfo, ModelOutOfMemory, ModelSpec

from ..errors import ApiError
from ..settings import Settings
from .contention import ThreadGuard
from .threads import on_threads

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
        self.inline_tokenize_chars: float = 0.0
        """Requests with at most this much text are tokenized on the event loop; measured
        at start-up (``runtime/tokenize.py``)."""
        self.idle_inline_chars: float = 0.0
        """The same for a request that is the only one in progress (``idle_inline_limit``)."""

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

    def lane(
        self, profiler: BatchProfiler, guard: ThreadGuard | None = None, *,
        threads_beside: int | None = None,
    ) -> Lane:  # fmt: skip
        """The batcher's view of this model; with ``threads_beside``, its passes may also run
        side by side, on that many intra-op threads each."""
        assert self.model is not None and self.sizer is not None
        forward = profiler.wrap(self.model.forward)
        side_forward = None
        if threads_beside:
            side_forward = on_threads(forward, threads_beside, guard.interrupt if guard else None)
        return Lane(
            self.name, guard.wrap(forward) if guard else forward, self.sizer,
            side_forward=side_forward,
        )  # fmt: skip

    def card(self) -> dict[str, object]:
        """How ``/v1/models`` describes this model (a generator: with its context length)."""
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
            "context_length": info.max_input_tokens if info.task == "generate" else None,
        }

    async def warm_up(self, batcher: Batcher) -> WarmUpReport:
        """Run calibration batches within the memory budget and the time bound (``WarmUp``),
        lowering the ceiling after each OOM, so the server never says ready with a budget it
        cannot run. The adaptive sizer calibrates its memory model on them; the report says
        the longest length proven."""
        assert self.model is not None and self.sizer is not None
        on_host = self.model.info.device == "cpu"
        if on_host:
            tune_host_allocator(measuring=True)
        try:
            self.report = await self._calibrate(batcher)
        finally:
            if on_host:
                tune_host_allocator(measuring=False, reading=batcher.memory.latest())
        log.info(
            "warm-up of %s: %s in %.1fs%s%s", self.name, self.report.describe(),
            self.report.elapsed_s,
            f" (bound {self.report.bound_s:.0f}s)" if self.report.bound_s is not None else "",
            f"; stopped: {self.report.stopped}" if self.report.stopped else "",
        )  # fmt: skip
        return self.report

    async def _calibrate(self, batcher: Batcher) -> WarmUpReport:
        assert self.model is not None and self.sizer is not None
        clock = batcher.clock
        started = clock.now()
        warm_up = WarmUp(
            self.sizer,
            max_input_tokens=self.model.info.max_input_tokens,
            max_items=self.settings.max_batch_size,
            timeout_s=self.settings.warmup_timeout_s,
        )
        while (
            step := warm_up.next_batch(
                self.probe.read() if self.probe else None, elapsed_s=clock.now() - started
            )
        ) is not None:
            # NOTE: left set if warm-up is cancelled here: the log says where it stopped.
            self.step = step
            items = self.model.synthetic_items(step.num_items, step.length)
            try:
                outcome = await batcher.run_calibration(items, self.name)
            except ModelOutOfMemory:
                self.step = None
                warm_up.out_of_memory()
                continue
            self.step = None
            warm_up.ran(outcome)
        return warm_up.finish(clock.now() - started)


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
    return AdaptiveSizer(prior_for(info.shape), settings.adaptive_config())


_PARAMETERS: dict[Any, Mapping[str, inspect.Parameter]] = {}


def _parameters(prepare: Callable[..., Any]) -> Mapping[str, inspect.Parameter]:
    """``prepare``'s parameters, read once per function: ``inspect.signature`` costs tens
    of microseconds, on every request otherwise."""
    key = getattr(prepare, "__func__", prepare)
    try:
        return _PARAMETERS[key]
    except KeyError:
        found = _PARAMETERS[key] = inspect.signature(prepare).parameters
        return found
    except TypeError:  # an unhashable callable
        return inspect.signature(prepare).parameters


def tokenize_inline(
    slot: Any, inputs: Sequence[str], *, query: str | None, prompt: str | None, alone: bool
) -> bool:
    """Whether a request's text (its inputs, with the query and the prompt each pairs or
    goes in front of) is short enough to tokenize on the event loop: within ``slot``'s limit
    for a loop with other requests in progress, or, ``alone``, for a request on its own."""
    each = len(query or "") + len(prompt or "")
    chars = sum(len(text) for text in inputs) + each * len(inputs)
    return chars <= (slot.idle_inline_chars if alone else slot.inline_tokenize_chars)


def prepare_call(
    model: Model, inputs: Sequence[str], *, name: str, truncate: bool, query: str | None,
    prompt: str | None, truncation_direction: str | None = None,
    max_tokens_per_doc: int | None = None, chunk: bool = False,
    late_chunks: Sequence[Sequence[tuple[int, int]]] | None = None,
) -> Callable[[], Any]:  # fmt: skip
    """The tokenization of a request's inputs, to run inline or off the event loop. A model
    whose ``prepare`` takes no ``prompt`` gets the prompt already in front of each text; one
    that takes no ``truncation_direction`` (or ``max_tokens_per_doc``) cannot be asked for
    one (400). ``name``: the model's name as served, for that error. ``chunk``: the inputs as
    ``Windows`` (``prepare_windows``); ``late_chunks``: each input's character spans."""
    if chunk:
        windows = getattr(model, "prepare_windows", None)
        if windows is None or query is not None:
            raise ApiError(
                400, "unsupported_parameter",
                f"model {name!r} cannot cut inputs into windows; leave truncate: chunk out",
            )  # fmt: skip
        return functools.partial(windows, inputs, prompt=prompt or None)
    prepare = model.prepare_pairs if query is not None else model.prepare  # type: ignore[attr-defined]
    parameters = _parameters(prepare)
    options: dict[str, Any] = {"truncate": truncate}
    if late_chunks is not None:
        if "late_chunks" not in parameters or query is not None:
            raise ApiError(
                400, "unsupported_parameter",
                f"model {name!r} cannot pool late chunks; leave late_chunks out",
            )  # fmt: skip
        options["late_chunks"] = late_chunks
    if truncation_direction is not None:
        if "truncation_direction" not in parameters:
            raise ApiError(
                400, "unsupported_parameter",
                f"model {name!r} cannot truncate from a chosen side; leave "
                "truncation_direction out",
            )  # fmt: skip
        options["truncation_direction"] = truncation_direction
    if max_tokens_per_doc is not None:
        if "max_tokens_per_doc" not in parameters:
            raise ApiError(
                400, "unsupported_parameter",
                f"model {name!r} cannot cut documents to a token count; leave "
                "max_tokens_per_doc out",
            )  # fmt: skip
        options["max_tokens_per_doc"] = max_tokens_per_doc
    if query is not None:
        if prompt and "prompt" in parameters:
            return functools.partial(prepare, query, inputs, prompt=prompt, **options)
        query = prompt + query if prompt else query
        return functools.partial(prepare, query, inputs, **options)
    if prompt and "prompt" in parameters:
        return functools.partial(prepare, inputs, prompt=prompt, **options)
    texts = [prompt + text for text in inputs] if prompt else inputs
    return functools.partial(prepare, texts, **options)
