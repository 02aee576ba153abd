"""The HTTP front end: where it listens, its processes, what a request may be and how long
it may take, who may call it, and what it logs and shows."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Self
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, SecretStr, model_validator


class FrontEndSettings(BaseModel):
    """The front end's group of ``Settings`` (flags of the same names)."""

    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8000, ge=1, le=65535, description="Port to listen on.")
    metrics_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Serve /metrics on this port (same address) instead of the main port, so "
        "it stays off the public path.",
    )
    api_workers: int = Field(
        1,
        ge=1,
        description="HTTP API processes in front of one engine process. 1: one process does "
        "everything. N >= 2: N processes accept HTTP on the port, validate, tokenize and encode "
        "answers; one engine process owns the device, the queue, the batcher and the model "
        "thread, so batches still form across every client. For hosts with many cores.",
    )
    max_body_bytes: int = Field(
        2 * 2**20, ge=1024, description="Largest request body accepted; beyond it 413."
    )
    default_timeout_s: float = Field(
        60.0, gt=0, description="Deadline of a request that sets no timeout_s."
    )
    truncate: Literal["end", "start", "none", "chunk"] | None = Field(
        None,
        description="What a request that sets no truncate gets for an input longer than the "
        "model's maximum: end cuts its end, start its start, none answers 413, chunk cuts it "
        "into windows of the model's maximum length and answers their token-weighted mean "
        "(embedding models). Unset: cut from the model's own side (its end, for most models).",
    )
    max_timeout_s: float = Field(
        300.0, gt=0, description="Cap on a request's timeout_s (longer values are capped)."
    )
    api_key: SecretStr | None = Field(
        None,
        description="Require 'Authorization: Bearer <key>' on the API (health and metrics "
        "stay open). Prefer --api-key-file: flags show up in the process list.",
    )
    api_key_file: Path | None = Field(
        None,
        description="File holding accepted API keys, one per line (blank lines and lines "
        "starting with # are skipped).",
    )
    admin_token: SecretStr | None = Field(
        None,
        description="Bearer token for the /admin endpoints (profiling); unset, they do not exist.",
    )
    profile_dir: str = Field(
        "batchfit-profiles", description="Folder the profiler writes its trace files to."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level."
    )
    status_window_s: int = Field(
        300,
        ge=10,
        le=3600,
        description="How many seconds of history the status page (GET /status) keeps and "
        "draws, one sample a second.",
    )
    access_log: bool = Field(
        False,
        description="Write one JSON line per request to stdout: request id, endpoint, status, "
        "inputs, tokens, inputs answered from the output cache, queue wait, batch sizes and "
        "duration (never the text). Health checks, "
        "metrics scrapes and the status page's polling are left out.",
    )
    otlp_endpoint: str | None = Field(
        None,
        description="Send OpenTelemetry trace spans of each request (tokenize, queue wait, "
        "batch, postprocess, answer) over OTLP/HTTP to this collector, e.g. "
        "http://127.0.0.1:4318 (/v1/traces is added to a URL without a path). An incoming "
        "W3C traceparent header is honoured. Unset: no tracing, at no cost.",
    )

    def api_keys(self) -> tuple[str, ...]:
        """Every accepted API key; empty when auth is off."""
        keys = [self.api_key.get_secret_value()] if self.api_key is not None else []
        if self.api_key_file is not None:
            lines = self.api_key_file.read_text(encoding="utf-8").splitlines()
            keys += [k.strip() for k in lines if k.strip() and not k.lstrip().startswith("#")]
        return tuple(keys)

    @model_validator(mode="after")
    def _check_api_keys(self) -> Self:
        if self.api_key is not None and not self.api_key.get_secret_value().strip():
            raise ValueError("api_key is empty")
        if self.api_key_file is not None:
            try:
                keys = self.api_keys()
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"cannot read api_key_file {self.api_key_file}: {exc}") from None
            if not keys:
                raise ValueError(f"api_key_file {self.api_key_file} holds no key")
        return self

    @model_validator(mode="after")
    def _check_timeouts(self) -> Self:
        if self.default_timeout_s > self.max_timeout_s:
            raise ValueError(
                f"default_timeout_s ({self.default_timeout_s}) exceeds "
                f"max_timeout_s ({self.max_timeout_s})"
            )
        return self

    @model_validator(mode="after")
    def _check_otlp_endpoint(self) -> Self:
        endpoint = self.otlp_endpoint
        if endpoint is not None:
            parts = urlsplit(endpoint)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(
                    f"otlp_endpoint must be an http:// or https:// URL, got {endpoint!r}"
                )
        return self

    @model_validator(mode="after")
    def _check_metrics_port(self) -> Self:
        if self.metrics_port is not None and self.metrics_port == self.port:
            raise ValueError(f"metrics_port ({self.metrics_port}) must differ from port")
        return self
