"""Our typed errors become HTTP in one table, with one JSON error shape everywhere."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from batching import (
    DeadlineExceeded,
    InferenceFailed,
    NeverAdmitted,
    OutOfMemory,
    QueueFull,
    ShuttingDown,
)
from models import InputTooLong, InvalidSpan, UnknownPrompt

log = logging.getLogger(__name__)

REPLICA = "replica"
NGINX = "Nginx"


@dataclass(frozen=True, slots=True)
class ErrorType:
    """One ``error_type`` a client can be answered: its status codes (the first is the usual
    one; empty: whatever status the HTTP framework raised), who answers it, and when."""

    name: str
    statuses: tuple[int, ...]
    when: str
    answered_by: tuple[str, ...] = (REPLICA,)


# NOTE: the one list of error types. ApiError refuses a type (or a status) missing here,
# docs/errors.md's table is generated from it (python -m server.docs), and the Nginx template's
# own error bodies are checked against the NGINX entries (tests/test_deploy.py).
_ERROR_TYPES = (
    ErrorType("invalid_json", (400,), "the body is not valid JSON, or not UTF-8"),
    ErrorType("empty_input", (400,),
              "no inputs, or an empty string among them (also an empty `query` or `documents` "
              "on `/v1/rerank`)"),
    ErrorType("wrong_task", (400,),
              "the model does another task than the endpoint serves (a reranker on `/v1/infer`, "
              "an embedder on `/v1/rerank` or `/embed_sparse`, a sparse embedder on "
              "`/v1/embeddings`)"),
    ErrorType("unsupported_parameter", (400,),
              "a parameter the model cannot honour: `dimensions`, `late_chunks`, `truncate: "
              "chunk` or a compact output (`embedding_types`, base64 `embed_dtype`) for a model "
              "that does not embed, int8 or uint8 for one that does not normalise, `top_k` for "
              "one that does not classify; on the generation routes an OpenAI parameter "
              "Batchfit does not implement (tools, `logit_bias`, penalties, `suffix`)"),
    ErrorType("unknown_prompt", (400,),
              "`prompt_name` names no prompt of the model (the message lists its prompts)"),
    ErrorType("invalid_dimensions", (400,),
              "`dimensions` outside 1 to the model's output size (`output_dim`)"),
    ErrorType("invalid_late_chunks", (400,),
              "`late_chunks` that do not fit the inputs: not one list of `[start_char, "
              "end_char]` per input, a span outside its text or covering none of its tokens, "
              "or late chunks with `truncate: chunk`"),
    ErrorType("unsupported_input", (400,),
              "token-id arrays instead of text on `/v1/embeddings`; images on `/v2/embed`"),
    ErrorType("no_tokenizer", (400,),
              "`/tokenize` or `/detokenize` for a model without a tokenizer Batchfit reads (a "
              "custom model)"),
    ErrorType("invalid_parameter", (400,),
              "a generation parameter out of its range (`n` above 8, `logprobs` or "
              "`top_logprobs` above 5, more than 4 `stop` strings), an unknown chat role, "
              "a token id outside the vocabulary (also on `/detokenize`); the message names "
              "the limit and the value"),
    ErrorType("context_length_exceeded", (400,),
              "a prompt as long as the generator's context, or the prompt and `max_tokens` "
              "together past it"),
    ErrorType("no_chat_template", (400,),
              "`/v1/chat/completions` to a generator without a chat template "
              "(`--chat-template` gives it one)"),
    ErrorType("unauthorized", (401,),
              "the API key (or, on `/admin`, the admin token) is missing or wrong "
              "(`WWW-Authenticate: Bearer`)"),
    ErrorType("model_not_found", (404,),
              "`model` (or the v2 path) names no served model; the message lists those served"),
    ErrorType("not_found", (404,),
              "no such route (behind Nginx: any path outside the API), or a v2 model version "
              "other than 1", (REPLICA, NGINX)),
    ErrorType("method_not_allowed", (405,),
              "a route called with another method (`GET /v1/infer`)"),
    ErrorType("profile_busy", (409,),
              "`POST /admin/profile` while a profile is armed or recording"),
    ErrorType("payload_too_large", (413,), "the body is larger than `--max-body-bytes`",
              (REPLICA, NGINX)),
    ErrorType("too_many_inputs", (413,),
              "more inputs than `--max-inputs-per-request` (documents than "
              "`--max-rerank-documents` on `/v1/rerank` and `/v2/rerank`), or, with `truncate: "
              "chunk`, more windows than the queue holds (`--max-queue-items`)"),
    ErrorType("input_too_long", (413,),
              "with `truncate: none` (or `false`, or `--truncate none`), or with `late_chunks`, "
              "an input longer than the model's maximum; the message names that maximum"),
    ErrorType("unsupported_media_type", (415,), "a body declared as something other than JSON"),
    ErrorType("invalid_request", (422, 400),
              "schema errors: wrong types, unknown fields, `timeout_s` not a positive finite "
              "number, `priority` out of range, text with lone surrogates, both `prompt` and "
              "`prompt_name` (400 on "
              "`/v1/embeddings` and `/v2`, as those protocols answer)"),
    ErrorType("invalid_top_n", (422,),
              "`top_n` on `/v1/rerank` or `/v2/rerank` below 1 (above the number of documents "
              "it returns them all)"),
    ErrorType("invalid_top_k", (422,), "`top_k` on `/v1/infer` below 1"),
    ErrorType("overloaded", (429,),
              "the replica's queue is full; `Retry-After` says when to retry"),
    ErrorType("rate_limited", (429,),
              "one client sent more than Nginx's per-client rate (`--rate-limit-rps` and "
              "`--rate-limit-burst` of `batchfit up`); `Retry-After` set", (NGINX,)),
    ErrorType("not_ready", (503,), "loading or warming up; `Retry-After` set"),
    ErrorType("draining", (503,), "stopping (after SIGTERM); `Retry-After` set"),
    ErrorType("unavailable", (503,),
              "no replica could answer (every one down, loading or draining); `Retry-After` set",
              (NGINX,)),
    ErrorType("engine_unavailable", (503,),
              "with `--api-workers`, the replica's engine process stopped (the replica exits "
              "and its supervisor restarts it), or, from `/health/live`, has been silent for "
              "5 s; `Retry-After` set"),
    ErrorType("model_hung", (503,),
              "from `/health/live`: a forward pass has run for longer than "
              "`--forward-timeout-s`; `Retry-After` set"),
    ErrorType("deadline_exceeded", (504,), "the request's deadline passed before its answer"),
    ErrorType("gateway_timeout", (504,),
              "a replica did not answer within Nginx's read timeout", (NGINX,)),
    ErrorType("out_of_memory", (507,),
              "one input (a generation request: its prompt) does not fit in memory even alone"),
    ErrorType("internal_error", (500,), "anything else (the traceback goes to the log only)"),
    ErrorType("profile_dir_unwritable", (500,),
              "`POST /admin/profile` when `--profile-dir` cannot be created"),
    ErrorType("http_error", (), "any other error the HTTP framework answers itself"),
)  # fmt: skip
ERROR_TYPES: dict[str, ErrorType] = {kind.name: kind for kind in _ERROR_TYPES}


def check_error_type(status: int, error_type: str) -> None:
    """Refuse an ``error_type`` (or a status for it) that ``ERROR_TYPES`` does not list."""
    kind = ERROR_TYPES.get(error_type)
    if kind is None:
        raise ValueError(f"error type {error_type!r} is not in server/errors.py ERROR_TYPES")
    if kind.statuses and status not in kind.statuses:
        raise ValueError(f"error type {error_type!r} is not answered with status {status}")


def error_body(error_type: str, message: str, request_id: str, *, status: int) -> bytes:
    """Our JSON error shape, for the places that answer without an ``ApiError``."""
    check_error_type(status, error_type)
    return orjson.dumps({"error": message, "error_type": error_type, "request_id": request_id})


class ApiError(Exception):
    """An error with its HTTP status and ``error_type``, raised anywhere on the request path.
    The type must be one of ``ERROR_TYPES``."""

    def __init__(
        self, status: int, error_type: str, message: str, *, retry_after_s: float | None = None
    ) -> None:
        check_error_type(status, error_type)
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.message = message
        self.retry_after_s = retry_after_s


def not_ready(message: str = "the model is not loaded and warmed up yet") -> ApiError:
    return ApiError(503, "not_ready", message, retry_after_s=1)


def model_not_found(name: str, served: list[str]) -> ApiError:
    return ApiError(
        404, "model_not_found",
        f"model {name!r} is not served here; this replica serves {', '.join(map(repr, served))}",
    )  # fmt: skip


def deadline_exceeded(timeout_s: float) -> ApiError:
    return ApiError(504, "deadline_exceeded", f"no answer within the deadline of {timeout_s:g}s")


def draining(message: str = "this replica is shutting down; retry on another") -> ApiError:
    return ApiError(503, "draining", message, retry_after_s=1)


# Errors the framework raises itself (routing, body parsing).
_HTTP_ERROR_TYPES = {
    400: "invalid_json",  # e.g. a body that is not UTF-8
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
}


def to_api_error(exc: BaseException) -> ApiError:
    """The table from our domain errors to HTTP."""
    match exc:
        case ApiError():
            return exc
        case QueueFull():
            return ApiError(429, "overloaded", str(exc), retry_after_s=exc.retry_after_s)
        case NeverAdmitted():
            return ApiError(413, "too_many_inputs", str(exc))
        case InputTooLong():
            return ApiError(413, "input_too_long", str(exc))
        case UnknownPrompt():
            return ApiError(400, "unknown_prompt", str(exc))
        case InvalidSpan():
            return ApiError(400, "invalid_late_chunks", str(exc))
        case DeadlineExceeded():
            return ApiError(504, "deadline_exceeded", str(exc))
        case OutOfMemory():
            return ApiError(507, "out_of_memory", str(exc))
        case ShuttingDown():
            return ApiError(503, "draining", str(exc), retry_after_s=1)
        case InferenceFailed():
            return ApiError(500, "internal_error", str(exc))
        case StarletteHTTPException() if isinstance(exc.__cause__, UnicodeDecodeError):
            # FastAPI's own message for this ("There was an error parsing the body") says
            # nothing about the cause.
            return ApiError(400, "invalid_json", "body is not valid UTF-8")
        case StarletteHTTPException():
            error_type = _HTTP_ERROR_TYPES.get(exc.status_code, "http_error")
            return ApiError(exc.status_code, error_type, str(exc.detail))
        case _:
            # Not one of ours: a bug. Its traceback goes to the log, never to the client.
            log.error("unexpected error", exc_info=exc)
            return ApiError(500, "internal_error", "internal server error")


def request_id_of(request: Request) -> str:
    return getattr(request.state, "request_id", "")


def error_response(request: Request, error: ApiError) -> Response:
    request.state.error_type = error.error_type
    headers = {}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))
    if error.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    body = {"error": error.message, "error_type": error.error_type}
    body["request_id"] = request_id_of(request)
    return Response(
        orjson.dumps(body), status_code=error.status, headers=headers, media_type="application/json"
    )


# Fields whose type is a union: pydantic reports one error per member of the union, which
# reads as noise; one sentence says what is accepted.
UNION_FIELD_MESSAGES = {"inputs": "inputs must be a string or a list of strings"}


def _describe_validation(exc: RequestValidationError) -> tuple[int, str, str]:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return 400, "invalid_json", "request body is not valid JSON"
    parts: list[str] = []
    for error in errors:
        loc = tuple(error.get("loc", ()))
        field = loc[1] if len(loc) > 1 and loc[0] == "body" else None
        message = UNION_FIELD_MESSAGES.get(field) if error.get("type") != "missing" else None
        if message is not None:
            if message not in parts:
                parts.append(message)
            continue
        if len(parts) == 5:
            break
        location = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "body"
        parts.append(f"{location}: {error.get('msg', 'invalid')}")
    return 422, "invalid_request", "; ".join(parts)


def validation_error(exc: RequestValidationError) -> ApiError:
    """The error for a schema error, FastAPI's or the lean path's (``server/lean``)."""
    return ApiError(*_describe_validation(exc))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return error_response(request, validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(request, to_api_error(exc))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        return error_response(request, to_api_error(exc))  # logs what is not ours
