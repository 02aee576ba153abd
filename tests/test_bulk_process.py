"""What a bulk job's process does around the job: the HTTP stack left unimported, no garbage
collection while the libraries import, and the loaded heap frozen only in a process of its
own (``python -m server embed``), never in a caller that goes on (a test)."""

import gc
import subprocess
import sys

import orjson

from server.cli import main
from tests.servers import ROOT

SERVER_ONLY = ("fastapi", "uvicorn", "aiohttp", "server.app", "bench.cli")


def run_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, cwd=ROOT, timeout=120)  # fmt: skip
    return done.stdout.strip()


def test_a_bulk_command_imports_none_of_the_http_stack():
    code = (
        "import sys\nfrom server.cli import main\ntry:\n    main(['embed', '--help'])\n"
        f"except SystemExit:\n    pass\nprint([m for m in {SERVER_ONLY!r} if m in sys.modules])"
    )
    assert run_python(code).splitlines()[-1] == "[]"


def test_the_entry_point_collects_again_after_the_imports_with_the_imported_heap_frozen():
    code = (
        "import gc, sys\nfrom server.__main__ import main\nsys.argv = ['batchfit', '--help']\n"
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
        [sys.executable, "-m", "server", *args, "--out", str(tmp_path / "own")],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert job.returncode == 0, job.stderr[-2000:]
    assert "objects of the loaded model frozen out of garbage collection" in job.stderr
