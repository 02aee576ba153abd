"""Run one request's inputs through the runtime on behalf of any protocol's route."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fastapi import Request

from models import ModelInfo, resolve_prompt, top_labels, truncate_dimensions

from .disconnect import client_watch
from .errors import ApiError
from .long_inputs import Truncation, late_chunks_of, resolve_truncation
from .runtime import ClientDisconnected, ModelSlot, RequestTrace

if TYPE_CHECKING:  # the engine's; an API process never imports it (nor torch)
    from .runtime import Runtime


def runtime_of(request: Request) -> Runtime:
    return request.app.state.runtime


TASK_ROUTES = {
    "rerank": "rerankers answer POST /v1/rerank and POST /v2/rerank",
    "generate": "generators answer POST /v1/completions and POST /v1/chat/completions",
    "sparse": "sparse embedders answer POST /embed_sparse, POST /v1/infer and v2 infer",
}


def task_hint(task: str) -> str:
    """Where a model of ``task`` is answered, for a ``wrong_task`` message ("" for the
    tasks most routes serve)."""
    route = TASK_ROUTES.get(task)
    return f"; {route}" if route else ""


def slot_for_task(
    request: Request, model: str | None, tasks: tuple[str, ...], endpoint: str,
    *, default_task: str | None = None,
) -> ModelSlot:  # fmt: skip
    """The model a request names (None: the default, or the first of ``default_task``),
    refused with 400 ``wrong_task`` unless its task is one of ``tasks``."""
    slot = runtime_of(request).slot(model, task=default_task)
    request.state.model = slot.name  # the model label of the request's metrics
    if slot.info.task not in tasks:
        hint = task_hint(slot.info.task)
        raise ApiError(
            400, "wrong_task",
            f"model {slot.name!r} does {slot.info.task}, which {endpoint} does not serve{hint}",
        )  # fmt: skip
    return slot


def check_inputs(
    runtime: Runtime,
    inputs: Sequence[str],
    field: str = "inputs",
    *,
    schema_status: int = 422,
    limit: int | None = None,
) -> None:
    """The same limits as ``/v1/infer``: not empty, not too many (``limit``; None: the
    server's ``max_inputs_per_request``), no empty string. ``schema_status``: the route's
    status for a schema error (a lone surrogate): 422 on our own routes, 400 on the
    protocols' (as OpenAI and KServe answer)."""
    limit = runtime.config.max_inputs_per_request if limit is None else limit
    if not inputs:
        raise ApiError(400, "empty_input", f"{field} is empty")
    if len(inputs) > limit:
        raise ApiError(
            413, "too_many_inputs", f"{len(inputs)} inputs, more than the limit of {limit}"
        )
    empty = next((i for i, text in enumerate(inputs) if not text), None)
    if empty is not None:
        raise ApiError(400, "empty_input", f"input {empty} is an empty string")
    for index, text in enumerate(inputs):
        # JSON can carry lone surrogates ("\ud800"), which no tokenizer can encode.
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(
                schema_status, "invalid_request",
                f"input {index} is not valid Unicode (lone surrogate)",
            ) from None  # fmt: skip


def check_prompt(prompt_name: str | None, prompt: str | None, *, schema_status: int = 422) -> None:
    """Schema errors of the prompt fields, with the route's ``schema_status`` (as
    ``check_inputs``)."""
    if prompt_name is not None and prompt is not None:
        raise ApiError(
            schema_status, "invalid_request",
            "give prompt_name or prompt (a literal prompt), not both",
        )  # fmt: skip
    if prompt is not None:
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(
                schema_status, "invalid_request", "prompt is not valid Unicode (lone surrogate)"
            ) from None


def check_dimensions(info: ModelInfo, dimensions: int | None, *, name: str) -> None:
    """Matryoshka ``dimensions``: from 1 to the model's output size, embedders only. ``name``:
    the model's name as served (what the client called it)."""
    if dimensions is None:
        return
    if info.task != "embed" or not info.output_dim:
        raise ApiError(
            400, "unsupported_parameter",
            f"dimensions applies to embedding models; {name!r} does {info.task}",
        )  # fmt: skip
    if not 1 <= dimensions <= info.output_dim:
        raise ApiError(
            400, "invalid_dimensions",
            f"dimensions must be from 1 to {info.output_dim} (the size of {name!r}'s "
            f"embeddings), got {dimensions}",
        )  # fmt: skip


def check_top_k(info: ModelInfo, top_k: int | None, *, name: str) -> None:
    if top_k is None:
        return
    if info.task != "classify":
        raise ApiError(
            400, "unsupported_parameter",
            f"top_k applies to classifiers; {name!r} does {info.task}",
        )  # fmt: skip
    if top_k < 1:
        raise ApiError(422, "invalid_top_k", f"top_k must be at least 1, got {top_k}")


def shape_outputs(
    info: ModelInfo, outputs: list[Any], *, dimensions: int | None = None, top_k: int | None = None
) -> list[Any]:
    """The answer per input: embeddings cut to ``dimensions`` (renormalised when the model
    normalises), a classifier's best label or its best ``top_k`` labels."""
    if info.task == "classify":
        return [top_labels(output, top_k) for output in outputs]
    if info.task == "sparse":  # SparseVector: named arrays, as /v1/infer answers them
        return [{"indices": o.indices, "values": o.values} for o in outputs]
    if dimensions is not None and dimensions != info.output_dim:
        return [truncate_dimensions(o, dimensions, bool(info.normalize)) for o in outputs]
    return outputs


async def infer_for_request(
    request: Request,
    inputs: Sequence[str],
    *,
    request_id: str,
    truncate: bool | str | None = None,
    timeout_s: float | None = None,
    priority: int = 0,
    model: str | None = None,
    query: str | None = None,
    prompt_name: str | None = None,
    prompt: str | None = None,
    truncation_direction: str | None = None,
    dimensions: int | None = None,
    max_tokens_per_doc: int | None = None,
    late_chunks: Sequence[Any] | None = None,
    schema_status: int = 422,
) -> tuple[list[Any], int]:
    """Queue the inputs for ``model`` (same queue, batcher and model thread as ``/v1/infer``)
    and wait, dropping them if the client disconnects. Returns the outputs and the token
    count (prompts included). With ``query``, each input is a document scored against it
    (reranking; ``truncate`` a boolean). ``prompt_name`` or a literal ``prompt`` (else the
    model's default prompt) goes in front of each input, or of the query. ``dimensions``
    (checked by the caller) cuts each embedding, in the runtime, where the cut answer is
    cached. ``truncate`` (None: the server's ``--truncate``) and ``late_chunks``: as
    ``server/long_inputs.py`` reads them; ``schema_status``: the route's status for a
    schema error."""
    runtime = runtime_of(request)
    config = runtime.config
    timeout_s = min(timeout_s or config.default_timeout_s, config.max_timeout_s)
    slot = runtime.slot(model)
    name = slot.name
    state = request.scope.setdefault("state", {})
    state["model"] = name
    check_prompt(prompt_name, prompt)
    resolved = resolve_prompt(slot.info, prompt_name, prompt, name=name)
    if query is not None:
        truncation = Truncation(truncate is not False, truncation_direction)
    else:
        truncation = resolve_truncation(
            truncate, truncation_direction, config.default_truncate, schema_status=schema_status
        )
    if truncation.chunk and slot.info.task != "embed":
        raise ApiError(
            400, "unsupported_parameter",
            f"truncate chunk applies to embedding models; {name!r} does {slot.info.task}",
        )  # fmt: skip
    spans = late_chunks_of(late_chunks, inputs, slot.info, name=name, truncation=truncation)
    # Read by the access log once the request has been answered.
    state["trace"] = trace = RequestTrace()
    # NOTE: awaited in the request's own task; the client's disconnect settles the wait
    # through ``client`` (no second task watches receive() where the server tells us).
    trace.called_s = time.perf_counter()
    try:
        outputs, num_tokens = await runtime.infer(
            inputs, truncate=truncation.truncate, timeout_s=timeout_s, request_id=request_id,
            priority=priority, model=name, query=query, trace=trace, prompt=resolved,
            truncation_direction=truncation.direction,
            client=client_watch(request.scope, request.receive), dimensions=dimensions,
            max_tokens_per_doc=max_tokens_per_doc, chunk=truncation.chunk, late_chunks=spans,
        )  # fmt: skip
    except ClientDisconnected:
        state["error_type"] = "client_disconnected"
        raise
    trace.answered_s = time.perf_counter()
    runtime.metrics.count_answered(name, len(outputs), num_tokens)
    return outputs, num_tokens
