"""Measure --dtype and --quantize against float32 on this machine: throughput, memory and
embedding agreement (cosine). Each configuration runs in a fresh process so its memory
readings are its own.

    python -m scripts.precision_table [--device cpu] [--repeats 3] [--batch-size 32]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CONFIGS = {
    "float32": ("float32", "none"),
    "bfloat16": ("bfloat16", "none"),
    "float16": ("float16", "none"),
    "int8 (dynamic)": ("float32", "int8"),
}
WORDS = [
    "batching",
    "requests",
    "on",
    "accelerators",
    "makes",
    "inference",
    "cheaper",
    "while",
    "memory",
    "limits",
    "how",
    "many",
    "items",
    "fit",
    "in",
    "one",
    "forward",
    "pass",
    "and",
    "the",
    "server",
    "splits",
    "a",
    "batch",
    "in",
    "two",
    "when",
    "it",
    "runs",
    "out",
]


def corpus(num_texts: int) -> list[str]:
    """Deterministic texts of 4 to 120 words."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(4, 120, size=num_texts)
    return [" ".join(rng.choice(WORDS, size=int(n))) for n in lengths]


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def measure_one(args: argparse.Namespace) -> None:
    import torch

    from models import ModelSpec, load_model

    dtype, quantize = CONFIGS[args.one]
    texts = corpus(args.num_texts)
    before = rss_bytes()
    model = load_model(ModelSpec(device=args.device, dtype=dtype, quantize=quantize))
    loaded = rss_bytes()
    items = model.prepare(texts, truncate=True)
    batches = [items[i : i + args.batch_size] for i in range(0, len(items), args.batch_size)]
    outputs = [out for batch in batches for out in model.forward(batch)]  # warm-up
    if torch.cuda.is_available() and model.info.device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        outputs = [out for batch in batches for out in model.forward(batch)]
        times.append(time.perf_counter() - started)
    peak_gpu = torch.cuda.max_memory_allocated() if model.info.device.startswith("cuda") else None
    np.save(args.out, np.stack(outputs).astype(np.float32))
    result = {
        "config": args.one,
        "weights_bytes": model.info.shape.parameter_bytes,
        "rss_load_bytes": loaded - before,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_gpu_bytes": peak_gpu,
        "items_per_s": len(items) / min(times),
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-texts", type=int, default=256)
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS))
    parser.add_argument("--one", choices=list(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        measure_one(args)
        return
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for config in args.configs:
            out = Path(folder) / f"{len(rows)}.npy"
            command = [
                sys.executable, "-m", "scripts.precision_table", "--one", config,
                "--out", str(out), "--device", args.device, "--repeats", str(args.repeats),
                "--batch-size", str(args.batch_size), "--num-texts", str(args.num_texts),
            ]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                print(f"{config}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
                continue
            result = json.loads(done.stdout.strip().splitlines()[-1])
            result["embeddings"] = np.load(out)
            rows.append(result)
    reference = next((r["embeddings"] for r in rows if r["config"] == "float32"), None)
    mib = 2**20
    print(
        f"device {args.device}, {args.num_texts} texts of 4-120 words, batches of "
        f"{args.batch_size}, best of {args.repeats}, torch threads {rows[0]['threads']}\n"
    )
    print("| config | weights MiB | RSS growth at load MiB | peak RSS MiB | items/s "
          "| cosine vs float32 min / mean | max abs diff |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        agreement, diff = "n/a", "n/a"
        if reference is not None:
            out = row["embeddings"]
            cosine = (out * reference).sum(1) / (
                np.linalg.norm(out, axis=1) * np.linalg.norm(reference, axis=1)
            )
            agreement = f"{cosine.min():.4f} / {cosine.mean():.4f}"
            diff = f"{np.abs(out - reference).max():.4f}"
        peak = row["peak_rss_bytes"] / mib
        if row["peak_gpu_bytes"] is not None:
            peak = f"{peak:.0f} (GPU peak {row['peak_gpu_bytes'] / mib:.0f})"
        else:
            peak = f"{peak:.0f}"
        print(
            f"| {row['config']} | {row['weights_bytes'] / mib:.1f} | "
            f"{row['rss_load_bytes'] / mib:.0f} | {peak} | {row['items_per_s']:.1f} | "
            f"{agreement} | {diff} |"
        )


if __name__ == "__main__":
    main()
