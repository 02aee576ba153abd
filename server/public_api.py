"""Which of a replica's routes are the public API: what Nginx (``batchfit up``, docker-compose)
and the Kubernetes Ingress send to the replicas.

The public API is everything under ``/v1`` and ``/v2`` (the native routes, OpenAI's
``/v1/embeddings``, Cohere's ``/v2/embed`` and ``/v2/rerank`` and KServe v2, its
``/v2/health/*`` included, which its clients call), and text-embeddings-inference's routes at
the root (``/embed_sparse``, ``/tokenize``, ``/detokenize``), each by its exact path. The
rest is for operators and probes on each replica directly, never through the front:
``/metrics``, ``/health/*``, ``/status``, ``/docs``, ``/redoc``, ``/openapi.json`` and ``/admin``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fastapi import FastAPI

try:
    from fastapi.routing import iter_route_contexts
except ImportError:  # older FastAPI keeps included routers' routes flat in app.routes
    iter_route_contexts = iter  # type: ignore[assignment]

PUBLIC_API_PREFIXES = ("/v1", "/v2")
PUBLIC_API_PATHS = ("/embed_sparse", "/tokenize", "/detokenize")
"""Public routes outside the prefixes, where their protocol puts them: only these paths."""


def is_public_api(path: str) -> bool:
    """A prefix matches itself and what lies below it, element by element: ``/v1`` and
    ``/v1/infer``, not ``/v1x`` (as a Kubernetes ``Prefix`` path matches); a path of
    ``PUBLIC_API_PATHS`` matches itself only (a Kubernetes ``Exact`` path)."""
    if path in PUBLIC_API_PATHS:
        return True
    return any(path == prefix or path.startswith(prefix + "/") for prefix in PUBLIC_API_PREFIXES)


def nginx_location_regex() -> str:
    """The Nginx ``location ~`` pattern that matches exactly the paths ``is_public_api`` does."""
    names = "|".join(re.escape(prefix.lstrip("/")) for prefix in PUBLIC_API_PREFIXES)
    exact = "".join(f"|{re.escape(path)}$" for path in PUBLIC_API_PATHS)
    return f"^(/({names})(/|$){exact})"


@dataclass(frozen=True, slots=True)
class ApiRoute:
    path: str
    """The route's path template, e.g. ``/v2/models/{name:path}/infer``."""
    methods: tuple[str, ...]


def public_api_routes(app: FastAPI) -> list[ApiRoute]:
    """The public API routes ``app`` serves, in the order it matches them."""
    routes = []
    for route in iter_route_contexts(app.routes):
        path, methods = getattr(route, "path", None), getattr(route, "methods", None)
        if path is not None and methods and is_public_api(path):
            methods = tuple(sorted(set(methods) - {"HEAD"}))
            routes.append(ApiRoute(path, methods))
    return routes
