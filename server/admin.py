"""Admin endpoints (profiling), bound only when ``--admin-token`` is set.

The trace itself is recorded on the model thread: ``Runtime.profiler`` wraps the batcher's
forward calls; these endpoints only arm it and report on it. In an API process
(``--api-workers``), they ask the engine, whose model thread it is (``RemoteRuntime.profile``).
"""

from __future__ import annotations

import hmac
from typing import Any, Literal

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from models import BatchProfiler, ProfilerBusy, ProfileStatus

from .errors import ApiError
from .inference import runtime_of
from .schemas import ErrorBody

_bearer = HTTPBearer(auto_error=False, description="The --admin-token value.")


class ProfileRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_batches: int = Field(10, ge=1, le=10_000, description="How many batches to record.")


class ProfileState(BaseModel):
    state: Literal["idle", "armed", "recording"] = Field(
        description="armed: waiting for the next batch; recording: batches being traced."
    )
    num_batches: int
    batches_recorded: int
    trace_path: str | None = Field(description="Where the trace in progress will be written.")
    last_trace_path: str | None = Field(description="The last trace written (Chrome JSON).")
    last_error: str | None


ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "Missing or wrong admin token"},
    409: {"model": ErrorBody, "description": "A trace is already armed or recording"},
}


def make_admin_router(admin_token: str) -> APIRouter:
    expected = admin_token.encode()

    def require_admin(
        credentials: HTTPAuthorizationCredentials | None = Depends(_bearer),  # noqa: B008
    ) -> None:
        given = credentials.credentials.encode() if credentials else b""
        if not hmac.compare_digest(given, expected):
            raise ApiError(401, "unauthorized", "admin endpoints need the admin bearer token")

    router = APIRouter(
        prefix="/admin", tags=["Admin"], dependencies=[Depends(require_admin)], responses=ERRORS
    )

    @router.post(
        "/profile",
        status_code=202,
        response_model=ProfileState,
        summary="Record a torch.profiler trace of the next N batches",
    )
    async def start_profile(request: Request, body: ProfileRequest | None = None) -> Response:
        num_batches = (body or ProfileRequest()).num_batches
        return _state(await _profile(runtime_of(request), num_batches), 202)

    @router.get("/profile", response_model=ProfileState, summary="The profiler's state")
    async def profile_status(request: Request) -> Response:
        return _state(await _profile(runtime_of(request), None))

    return router


async def _profile(runtime: Any, num_batches: int | None) -> ProfileStatus:
    remote = getattr(runtime, "profile", None)  # an API process: the engine's profiler
    if remote is not None:
        return await remote(num_batches)
    return profile(runtime.profiler, num_batches)


def profile(profiler: BatchProfiler, num_batches: int | None) -> ProfileStatus:
    """Arm ``profiler`` for the next ``num_batches`` batches (None: leave it as it is);
    return its state. Raises ``ApiError`` (409 busy, 500 no trace folder)."""
    if num_batches is not None:
        try:
            profiler.arm(num_batches)
        except ProfilerBusy as exc:
            raise ApiError(409, "profile_busy", str(exc)) from None
        except OSError as exc:  # the trace folder cannot be made
            raise ApiError(
                500, "profile_dir_unwritable",
                f"cannot write traces to --profile-dir {profiler.directory}: {exc.strerror}",
            ) from None  # fmt: skip
    return profiler.status()


def _state(status: ProfileStatus, status_code: int = 200) -> Response:
    body = {
        "state": status.state,
        "num_batches": status.num_batches,
        "batches_recorded": status.batches_recorded,
        "trace_path": status.trace_path,
        "last_trace_path": status.last_trace_path,
        "last_error": status.last_error,
    }
    return Response(orjson.dumps(body), status_code=status_code, media_type="application/json")
