"""Errors on Cohere's routes (``/v2/embed``, ``/v2/rerank``) in Cohere's shape, ``{"id",
"message"}``, with our ``error_type`` beside them, so its client raises its usual exceptions;
a 401 from the API key check included."""

from __future__ import annotations

import orjson
from fastapi import Request
from pydantic import BaseModel
from starlette.responses import Response

from ..errors import ApiError, request_id_of
from .routes import retry_headers

COHERE_PATHS = frozenset({"/v2/embed", "/v2/rerank"})
"""The paths whose errors (a 401 included) read as Cohere's."""


class CohereErrorBody(BaseModel):
    id: str
    message: str
    error_type: str


def cohere_error_response(request: Request, error: ApiError) -> Response:
    request.state.error_type = error.error_type
    body = {"id": request_id_of(request), "message": error.message, "error_type": error.error_type}
    return Response(
        orjson.dumps(body), status_code=error.status, headers=retry_headers(error),
        media_type="application/json",
    )  # fmt: skip
