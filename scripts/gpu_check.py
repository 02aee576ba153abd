"""The GPU check's Python steps; ``scripts/gpu_check.sh`` runs them (see docs/gpu.md).

    python -m scripts.gpu_check storm      --device cuda --work DIR
    python -m scripts.gpu_check throughput --device cuda --work DIR
    python -m scripts.gpu_check generate   --device cuda --work DIR
    python -m scripts.gpu_check generate-memory --device cuda --work DIR
    python -m scripts.gpu_check summary    --work DIR --out DIR --status tests=0 ...

With ``--device cpu`` (the dry run) each step runs its CPU counterpart at small sizes.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .gpu_common import device_facts, write_json
from .gpu_generate_memory import memory_markdown
from .gpu_storm import StormPlan, burst_texts, run_storm
from .gpu_throughput import ThroughputPlan, run_throughput
from .gpu_workers import plans as workers_plans
from .gpu_workers import run_workers

BUNDLED = "all-MiniLM-L6-v2"
BERT_LARGE = {
    "hidden_size": 1024,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "intermediate_size": 4096,
    "max_position_embeddings": 512,
}
STEPS = ("tests", "storm", "throughput", "workers")
GENERATE = "generate"
"""The generation step: ``gpu_check.sh --generate`` runs it alone, in a call of its own (the
four steps above fill one 10-minute call)."""
GENERATE_MEMORY = "generate-memory"
"""Generation while a second process takes device memory: ``gpu_check.sh --generate-memory``,
alone too."""


def guarded(run: Callable[..., dict[str, Any]], plan: Any, *args: Any) -> dict[str, Any]:
    """One run's figures; a run that breaks is recorded as failed, and the next one runs."""
    try:
        return run(plan, *args)
    except Exception as exc:
        logging.exception("%s failed", plan)
        return {"plan": asdict(plan), "error": f"{type(exc).__name__}: {exc}"[:2000],
                "checks": {}, "passed": False}  # fmt: skip


def storm(device: str, work: Path) -> bool:
    from tests.reference import reference_embeddings

    on_cuda = device.startswith("cuda")
    texts = burst_texts(1024, 128, seed=1) if on_cuda else burst_texts(24, 8, seed=1)
    reference = reference_embeddings(texts)  # CPU, float32, plain transformers
    if on_cuda:
        plans = [
            StormPlan(device, "adaptive", "auto", 1024, 128, inputs_per_request=8),
            StormPlan(device, "fixed", "float32", 1024, 128, inputs_per_request=8),
        ]
    else:
        plans = [StormPlan(device, "adaptive", "auto", 24, 8, inputs_per_request=4,
                           memory_limit=str(640 * 2**20))]  # fmt: skip
    runs = []
    for plan in plans:
        logging.info("storm: %s sizer, --dtype %s", plan.sizer, plan.dtype)
        runs.append(guarded(run_storm, plan, texts, reference, work / "logs"))
        write_json(work / "storm.json", {"runs": runs})  # kept if a later run is cut short
    return all(run["passed"] for run in runs)


def throughput(device: str, work: Path) -> bool:
    from models.testing import save_tiny_model

    if device.startswith("cuda"):
        folder = Path(tempfile.mkdtemp(prefix="batchfit-encoder-"))
        # BERT-large's shape, random weights: memory rather than compute binds its batches.
        big = str(save_tiny_model(folder / "bert-large-random", **BERT_LARGE))
        big_caps = {"max_batch_size": 1024, "max_batch_tokens": 262144, "memory_limit": "4GiB"}
        plans = [
            ThroughputPlan("MiniLM float16", device, BUNDLED, "float16", 800, 64),
            ThroughputPlan("MiniLM float32", device, BUNDLED, "float32", 800, 64),
            ThroughputPlan("BERT-large float16", device, big, "float16", 400, 64, **big_caps),
            ThroughputPlan("BERT-large float32", device, big, "float32", 400, 64, **big_caps),
        ]
    else:  # the dry run proves the step with one model; a saved random one is served elsewhere
        # Small caps: warming up to the default ones (256 x 32,768 tokens) took 15 s of the CPU.
        plans = [ThroughputPlan("MiniLM float32", device, BUNDLED, "float32", 32, 8,
                                max_batch_size=16, max_batch_tokens=2048)]  # fmt: skip
    runs = []
    for plan in plans:
        logging.info("throughput: %s", plan.label)
        runs.append(guarded(run_throughput, plan, work / "logs"))
        write_json(work / "throughput.json", {"runs": runs})  # kept if a later run is cut short
    return all(run["passed"] for run in runs)


def workers(device: str, work: Path) -> bool:
    runs = []
    for plan in workers_plans(device, BUNDLED):
        logging.info("workers: %s, --api-workers %d", plan.label, plan.api_workers)
        runs.append(guarded(run_workers, plan, work / "logs"))
        write_json(work / "workers.json", {"runs": runs})  # kept if a later run is cut short
    return all(run["passed"] for run in runs)


def generate(device: str, work: Path) -> bool:
    from .gpu_generate import generate_step

    return _figures_of(GENERATE, generate_step, device, work, "generate.json")


def generate_memory(device: str, work: Path) -> bool:
    from .gpu_generate_memory import memory_step

    return _figures_of(GENERATE_MEMORY, memory_step, device, work, "generate_memory.json")


def _figures_of(
    name: str, step: Callable[[str, Path], dict[str, Any]], device: str, work: Path, file: str
) -> bool:
    """Run a step that returns its figures; a step that breaks is its error. Written to
    ``work/file``; whether it passed."""
    try:
        figures = step(device, work)
    except Exception as exc:
        logging.exception("%s failed", name)
        figures = {"error": f"{type(exc).__name__}: {exc}"[:2000], "passed": False}
    write_json(work / file, figures)
    return bool(figures["passed"])


def checked_steps(status: dict[str, int]) -> tuple[str, ...]:
    """The steps a run must pass: the four, or a generation step where it ran (alone)."""
    alone = tuple(step for step in (GENERATE, GENERATE_MEMORY) if step in status)
    return alone or STEPS


def _read(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def _mib(value: float | None) -> str:
    return (
        "-"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else (f"{value / 2**20:,.0f} MiB")
    )


def _num(value: float | None, spec: str = ".1f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def summary(work: Path, out: Path, status: dict[str, int], dry_run: bool, device: str) -> bool:
    results = {
        "dry_run": dry_run,
        "machine": _read(work / "machine.json"),
        "exit_status": status,
        "tests": _read(work / "gpu_tests.json"),
        "storm": _read(work / "storm.json"),
        "throughput": _read(work / "throughput.json"),
        "workers": _read(work / "workers.json"),
        "generate": _read(work / "generate.json"),
        "generate_memory": _read(work / "generate_memory.json"),
    }
    results["passed"] = all(status.get(step) == 0 for step in checked_steps(status))
    write_json(out / "results.json", results)
    (out / "summary.md").write_text(markdown(results, device))
    return results["passed"]


def markdown(results: dict[str, Any], device: str) -> str:
    machine = results.get("machine") or {}
    status = results["exit_status"]
    lines = [
        f"# GPU check{' (dry run on the CPU)' if results['dry_run'] else ''}",
        "",
        f"{machine.get('name', device)}; torch {machine.get('torch', '?')}, "
        f"CUDA {machine.get('cuda', '-')}; {machine.get('when', '')}",
        "",
        "| step | result |",
        "| --- | --- |",
        *(
            f"| {s} | {'passed' if status.get(s) == 0 else f'FAILED ({status.get(s)})'} |"
            for s in checked_steps(status)
        ),
        "",
        *generate_markdown(results.get("generate")),
        *memory_markdown(results.get("generate_memory")),
    ]
    if GENERATE in status or GENERATE_MEMORY in status:  # the generation steps run alone
        return "\n".join(lines) + "\n"
    lines += ["## 1. `pytest -m gpu`", ""]
    for name, figures in sorted((results.get("tests") or {}).items()):
        shown = (f"{k} {_num(v, '.4g') if isinstance(v, float) else v}" for k, v in figures.items())
        lines.append(f"- `{name}`: " + ", ".join(shown))
    lines += ["", "## 2. Out-of-memory storm", ""]
    lines += [
        "| sizer | dtype | inputs | failed | OOM splits | batches | budget before | budget low "
        "| room at ready (replica) | room (check) | held peak | min cosine | ready "
        "| grow-back batches |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- "
        "| ---: |",
    ]
    errors = []
    for run in (results.get("storm") or {}).get("runs", []):
        plan, grow = run["plan"], run.get("grow_back", {})
        if "error" in run:
            errors.append(f"storm ({plan['sizer']}): {run['error']}")
            continue
        lines.append(
            f"| {plan['sizer']} | {run.get('replica_dtype', plan['dtype'])} | "
            f"{plan['num_inputs']} | {run.get('failed_requests') or 0} | "
            f"{_num(run.get('oom_splits'), '.0f')} | {_num(run.get('batches'), '.0f')} | "
            f"{_mib(run.get('budget_before_bytes'))} | {_mib(run.get('budget_low_bytes'))} | "
            f"{_mib(run.get('room_at_ready_bytes'))} | {_mib(run.get('independent_room_bytes'))} | "
            f"{_mib(run.get('held_peak_bytes'))} | "
            f"{_num(run.get('min_cosine_vs_cpu_float32'), '.5f')} | {run.get('ready_after')} | "
            f"{grow.get('batches', '-')} |"
        )
        failed = [name for name, ok in run.get("checks", {}).items() if not ok]
        if failed:
            lines.append(f"\nFailed checks ({plan['sizer']}): {'; '.join(failed)}\n")
    lines += ["", "## 3. Throughput against the in-process limit", ""]
    lines += [
        "| model | replica inputs/s | limit inputs/s | ratio | replica mean batch "
        "| limit mean batch | p50 / p99 ms | budget low | batch peak high | peak / budget |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in (results.get("throughput") or {}).get("runs", []):
        if "error" in run:
            errors.append(f"throughput ({run['plan']['label']}): {run['error']}")
            continue
        rep, lim, mem = run["replica"], run["limit"], run["memory"]
        lines.append(
            f"| {run['plan']['label']} | {_num(rep['inputs_per_s'])} | "
            f"{_num(lim['inputs_per_s'])} | {_num(run['vs_limit'], '.2f')} | "
            f"{_num(rep['mean_batch_size'])} | {_num(lim['mean_batch_size'])} | "
            f"{_num(rep['p50_s'] * 1e3)} / {_num(rep['p99_s'] * 1e3)} | "
            f"{_mib(mem['budget_low_bytes'])} | {_mib(mem['measured_batch_peak_high_bytes'])} | "
            f"{_num(mem['peak_vs_budget'], '.2f')} |"
        )
    lines += ["", "## 4. API processes in front of one engine (`--api-workers`)", ""]
    lines += [
        "| model | API processes | load | requests/s | p50 / p99 ms | replica CPU ms per input |",
        "| --- | ---: | --- | ---: | ---: | ---: |",
    ]
    for run in (results.get("workers") or {}).get("runs", []):
        plan = run["plan"]
        if "error" in run:
            errors.append(f"workers ({plan['label']}, {plan['api_workers']}): {run['error']}")
            continue
        rep = run["replica"]
        lines.append(
            f"| {plan['label']} | {plan['api_workers']} | {run['load']} c={plan['connections']} "
            f"| {_num(rep['requests_per_s'])} | {_num(rep['p50_s'] * 1e3, '.2f')} / "
            f"{_num(rep['p99_s'] * 1e3, '.2f')} | {_num(rep.get('cpu_ms_per_input'), '.3f')} |"
        )
    if errors:
        lines += ["", "## Runs that broke", "", *(f"- {e}" for e in errors)]
    return "\n".join(lines) + "\n"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def generate_markdown(figures: dict[str, Any] | None) -> list[str]:
    if not figures:
        return []
    lines = ["## 5. Generation: batchfit against the limit", ""]
    if "error" in figures:
        return [*lines, f"The step broke: {figures['error']}", ""]
    lines += [f"{figures['model']}, {figures['dtype']} on {figures['device']}; the whole "
              "report is `generate/report.md` in the logs.", "",
              "| streams | batchfit output tokens/s | limit output tokens/s | ratio "
              "| TTFT p50 / p99 ms | TBT p50 / p99 ms | errors |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
    for level in (figures.get("batchfit") or {}).get("levels", []):
        limit = figures["limit"].get(f"c={level['concurrency']}", {}).get("output_tokens_per_s")
        ours = level["output_tokens_per_s"]
        lines.append(
            f"| {level['concurrency']} | {_num(ours)} | {_num(limit)} "
            f"| {_num(ours / limit if ours is not None and limit else None, '.2f')} "
            f"| {_num(_ms(level['ttft_p50_s']), '.0f')} / {_num(_ms(level['ttft_p99_s']), '.0f')} "
            f"| {_num(_ms(level['tbt_p50_s']), '.1f')} / {_num(_ms(level['tbt_p99_s']), '.1f')} "
            f"| {level['errors'] or 0} |"
        )
    lines += ["", "| ratio | value | figures |", "| --- | ---: | --- |"]
    for ratio in figures["ratios"]:
        value = "n/a" if ratio["value"] is None else f"{ratio['value']:.2f}"
        lines.append(f"| {ratio['name']} | {value} | {ratio['detail']} |")
    batchfit = figures.get("batchfit") or {}
    if batchfit.get("error"):
        lines += ["", f"batchfit failed: {batchfit['error'].splitlines()[0]}"]
    return [*lines, ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.gpu_check")
    parser.add_argument(
        "step",
        choices=("machine", "storm", "throughput", "workers", GENERATE, GENERATE_MEMORY, "summary"),
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--status", nargs="*", default=[], help="step=exit status, ...")
    args = parser.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s gpu-check: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.step == "machine":
        write_json(args.work / "machine.json", device_facts(args.device))
        return 0
    if args.step == "storm":
        return 0 if storm(args.device, args.work) else 1
    if args.step == "throughput":
        return 0 if throughput(args.device, args.work) else 1
    if args.step == "workers":
        return 0 if workers(args.device, args.work) else 1
    if args.step == GENERATE:
        return 0 if generate(args.device, args.work) else 1
    if args.step == GENERATE_MEMORY:
        return 0 if generate_memory(args.device, args.work) else 1
    status = {k: int(v) for k, v in (item.split("=", 1) for item in args.status)}
    return 0 if summary(args.work, args.out, status, args.dry_run, args.device) else 1


if __name__ == "__main__":
    sys.exit(main())
