"""What a bulk job's process does around the job: the HTTP stack left unimported, no garbage
collection while the libraries import, and the loaded heap frozen only in a process of its
own (``python -m batchfit embed``), never in a caller that goes on (a test)."""

import gc
import os
import subprocess
import sys

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from batchfit.cli import main
from tests.bulk_fakes import HANG_HOLDING_GIL, HANG_ONCE, SLOW_WRITE_ENV, expected_embedding
from tests.servers import ROOT

SERVER_ONLY = ("fastapi", "uvicorn", "aiohttp", "server.app", "bench.cli")


def run_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, cwd=ROOT, timeout=120)  # fmt: skip
    return done.stdout.strip()


def test_a_bulk_command_imports_none_of_the_http_stack():
    code = (
        "import sys\nfrom batchfit.cli import main\ntry:\n    main(['embed', '--help'])\n"
        f"except SystemExit:\n    pass\nprint([m for m in {SERVER_ONLY!r} if m in sys.modules])"
    )
    assert run_python(code).splitlines()[-1] == "[]"


def test_the_entry_point_collects_again_after_the_imports_with_the_imported_heap_frozen():
    code = (
        "import gc, sys\nfrom batchfit.__main__ import main\nsys.argv = ['batchfit', '--help']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print(gc.isenabled(), gc.get_freeze_count() > 100_000)"
    )
    assert run_python(code).splitlines()[-1] == "True True"


def test_only_a_job_in_its_own_process_freezes_the_heap(tmp_path, capsys):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"text": f"w {i}"}) + b"\n" for i in range(20)))
    args = ["embed", str(path), "--model", "python:tests.bulk_fakes:fake_embedder",
            "--progress", "log", "--log-level", "debug"]  # fmt: skip
    frozen = gc.get_freeze_count()
    assert main([*args, "--out", str(tmp_path / "here")]) == 0
    assert gc.get_freeze_count() == frozen
    job = subprocess.run(
        [sys.executable, "-m", "batchfit", *args, "--out", str(tmp_path / "own")],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert job.returncode == 0, job.stderr[-2000:]
    assert "objects of the loaded model frozen out of garbage collection" in job.stderr


def test_a_hung_pass_ends_the_job_with_every_stack_and_a_rerun_resumes_after_the_written_parts(
    tmp_path,
):
    texts = [f"w {i}" for i in range(40)]
    texts[25] = HANG_ONCE + str(tmp_path / "hung")  # in the third part of 10 rows
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"text": t}) + b"\n" for t in texts))
    out = tmp_path / "out"
    command = [
        sys.executable, "-m", "batchfit", "embed", str(path), "--out", str(out), "--model",
        "python:tests.bulk_fakes:hanging_embedder", "--part-rows", "10", "--progress", "log",
        "--forward-timeout-s", "1",
    ]  # fmt: skip
    # Each part takes the writer 2.5 s: when the pass is found hung (1-2 s after it started),
    # the first two parts are still being written, and they are before the process ends.
    hung = subprocess.run(
        command, capture_output=True, text=True, cwd=ROOT, timeout=120,
        env={**os.environ, SLOW_WRITE_ENV: "2.5"},
    )  # fmt: skip
    assert hung.returncode == 3, hung.stderr[-3000:]
    assert "past --forward-timeout-s 1: the device or the model hangs" in hung.stderr
    # faulthandler's dump: the hung pass's own frame, in the thread that runs it
    assert "most recent call first" in hung.stderr
    assert "bulk_fakes.py" in hung.stderr and "in forward" in hung.stderr
    assert (
        "batchfit embed: a forward pass hung; the parts computed before it are written: run "
        "the same command again to resume"
    ) in hung.stderr
    written = orjson.loads((out / "manifest.json").read_bytes())["parts"]
    assert [part["first_row"] for part in written] == [0, 10]

    resumed = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "parts: 2 written, 2 skipped" in resumed.stdout
    table = pa.concat_tables([pq.read_table(p) for p in sorted(out.glob("part-*.parquet"))])
    assert table.column("id").to_pylist() == list(range(40))
    embeddings = np.array(table.column("embedding").to_pylist(), dtype=np.float32)
    np.testing.assert_array_equal(embeddings, [expected_embedding(t) for t in texts])


def test_a_pass_that_holds_the_gil_ends_the_job_from_faulthandlers_thread(tmp_path):
    texts = [f"w {i}" for i in range(20)]
    texts[15] = HANG_HOLDING_GIL + "w 15"  # no Python thread runs again, the watch's included
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"text": t}) + b"\n" for t in texts))
    frozen = subprocess.run(
        [sys.executable, "-m", "batchfit", "embed", str(path), "--out", str(tmp_path / "out"),
         "--model", "python:tests.bulk_fakes:hanging_embedder", "--part-rows", "10",
         "--forward-timeout-s", "1"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert frozen.returncode == 1, frozen.stderr[-3000:]
    # faulthandler's timer (at least 5 s; twice the 1-s bound and a look is less), not the watch
    assert "Timeout (0:00:05)!" in frozen.stderr, frozen.stderr[-3000:]
    assert "bulk_fakes.py" in frozen.stderr and "in forward" in frozen.stderr
    assert "past --forward-timeout-s" not in frozen.stderr
