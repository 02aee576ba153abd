"""``bulk.ray.embed`` on a local Ray instance (``ray.init(num_cpus=2)``) with two actors over a
Parquet dataset: the same embeddings as ``batchfit embed`` over the same file, and the
manifest in its output folder resuming the job and refusing another; an actor whose pass
hangs, ended and started again by Ray, and a batch that hangs every pass ending the job."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bulk import ManifestMismatch
from tests.bulk_fakes import HANG_ALWAYS, HANG_ONCE, expected_embedding
from tests.ci import unavailable
from tests.servers import ROOT

pytestmark = [
    pytest.mark.integration,
    # Ray Data warns about its own deprecated settings when it reads its context.
    pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.*"),
]

try:
    import ray
except ImportError:
    unavailable("ray is not installed (the ray extra; the test extra brings it)")

WORDS = ["ray", "actor", "device", "batch", "memory", "parquet", "token", "model"]


@pytest.fixture(scope="module")
def cluster():
    # A session folder of its own, removed after (a short path: Ray's sockets live in it).
    scratch = tempfile.mkdtemp(prefix="ray-test-")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=scratch)
    yield
    ray.shutdown()
    shutil.rmtree(scratch, ignore_errors=True)


def make_dataset(path) -> dict[int, str]:
    rng = random.Random(5)
    ids = rng.sample(range(10_000, 99_999), 240)  # not the row numbers
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.choice([4, 9, 30, 120, 300])))
             for _ in ids]  # fmt: skip
    path.mkdir()
    for start in range(0, len(ids), 40):
        chunk = {"id": ids[start : start + 40], "text": texts[start : start + 40]}
        pq.write_table(pa.table(chunk), path / f"{start // 40}.parquet")
    return dict(zip(ids, texts, strict=True))


def dataset(path):
    """The files as Ray reads them (small files come as one block), split into six blocks so
    that two actors share the work."""
    return ray.data.read_parquet(str(path)).repartition(6)


def by_id(table: pa.Table) -> dict[int, np.ndarray]:
    return {
        i: np.asarray(e, dtype=np.float32)
        for i, e in zip(table["id"].to_pylist(), table["embedding"].to_pylist(), strict=True)
    }


def test_two_actors_give_the_single_process_embeddings_and_resume(cluster, tmp_path):
    import bulk.ray

    path = tmp_path / "data"
    rows = make_dataset(path)
    single = tmp_path / "single"
    done = subprocess.run(
        [sys.executable, "-m", "batchfit", "embed", str(path / "*.parquet"), "--out", str(single),
         "--id-field", "id", "--part-rows", "80", "--progress", "log"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    expected = by_id(pa.concat_tables([pq.read_table(p) for p in sorted(single.glob("part-*"))]))

    out = tmp_path / "ray"
    # Smaller batches than the default 128 keep each actor's warm-up short on half a CPU.
    options = {"num_actors": 2, "num_cpus_per_actor": 0.5, "batch_rows": 40, "out": str(out),
               "max_batch_size": 32}  # fmt: skip
    result = bulk.ray.embed(dataset(path), model="all-MiniLM-L6-v2", **options)
    got = by_id(pa.concat_tables(ray.get(result.to_arrow_refs())))
    assert got.keys() == expected.keys() == rows.keys()
    worst = max(float(np.abs(got[i] - expected[i]).max()) for i in rows)
    assert worst < 1e-5, worst  # the last bits differ with the batches' shapes and threads
    records = list(out.glob("ray-part-*.json"))
    assert len(records) == 6
    listed = orjson.loads((out / "manifest.json").read_bytes())
    assert listed["complete"] and listed["rows"] == 240 and len(listed["ray_parts"]) == 6
    assert len({r["worker"] for r in listed["ray_parts"]}) == 2, "both actors embedded"

    stamps = {p.name: p.stat().st_mtime_ns for p in out.glob("ray-part-*")}
    again = bulk.ray.embed(dataset(path), model="all-MiniLM-L6-v2", **options)
    assert by_id(pa.concat_tables(ray.get(again.to_arrow_refs()))).keys() == rows.keys()
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("ray-part-*")} == stamps, (
        "every batch was found finished, none written again"
    )
    with pytest.raises(ManifestMismatch, match="holds the results of another job"):
        bulk.ray.embed(dataset(path), dtype="bfloat16", **options)


@pytest.mark.timeout(300)
def test_an_actor_whose_pass_hangs_ends_and_ray_retries_its_batch_on_a_new_one(cluster, tmp_path):
    import bulk.ray

    marker = tmp_path / "hung"
    texts = [f"row {i} " + "w " * (i % 7) for i in range(60)]
    texts[45] = HANG_ONCE + str(marker)
    data = ray.data.from_arrow(pa.table({"id": list(range(60)), "text": texts}))
    result = bulk.ray.embed(
        data.repartition(3), model="python:tests.bulk_fakes:hanging_embedder", num_actors=1,
        num_cpus_per_actor=0.5, batch_rows=20, out=str(tmp_path / "out"), forward_timeout_s=1,
    )  # fmt: skip
    # The pass holding row 45 hung in the first actor (it left the marker), which never
    # returns from it: the batch was computed again in an actor started after it.
    assert marker.exists()
    got = by_id(pa.concat_tables(ray.get(result.to_arrow_refs())))
    assert got.keys() == set(range(60))
    for i, text in enumerate(texts):
        np.testing.assert_array_equal(got[i], expected_embedding(text))
    listed = orjson.loads((tmp_path / "out" / "manifest.json").read_bytes())
    assert listed["complete"] and listed["rows"] == 60


@pytest.mark.timeout(300)
def test_a_batch_that_hangs_every_pass_ends_the_job_after_two_actors(cluster, tmp_path):
    import bulk.ray

    texts = [f"row {i}" for i in range(40)]
    texts[25] = HANG_ALWAYS + "row 25"
    data = ray.data.from_arrow(pa.table({"id": list(range(40)), "text": texts}))
    out = tmp_path / "out"
    with pytest.raises(Exception) as raised:
        bulk.ray.embed(
            data.repartition(2), model="python:tests.bulk_fakes:hanging_embedder",
            num_actors=1, num_cpus_per_actor=0.5, batch_rows=20, out=str(out),
            forward_timeout_s=1,
        )  # fmt: skip
    message = str(raised.value)
    assert (
        "a batch of 20 rows (ids 20, 21, 22, 23, 24, ...) ended the process of each of the 2 "
        "actors that ran it"
    ) in message, message
    assert "the job stops rather than try it again" in message
    listed = orjson.loads((out / "manifest.json").read_bytes())
    assert not listed["complete"]
    assert not (out / bulk.ray.ATTEMPTS_FOLDER).exists()  # the attempts go with the call
