"""The app factory: the only place that composes settings, model, batching and HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, disable_created_metrics
from starlette.responses import Response
from starlette.types import ASGIApp

from batching import Clock, MemoryProbe, Sizer
from models import Model

from .access_log import AccessLog
from .admin import make_admin_router
from .auth import ApiKeyMiddleware
from .errors import install_error_handlers
from .generate import router as generate_router
from .lean import install_lean_front
from .metrics_server import serve_metrics
from .middleware import RequestContextMiddleware
from .protocols import cohere_embed, cohere_rerank, kserve_v2, openai
from .rerank import router as rerank_router
from .routes import metrics_response, router
from .settings import Settings
from .sparse import router as sparse_router
from .status import ASSETS_URL as STATUS_ASSETS_URL
from .status import StatusHistory, make_status_router, status_assets
from .tokens import router as tokens_router
from .watchdog import loop_watchdog

log = logging.getLogger("batchfit")

DOCS_ASSETS_URL = "/docs/assets"


def create_app(
    settings: Settings,
    *,
    model: Model | None = None,
    models: Mapping[str, Model] | None = None,
    probe: MemoryProbe | None = None,
    clock: Clock | None = None,
    registry: CollectorRegistry | None = None,
    sizer: Sizer | None = None,
    on_fatal: Callable[[], None] | None = None,
    on_ready: Callable[[], None] | None = None,
    runtime: Any = None,
    watch_loop: bool = False,
) -> FastAPI:
    """Build one replica's app. Start-up (model load, warm-up) runs in the background so that
    ``/health/live`` answers at once and ``/health/ready`` says 503 until it is done.
    ``runtime`` replaces the ``Runtime`` (an API process's ``RemoteRuntime``). With
    ``watch_loop`` (a serving process: one timer per process, which a test process's apps
    would share), a hung event loop ends the process (``watchdog.py``)."""
    # The *_created series only add noise to every scrape.
    disable_created_metrics()
    registry = registry if registry is not None else CollectorRegistry()
    if runtime is None:
        from .runtime import Runtime  # with torch: an API process passes its own runtime

        runtime = Runtime(
            settings,
            registry=registry,
            model=model,
            models=models,
            clock=clock,
            sizer=sizer,
            probe=probe,
            on_fatal=on_fatal,
            on_ready=on_ready,
        )

    tracing = None
    if settings.otlp_endpoint is not None:
        # The OpenTelemetry SDK only where it is asked for.
        from .tracing import Tracing, TracingMiddleware

        tracing = Tracing(settings.otlp_endpoint)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            if tracing is not None:  # registered first, run last: after the last requests
                stack.push_async_callback(asyncio.to_thread, tracing.shutdown)
            if watch_loop:
                stack.enter_context(loop_watchdog(settings.hang_timeout_s))
            if settings.metrics_port is not None and not remote:  # else the engine's
                await stack.enter_async_context(
                    serve_metrics(registry, host=settings.host, port=settings.metrics_port)
                )
            starting = asyncio.create_task(runtime.start(), name="batchfit-start")
            tasks = [starting]
            if not remote:  # an API process's requests are sampled by the engine
                tasks.append(asyncio.create_task(history.run(), name="batchfit-status"))
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                await runtime.stop()

    # /docs and /redoc from assets shipped in a package: no CDN, so they work offline.
    app = FastAPIOffline(
        title="Batchfit",
        summary="Adaptive-batching inference server",
        version="0.1.0",
        lifespan=lifespan,
        static_url=DOCS_ASSETS_URL,
        # Swagger UI's validator badge is an image from an outside host.
        swagger_ui_parameters={"validatorUrl": None},
    )
    app.state.runtime = runtime
    app.state.registry = registry
    api_keys = settings.api_keys()
    # The admin endpoints check their own token in the same header; the API key is not asked
    # for there (it could not be sent alongside).
    exempt = ("/admin/",) if settings.admin_token is not None else ()
    if api_keys:
        # Added first, so it runs inside the request-id and metrics middleware.
        app.add_middleware(ApiKeyMiddleware, keys=api_keys, exempt_prefixes=exempt)
    history = StatusHistory(
        registry, queue_depth=lambda: len(runtime.queue), window_s=settings.status_window_s
    )
    app.state.status_history = history
    remote = hasattr(runtime, "status_samples")  # an API process: the engine keeps the history
    if remote:
        runtime.status_history = history
    observers = [history.observe, *([AccessLog()] if settings.access_log else [])]
    app.add_middleware(
        RequestContextMiddleware, max_body_bytes=settings.max_body_bytes,
        metrics=runtime.metrics, observers=observers,
    )  # fmt: skip
    if tracing is not None:
        # Added last, so it runs outermost: it sees the status of every answer.
        app.add_middleware(TracingMiddleware, tracer=tracing.tracer)

    def lean_middleware(inner: ASGIApp) -> ASGIApp:
        """The same middleware, in the same order, for the lean routes."""
        if api_keys:
            inner = ApiKeyMiddleware(inner, keys=api_keys, exempt_prefixes=exempt)
        inner = RequestContextMiddleware(
            inner, max_body_bytes=settings.max_body_bytes, metrics=runtime.metrics,
            observers=observers,
        )  # fmt: skip
        if tracing is not None:
            inner = TracingMiddleware(inner, tracer=tracing.tracer)
        return inner

    install_error_handlers(app)
    routers = (
        router, rerank_router, sparse_router, openai.router, cohere_rerank.router,
        cohere_embed.router, generate_router, kserve_v2.router, tokens_router,
    )  # fmt: skip
    for included in routers:
        app.include_router(included)
    lean_routes = [r for included in routers for r in included.routes if hasattr(r, "lean_app")]
    install_lean_front(app, lean_routes, lean_middleware)
    app.include_router(make_status_router(history))
    app.mount(STATUS_ASSETS_URL, status_assets(), name="status-assets")
    if settings.admin_token is not None:
        app.include_router(make_admin_router(settings.admin_token.get_secret_value()))

    if settings.metrics_port is None:
        # With --metrics-port, /metrics lives only on that port, off the public path.

        @app.get("/metrics", include_in_schema=False)
        async def metrics(request: Request) -> Response:
            if hasattr(runtime, "exposition"):  # an API process: the replica's, merged
                return Response(await runtime.exposition(), media_type=CONTENT_TYPE_LATEST)
            return metrics_response(registry)

    return app
