"""``batchfit up``'s own settings: the replicas, Nginx in front of them, and how they are
restarted and watched."""

from __future__ import annotations

from pathlib import Path

from pydantic import ByteSize, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class LauncherSettings(BaseSettings):
    """``batchfit up``: several replicas behind a local Nginx. Flags of ``batchfit up``; the
    replicas' own settings are the ``serve`` flags, passed through to every replica."""

    model_config = SettingsConfigDict(env_prefix="BATCHFIT_UP_", frozen=True, extra="forbid")

    replicas: int = Field(2, ge=1, le=64, description="Number of replicas to start.")
    host: str = Field("127.0.0.1", description="Address Nginx listens on.")
    port: int = Field(8080, ge=1, le=65535, description="Port Nginx listens on.")
    replica_ports: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="First of the consecutive loopback ports the replicas listen on, for hosts "
        "with firewall rules: with N replicas, replica i serves HTTP on START+i and /metrics on "
        "START+N+i (START to START+2N-1 in all). Unset: free ports picked at start.",
    )
    rate_limit_rps: int = Field(
        100, ge=1, description="Requests per second per client before Nginx answers 429."
    )
    rate_limit_burst: int = Field(
        200, ge=1, description="Requests per client allowed above the rate in a burst."
    )
    nginx_cache_bytes: ByteSize = Field(
        0,
        description="Let Nginx cache whole answers of /v1/embeddings and /v1/infer, keyed by "
        "the request body and its API key, up to this many bytes on disk under the work "
        "folder; 0 (the default) turns it off.",
    )
    nginx_cache_valid_s: int = Field(
        60, ge=1, description="How long Nginx keeps one cached answer."
    )
    generation_read_timeout_s: int = Field(
        3600,
        ge=2,
        description="How long Nginx waits for a replica's next bytes on /v1/completions and "
        "/v1/chat/completions: the gap between two events of a stream, and the whole of a "
        "non-streamed generation, whose answer comes after its last token (keep it above your "
        "longest one: max_tokens over the slowest tokens/s). Never below the other routes' "
        "read timeout (--max-timeout-s + 5 s).",
    )
    ready_timeout_s: float = Field(
        300.0, gt=0, description="How long to wait for every replica to be ready."
    )
    stop_timeout_s: float = Field(
        60.0, gt=0, description="How long a stopping replica may take before it is killed."
    )
    nginx: str = Field("nginx", description="The Nginx binary (open-source Nginx).")
    workdir: Path | None = Field(
        None,
        description="Folder for the Nginx prefix, config and logs; by default a new "
        "batchfit-up-* folder in the temporary directory, printed at start and at exit.",
    )
    keep_logs: bool = Field(
        True,
        description="Keep the work folder (config and logs) at exit; --no-keep-logs removes "
        "it when it was created by the launcher (a --workdir is always kept).",
    )
    restart: bool = Field(
        True,
        description="Restart a replica that exits or is killed (for example by the kernel's "
        "OOM killer); Nginx sends its traffic to the others meanwhile.",
    )
    restart_backoff_s: float = Field(
        1.0, gt=0, description="Wait before the first restart; doubles after each quick death."
    )
    restart_backoff_max_s: float = Field(
        30.0, gt=0, description="Longest wait between restarts of one replica."
    )
    restart_reset_s: float = Field(
        60.0,
        gt=0,
        description="A replica that stays up this long is healthy again: its next restart "
        "waits restart_backoff_s again.",
    )
    liveness_period_s: float = Field(
        10.0,
        gt=0,
        description="How often a ready replica's /health/live is asked whether it still "
        "answers (as Kubernetes' liveness probe does).",
    )
    liveness_timeout_s: float = Field(
        3.0, gt=0, description="How long one /health/live question waits for its answer."
    )
    liveness_failures: int = Field(
        3,
        ge=0,
        description="Unanswered /health/live questions in a row after which a hung replica "
        "(alive, but not answering) is killed with SIGKILL, then restarted like one that "
        "died, so that Nginx retries its requests on the others; 0 never asks.",
    )

    @model_validator(mode="after")
    def _check_replica_ports(self) -> LauncherSettings:
        if self.replica_ports is None:
            return self
        last = self.replica_ports + 2 * self.replicas - 1
        if last > 65535:
            raise ValueError(
                f"replica_ports {self.replica_ports} with {self.replicas} replicas needs ports up "
                f"to {last}, past 65535"
            )
        if self.replica_ports <= self.port <= last:
            raise ValueError(
                f"port {self.port} (Nginx's) lies inside the replica ports "
                f"{self.replica_ports}-{last}"
            )
        return self
