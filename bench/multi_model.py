"""Two models on one memory limit: one replica serving both against one replica per model
with half the limit each.

The models are the bundled embedder and a classifier of the same size (the bundled model's
config with random weights and three labels, built in a temporary folder). One seeded
mixed-length workload goes to both, each request to one model at random. The two replicas run
twice: with the default threads (each uses every CPU, so they contend for cores) and with the
CPUs split between them. Reported per setup:
inputs per second, p50 and p99 latency, failed requests and the peak of the replicas' summed
resident memory. Run: ``python -m bench.multi_model`` (loopback only, bounded).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
from pathlib import Path

from .memory_limit import Result, drive, make_workload, measure
from .servers import start_replicas

EMBEDDER, CLASSIFIER = "embed", "classify"


def save_classifier(folder: Path, seed: int = 0) -> Path:
    """The bundled model's architecture as a three-label classifier with random weights."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, BertForSequenceClassification

    from models.loading import resolve_model_path
    from models.spec import BUNDLED_MODEL

    source = resolve_model_path(BUNDLED_MODEL)
    config = AutoConfig.from_pretrained(source)
    config.num_labels = 3
    config.architectures = ["BertForSequenceClassification"]
    torch.manual_seed(seed)
    BertForSequenceClassification(config).save_pretrained(folder, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.model_max_length = 256  # as the bundled model's sentence-transformers limit
    tokenizer.save_pretrained(folder)
    return folder


def run_setup(
    name: str,
    flag_lists: list[list[str]],
    route: dict[str, int],
    workload: list[tuple[str, list[str]]],
    concurrency: int,
    log_dir: Path,
) -> Result:
    """Start the replicas, send the workload (model -> index of the replica serving it)."""
    with start_replicas(flag_lists, log_dir=log_dir / name, ready_timeout_s=300) as replicas:
        requests = [
            (f"{replicas[route[model]].url}/v1/infer",
             {"inputs": inputs, "model": model, "timeout_s": 300})
            for model, inputs in workload
        ]  # fmt: skip
        asyncio.run(drive(requests[:8], 4))  # a first request per model, not measured
        return measure(name, requests, concurrency, *replicas)


def mixed_workload(num_requests: int, seed: int, long_share: float) -> list[tuple[str, list[str]]]:
    rng = random.Random(seed + 1)
    return [
        (rng.choice((EMBEDDER, CLASSIFIER)), inputs)
        for inputs in make_workload(num_requests, seed, long_share)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-limit-mib", type=int, default=1280)
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--long-share", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--split-threads",
        type=int,
        default=max(1, len(os.sched_getaffinity(0)) // 2),
        help="torch threads of each of the two replicas in the last setup (default: half the "
        "CPUs this process may use)",
    )
    parser.add_argument("--log-dir", type=Path, default=Path("bench-results"))
    args = parser.parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    workload = mixed_workload(args.requests, args.seed, args.long_share)
    limit, half = args.memory_limit_mib, args.memory_limit_mib // 2
    common = ["--max-wait-ms", "5"]
    split = ["--num-threads", str(args.split_threads)]
    with tempfile.TemporaryDirectory(prefix="batchfit-multi-") as tmp:
        classifier = save_classifier(Path(tmp) / "classifier")
        embed_flag = f"{EMBEDDER}=all-MiniLM-L6-v2"
        classify_flag = f"{CLASSIFIER}={classifier}"
        setups = [
            (
                "one replica, both models",
                [["--model", embed_flag, "--model", classify_flag,
                  "--memory-limit", f"{limit}MiB", *common]],
                {EMBEDDER: 0, CLASSIFIER: 0},
            ),
            (
                "two replicas, one model each",
                [["--model", embed_flag, "--memory-limit", f"{half}MiB", *common],
                 ["--model", classify_flag, "--memory-limit", f"{half}MiB", *common]],
                {EMBEDDER: 0, CLASSIFIER: 1},
            ),
            (
                f"two replicas, CPUs split ({args.split_threads} each)",
                [["--model", embed_flag, "--memory-limit", f"{half}MiB", *split, *common],
                 ["--model", classify_flag, "--memory-limit", f"{half}MiB", *split, *common]],
                {EMBEDDER: 0, CLASSIFIER: 1},
            ),
        ]  # fmt: skip
        inputs = sum(len(i) for _, i in workload)
        print(f"{args.requests} requests ({inputs} inputs, {args.long_share:.0%} at the maximum "
              f"length, to two models at random), {args.concurrency} clients, memory limit "
              f"{limit} MiB in all")  # fmt: skip
        print(f"{'setup':<36}{'inputs/s':>10}{'p50 s':>8}{'p99 s':>8}{'failed':>8}"
              f"{'peak RSS MiB':>14}  statuses")  # fmt: skip
        for name, flag_lists, route in setups:
            result = run_setup(name, flag_lists, route, workload, args.concurrency, args.log_dir)
            print(f"{result.name:<36}{result.inputs_per_s:>10.1f}{result.p50_s:>8.2f}"
                  f"{result.p99_s:>8.2f}{result.failed:>8}{result.peak_rss_mib:>14.0f}  "
                  f"{dict(result.statuses)}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
