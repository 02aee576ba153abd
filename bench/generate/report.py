"""The generation benchmark's report: ``report.md`` (tables and the ratios the targets need)
and ``results.json`` (every figure)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .in_turn import IN_TURN
from .runner import GenerateResult, PeerResult
from .stats import GenLevelSummary

REPORT = "report.md"
FIGURES = "results.json"


@dataclass(frozen=True, slots=True)
class Ratio:
    name: str
    value: float | None
    """None where a figure it needs is missing (a peer that did not run or failed)."""
    detail: str


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or math.isnan(a) or math.isnan(b) or b == 0:
        return None
    return a / b


def vllm_best(result: GenerateResult, concurrency: int) -> tuple[float | None, str]:
    """vLLM's best output tokens/s at a level over its default and every ``max_num_seqs``
    tried there, and which one it was."""
    runs = [p for p in result.peers if p.name == "vllm"] + result.vllm_sweep
    best: tuple[float | None, str] = (None, "")
    for peer in runs:
        level = peer.level(concurrency)
        if level is not None and (best[0] is None or level.output_tokens_per_s > best[0]):
            best = (level.output_tokens_per_s, peer.name)
    return best


def _tokens_per_s(peer: PeerResult | None, concurrency: int) -> float | None:
    level = peer.level(concurrency) if peer else None
    return level.output_tokens_per_s if level else None


def ratios(result: GenerateResult) -> list[Ratio]:
    batchfit, naive = result.peer("batchfit"), result.peer("naive")
    found: list[Ratio] = []
    for c in (16, 64):
        ours = _tokens_per_s(batchfit, c)
        limit = result.limit.get(f"c={c}", {}).get("output_tokens_per_s")
        found.append(Ratio(f"batchfit / limit output tokens/s at {c} streams",
                           _ratio(ours, limit), f"{_num(ours)} / {_num(limit)}"))  # fmt: skip
        best, which = vllm_best(result, c)
        detail = f"{_num(ours)} / {_num(best)} ({which or '-'})"
        found.append(Ratio(f"batchfit / vLLM-best output tokens/s at {c} streams",
                           _ratio(ours, best), detail))  # fmt: skip
    # At one stream, the figures of the two measured in turn where there are some.
    turn = "naive" in result.in_turn and "batchfit" in result.in_turn
    ours_1 = result.in_turn["batchfit"] if turn else (batchfit.level(1) if batchfit else None)
    naive_1 = result.in_turn["naive"] if turn else (naive.level(1) if naive else None)
    where = f" ({IN_TURN})" if turn else ""
    for label, attr in (("TTFT p50", "ttft_p50_s"), ("TBT p50", "tbt_p50_s")):
        a = getattr(ours_1, attr) if ours_1 else None
        b = getattr(naive_1, attr) if naive_1 else None
        found.append(Ratio(f"batchfit / naive {label} at 1 stream{where}", _ratio(a, b),
                           f"{_ms(a)} ms / {_ms(b)} ms"))  # fmt: skip
    join = batchfit.join if batchfit else None
    found.append(Ratio(
        f"batchfit TBT p99 / p50 while a {result.options.join_prompt_tokens:,}-token prompt joins",
        _ratio(join.tbt_p99_s, join.tbt_p50_s) if join else None,
        f"{_ms(join.tbt_p99_s)} ms / {_ms(join.tbt_p50_s)} ms" if join else "-",
    ))  # fmt: skip
    return found


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None or math.isnan(seconds) else f"{seconds * 1e3:.0f}"


def _errors(summary: GenLevelSummary) -> str:
    return ", ".join(f"{k}: {n}" for k, n in summary.errors.items()) or "0"


def level_table(result: GenerateResult, concurrency: int) -> list[str]:
    lines = [
        f"### {concurrency} stream{'s' if concurrency > 1 else ''}",
        "",
        "| peer | output tokens/s | TTFT p50 ms | TTFT p99 ms | TBT p50 ms | TBT p99 ms "
        "| TBT max ms | requests | ok | cut | errors | tokens | wall s | other CPUs |",
        "| --- |" + " ---: |" * 9 + " --- | ---: | ---: | ---: |",
    ]
    limit = result.limit.get(f"c={concurrency}")
    if limit is not None and "error" not in limit:
        lines.append(
            f"| limit (in-process, all at once) | {_num(limit['output_tokens_per_s'])} "  # type: ignore[arg-type]
            f"| n/a | n/a | n/a | n/a | n/a | {limit['num_requests']} "
            f"| {limit['num_requests'] - limit['errors']} | 0 | {limit['errors']} "  # type: ignore[operator]
            f"| {limit['output_tokens']} | {_num(limit['wall_s'])} "  # type: ignore[arg-type]
            f"| {_num(result.limit_other_cpus, 2)} |"
        )
    elif limit is not None:
        lines.append(f"| limit | failed: {_cell(str(limit['error']))} |" + " |" * 12)
    for peer in [*result.peers, *result.vllm_sweep]:
        s = peer.level(concurrency)
        if s is None:
            if peer.error and peer in result.peers:
                lines.append(f"| {peer.name} | failed (below) |" + " |" * 12)
            continue
        lines.append(
            f"| {peer.name} | {_num(s.output_tokens_per_s)} | {_ms(s.ttft_p50_s)} "
            f"| {_ms(s.ttft_p99_s)} | {_ms(s.tbt_p50_s)} | {_ms(s.tbt_p99_s)} "
            f"| {_ms(s.tbt_max_s)} | {s.num_requests} | {s.num_ok} | {s.num_cut} "
            f"| {_errors(s)} | {s.completion_tokens} | {_num(s.wall_s)} "
            f"| {_num(s.other_cpus, 2)} |"
        )
    return [*lines, ""]


def in_turn_table(result: GenerateResult) -> list[str]:
    """The one-stream level again, naive and batchfit both running, their requests in turn."""
    if not result.in_turn and result.in_turn_error is None:
        return []
    lines = [
        "### 1 stream, in turn", "",
        "Both servers started; each request of the one-stream level went to one and then the "
        "other (the first alternating), so that both were measured at the same moments. The "
        "one-stream ratios below read these figures.", "",
    ]  # fmt: skip
    if result.in_turn_error is not None:
        return [*lines, f"Failed: {_cell(result.in_turn_error)}", ""]
    lines += [
        "| peer | TTFT p50 ms | TTFT p99 ms | TBT p50 ms | TBT p99 ms | requests | ok | tokens "
        "| other CPUs |",
        "| --- |" + " ---: |" * 8,
    ]
    for name, s in result.in_turn.items():
        lines.append(
            f"| {name} | {_ms(s.ttft_p50_s)} | {_ms(s.ttft_p99_s)} | {_ms(s.tbt_p50_s)} "
            f"| {_ms(s.tbt_p99_s)} | {s.num_requests} | {s.num_ok} | {s.completion_tokens} "
            f"| {_num(s.other_cpus, 2)} |"
        )
    return [*lines, ""]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:300]


def join_table(result: GenerateResult) -> list[str]:
    o = result.options
    rows = [p for p in result.peers if p.join is not None]
    if not rows:
        return []
    lines = [
        f"## One stream while a {o.join_prompt_tokens:,}-token prompt joins",
        "",
        f"One stream ({o.join_first_max_tokens} new tokens from a 64-token prompt); once it "
        f"has {o.join_after_tokens} tokens, a request with a {o.join_prompt_tokens}-token "
        f"prompt and {o.join_max_tokens} new tokens is sent beside it. The window opens at "
        "that send and closes when the joining stream ends (or the first one, if sooner); the "
        "first stream's gaps between tokens inside it are pooled over "
        f"{o.join_trials} trial(s). A prefill that stalls the running stream is the p99 and "
        "the max. 'alone' is the first stream's TBT p50 before the join.",
        "",
        "| peer | TBT p50 ms | TBT p99 ms | TBT max ms | p99 / p50 | gaps | joining TTFT p50 ms "
        "| alone TBT p50 ms | errors | other CPUs |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for peer in rows:
        j = peer.join
        assert j is not None
        errors = ", ".join(f"{k}: {n}" for k, n in j.errors.items()) or "0"
        lines.append(
            f"| {peer.name} | {_ms(j.tbt_p50_s)} | {_ms(j.tbt_p99_s)} | {_ms(j.tbt_max_s)} "
            f"| {_num(j.p99_over_p50, 2)} | {j.num_gaps} | {_ms(j.join_ttft_p50_s)} "
            f"| {_ms(j.alone_tbt_p50_s)} | {errors} | {_num(j.other_cpus, 2)} |"
        )
    return [*lines, ""]


def render_markdown(result: GenerateResult, *, command: str) -> str:
    o = result.options
    spec = o.spec
    load = ", ".join(f"{x:.2f}" for x in result.load_average)
    load_after = ", ".join(f"{x:.2f}" for x in result.load_average_after)
    lines = [
        "# batchfit bench --generate",
        "",
        f"`{command}`",
        "",
        f"Started {result.started_at}; {result.wall_s / 60:.1f} min. Host: {result.cpu_count} "
        f"CPUs, load average {load} before and {load_after} after.",
        "",
        f"Model: `{result.model}`; every peer serves the float32 safetensors folder "
        f"`{result.folder}` (the same weights).",
        "",
        *(
            [
                "**Quick mode**: small counts and short requests, a smoke test whose figures are "
                "not for the targets.",
                "",
            ]
            if o.quick
            else []
        ),
        "## Workload",
        "",
        f"Seed {o.seed}. Prompts of {spec.min_prompt_tokens} to {spec.max_prompt_tokens} "
        f"tokens and `max_tokens` {spec.min_new_tokens} to {spec.max_new_tokens}, each drawn "
        "log-uniformly and independently; prompts are prose cut to their exact token count "
        "with the model's tokenizer, each opening with a sentence of its own (no shared "
        "prefixes), and every level has its own requests. Each request is a streamed "
        "`POST /v1/completions` with a text prompt, `temperature` 0, `ignore_eos` true and "
        "`stream_options.include_usage`. Levels are closed loops of C streams over the "
        f"level's requests, sending nothing new after {o.max_level_s:g} s and cutting what is "
        f"still open {o.drain_s:g} s later (a cut stream's tokens count, it is not an error). "
        "Output tokens/s: every token received over the level's wall time. TTFT: send to the "
        "first token chunk, over the streams that had one (one cut before it has none). "
        "TBT: the gaps between a stream's token chunks (one token each "
        "with these peers), pooled over the level's streams. Each server is warmed up first "
        "(6 short and long requests, two at a time) and runs alone; before each level the "
        f"benchmark waits up to {o.quiet_wait_s:g} s for the host's other work to settle. "
        "'other CPUs': what work other than the peer and the benchmark took of the host's "
        "CPUs during the level (from /proc/stat); figures taken beside much of it are not "
        "the peer's alone.",
        "",
        "| level | requests | prompt tokens min / median / mean / max | max_tokens min / median "
        "/ mean / max | tokens asked |",
        "| --- | ---: | --- | --- | ---: |",
    ]
    for label, shape in result.workload.items():
        if label == "join":
            continue
        d = shape  # type: ignore[assignment]
        lines.append(
            f"| {label} | {d['num_requests']} | {d['prompt_tokens_min']} / "  # type: ignore[index]
            f"{d['prompt_tokens_median']:g} / {d['prompt_tokens_mean']:.0f} / "  # type: ignore[index]
            f"{d['prompt_tokens_max']} | {d['max_tokens_min']} / {d['max_tokens_median']:g} / "  # type: ignore[index]
            f"{d['max_tokens_mean']:.0f} / {d['max_tokens_max']} | {d['max_tokens_total']} |"  # type: ignore[index]
        )
    lines += ["", "## Peers", "", *peer_notes(result), "", "## Load levels", ""]
    for c in o.concurrency:
        lines += level_table(result, c)
    lines += in_turn_table(result)
    lines += join_table(result)
    lines += [
        "## Ratios for the targets",
        "",
        "| ratio | value | figures |",
        "| --- | ---: | --- |",
    ]
    for r in ratios(result):
        lines.append(f"| {r.name} | {_num(r.value, 2) if r.value is not None else 'n/a'} "
                     f"| {r.detail} |")  # fmt: skip
    failures = [p for p in [*result.peers, *result.vllm_sweep] if p.error]
    if failures:
        lines += ["", "## Failures", ""]
        for p in failures:
            lines += [f"**{p.name}**:", "", "```", p.error or "", "```", ""]
    return "\n".join(lines) + "\n"


def peer_notes(result: GenerateResult) -> list[str]:
    o = result.options
    notes = {
        "naive": "`naive`: transformers `generate` behind FastAPI and plain uvicorn, one request "
        "at a time (one worker thread), each token streamed as a chunk; torch's default "
        "threads (`bench/generate/naive.py`).",
        "limit": "`limit`: transformers' in-process continuous batching "
        "(`ContinuousBatchingManager`, as `generate_batch` drives it) with every request of the "
        "level submitted at once, torch's default threads; its cache sized for the whole set "
        "(`bench/generate/limit.py`). TTFT and TBT are n/a.",
        "vllm": f"`vllm`: vLLM's CPU build in its own environment ({result.vllm_env or '-'}), "
        f"its OpenAI server at its defaults but `--dtype float32`, with "
        f"`VLLM_CPU_KVCACHE_SPACE={o.vllm_kv_cache_gib:g}`; `max_num_seqs` "
        f"{', '.join(map(str, o.vllm_max_num_seqs)) or '(none)'} tried on the highest level "
        "(its default is 128 on a CPU: any value at or above a level's streams is the default "
        "there)"
        + (
            "; `all cores`: its threads bound to every core (`VLLM_CPU_OMP_THREADS_BIND`), none "
            "kept for its scheduler (`VLLM_CPU_NUM_OF_RESERVED_CPU=0`), on the levels of 16 "
            "streams or more"
            if o.vllm_all_cores
            else ""
        )
        + ". Its best at a level is the best of these.",
        "batchfit": "`batchfit`: `batchfit serve --task generate` "
        f"{' '.join(o.batchfit_flags)}".rstrip()
        + ".",
    }
    lines = [f"- {notes[name]}" for name in o.peers]
    for peer in [*result.peers, *result.vllm_sweep]:
        extra = f" ({'; '.join(peer.notes)})" if peer.notes else ""
        if peer.start_s is not None:
            lines.append(f"- {peer.name} was ready {peer.start_s:.0f} s after its start{extra}.")
    return lines


def _jsonable(value: object) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def write_report(result: GenerateResult, out: Path, *, command: str) -> Sequence[Path]:
    out.mkdir(parents=True, exist_ok=True)
    report, figures = out / REPORT, out / FIGURES
    report.write_text(render_markdown(result, command=command))
    data = {"command": command, **_jsonable(result),  # type: ignore[dict-item]
            "ratios": [_jsonable(r) for r in ratios(result)]}  # fmt: skip
    figures.write_text(json.dumps(data, indent=1))
    return [report, figures]
