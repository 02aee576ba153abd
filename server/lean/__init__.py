"""The lean path for the hot routes: plain ASGI from the socket to the handler.

FastAPI still documents these routes (their OpenAPI entries come from the same endpoint
signatures and schema models), but a request to one skips its per-request machinery:
middleware wrappers, route matching through the included routers, dependency solving.
"""

from .answer import JsonAnswer, encode_json
from .body import (
    is_json_media_type,
    parse_body,
    read_body,
    require_json_media_type,
    validation_errors,
)
from .front import LeanFront, install_lean_front
from .route import LeanHandler, lean_route, method_not_allowed

__all__ = [
    "JsonAnswer",
    "LeanFront",
    "LeanHandler",
    "encode_json",
    "install_lean_front",
    "is_json_media_type",
    "lean_route",
    "method_not_allowed",
    "parse_body",
    "read_body",
    "require_json_media_type",
    "validation_errors",
]
