"""What one ``batchfit bench --generate`` run does: its options, and the requests it sends
(each level's own, the joining prompts, the warm-up)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from . import vllm_env
from .peers import PEERS
from .workload import (
    Decode,
    Encode,
    GenerateSpec,
    GenRequest,
    long_prompt_request,
    make_generate_requests,
)


@dataclass(frozen=True, slots=True)
class GenerateOptions:
    peers: tuple[str, ...] = PEERS
    concurrency: tuple[int, ...] = (1, 4, 16, 64)
    requests_per_level: int | None = None
    """None: twice the level's streams, at least 8."""
    max_level_s: float = 180.0
    """A level sends nothing new after this long ..."""
    drain_s: float = 60.0
    """... and cuts the streams still open this much later."""
    request_timeout_s: float = 600.0
    quiet_wait_s: float = 60.0
    """Before each level, wait up to this long for other work on the host to settle."""
    join_trials: int = 3
    join_prompt_tokens: int = 1024
    join_max_tokens: int = 32
    join_after_tokens: int = 16
    join_first_max_tokens: int = 256
    limit_levels: tuple[int, ...] | None = None
    """Levels whose request sets the limit runs (None: those of 16 streams or more, else
    the highest)."""
    vllm_max_num_seqs: tuple[int, ...] = (16, 32)
    """vLLM's ``--max-num-seqs`` values tried on the highest level, beside its default."""
    vllm_all_cores: bool = True
    """Also run vLLM with its threads on every core, none kept for its scheduler, on the
    levels the limit runs."""
    vllm_kv_cache_gib: float = 4.0
    vllm_venv: Path = field(default_factory=vllm_env.default_venv)
    model: str | None = None
    """A causal-LM folder or a GGUF file (None: Gemma-3-270m Q4_K_M, converted once)."""
    batchfit_flags: tuple[str, ...] = ()
    limit_device: str = "cpu"
    limit_dtype: str = "float32"
    """Where and in what the limit runs (the GPU check: cuda, float16)."""
    spec: GenerateSpec = field(default_factory=GenerateSpec)
    """Token ranges; its seed is replaced by ``seed``."""
    seed: int = 0
    quick: bool = False
    log_dir: Path | None = None

    def __post_init__(self) -> None:
        unknown = [p for p in self.peers if p not in PEERS]
        if unknown or not self.peers:
            raise ValueError(f"unknown peers {unknown}; expected some of {list(PEERS)}")
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError(f"concurrency levels must be positive, got {self.concurrency}")
        if self.requests_per_level is not None and self.requests_per_level < 1:
            raise ValueError(f"requests per level must be positive: {self.requests_per_level}")
        if min(self.max_level_s, self.drain_s, self.request_timeout_s) <= 0:
            raise ValueError("level and request time limits must be positive")
        if self.join_trials < 0 or self.join_after_tokens >= self.join_first_max_tokens:
            raise ValueError("join trials must be >= 0 and join after fewer tokens than the "
                             f"first stream makes ({self.join_first_max_tokens})")  # fmt: skip

    def requests_for(self, concurrency: int) -> int:
        return self.requests_per_level or max(8, 2 * concurrency)

    def levels_for_limit(self) -> tuple[int, ...]:
        if self.limit_levels is not None:
            return self.limit_levels
        return tuple(c for c in self.concurrency if c >= 16) or (max(self.concurrency),)


def quick_options(**overrides: object) -> GenerateOptions:
    """A smoke test of a few minutes: two levels, short requests, no vLLM sweep."""
    base: dict[str, object] = {
        "concurrency": (1, 4),
        "requests_per_level": 4,
        "max_level_s": 40.0,
        "drain_s": 20.0,
        "join_trials": 1,
        "join_prompt_tokens": 512,
        "join_max_tokens": 8,
        "join_after_tokens": 4,
        "join_first_max_tokens": 48,
        "vllm_max_num_seqs": (),
        "vllm_all_cores": False,
        "quiet_wait_s": 10.0,
        "spec": GenerateSpec(max_prompt_tokens=256, min_new_tokens=8, max_new_tokens=32),
        "quick": True,
    }
    base.update(overrides)
    return GenerateOptions(**base)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Workload:
    levels: dict[int, list[GenRequest]]
    joins: list[tuple[GenRequest, GenRequest]]
    warm_up: list[GenRequest]

    def describe(self) -> dict[str, object]:
        def shape(requests: Sequence[GenRequest]) -> dict[str, object]:
            prompts = [r.num_prompt_tokens for r in requests]
            new = [r.max_tokens for r in requests]
            return {"num_requests": len(requests), "prompt_tokens_min": min(prompts),
                    "prompt_tokens_median": statistics.median(prompts),
                    "prompt_tokens_mean": statistics.fmean(prompts),
                    "prompt_tokens_max": max(prompts), "max_tokens_min": min(new),
                    "max_tokens_median": statistics.median(new),
                    "max_tokens_mean": statistics.fmean(new), "max_tokens_max": max(new),
                    "max_tokens_total": sum(new)}  # fmt: skip

        described: dict[str, object] = {f"c={c}": shape(r) for c, r in self.levels.items()}
        if self.joins:
            described["join"] = {
                "first": shape([f for f, _ in self.joins]),
                "joining": shape([j for _, j in self.joins]),
            }
        return described


def build_workload(options: GenerateOptions, encode: Encode, decode: Decode) -> Workload:
    spec = replace(options.spec, seed=options.seed)
    levels = {c: make_generate_requests(spec, options.requests_for(c), encode, decode,
                                        salt=f"c={c}") for c in options.concurrency}  # fmt: skip
    joins = [
        (long_prompt_request(spec, 64, options.join_first_max_tokens, encode, decode,
                             salt=f"first:{t}"),
         long_prompt_request(spec, options.join_prompt_tokens, options.join_max_tokens,
                             encode, decode, salt=f"join:{t}"))
        for t in range(options.join_trials)
    ]  # fmt: skip
    warm_up = [
        long_prompt_request(spec, 32, 8, encode, decode, salt="warm:short"),
        long_prompt_request(spec, options.join_prompt_tokens, 4, encode, decode, salt="warm:long"),
        *make_generate_requests(replace(spec, max_new_tokens=16, min_new_tokens=8,
                                        max_prompt_tokens=256), 4, encode, decode,
                                salt="warm"),
    ]  # fmt: skip
    return Workload(levels, joins, warm_up)
