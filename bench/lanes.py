"""Forward passes one at a time on every thread, against passes side by side on one thread each.

``python -m bench.lanes`` times the bundled model with plain transformers calls over the bulk
benchmark's corpus (``bench.bulk.make_corpus``), cut into batches sorted by length as
``SentenceTransformer.encode`` cuts them: once with one pass at a time on every CPU the
process may use, once with the batches shared between threads that run one pass each on
their share of the CPUs (what ``batchfit embed`` does on a CPU with memory to spare:
``bulk.lanes``). The two ways alternate, ``--rounds`` times, each in its own process so that
neither inherits the other's thread pool.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bulk.lanes import lane_shape

ROOT = Path(__file__).resolve().parents[1]


def measure(mode: str, rows: int, batch_size: int, seed: int) -> float:
    """Inputs per second of one way (``one``: one pass at a time; ``side``: side by side)."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from bench.bulk import make_corpus
    from models.loading import resolve_model_path
    from models.spec import BUNDLED_MODEL

    threads = len(os.sched_getaffinity(0))
    lanes, per_lane = lane_shape(threads) if mode == "side" else (1, threads)
    with tempfile.TemporaryDirectory() as tmp:
        texts = make_corpus(Path(tmp) / "corpus.jsonl", rows, seed)
    path = resolve_model_path(BUNDLED_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    encoded = tokenizer(texts, truncation=True, max_length=256)
    order = sorted(range(len(texts)), key=lambda i: -len(encoded["input_ids"][i]))
    batches = []
    for start in range(0, len(order), batch_size):
        chosen = order[start : start + batch_size]
        batches.append(tokenizer.pad(
            {key: [encoded[key][i] for i in chosen] for key in ("input_ids", "attention_mask")},
            return_tensors="pt",
        ))  # fmt: skip

    def run(share: list) -> None:
        torch.set_num_threads(per_lane)
        with torch.inference_mode():
            for batch in share:
                model(**batch)

    run(batches[:4])  # warm
    workers = [threading.Thread(target=run, args=(batches[k::lanes],)) for k in range(lanes)]
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return len(texts) / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.lanes", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--rows", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mode", choices=("one", "side"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mode is not None:  # one measurement, in this process
        print(f"{measure(args.mode, args.rows, args.batch_size, args.seed):.1f}")
        return 0
    threads = len(os.sched_getaffinity(0))
    print(f"{args.rows:,} rows in sorted batches of {args.batch_size}, {threads} CPUs")
    figures: dict[str, list[float]] = {"one": [], "side": []}
    for _ in range(args.rounds):
        for mode in figures:
            done = subprocess.run(
                [sys.executable, "-m", "bench.lanes", "--mode", mode, "--rows", str(args.rows),
                 "--batch-size", str(args.batch_size), "--seed", str(args.seed)],
                cwd=ROOT, capture_output=True, text=True, check=True,
            )  # fmt: skip
            figures[mode].append(float(done.stdout.strip().splitlines()[-1]))
    one, side = figures["one"], figures["side"]
    print(f"one pass at a time, {threads} threads: " + ", ".join(f"{r:.1f}" for r in one)
          + " inputs/s")  # fmt: skip
    lanes, per_lane = lane_shape(threads)
    print(f"{lanes} passes side by side, {per_lane} thread(s) each: "
          + ", ".join(f"{r:.1f}" for r in side) + " inputs/s")  # fmt: skip
    print(f"side by side vs one at a time: {min(side) / max(one):.2f}x to "
          f"{max(side) / min(one):.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
