"""Prometheus metrics of generation, on a registry passed in, per model (``for_model``)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from batching import LATENCY_BUCKETS_S, latency_buckets, powers_of_two

MODEL = ("model",)
TOKEN_GAP_BUCKETS_S = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
PREEMPTION_REASONS = ("memory", "out_of_memory")


class GenerationMetrics:
    def __init__(
        self, registry: CollectorRegistry, *, max_step_tokens: int,
        max_latency_s: float = LATENCY_BUCKETS_S[-1],
    ) -> None:  # fmt: skip
        latency = latency_buckets(max_latency_s)
        self.time_to_first_token = Histogram(
            "batchfit_generation_time_to_first_token_seconds",
            "From a sequence's admission to its first token.",
            MODEL, buckets=latency, registry=registry,
        )  # fmt: skip
        self.time_between_tokens = Histogram(
            "batchfit_generation_time_between_tokens_seconds",
            "Between two tokens of one sequence (its decode steps, and any wait between them).",
            MODEL, buckets=TOKEN_GAP_BUCKETS_S, registry=registry,
        )  # fmt: skip
        self.request_duration = Histogram(
            "batchfit_generation_request_duration_seconds",
            "From a sequence's admission to its last token.",
            MODEL, buckets=(*latency, *(b for b in (600.0, 1800.0) if b > latency[-1])),
            registry=registry,
        )  # fmt: skip
        self.step_tokens = Histogram(
            "batchfit_generation_step_tokens",
            "Tokens fed to one step (decode tokens and prefill chunks); powers of two up to "
            "--max-step-tokens.",
            MODEL, buckets=powers_of_two(max_step_tokens), registry=registry,
        )  # fmt: skip
        self.step_duration = Histogram(
            "batchfit_generation_step_duration_seconds",
            "Wall time of one step on the model thread.",
            MODEL, buckets=LATENCY_BUCKETS_S, registry=registry,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "batchfit_generation_prompt_tokens",
            "Prompt tokens of the sequences admitted.",
            MODEL, registry=registry,
        )  # fmt: skip
        self.generated_tokens = Counter(
            "batchfit_generation_generated_tokens",
            "Tokens generated (the ones a stop string cut off included).",
            MODEL, registry=registry,
        )  # fmt: skip
        self.running = Gauge(
            "batchfit_generation_running_sequences",
            "Sequences whose cache is in the store (decoding, or prefilling their prompt).",
            MODEL, registry=registry,
        )  # fmt: skip
        self.waiting = Gauge(
            "batchfit_generation_waiting_sequences",
            "Sequences admitted and waiting to join the steps (new or preempted).",
            MODEL, registry=registry,
        )  # fmt: skip
        self.cache_bytes = Gauge(
            "batchfit_generation_cache_bytes",
            "Bytes the key/value store holds for the running sequences.",
            MODEL, registry=registry,
        )  # fmt: skip
        self.cache_budget_bytes = Gauge(
            "batchfit_generation_cache_budget_bytes",
            "The most the key/value store may hold at the latest step: what it held plus the "
            "memory free, less the headroom's share of both and the step's activations.",
            MODEL, registry=registry,
        )  # fmt: skip
        self.preemptions = Counter(
            "batchfit_generation_preemptions",
            "Sequences preempted (their cache freed, to resume later), by reason: memory (the "
            "next step would not fit) or out_of_memory (a step failed an allocation).",
            [*MODEL, "reason"], registry=registry,
        )  # fmt: skip
        self.resumed = Counter(
            "batchfit_generation_resumed_sequences",
            "Preempted sequences that joined the steps again (their prompt and the tokens they "
            "had generated prefilled again).",
            MODEL, registry=registry,
        )  # fmt: skip
        self.oversized = Counter(
            "batchfit_generation_oversized_sequences",
            "Sequences too large for memory even alone, so ended: with tokens generated they "
            "end with finish_reason length; a prompt not yet started gets 507.",
            [*MODEL, "outcome"], registry=registry,
        )  # fmt: skip
        self.finished = Counter(
            "batchfit_generation_finished_sequences",
            "Sequences ended, by reason: stop, length, cancelled (the client went away), error.",
            [*MODEL, "reason"], registry=registry,
        )  # fmt: skip

    def for_model(self, model: str) -> ModelGenerationMetrics:
        series = ModelGenerationMetrics(
            time_to_first_token=self.time_to_first_token.labels(model),
            time_between_tokens=self.time_between_tokens.labels(model),
            request_duration=self.request_duration.labels(model),
            step_tokens=self.step_tokens.labels(model),
            step_duration=self.step_duration.labels(model),
            prompt_tokens=self.prompt_tokens.labels(model),
            generated_tokens=self.generated_tokens.labels(model),
            running=self.running.labels(model),
            waiting=self.waiting.labels(model),
            cache_bytes=self.cache_bytes.labels(model),
            cache_budget_bytes=self.cache_budget_bytes.labels(model),
            preemptions={r: self.preemptions.labels(model, r) for r in PREEMPTION_REASONS},
            resumed=self.resumed.labels(model),
            oversized={o: self.oversized.labels(model, o) for o in ("length", "refused")},
            finished={
                r: self.finished.labels(model, r) for r in ("stop", "length", "cancelled", "error")
            },
        )
        return series


@dataclass(frozen=True, slots=True)
class ModelGenerationMetrics:
    time_to_first_token: Histogram
    time_between_tokens: Histogram
    request_duration: Histogram
    step_tokens: Histogram
    step_duration: Histogram
    prompt_tokens: Counter
    generated_tokens: Counter
    running: Gauge
    waiting: Gauge
    cache_bytes: Gauge
    cache_budget_bytes: Gauge
    preemptions: dict[str, Counter]
    resumed: Counter
    oversized: dict[str, Counter]
    finished: dict[str, Counter]
