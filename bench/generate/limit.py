"""The limit: transformers' in-process continuous batching (``ContinuousBatchingManager``,
what ``generate_batch`` drives) with every request of a level submitted at once, on every
core. No HTTP, no streaming to a client: the output tokens/s a server on the same model and
library could reach at most.

It runs in a child process (``main``, given IN.json and OUT.json), so that its
model and cache leave with it and a crash is one error in the report, not the end of the run.

Its cache is sized here, not by transformers: by default that takes a share of the host's
whole RAM (psutil, blind to cgroup limits) for a KV cache and 1,024 requests' logits.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from .workload import GenRequest

PAGE_SIZE = 64
"""Tokens of one cache page: small, so that short requests waste little of theirs."""
MAX_BATCH_TOKENS = 2048
"""Tokens of one forward pass (prefill chunks and decode steps together): vLLM's CPU default.
On 32 requests of the 16-stream level: 24 output tokens/s at 512, 36 at 2,048, 32 at 4,096."""


CHILD = "import sys\nfrom bench.generate.limit import main\nsys.exit(main(sys.argv[1:]))"
"""The child's program (``-m`` would warn: the package has imported this module already)."""


@dataclass(frozen=True, slots=True)
class CachePlan:
    num_blocks: int
    page_size: int
    max_batch_tokens: int
    max_requests_per_batch: int


def cache_plan(
    requests: Sequence[GenRequest],
    *,
    page_size: int = PAGE_SIZE,
    max_batch_tokens: int = MAX_BATCH_TOKENS,
) -> CachePlan:
    """Enough pages for every request's prompt and ``max_tokens`` at once (each rounded up to
    whole pages, one spare each), so nothing is evicted and no request waits for room."""
    if not requests:
        raise ValueError("no requests to plan a cache for")
    pages = sum(math.ceil((r.num_prompt_tokens + r.max_tokens) / page_size) + 1 for r in requests)
    return CachePlan(pages, page_size, max_batch_tokens, len(requests))


@dataclass(frozen=True, slots=True)
class LimitRun:
    label: str
    num_requests: int
    output_tokens: int
    expected_tokens: int
    wall_s: float
    output_tokens_per_s: float
    num_threads: int
    plan: CachePlan
    errors: int


def run_limit(
    model: object, label: str, requests: Sequence[GenRequest], *, defaults: bool = False
) -> LimitRun:
    """Every request at once through a manager sized by ``cache_plan`` (``defaults``: as
    transformers sizes it itself); timed from the first submission to the last result (the
    cache is allocated before the clock starts)."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    plan = cache_plan(requests)
    config = (
        ContinuousBatchingConfig()
        if defaults
        else ContinuousBatchingConfig(
            num_blocks=plan.num_blocks,
            page_size=plan.page_size,
            max_batch_tokens=plan.max_batch_tokens,
            max_requests_per_batch=plan.max_requests_per_batch,
        )
    )
    # eos -1: no token ends a request, so each makes exactly max_tokens (ignore_eos).
    generation = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=1)
    results: dict[str, object] = {}
    with model.continuous_batching_context_manager(  # type: ignore[attr-defined]
        generation_config=generation, continuous_batching_config=config, block=True, timeout=10
    ) as manager:
        started = time.perf_counter()
        for i, request in enumerate(requests):
            manager.add_request(list(request.prompt_token_ids), request_id=f"r{i}",
                                max_new_tokens=request.max_tokens, eos_token_id=-1)  # fmt: skip
        while len(results) < len(requests):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    break
                continue
            if result.is_finished():
                results[result.request_id] = result
        wall = time.perf_counter() - started
    tokens = sum(len(r.generated_tokens) for r in results.values())  # type: ignore[attr-defined]
    failed = sum(1 for r in results.values() if r.error is not None)  # type: ignore[attr-defined]
    return LimitRun(
        label=label,
        num_requests=len(requests),
        output_tokens=tokens,
        expected_tokens=sum(r.max_tokens for r in requests),
        wall_s=wall,
        output_tokens_per_s=tokens / wall if wall > 0 else math.nan,
        num_threads=torch.get_num_threads(),
        plan=plan,
        errors=failed + len(requests) - len(results),
    )


def _requests(raw: Sequence[Mapping[str, object]]) -> list[GenRequest]:
    return [GenRequest("", tuple(r["prompt_token_ids"]), int(r["max_tokens"])) for r in raw]  # type: ignore[arg-type]


def main(argv: Sequence[str]) -> int:
    """``IN.json``: {"model": folder, "device": "cpu", "dtype": "float32", "warm_up": [...],
    "sets": {label: [request, ...]}, "defaults": false}, a request being
    {"prompt_token_ids": [...], "max_tokens": n}. Writes {label: LimitRun or {"error": ...}}
    to ``OUT.json`` after each set."""
    import torch
    from transformers import AutoModelForCausalLM

    given = json.loads(Path(argv[0]).read_text())
    out = Path(argv[1])
    dtype = getattr(torch, given.get("dtype", "float32"))
    model = AutoModelForCausalLM.from_pretrained(given["model"], dtype=dtype)
    model = model.to(given.get("device", "cpu")).eval()
    defaults = bool(given.get("defaults"))
    figures: dict[str, object] = {}
    if given.get("warm_up"):
        run_limit(model, "warm-up", _requests(given["warm_up"]), defaults=defaults)
    for label, raw in given["sets"].items():
        try:
            figures[label] = asdict(run_limit(model, label, _requests(raw), defaults=defaults))
        except Exception as exc:  # one set's failure is its figure
            figures[label] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        out.write_text(json.dumps(figures))
    return 0


def measure_limit(
    folder: str,
    sets: Mapping[str, Sequence[GenRequest]],
    warm_up: Sequence[GenRequest],
    *,
    timeout_s: float,
    log_path: Path,
    device: str = "cpu",
    dtype: str = "float32",
    defaults: bool = False,
    preexec: Callable[[], None] | None = None,
) -> dict[str, dict[str, object]]:
    """Each set's ``LimitRun`` as a dict, or ``{"error": ...}`` (the child's last words where
    it failed or outlasted ``timeout_s``). ``defaults``: the cache as transformers sizes it;
    ``preexec`` runs in the child before it starts (to join a cgroup)."""

    def encode(requests: Sequence[GenRequest]) -> list[dict[str, object]]:
        return [{"prompt_token_ids": list(r.prompt_token_ids), "max_tokens": r.max_tokens}
                for r in requests]  # fmt: skip

    with tempfile.TemporaryDirectory(prefix="batchfit-limit-") as scratch:
        given, out = Path(scratch) / "in.json", Path(scratch) / "out.json"
        given.write_text(json.dumps({
            "model": folder,
            "device": device,
            "dtype": dtype,
            "defaults": defaults,
            "warm_up": encode(warm_up),
            "sets": {label: encode(requests) for label, requests in sets.items()},
        }))  # fmt: skip
        error = None
        with open(log_path, "wb") as log:
            try:
                code = subprocess.run(
                    [sys.executable, "-c", CHILD, str(given), str(out)],
                    stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, check=False,
                    preexec_fn=preexec,
                ).returncode  # fmt: skip
                if code != 0:
                    error = f"exited with {code}"
            except subprocess.TimeoutExpired:
                error = f"outlasted {timeout_s:g} s"
        figures = json.loads(out.read_text()) if out.exists() else {}
    if error is not None:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
        error = f"{error}: {' | '.join(tail)}"[:500]
    return {label: figures.get(label, {"error": error or "no figure"}) for label in sets}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
