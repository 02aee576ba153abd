"""Write a run's Markdown report, its JSON figures and its PNG plots."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path

from .loadgen import IN_TURN
from .runner import SERVER_CONFIGS, BenchResult
from .sampler import batch_size_series
from .stats import LoadSummary
from .targets import Target, targets

REPORT = "report.md"
FIGURES = "results.json"
THROUGHPUT_PLOT = "throughput_vs_p99.png"
TIMELINE_PLOT = "timeline.png"
BATCH_COLOR = "#1f77b4"


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:.1f}"


def _num(value: float, digits: int = 1) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def _errors(errors: dict[str, int]) -> str:
    return ", ".join(f"{code}: {n}" for code, n in errors.items()) or "0"


def load_table(result: BenchResult) -> str:
    """Throughput and latency at each load level, with the in-process limit first."""
    limit = result.limit
    lines = [
        "| config | load | inputs/s | requests/s | p50 ms | p90 ms | p99 ms | max ms | errors "
        "| mean batch | padding | queue wait ms | CPU ms/input | peak RSS MiB |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: "
        "| ---: |",
        f"| limit | in-process, {limit.num_threads} threads, {limit.plan} "
        f"| {limit.inputs_per_s:.1f} | - | - | - | - | - | 0 "
        f"| {limit.mean_batch_size:.1f} | {limit.padding_ratio:.2f} | - "
        f"| {_num(limit.cpu_ms_per_input, 2)} | - |",
    ]
    for s in result.summaries:
        lines.append(
            f"| {s.config} | {s.load} | {s.inputs_per_s:.1f} | {s.requests_per_s:.1f} "
            f"| {_ms(s.p50_s)} | {_ms(s.p90_s)} | {_ms(s.p99_s)} | {_ms(s.max_s)} "
            f"| {_errors(s.errors)} | {_num(s.mean_batch_size)} | {_num(s.padding_ratio, 2)} "
            f"| {_ms(s.mean_queue_wait_s)} | {_num(s.cpu_ms_per_input, 2)} "
            f"| {_mib(s.peak_rss_bytes)} |"
        )
    return "\n".join(lines)


def idle_table(idle: dict[str, LoadSummary], batch1_p50_s: dict[str, float]) -> str:
    lines = [
        "One client, single-input requests, one at a time. Between two requests the benchmark "
        "runs the same input alone through plain transformers calls (tokenizer, model, "
        "pooling), in-process: the model's batch-1 "
        "latency at the same moments (an idle 2-core VM runs everything slower than a busy "
        "loop does, so a batch-1 figure from a tight loop would flatter the model).",
        "",
        "| config | requests | p50 ms | p90 ms | p99 ms | model batch-1 p50 ms "
        "| server queue wait ms | errors |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for config, s in idle.items():
        batch1 = batch1_p50_s.get(config, math.nan)
        lines.append(
            f"| {config} | {s.num_requests} | {_ms(s.p50_s)} | {_ms(s.p90_s)} | {_ms(s.p99_s)} "
            f"| {_ms(batch1)} | {_num(s.mean_queue_wait_s * 1e3, 2)} | {_errors(s.errors)} |"
        )
    return "\n".join(lines)


def overhead_table(rows: Sequence[LoadSummary], bare: Sequence[LoadSummary] = ()) -> list[str]:
    """The no-op model's levels (the server's own cost per request), beside the bare stack's
    under the same load, level by level in turn."""
    if not rows:
        return []
    load = rows[0].client
    turns = "one level of each in turn"
    if load == "wrk":
        turns = "each level in 2-s rounds, the two taking turns"
    lines = [
        "## Server overhead",
        "",
        "The same server serving a model that does no work (`--model python:bench.noop:create`), "
        "single-input requests: what HTTP, validation, the queue, the batcher, the hand-offs "
        "to the model thread and back and the JSON answer cost per request, in the server's "
        "CPU time and in latency as the client sees it. Beside it, the bare stack it is built "
        "on: a FastAPI endpoint with a pydantic body, the bundled model's tokenizer and an "
        "orjson answer of 4 floats per input, no queue and no model (`bench/baselines.py`), "
        f"under the same load ({load}; {turns}). Where the server's CPU goes, "
        "stage by stage, and the commands that measure it: docs/frontend.md "
        "([in the repository](../frontend.md)).",
        "",
        "| server | load | requests/s | mean ms | p50 ms | p99 ms | server CPU ms/request "
        "| errors |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for s in [*rows, *bare]:
        lines.append(
            f"| {s.config} | {s.load} | {s.requests_per_s:,.0f} | {_num(s.mean_s * 1e3, 2)} "
            f"| {_num(s.p50_s * 1e3, 2)} | {_num(s.p99_s * 1e3, 2)} "
            f"| {_num(s.cpu_ms_per_input, 3)} | {_errors(s.errors)} |"
        )
    return [*lines, ""]


def baseline_table(result: BenchResult) -> list[str]:
    """The no-batching server and adaptive with each load generator."""
    rows = [
        *[s for s in result.idle.values() if s.config == "adaptive"],
        *result.beside_no_batching,
        *result.other_clients,
        *result.no_batching,
    ]
    if not result.no_batching and not result.other_clients:
        return []
    lines = [
        "## Against a server without batching, and with another client",
        "",
        "The no-batching server is the bundled model behind a FastAPI endpoint and one model "
        "thread, each request's inputs one forward pass, with torch's defaults and the "
        "server's OpenMP spin (`bench/baselines.py`). The one-client levels send the "
        "single-input requests of the idle level; the others the workload above. "
        f"`{IN_TURN}`: one client sends each request to adaptive and to the no-batching "
        "server, one after the other (which goes first alternates), so the two are measured "
        "at the same moments; their inputs/s count the time spent on that server. The load "
        "generator's own CPU is part of what it measures: httpx costs more per request than "
        "aiohttp.",
        "",
        "| server | load | client | inputs/s | p50 ms | p90 ms | p99 ms | CPU ms/input | errors |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for s in rows:
        lines.append(
            f"| {s.config} | {s.load} | {s.client} | {s.inputs_per_s:.1f} | {_ms(s.p50_s)} "
            f"| {_ms(s.p90_s)} | {_ms(s.p99_s)} | {_num(s.cpu_ms_per_input, 2)} "
            f"| {_errors(s.errors)} |"
        )
    return [*lines, ""]


def _limit_drift(result: BenchResult) -> list[str]:
    """The limit measured again before each configuration's highest level (the host drifts)."""
    if not result.limit_before_top:
        return []
    again = ", ".join(
        f"{config} {limit.inputs_per_s:.1f}" for config, limit in result.limit_before_top.items()
    )
    return [
        f"The limit measured again just before each configuration's highest level: {again} "
        f"inputs/s{_after(result)}. The saturation targets compare adaptive with the limit "
        "measured around its highest level.",
        "",
    ]


CAP_FLAGS = ("--max-batch-size", "--max-batch-tokens", "--sizer")


def _same_server(result: BenchResult) -> list[str]:
    """Adaptive against fixed-128 by level, where fixed-128's caps are the server's defaults
    (and no ``--server-flag`` sets them): the two are then the same server, and their ratios
    show how far this run's figures move between two measurements of one thing."""
    o = result.options
    defaults = ("--max-batch-size", str(o.max_batch_size), "--max-batch-tokens",
                str(o.max_batch_tokens))  # fmt: skip
    if SERVER_CONFIGS["fixed-128"] != defaults or any(
        flag.split("=")[0] in CAP_FLAGS for flag in o.extra_server_flags
    ):
        return []
    fixed = {s.load: s for s in result.summaries if s.config == "fixed-128"}
    pairs = [
        (s.load, s.inputs_per_s / fixed[s.load].inputs_per_s)
        for s in result.summaries
        if s.config == "adaptive" and s.load in fixed and fixed[s.load].inputs_per_s
    ]
    if not pairs:
        return []
    ratios = ", ".join(f"{load} {ratio:.2f}" for load, ratio in pairs)
    return [
        f"fixed-128 runs with the server's default caps ({o.max_batch_size} items, "
        f"{o.max_batch_tokens} padded tokens) and its sizer, as adaptive does: the two are one "
        "server measured twice, minutes apart, and their gap is this run's own spread. "
        f"Adaptive / fixed-128 inputs/s by level: {ratios}.",
        "",
    ]


def _after(result: BenchResult) -> str:
    after = result.limit_after_top.get("adaptive")
    return "" if after is None else f"; just after adaptive's, {after.inputs_per_s:.1f}"


def target_table(rows: Sequence[Target]) -> str:
    lines = ["| target | measured | goal | ratio | met |", "| --- | --- | --- | ---: | --- |"]
    for t in rows:
        met = "n/a" if t.met is None else ("yes" if t.met else "**no**")
        lines.append(f"| {t.name} | {t.measured} | {t.goal} | {t.ratio:.2f} | {met} |")
    return "\n".join(lines)


QUICK_NOTE = (
    "This was a quick run (`--quick`): a smoke test that shows the benchmark works end to end. "
    "Its counts are small and its replicas start together, so its figures are not comparable "
    "with the targets, which are left out. Run `batchfit bench` without `--quick` on an "
    "otherwise idle host to measure against them."
)


def target_section(result: BenchResult) -> list[str]:
    if result.options.quick:
        return [QUICK_NOTE, ""]
    return [target_table(targets(result)), ""]


def render_markdown(result: BenchResult, *, command: str, plots: bool) -> str:
    o, limit = result.options, result.limit
    load = ", ".join(f"{x:.2f}" for x in result.load_average)
    parts = [
        "# Batchfit benchmark",
        "",
        f"Run {result.started_at} on {result.cpu_count} CPUs (load average at start: {load}), "
        f"{result.wall_s:.0f} s in all. Command:",
        "",
        f"```sh\n{command}\n```",
        "",
        f"Workload: seed {o.seed}, {o.requests_per_level} requests per closed-loop level "
        "(75% short, 20% medium, 5% near the 256-token maximum; 20% of requests carry 2-8 "
        "inputs); open-loop levels send Poisson arrivals with 10% bursts of 16 for "
        f"{o.duration_s:g} s. Every server configuration runs with the server's default "
        "thread count (every CPU) unless `--server-flag` sets one. The limit runs the same "
        "inputs through plain transformers calls, as a user's script would (each batch "
        "tokenized by the tokenizer, run through the model and mean-pooled; none of the "
        "server's code): torch's default thread count "
        f"({limit.num_threads} threads, every CPU this process may use) and ideal batches over "
        f"every input at once (sorted by length, at most {o.max_batch_size} items and "
        f"{o.max_batch_tokens} padded tokens, the server's default caps), planned two ways: "
        "the largest batches the budget allows, and the cheapest split by a time model fitted "
        f"to those batches. The faster plan counts: {limit.plan}, {limit.num_batches} batches, "
        f"{limit.compute_s:.2f} s of compute (the other plan: "
        f"{_num(limit.other_plan_inputs_per_s)} inputs/s), tokenizing included; counting "
        f"every input's tokens for the plans took {limit.tokenize_s:.3f} s more (not counted). "
        "Padding is padded / real tokens. "
        "Latencies are client-side, over successful requests.",
        "",
        "## Throughput and latency by load level",
        "",
        load_table(result),
        "",
        *_limit_drift(result),
        *_same_server(result),
        "## Idle latency",
        "",
        idle_table(result.idle, result.batch1_p50_s),
        "",
        *baseline_table(result),
        *overhead_table(result.overhead, result.bare),
        "## Targets",
        "",
        *target_section(result),
    ]
    if plots:
        parts += [
            "## Plots",
            "",
            f"![throughput vs p99]({THROUGHPUT_PLOT})",
            "",
            f"![batch size and memory over time]({TIMELINE_PLOT})",
            "",
            f"Batch size and memory over time: {result.timeline_config} at {result.timeline_load}.",
            "",
        ]
    return "\n".join(parts)


def to_json(result: BenchResult) -> dict[str, object]:
    def clean(value: object) -> object:
        if isinstance(value, float) and math.isnan(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [clean(v) for v in value]
        return value

    data = dataclasses.asdict(result)
    reported = [] if result.options.quick else targets(result)
    data["targets"] = [dataclasses.asdict(t) for t in reported]
    return clean(data)  # type: ignore[return-value]


def plot_throughput(result: BenchResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    configs = dict.fromkeys(s.config for s in result.summaries)
    for config in configs:
        rows = [s for s in result.summaries if s.config == config and not math.isnan(s.p99_s)]
        ax.plot([s.p99_s * 1e3 for s in rows], [s.inputs_per_s for s in rows], "o-", label=config)
        for s in rows:
            ax.annotate(s.load, (s.p99_s * 1e3, s.inputs_per_s), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))  # fmt: skip
    ax.axhline(result.limit.inputs_per_s, color="k", linestyle="--", label="in-process limit")
    ax.set_xscale("log")
    ax.set_xlabel("p99 latency (ms, log)")
    ax.set_ylabel("throughput (inputs/s)")
    ax.set_title("Throughput vs p99 latency across load levels")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timeline(result: BenchResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    series = batch_size_series(result.timeline)
    # Points as well as lines: a load level short enough to give one point still shows.
    top.plot([t for t, _ in series], [b for _, b in series], "o-", markersize=3,
             drawstyle="steps-pre", color=BATCH_COLOR)  # fmt: skip
    top.set_ylabel("mean batch size")
    top.set_title(f"{result.timeline_config} at {result.timeline_load}")
    top.grid(True, alpha=0.3)
    rss = [(s.t_s, s.rss_bytes / 2**20) for s in result.timeline if s.rss_bytes is not None]
    bottom.plot([t for t, _ in rss], [m for _, m in rss], "-", color="tab:red")
    bottom.set_ylabel("resident memory (MiB)")
    bottom.set_xlabel("time (s)")
    bottom.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plots_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_report(result: BenchResult, out_dir: Path, *, command: str) -> list[Path]:
    """Write the report, the figures and (with matplotlib) the plots; return the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = plots_available()
    written = []
    if plots:
        plot_throughput(result, out_dir / THROUGHPUT_PLOT)
        plot_timeline(result, out_dir / TIMELINE_PLOT)
        written += [out_dir / THROUGHPUT_PLOT, out_dir / TIMELINE_PLOT]
    (out_dir / REPORT).write_text(render_markdown(result, command=command, plots=plots))
    (out_dir / FIGURES).write_text(json.dumps(to_json(result), indent=1) + "\n")
    return [out_dir / REPORT, out_dir / FIGURES, *written]
