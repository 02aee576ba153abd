"""A JSON answer sent as two ASGI messages, without building a framework response object."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
from starlette.types import Receive, Scope, Send

JSON = b"application/json"


def encode_json(value: Any) -> bytes:
    """orjson, numpy arrays included: float32 embeddings are written from their buffers."""
    return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)


class JsonAnswer:
    __slots__ = ("body", "headers", "media_type", "status")

    def __init__(
        self,
        body: bytes,
        status: int = 200,
        headers: Sequence[tuple[bytes, bytes]] = (),
        media_type: bytes = JSON,
    ) -> None:
        self.body = body
        self.status = status
        self.headers = headers
        self.media_type = media_type

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": self.status,
                "headers": [
                    (b"content-length", str(len(self.body)).encode()),
                    (b"content-type", self.media_type),
                    *self.headers,
                ],
            }
        )
        await send({"type": "http.response.body", "body": self.body})
