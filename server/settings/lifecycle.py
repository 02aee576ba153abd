"""The process's life: how it drains on SIGTERM, and when a hung forward pass or event loop
makes it unhealthy or ends it."""

from __future__ import annotations

from typing import Self

from pydantic import BaseModel, Field, model_validator


class LifecycleSettings(BaseModel):
    """The lifecycle's group of ``Settings`` (flags of the same names)."""

    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM, how long admitted requests may take to finish (new ones get "
        "503 draining) before the rest get 503 and the process exits.",
    )
    forward_timeout_s: float = Field(
        300.0,
        ge=0,
        description="Once ready, a forward pass running for longer than this means a hung "
        "device or model: /health/live answers 503 model_hung, so that the kubelet or batchfit "
        "up restarts the replica; 0: never. Keep it above the longest batch.",
    )
    forward_exit_s: float | None = Field(
        None,
        ge=0,
        description="Once ready, a forward pass running for longer than this ends the process: "
        "every thread's stack to the log and exit status 1, for a supervisor that sees only "
        "exits (Docker Compose); default: twice --forward-timeout-s; 0: never. At least "
        "--forward-timeout-s, so that a liveness probe restarts the replica first where one "
        "runs.",
    )
    hang_timeout_s: float = Field(
        30.0,
        ge=0,
        description="A process of the replica whose event loop has not run for this long (hung: "
        "a call that never returns, a deadlock) writes every thread's stack to the log and "
        "exits with status 1, for its supervisor to restart it; 0: never.",
    )

    @property
    def forward_exit_after_s(self) -> float:
        """``forward_exit_s``, its default (twice ``forward_timeout_s``) resolved; 0: never."""
        if self.forward_exit_s is None:
            return 2 * self.forward_timeout_s
        return self.forward_exit_s

    @model_validator(mode="after")
    def _check_forward_exit(self) -> Self:
        if self.forward_exit_s and self.forward_exit_s < self.forward_timeout_s:
            raise ValueError(
                f"forward_exit_s ({self.forward_exit_s}) is below forward_timeout_s "
                f"({self.forward_timeout_s}): a hung replica would exit before its liveness "
                "says so"
            )
        return self
