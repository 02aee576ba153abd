"""``GET /status`` (a page for a person) and ``GET /status.json`` (what it draws)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Query, Request
from starlette.responses import FileResponse, Response
from starlette.staticfiles import StaticFiles

from .history import StatusHistory

STATIC_DIR = Path(__file__).parent / "static"
ASSETS_URL = "/status/assets"


def status_assets() -> StaticFiles:
    return StaticFiles(directory=STATIC_DIR)


def model_card(request: Request) -> dict[str, Any] | None:
    runtime = request.app.state.runtime
    if not runtime.slots:  # the models have not loaded yet
        return None
    default = runtime.slot()  # the default model's card
    settings = runtime.settings
    card = default.card()
    return {
        **card,
        "prompts": ", ".join(card["prompts"]) or None,  # type: ignore[arg-type]
        "num_parameters": default.info.num_parameters,
        "sizer": settings.sizer,
        "max_batch_size": settings.max_batch_size,
        "max_batch_tokens": settings.max_batch_tokens,
        "max_queue_items": settings.max_queue_items,
        "memory_headroom": settings.memory_headroom,
        "memory_limit_bytes": settings.memory_limit,
    }


def generator_names(request: Request) -> list[str]:
    """The models this replica generates with: the page draws the generation figures only
    for a replica that has one."""
    slots = request.app.state.runtime.slots
    return [name for name, slot in slots.items() if slot.info.task == "generate"]


def make_status_router(history: StatusHistory) -> APIRouter:
    router = APIRouter(include_in_schema=False)

    @router.get("/status")
    async def status_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "status.html", headers={"Cache-Control": "no-cache"})

    @router.get("/status.json")
    async def status_json(
        request: Request,
        since: Annotated[float | None, Query(description="Only samples after this time.")] = None,
    ) -> Response:
        runtime = request.app.state.runtime
        if hasattr(runtime, "status_samples"):  # an API process: the engine's, for the replica
            samples = await runtime.status_samples(since)
        else:
            samples = history.since(since)
        body = {
            "window_s": history.window_s,
            "interval_s": history.interval_s,
            "ready": runtime.ready,
            "draining": runtime.draining,
            "model": model_card(request),
            "generators": generator_names(request),
            "samples": samples,
        }
        return Response(
            orjson.dumps(body),
            media_type="application/json",
            headers={"Cache-Control": "no-store"},
        )

    return router
