"""``start_replicas`` cleans up the log folder it made, except after a failure."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench import servers


@pytest.fixture
def fake_replicas(monkeypatch, tmp_path):
    """Replicas that are a sleeping process each (no model), logging where they are told."""
    monkeypatch.setattr(servers.tempfile, "tempdir", str(tmp_path))
    made: list[Path] = []

    def launch(flags, *, log_dir):
        made.append(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / "server.log"
        log_path.write_text("log\n")
        process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        return servers.Replica("http://127.0.0.1:9", process, log_path)

    monkeypatch.setattr(servers, "launch_replica", launch)
    return made


def test_own_log_folder_is_removed_after_a_clean_run(fake_replicas, monkeypatch):
    monkeypatch.setattr(servers, "wait_ready", lambda replica, timeout_s: None)
    with servers.start_replicas([[], []]) as replicas:
        assert len(replicas) == 2
        (log_dir,) = set(fake_replicas)
        assert log_dir.name.startswith("batchfit-bench-") and log_dir.is_dir()
    assert not log_dir.exists()
    assert all(replica.process.poll() is not None for replica in replicas)


def test_own_log_folder_is_kept_after_a_failure(fake_replicas, monkeypatch):
    def not_ready(replica, timeout_s):
        raise RuntimeError(f"not ready; log {replica.log_path}")

    monkeypatch.setattr(servers, "wait_ready", not_ready)
    with pytest.raises(RuntimeError), servers.start_replicas([[]]):
        pass
    (log_dir,) = set(fake_replicas)
    assert (log_dir / "server.log").read_text() == "log\n"


def test_a_given_log_folder_is_never_removed(fake_replicas, monkeypatch, tmp_path):
    monkeypatch.setattr(servers, "wait_ready", lambda replica, timeout_s: None)
    with servers.start_replicas([[]], log_dir=tmp_path / "mine"):
        pass
    assert (tmp_path / "mine" / "server.log").exists()
