"""``batchfit embed`` as a user runs it: a real process over a 2,000-row JSONL corpus.

One uninterrupted run is shared by the checks: its outputs against a real replica's
``/v1/infer`` answers, its bad rows, a run killed with SIGKILL midway and resumed (the same
bytes), and a changed model refused against its manifest.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.reference import cosine
from tests.servers import ROOT, run_server

pytestmark = pytest.mark.integration

NUM_ROWS = 2000
PART_ROWS = 250
WORDS = ["the", "a", "cat", "dog", "runs", "over", "under", "river", "city", "night", "light",
         "data", "model", "batch", "token"]  # fmt: skip
BAD_ROWS = {  # row number: (the line as written, the reason expected in rejects.jsonl)
    17: (b'{"body": "no text field"}', "missing field 'text'"),
    404: (b'{"text": ""}', "empty text in field 'text'"),
    1234: (b'{"text": "cut off', "undecodable line"),
    1999: (b'{"text": "bad \xff utf-8"}', "undecodable line"),
}


def make_corpus(path: Path) -> list[str | None]:
    """Mixed lengths: mostly short, some medium, 5% past the model's 256-token maximum."""
    rng = random.Random(24)
    texts: list[str | None] = []
    lines = []
    for row in range(NUM_ROWS):
        if row in BAD_ROWS:
            texts.append(None)
            lines.append(BAD_ROWS[row][0])
            continue
        words = rng.choice([rng.randint(1, 12)] * 15 + [rng.randint(12, 60)] * 4 + [300])
        text = f"{row} " + " ".join(rng.choice(WORDS) for _ in range(words))
        texts.append(text)
        lines.append(orjson.dumps({"text": text, "n": row}))
    path.write_bytes(b"\n".join(lines) + b"\n")
    return texts


def embed_command(corpus: Path, out: Path, *flags: str) -> list[str]:
    return [
        sys.executable, "-m", "batchfit", "embed", str(corpus), "--out", str(out),
        "--part-rows", str(PART_ROWS), "--progress", "log", "--log-every-s", "5", *flags,
    ]  # fmt: skip


def run_embed(corpus: Path, out: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        embed_command(corpus, out, *flags), cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def read_parts(out: Path) -> pa.Table:
    return pa.concat_tables([pq.read_table(p) for p in sorted(out.glob("part-*.parquet"))])


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The corpus, and one uninterrupted run over it."""
    folder = tmp_path_factory.mktemp("bulk")
    corpus = folder / "corpus.jsonl"
    texts = make_corpus(corpus)
    whole = folder / "whole"
    done = run_embed(corpus, whole)
    assert done.returncode == 0, done.stderr[-4000:]
    return corpus, texts, whole, done


def test_the_outputs_equal_the_servers_answers_in_input_order(job, tmp_path):
    _, texts, whole, done = job
    table = read_parts(whole)
    good = [row for row, text in enumerate(texts) if text is not None]
    assert table["id"].to_pylist() == good
    assert f"done: {NUM_ROWS:,} inputs" in done.stdout
    assert f"{len(good):,} outputs, {len(BAD_ROWS)} rejected (0 for memory)" in done.stdout
    embeddings = table["embedding"].to_pylist()
    with run_server(tmp_path) as server, httpx.Client(base_url=server.url, timeout=300) as client:
        answers = []
        for start in range(0, len(good), 256):
            inputs = [texts[row] for row in good[start : start + 256]]
            response = client.post("/v1/infer", json={"inputs": inputs})
            assert response.status_code == 200, response.text
            answers += response.json()["outputs"]
    worst = min(cosine(a, b) for a, b in zip(embeddings, answers, strict=True))
    assert worst >= 0.9999, worst


def test_bad_rows_land_in_the_rejects_file_with_their_reasons(job):
    corpus, _, whole, _ = job
    rejects = [orjson.loads(line) for line in (whole / "rejects.jsonl").read_bytes().splitlines()]
    assert [r["row"] for r in rejects] == sorted(BAD_ROWS)
    for reject in rejects:
        assert reject["file"] == str(corpus)
        assert reject["line"] == reject["row"] + 1
        assert reject["reason"].startswith(BAD_ROWS[reject["row"]][1]), reject


def test_a_run_killed_midway_resumes_to_the_same_bytes(job, tmp_path):
    corpus, _, whole, _ = job
    out = tmp_path / "killed"
    log_path = tmp_path / "killed.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(embed_command(corpus, out), cwd=ROOT, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 300
        while len(finished_parts(out)) < 2 and process.poll() is None:
            assert time.monotonic() < deadline, log_path.read_text()[-4000:]
            time.sleep(0.05)
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.wait(30)
    assert process.returncode == -signal.SIGKILL
    at_kill = finished_parts(out)
    num_parts = -(-NUM_ROWS // PART_ROWS)
    assert 2 <= len(at_kill) < num_parts, "killed midway, not after the end"
    killed_log = log_path.read_text()
    computed = killed_log.count(" inputs in ")  # one "part N (rows ...): K inputs in" per part
    assert computed - len(at_kill) <= 1, "at most one computed part was not yet written"

    resumed = run_embed(corpus, out)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    for part in at_kill:
        first, last = part["first_row"], part["first_row"] + part["rows"] - 1
        assert f"part {part['index']} (rows {first}-{last}) skipped: finished earlier" in (
            resumed.stderr
        )
    assert resumed.stderr.count(" inputs in ") == num_parts - len(at_kill)
    assert f"{len(at_kill)} skipped" in resumed.stdout
    names = sorted(p.name for p in whole.glob("part-*.parquet"))
    assert sorted(p.name for p in out.glob("part-*.parquet")) == names
    for name in names:
        assert (out / name).read_bytes() == (whole / name).read_bytes(), name
    assert (out / "rejects.jsonl").read_bytes() == (whole / "rejects.jsonl").read_bytes()


def test_a_changed_model_is_refused_against_the_manifest(job):
    corpus, _, whole, _ = job
    before = {p.name: p.stat().st_mtime_ns for p in whole.iterdir()}
    refused = run_embed(corpus, whole, "--dtype", "bfloat16")
    assert refused.returncode == 2
    assert "holds the results of another job (dtype: 'float32' then, 'bfloat16' now)" in (
        refused.stderr
    )
    assert "--overwrite" in refused.stderr
    assert {p.name: p.stat().st_mtime_ns for p in whole.iterdir()} == before


def finished_parts(out: Path) -> list[dict]:
    try:
        return orjson.loads((out / "manifest.json").read_bytes())["parts"]
    except (FileNotFoundError, orjson.JSONDecodeError):
        return []
