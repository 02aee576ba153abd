"""OpenAI-compatible ``POST /v1/completions`` and ``POST /v1/chat/completions``.

Errors use OpenAI's shape (``server/protocols/openai.py``): schema errors and bad values are
400 with the field at fault as ``param``, as OpenAI answers them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from pydantic import TypeAdapter
from starlette.responses import Response
from starlette.types import ASGIApp

from generation import TokenEvent

from ..disconnect import client_watch
from ..errors import ApiError, draining, request_id_of
from ..inference import runtime_of, slot_for_task
from ..lean import JsonAnswer, lean_route, parse_body, read_body, require_json_media_type
from ..protocols.openai import (
    OpenAIErrorBody,
    ParamError,
    openai_error_response,
    validation_for,
)
from ..runtime import RequestTrace
from .answers import Answer
from .params import GenerationCall, chat_call, completion_call, prompt_tokenizer
from .schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
)
from .sse import EventStream

router = APIRouter(tags=["OpenAI"])

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": OpenAIErrorBody, "description": description}
    for code, description in {
        400: "Bad request: schema error, a value out of range (n, top_logprobs, logprobs, "
        "stop), a prompt or max_tokens past the context, an unknown role, no chat template, "
        "an unsupported parameter (tools, logit_bias, penalties)",
        401: "Missing or wrong API key (when the server requires one)",
        404: "No model of that name is served (model_not_found)",
        413: "Body too large",
        415: "Body declared as something other than JSON",
        429: "Too many sequences waiting; see Retry-After",
        503: "Not ready or draining; see Retry-After",
        504: "No first token within timeout_s",
        507: "A prompt does not fit in memory even alone",
        500: "Unexpected error",
    }.items()
}
STREAM_RESPONSE = {
    "description": "With stream: true, server-sent events: one `data: {chunk}` line per "
    "chunk, then `data: [DONE]`; an error after the stream began is a `data: {error}` event, "
    "then the stream closes.",
    "content": {"text/event-stream": {"schema": {"type": "string"}}},
}

_COMPLETION_BODY = TypeAdapter(CompletionRequest)
_CHAT_BODY = TypeAdapter(ChatCompletionRequest)


async def handle_completions(request: Request) -> ASGIApp:
    """``POST /v1/completions`` on the lean path (``server/lean``)."""
    return await _generate(request, _COMPLETION_BODY, completion_call, chat=False)


async def handle_chat(request: Request) -> ASGIApp:
    """``POST /v1/chat/completions`` on the lean path (``server/lean``)."""
    return await _generate(request, _CHAT_BODY, chat_call, chat=True)


async def _generate(
    request: Request, adapter: TypeAdapter[Any], prepare: Callable[..., GenerationCall],
    *, chat: bool,
) -> ASGIApp:  # fmt: skip
    raw = await read_body(request.receive)
    runtime = runtime_of(request)
    if runtime.draining:  # at once: Nginx retries it on another replica
        raise draining()
    require_json_media_type(request.headers.get("content-type"))
    body = parse_body(adapter, raw)
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        slot = slot_for_task(request, body.model, ("generate",), endpoint)
    except ApiError as exc:
        if exc.status != 404 and exc.error_type != "wrong_task":
            raise
        raise ParamError(exc.status, exc.error_type, exc.message, "model") from None
    config = runtime.config
    timeout_s = min(body.timeout_s or config.default_timeout_s, config.max_timeout_s)
    prompts = prompt_tokenizer(slot.model)
    call = prepare(body, name=slot.name, prompts=prompts, defaults=prompts.defaults,
                   timeout_s=timeout_s)  # fmt: skip
    state = request.scope.setdefault("state", {})
    state["trace"] = trace = RequestTrace(inputs=len(call.specs))
    trace.tokens = sum(len(prompt) for prompt in call.prompts)
    run = runtime.generate(
        call.specs, model=slot.name, priority=call.priority, timeout_s=timeout_s,
        client=client_watch(request.scope, request.receive),
    )  # fmt: skip
    answer = Answer(call, chat=chat, request_id=request_id_of(request))
    try:
        first: list[TokenEvent] = await run.next_events()
    except EOFError:
        first = []
    except BaseException:
        run.close()
        raise
    if call.stream:
        return EventStream(run, first, answer)
    try:
        events = first
        while True:
            answer.add(events)
            try:
                events = await run.next_events()
            except EOFError:
                break
    finally:
        run.close()
        trace.generated_tokens = answer.completion_tokens
    return JsonAnswer(answer.body())


# The OpenAPI entries of the two routes; the lean handlers above serve them.
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    raise AssertionError("handle_completions serves this route")


async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    raise AssertionError("handle_chat serves this route")


router.add_api_route(
    "/v1/completions",
    create_completion,
    methods=["POST"],
    response_model=CompletionResponse,
    responses={**ERROR_RESPONSES, 200: STREAM_RESPONSE},
    summary="Create a completion (OpenAI-compatible)",
    route_class_override=lean_route(
        handle_completions,
        render=openai_error_response,
        validation=validation_for(CompletionRequest),
    ),
)
router.add_api_route(
    "/v1/chat/completions",
    create_chat_completion,
    methods=["POST"],
    response_model=ChatCompletionResponse,
    responses={**ERROR_RESPONSES, 200: STREAM_RESPONSE},
    summary="Create a chat completion (OpenAI-compatible)",
    route_class_override=lean_route(
        handle_chat,
        render=openai_error_response,
        validation=validation_for(ChatCompletionRequest),
    ),
)
