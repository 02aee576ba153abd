"""Settings: the one place the environment (``BATCHFIT_*``) and CLI flags are read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import ByteSize, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from batching import AdaptiveConfig, BatcherConfig
from generation import EngineConfig
from models import BUNDLED_MODEL, ModelSpec

from .model_list import ModelEntry, model_specs, parse_models, split_list

# After a batch the model thread reads memory for the next one at most this often; a batch in
# between is sized from the latest reading. The reading costs a serving process's model
# thread about 0.1 ms on a CPU host (``python -m bench.layers``), as much as a short batch: on
# batches shorter than this, fresh memory for each of them would cost a good part of it.
MEMORY_READING_INTERVAL_S = 0.005
# ... and, whatever that interval, at most this share of the model thread's time goes to them:
# the interval grows with what a reading costs (measured on each), up to half the age at
# which the event loop reads anew.
MEMORY_READING_SHARE = 0.01


class Settings(BaseSettings):
    """Every field is also a CLI flag: ``max_batch_size`` is ``--max-batch-size``."""

    model_config = SettingsConfigDict(env_prefix="BATCHFIT_", frozen=True, extra="forbid")

    model: Annotated[tuple[str, ...], NoDecode] = Field(
        (BUNDLED_MODEL,),
        description="Model to serve, as [name=]source; repeat the flag (or separate with commas "
        "in BATCHFIT_MODEL) to serve several, the first being the default. A source is the "
        "bundled all-MiniLM-L6-v2, a local Hugging Face folder, a hub name (safetensors only) "
        "or python:package.module:factory (a custom model); without name= a model serves "
        "under its own name.",
    )
    task: Annotated[tuple[str, ...], NoDecode] = Field(
        ("auto",),
        description="[name=]task: embed (pooled as the model's configuration says), classify, "
        "rerank (a cross-encoder), generate (a causal LM behind /v1/completions and "
        "/v1/chat/completions) or auto, which reads the config (a one-label sequence "
        "classifier is a reranker; a causal LM without a sentence-transformers layout, or a "
        ".gguf file, generates). A bare task applies to every model without a name=task of "
        "its own.",
    )
    default_prompt_name: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        description="[name=]prompt_name: the prompt (from the model's "
        "config_sentence_transformers.json) put in front of inputs whose request names none, "
        "instead of the model's own default; an empty name means no prompt. A bare value "
        "applies to every model without a name=value of its own.",
    )
    device: str = Field("auto", description="cuda, cuda:N or cpu; auto picks CUDA if present.")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto",
        description="Weights and activations dtype; auto is float16 on CUDA and float32 on CPU. "
        "bfloat16 runs on either.",
    )
    quantize: Literal["none", "int8"] = Field(
        "none",
        description="int8: torch dynamic quantization of the linear layers (CPU, float32 only).",
    )
    admin_token: SecretStr | None = Field(
        None,
        description="Bearer token for the /admin endpoints (profiling); unset, they do not exist.",
    )
    profile_dir: str = Field(
        "batchfit-profiles", description="Folder the profiler writes its trace files to."
    )
    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8000, ge=1, le=65535, description="Port to listen on.")
    metrics_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Serve /metrics on this port (same address) instead of the main port, so "
        "it stays off the public path.",
    )
    max_batch_size: int = Field(
        128,
        ge=1,
        description="Most items in one forward pass. A generous cap: within it the memory "
        "budget and the time model choose each batch.",
    )
    max_batch_tokens: int = Field(
        4096,
        ge=1,
        description="Most padded tokens (items x longest input) in one forward pass. On a CPU "
        "larger passes cost more per token (they outgrow the caches), which the time model "
        "cannot see; within the cap the memory budget and the time model choose.",
    )
    max_wait_ms: float = Field(
        0.0,
        ge=0,
        le=1000,
        description="How long the oldest waiting item may wait for batch-mates while the model "
        "is idle. Batches mostly form while the model runs the previous one.",
    )
    max_length_ratio: float | None = Field(
        2.0,
        ge=1,
        description="Longest / shortest input in one batch (plus 16 tokens of slack); a short "
        "input padded to a long one's length wastes compute. A large value lifts the bound. "
        "Applies while --plan-by-time is off or has no fitted model yet.",
    )
    plan_by_time: bool = Field(
        True,
        description="Choose batch-mates with a model of forward time (a + b*n*L + c*n*L^2 for n "
        "inputs padded to L tokens) fitted to the last 256 batches: the oldest input's batch "
        "spans its lengths in the split of the queue that takes least time in all.",
    )
    max_queue_items: int = Field(
        1024, ge=1, description="Queue capacity in items; beyond it requests get 429."
    )
    max_queue_share: float = Field(
        1.0,
        gt=0,
        le=1,
        description="With several models: the most of the queue's capacity one model's items "
        "may take (e.g. 0.5), so that a flood to one model cannot fill the queue for the "
        "others; beyond it that model's requests get 429.",
    )
    max_inputs_per_request: int = Field(
        256,
        ge=1,
        description="Most inputs in one request; beyond it 413. At most --max-queue-items "
        "(and one model's --max-queue-share of it), so that every request can be admitted.",
    )
    max_input_tokens: int | None = Field(
        None,
        ge=2,
        description="Truncation length; defaults to the model's own maximum. For a generator: "
        "its context (prompt and generated tokens together).",
    )
    chat_template: Path | None = Field(
        None,
        description="A Jinja chat template file, for every generator, instead of its "
        "tokenizer's own (a generator without one answers chat requests with 400).",
    )
    max_running_seqs: int = Field(
        64,
        ge=1,
        description="Generation: most sequences decoding at once (each choice of each request "
        "is one). A cap: within it, the memory free at each step decides.",
    )
    max_step_tokens: int = Field(
        2048,
        ge=16,
        description="Generation: most tokens one step feeds (decode tokens and prompt chunks).",
    )
    prefill_time_factor: float = Field(
        1.8,
        gt=1,
        description="Generation: while sequences decode, prompts are prefilled in chunks that "
        "keep a step's predicted time within this many times a step without them, so that "
        "running streams wait at most one chunk for a new prompt.",
    )
    api_workers: int = Field(
        1,
        ge=1,
        description="HTTP API processes in front of one engine process. 1: one process does "
        "everything. N >= 2: N processes accept HTTP on the port, validate, tokenize and encode "
        "answers; one engine process owns the device, the queue, the batcher and the model "
        "thread, so batches still form across every client. For hosts with many cores.",
    )
    num_threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads on CPU; default: OMP_NUM_THREADS where set (batchfit "
        "up sets it to share the cores among its replicas), else every CPU the process may "
        "use, at most its cgroup's CPU quota rounded up; that default drops to one thread "
        "while other work holds the host's CPUs and one thread runs faster. A number set here "
        "or in OMP_NUM_THREADS is kept as it is.",
    )
    cpu_passes: int = Field(
        0,
        ge=0,
        le=16,
        description="Forward passes at once on a CPU while work waits, each on its share of "
        "the threads (1: one pass at a time, on every thread). Default 0: one per thread, up "
        "to 4, where memory cannot bind them (that many of the largest batch the caps allow fit in "
        "half the memory budget) and the passes are heavy; a batch planned while nothing "
        "else waits still runs alone on every thread.",
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
    sizer: Literal["adaptive", "fixed"] = Field(
        "adaptive",
        description="adaptive sizes each batch from live memory readings; fixed uses only "
        "--max-batch-size and --max-batch-tokens.",
    )
    memory_headroom: float = Field(
        0.15,
        ge=0,
        lt=1,
        description="Share of the free memory the adaptive sizer leaves unused.",
    )
    memory_limit: ByteSize | None = Field(
        None,
        description="Most memory the server lets itself use (e.g. 2GiB): caps the batch budget, "
        "and on CPU also sets an address-space limit once the model is loaded, so a runaway "
        "batch gets a real allocation failure instead of swapping the host.",
    )
    warmup_timeout_s: float | None = Field(
        None,
        gt=0,
        description="Time bound of the warm-up's calibration: it proves the longest input "
        "length it can within this many seconds (and the memory budget), and the fitted "
        "memory model predicts beyond it. Default: 20 times its first full batch, at least "
        "10 s.",
    )
    memory_release_idle_s: float = Field(
        10.0,
        ge=0,
        description="Once no inference request has been in progress for this long, hand the "
        "free memory the C allocator holds back to the OS (glibc malloc_trim), so a quiet "
        "replica's resident memory is what it uses, not what its last burst left behind. "
        "0 turns it off.",
    )
    cache_bytes: ByteSize | None = Field(
        None,
        description="Most bytes of outputs the replica keeps, per input, to answer a repeated "
        "input without computing it again (least recently used evicted first). Default: 1/20 "
        "of the host memory the replica may use (the smallest of the host's total, its "
        "memory cgroup's limit and, on CPU, --memory-limit), in whole MiB; 0 turns it off.",
    )
    deduplicate: bool = Field(
        True,
        description="An input equal to one already queued or running waits for that "
        "computation instead of being computed again.",
    )
    target_latency_ms: float | None = Field(
        None,
        gt=0,
        description="Optional cap on a batch's compute time: padded tokens shrink after a "
        "slower batch and grow back after faster ones (AIMD).",
    )
    oom_split: bool = Field(
        True,
        description="Retry a batch that ran out of memory as two halves, down to one input; "
        "off fails the whole batch with 507, as most servers do.",
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

    def api_keys(self) -> tuple[str, ...]:
        """Every accepted API key; empty when auth is off."""
        keys = [self.api_key.get_secret_value()] if self.api_key is not None else []
        if self.api_key_file is not None:
            lines = self.api_key_file.read_text(encoding="utf-8").splitlines()
            keys += [k.strip() for k in lines if k.strip() and not k.lstrip().startswith("#")]
        return tuple(keys)

    @field_validator("model", "task", "default_prompt_name", mode="before")
    @classmethod
    def _split_list(cls, value: object) -> object:
        return split_list(value)

    @model_validator(mode="after")
    def _check_models(self) -> Settings:
        parse_models(self.model, self.task, self.default_prompt_name)
        return self

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

    @property
    def forward_exit_after_s(self) -> float:
        """``forward_exit_s``, its default (twice ``forward_timeout_s``) resolved; 0: never."""
        if self.forward_exit_s is None:
            return 2 * self.forward_timeout_s
        return self.forward_exit_s

    @model_validator(mode="after")
    def _check_timeouts(self) -> Settings:
        if self.default_timeout_s > self.max_timeout_s:
            raise ValueError(
                f"default_timeout_s ({self.default_timeout_s}) exceeds "
                f"max_timeout_s ({self.max_timeout_s})"
            )
        if self.forward_exit_s and self.forward_exit_s < self.forward_timeout_s:
            raise ValueError(
                f"forward_exit_s ({self.forward_exit_s}) is below forward_timeout_s "
                f"({self.forward_timeout_s}): a hung replica would exit before its liveness "
                "says so"
            )
        return self

    @model_validator(mode="after")
    def _check_admission(self) -> Settings:
        """A request of ``max_inputs_per_request`` inputs must fit in the queue (and in one
        model's share of it); else such a request would get 429 "retry later" for ever."""
        limit = self.max_inputs_per_request
        if limit > self.max_queue_items:
            raise ValueError(
                f"max_inputs_per_request ({limit}) exceeds max_queue_items "
                f"({self.max_queue_items}): such a request could never be admitted; lower "
                "--max-inputs-per-request or raise --max-queue-items"
            )
        share = self.max_items_per_model()
        if share is not None and limit > share:
            raise ValueError(
                f"max_inputs_per_request ({limit}) exceeds one model's share of the queue "
                f"({share} = max_queue_items {self.max_queue_items} x max_queue_share "
                f"{self.max_queue_share}): such a request could never be admitted; lower "
                "--max-inputs-per-request or raise --max-queue-share (or --max-queue-items)"
            )
        return self

    @model_validator(mode="after")
    def _check_metrics_port(self) -> Settings:
        if self.metrics_port is not None and self.metrics_port == self.port:
            raise ValueError(f"metrics_port ({self.metrics_port}) must differ from port")
        return self

    def model_entries(self) -> list[ModelEntry]:
        """The served models in order, the default first, each with its task."""
        return parse_models(self.model, self.task, self.default_prompt_name)

    def model_specs(self) -> list[tuple[str | None, ModelSpec]]:
        """Each model's name (None: its own) and what to load."""
        return model_specs(self.model_entries(), self.model_spec())

    def max_items_per_model(self, num_models: int | None = None) -> int | None:
        """What one model may hold of the queue (None: all of it), serving ``num_models``
        (default: as many as ``model`` names)."""
        if self.max_queue_share >= 1 or (num_models or len(self.model)) < 2:
            return None
        return max(1, int(self.max_queue_items * self.max_queue_share))

    def model_spec(self) -> ModelSpec:
        """The default model's spec (the others differ only in source and task)."""
        default = self.model_entries()[0]
        return ModelSpec(
            model=default.source,
            task=default.task,
            device=self.device,
            dtype=self.dtype,
            max_input_tokens=self.max_input_tokens,
            quantize=self.quantize,
            num_threads=self.num_threads,
            default_prompt_name=default.default_prompt_name,
            chat_template=str(self.chat_template) if self.chat_template else None,
        )

    def batcher_config(self) -> BatcherConfig:
        return BatcherConfig(
            max_wait_s=self.max_wait_ms / 1000,
            max_length_ratio=self.max_length_ratio,
            oom_split=self.oom_split,
            plan_by_time=self.plan_by_time,
            min_reading_interval_s=MEMORY_READING_INTERVAL_S,
            max_reading_share=MEMORY_READING_SHARE,
        )

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            max_running=self.max_running_seqs,
            max_step_tokens=self.max_step_tokens,
            prefill_time_factor=self.prefill_time_factor,
            max_waiting=self.max_queue_items,
            headroom_fraction=self.memory_headroom,
            priority_aging_s=self.priority_aging_s,
        )

    def adaptive_config(self) -> AdaptiveConfig:
        return AdaptiveConfig(
            max_items=self.max_batch_size,
            max_tokens=self.max_batch_tokens,
            headroom_fraction=self.memory_headroom,
            target_latency_s=self.target_latency_ms / 1000 if self.target_latency_ms else None,
        )

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
