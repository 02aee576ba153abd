"""Settings: the one place the environment (``BATCHFIT_*``) and CLI flags are read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from batching import BatcherConfig
from models import BUNDLED_MODEL, ModelSpec


class Settings(BaseSettings):
    """Every field is also a CLI flag: ``max_batch_size`` is ``--max-batch-size``."""

    model_config = SettingsConfigDict(env_prefix="BATCHFIT_", frozen=True, extra="forbid")

    model: str = Field(
        BUNDLED_MODEL,
        description="Model to serve: the bundled all-MiniLM-L6-v2, a local Hugging Face folder "
        "or a hub name (safetensors only).",
    )
    task: Literal["auto", "embed", "classify"] = Field(
        "auto", description="embed (mean-pooled, normalised) or classify; auto reads the config."
    )
    device: str = Field("auto", description="cuda, cuda:N or cpu; auto picks CUDA if present.")
    dtype: Literal["float32", "float16", "bfloat16"] = Field(
        "float32", description="Weights and activations dtype."
    )
    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8000, ge=1, le=65535, description="Port to listen on.")
    max_batch_size: int = Field(32, ge=1, description="Most items in one forward pass.")
    max_batch_tokens: int = Field(
        4096, ge=1, description="Most padded tokens (items x longest input) in one forward pass."
    )
    max_wait_ms: float = Field(
        2.0,
        ge=0,
        le=1000,
        description="How long the oldest waiting item may wait for batch-mates while the model "
        "is idle. Batches mostly form while the model runs the previous one.",
    )
    max_queue_items: int = Field(
        1024, ge=1, description="Queue capacity in items; beyond it requests get 429."
    )
    max_inputs_per_request: int = Field(
        256, ge=1, description="Most inputs in one request; beyond it 413."
    )
    max_input_tokens: int | None = Field(
        None, ge=2, description="Truncation length; defaults to the model's own maximum."
    )
    max_body_bytes: int = Field(
        2 * 2**20, ge=1024, description="Largest request body accepted; beyond it 413."
    )
    default_timeout_s: float = Field(
        60.0, gt=0, description="Deadline of a request that sets no timeout_s."
    )
    max_timeout_s: float = Field(
        300.0, gt=0, description="Cap on a request's timeout_s (longer values are capped)."
    )
    priority_aging_s: float = Field(
        1.0,
        gt=0,
        description="A waiting item's priority rises by one every this many seconds: work "
        "arriving more than d x this after an item d levels below it never overtakes it, so "
        "low priority is delayed, never starved.",
    )
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM, how long admitted requests may take to finish (new ones get "
        "503 draining) before the rest get 503 and the process exits.",
    )
    api_key: SecretStr | None = Field(
        None,
        description="Require 'Authorization: Bearer <key>' on the API (health and metrics "
        "stay open). Prefer api_key_file: flags show up in the process list.",
    )
    api_key_file: Path | None = Field(
        None,
        description="File holding accepted API keys, one per line (blank lines and lines "
        "starting with # are skipped).",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level."
    )

    def api_keys(self) -> tuple[str, ...]:
        """Every accepted API key; empty when auth is off."""
        keys = [self.api_key.get_secret_value()] if self.api_key is not None else []
        if self.api_key_file is not None:
            lines = self.api_key_file.read_text(encoding="utf-8").splitlines()
            keys += [k.strip() for k in lines if k.strip() and not k.lstrip().startswith("#")]
        return tuple(keys)

    @model_validator(mode="after")
    def _check_api_keys(self) -> Settings:
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
    def _check_timeouts(self) -> Settings:
        if self.default_timeout_s > self.max_timeout_s:
            raise ValueError(
                f"default_timeout_s ({self.default_timeout_s}) exceeds "
                f"max_timeout_s ({self.max_timeout_s})"
            )
        return self

    def model_spec(self) -> ModelSpec:
        return ModelSpec(
            model=self.model,
            task=self.task,
            device=self.device,
            dtype=self.dtype,
            max_input_tokens=self.max_input_tokens,
        )

    def batcher_config(self) -> BatcherConfig:
        return BatcherConfig(max_wait_s=self.max_wait_ms / 1000)

    def server_config(self) -> ServerConfig:
        return ServerConfig(
            max_inputs_per_request=self.max_inputs_per_request,
            max_body_bytes=self.max_body_bytes,
            default_timeout_s=self.default_timeout_s,
            max_timeout_s=self.max_timeout_s,
            max_queue_items=self.max_queue_items,
            max_batch_size=self.max_batch_size,
            max_batch_tokens=self.max_batch_tokens,
        )


@dataclass(frozen=True, slots=True)
class ServerConfig:
    max_inputs_per_request: int
    max_body_bytes: int
    default_timeout_s: float
    max_timeout_s: float
    max_queue_items: int
    max_batch_size: int
    max_batch_tokens: int
