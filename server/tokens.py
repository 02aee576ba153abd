"""``POST /tokenize`` and ``POST /detokenize``: a served model's own tokenizer, text to token ids
(and character offsets) and back, as the model reads its inputs (lowercased where it
lowercases; never truncated).

The request takes TEI's ``inputs`` (one text or a list) and ``add_special_tokens``; ``model``
picks the model on a replica that serves several, as on every route. Neither route queues:
tokenizing runs in this process (on a thread past the size a request is tokenized inline),
within the request's deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, WithJsonSchema
from starlette.responses import Response
from starlette.types import ASGIApp

from models import TokenCodec

from .errors import (
    ApiError,
    deadline_exceeded,
    error_response,
    not_ready,
    request_id_of,
    validation_error,
)
from .inference import check_inputs, runtime_of
from .lean import JsonAnswer, encode_json, lean_route, parse_body
from .routes import (
    ERROR_RESPONSES,
    read_json_request,
    require_json,
    require_serving,
    timeout_header,
)
from .schemas import INPUTS_SCHEMA

T = TypeVar("T")


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    inputs: Annotated[str | list[str], WithJsonSchema(INPUTS_SCHEMA)] = Field(
        description="One text or a list of texts; no empty ones (400 empty_input)."
    )
    model: str | None = Field(
        None, description="Whose tokenizer, by name; default: the first model served."
    )
    add_special_tokens: bool = Field(
        True, description="Add the tokens the model's tokenizer adds ([CLS], <s>, <bos>...)."
    )
    return_offsets: bool = Field(
        False,
        description="Also answer each token's character span [start, end) in its text "
        "(Unicode code points; an added special token spans [0, 0]).",
    )


class TokenizeResponse(BaseModel):
    model: str
    tokens: list[list[int]] = Field(description="Each input's token ids, in order.")
    offsets: list[list[list[int]]] | None = Field(
        None, description="With return_offsets: each token's [start, end) in its input."
    )
    max_input_tokens: int = Field(description="The most tokens the model reads of an input.")
    request_id: str


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    ids: list[int] | list[list[int]] = Field(
        description="One list of token ids, or a list of them; each id within the "
        "vocabulary (else 400 invalid_parameter)."
    )
    model: str | None = Field(
        None, description="Whose tokenizer, by name; default: the first model served."
    )
    skip_special_tokens: bool = Field(
        False, description="Leave special tokens out of the text, as transformers' decode."
    )


class DetokenizeResponse(BaseModel):
    model: str
    texts: list[str] = Field(description="Each id list's text, in order.")
    request_id: str


router = APIRouter(tags=["Tokens"])
_TOKENIZE_BODY = TypeAdapter(TokenizeRequest)
_DETOKENIZE_BODY = TypeAdapter(DetokenizeRequest)


def codec_for(request: Request, model: str | None) -> tuple[str, TokenCodec, Any]:
    """The named model's (or the default's) name, token codec and slot; 400 no_tokenizer for
    a model that has none (a custom model's)."""
    runtime = runtime_of(request)
    if not runtime.ready:
        raise not_ready()
    slot = runtime.slot(model)
    request.state.model = slot.name
    served = slot.model
    # An API process holds the engine's preparer itself; one process, the model.
    preparer = served.preparer() if hasattr(served, "preparer") else served
    if not hasattr(preparer, "codec"):
        raise ApiError(
            400, "no_tokenizer", f"model {slot.name!r} has no tokenizer this server can read"
        )
    return slot.name, preparer.codec(), slot


async def off_the_loop(
    request: Request, work: Callable[[], T], size: float, slot: Any
) -> T:  # fmt: skip
    """``work()`` inline when small (as the inference routes tokenize), else on a thread,
    within the request's deadline (504 past it)."""
    header_timeout, errors = timeout_header(request)
    if errors:
        raise ApiError(422, "invalid_request", "X-Timeout-S must be a positive number")
    config = runtime_of(request).config
    timeout_s = min(header_timeout or config.default_timeout_s, config.max_timeout_s)
    if size <= getattr(slot, "inline_tokenize_chars", 0.0):
        return work()
    try:
        return await asyncio.wait_for(asyncio.to_thread(work), timeout_s)
    except TimeoutError:
        raise deadline_exceeded(timeout_s) from None


async def handle_tokenize(request: Request) -> ASGIApp:
    """``POST /tokenize`` on the lean path (``server/lean``)."""
    body = parse_body(_TOKENIZE_BODY, await read_json_request(request))
    name, codec, slot = codec_for(request, body.model)
    texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    check_inputs(runtime_of(request), texts)
    found = await off_the_loop(
        request, lambda: codec.tokenize(texts, add_special_tokens=body.add_special_tokens),
        sum(map(len, texts)), slot,
    )  # fmt: skip
    answer: dict[str, Any] = {"model": name, "tokens": [t.ids for t in found]}
    if body.return_offsets:
        answer["offsets"] = [t.offsets for t in found]
    answer["max_input_tokens"] = slot.info.max_input_tokens
    answer["request_id"] = request_id_of(request)
    return JsonAnswer(encode_json(answer))


async def handle_detokenize(request: Request) -> ASGIApp:
    """``POST /detokenize`` on the lean path (``server/lean``)."""
    body = parse_body(_DETOKENIZE_BODY, await read_json_request(request))
    name, codec, slot = codec_for(request, body.model)
    sequences: list[list[int]] = (
        [body.ids] if not body.ids or isinstance(body.ids[0], int) else body.ids  # type: ignore[list-item]
    )
    limit = runtime_of(request).config.max_inputs_per_request
    if not body.ids:
        raise ApiError(400, "empty_input", "ids is empty")
    if len(sequences) > limit:
        raise ApiError(
            413, "too_many_inputs", f"{len(sequences)} id lists, more than the limit of {limit}"
        )

    def decode() -> list[str]:
        try:
            return codec.detokenize(sequences, skip_special_tokens=body.skip_special_tokens)
        except ValueError as exc:
            raise ApiError(400, "invalid_parameter", str(exc)) from None

    texts = await off_the_loop(request, decode, sum(map(len, sequences)), slot)
    answer = {"model": name, "texts": texts, "request_id": request_id_of(request)}
    return JsonAnswer(encode_json(answer))


# The OpenAPI entries; ``handle_tokenize`` and ``handle_detokenize`` serve them.
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    raise AssertionError("handle_tokenize serves this route")


async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    raise AssertionError("handle_detokenize serves this route")


for path, endpoint, response_model, handler, summary in (
    ("/tokenize", tokenize, TokenizeResponse, handle_tokenize, "Text to a model's token ids"),
    ("/detokenize", detokenize, DetokenizeResponse, handle_detokenize,
     "A model's token ids to text"),
):  # fmt: skip
    router.add_api_route(
        path,
        endpoint,
        methods=["POST"],
        response_model=response_model,
        response_model_exclude_none=True,
        responses=ERROR_RESPONSES,
        dependencies=[Depends(require_serving), Depends(require_json)],
        summary=summary,
        route_class_override=lean_route(
            handler, render=error_response, validation=validation_error
        ),
    )
