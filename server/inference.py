"""Run one request's inputs through the runtime on behalf of any protocol's route."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import Request

from .disconnect import client_watch
from .errors import ApiError
from .runtime import ClientDisconnected, ModelSlot, RequestTrace, Runtime


def runtime_of(request: Request) -> Runtime:
    return request.app.state.runtime


def slot_for_task(
    request: Request, model: str | None, tasks: tuple[str, ...], endpoint: str,
    *, default_task: str | None = None,
) -> ModelSlot:  # fmt: skip
    """The model a request names (None: the default, or the first of ``default_task``),
    refused with 400 ``wrong_task`` unless its task is one of ``tasks``."""
    slot = runtime_of(request).slot(model, task=default_task)
    request.state.model = slot.name  # the model label of the request's metrics
    if slot.info.task not in tasks:
        hint = "; rerankers answer POST /v1/rerank" if slot.info.task == "rerank" else ""
        raise ApiError(
            400, "wrong_task",
            f"model {slot.name!r} does {slot.info.task}, which {endpoint} does not serve{hint}",
        )  # fmt: skip
    return slot


def check_inputs(runtime: Runtime, inputs: Sequence[str], field: str = "inputs") -> None:
    """The same limits as ``/v1/infer``: not empty, not too many, no empty string."""
    limit = runtime.config.max_inputs_per_request
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
                422, "invalid_request", f"input {index} is not valid Unicode (lone surrogate)"
            ) from None


async def infer_for_request(
    request: Request,
    inputs: Sequence[str],
    *,
    request_id: str,
    truncate: bool = True,
    timeout_s: float | None = None,
    priority: int = 0,
    model: str | None = None,
    query: str | None = None,
) -> tuple[list[Any], int]:
    """Queue the inputs for ``model`` (same queue, batcher and model thread as ``/v1/infer``)
    and wait, dropping them if the client disconnects. Returns the outputs and the token
    count. With ``query``, each input is a document scored against it (reranking)."""
    runtime = runtime_of(request)
    config = runtime.config
    timeout_s = min(timeout_s or config.default_timeout_s, config.max_timeout_s)
    name = runtime.slot(model).name
    state = request.scope.setdefault("state", {})
    state["model"] = name
    # Read by the access log once the request has been answered.
    state["trace"] = trace = RequestTrace()
    # NOTE: awaited in the request's own task; the client's disconnect settles the wait
    # through ``client`` (no second task watches receive() where the server tells us).
    try:
        outputs, num_tokens = await runtime.infer(
            inputs, truncate=truncate, timeout_s=timeout_s, request_id=request_id,
            priority=priority, model=name, query=query, trace=trace,
            client=client_watch(request.scope, request.receive),
        )  # fmt: skip
    except ClientDisconnected:
        state["error_type"] = "client_disconnected"
        raise
    runtime.metrics.count_answered(name, len(outputs), num_tokens)
    return outputs, num_tokens
