import http.server
import io
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from batching.procfs import CpuQuota
from server.cli import build_parser
from server.settings import LauncherSettings, Settings
from server.supervise import launcher
from server.supervise.launcher import (
    REPLICA_ADDRESS_FIELDS,
    describe_exit,
    next_backoff,
    passthrough_argv,
    replica_environment,
    replica_ports,
)
from tests.servers import ROOT, free_port


def up_args(*argv):
    return vars(build_parser().parse_args(["up", *argv]))


def test_up_flags_and_serve_flags_passed_through():
    given = up_args("--replicas", "3", "--port", "9000", "--max-batch-size", "8",
                    "--max-wait-ms", "0.5", "--device", "cpu")  # fmt: skip
    assert LauncherSettings(**{k: v for k, v in given.items() if k in LauncherSettings.model_fields}
                            ).model_dump(include={"replicas", "port"}) == {
        "replicas": 3, "port": 9000,
    }  # fmt: skip
    replica = {k: v for k, v in given.items() if k in Settings.model_fields and k != "port"}
    assert passthrough_argv(replica) == [
        "--max-batch-size", "8", "--max-wait-ms", "0.5", "--device", "cpu",
    ]  # fmt: skip
    # What the replicas get parses back into the same settings.
    serve = vars(build_parser().parse_args(["serve", *passthrough_argv(replica)]))
    assert Settings(**{k: v for k, v in serve.items() if k in Settings.model_fields}) == Settings(
        **replica
    )


def test_every_serve_flag_but_the_address_is_an_up_flag():
    up = build_parser()._subparsers._group_actions[0].choices["up"]
    help_text = up.format_help()
    for name in [*Settings.model_fields, *LauncherSettings.model_fields]:
        if name in REPLICA_ADDRESS_FIELDS - set(LauncherSettings.model_fields):
            assert "--" + name.replace("_", "-") + " " not in help_text
        else:
            assert "--" + name.replace("_", "-") in help_text
    # One --port and one --host: Nginx's; the launcher gives each replica its own.
    dests = [action.dest for action in up._actions]
    assert dests.count("port") == dests.count("host") == 1
    assert "Port Nginx listens on" in help_text


def test_booleans_pass_through_both_ways():
    assert passthrough_argv({"flag_x": True, "other": False}) == ["--flag-x", "--no-other"]


def test_launcher_settings_are_described_and_validated():
    for name, field in LauncherSettings.model_fields.items():
        assert field.description, name
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        LauncherSettings(replicas=0)


def test_replicas_share_the_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr("server.runtime.threads.own_cpu_quota", lambda: None)
    assert replica_environment(3)["OMP_NUM_THREADS"] == "2"
    assert replica_environment(16)["OMP_NUM_THREADS"] == "1"
    # Under a CPU quota of 4.5 CPUs (5 rounded up) the launcher has 5 cores to share, not 8.
    monkeypatch.setattr("server.runtime.threads.own_cpu_quota", lambda: CpuQuota(4.5, "/pod"))
    assert replica_environment(2)["OMP_NUM_THREADS"] == "2"
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert replica_environment(3)["OMP_NUM_THREADS"] == "5"


def test_replicas_that_share_the_cores_spin_briefly_unless_the_operator_says(monkeypatch):
    """Their thread count is the launcher's, so no replica falls back to one thread on a busy
    host, and a long OpenMP spin would wait at every step for a peer off its CPU."""
    monkeypatch.setenv("GOMP_SPINCOUNT", "30000")  # as the launcher's own import set it
    monkeypatch.setattr(launcher, "OPERATOR_SPINCOUNT", None)
    assert replica_environment(2, cores=8)["GOMP_SPINCOUNT"] == "1000"
    monkeypatch.setattr(launcher, "OPERATOR_SPINCOUNT", "50000")
    assert replica_environment(2, cores=8)["GOMP_SPINCOUNT"] == "50000"


def test_missing_nginx_fails_before_starting_anything(tmp_path, caplog):
    from server.cli import main

    workdir = tmp_path / "up"
    assert main(["up", "--nginx", str(tmp_path / "no-nginx"), "--workdir", str(workdir)]) == 1
    assert "no-nginx' binary found" in caplog.text
    assert not list(workdir.glob("replica-*.log"))  # no replica was started


def test_replica_ports_are_consecutive_from_start():
    settings = LauncherSettings(**up_args_launcher("--replicas", "3", "--replica-ports", "9100"))
    assert replica_ports(settings) == [(9100, 9103), (9101, 9104), (9102, 9105)]
    free = replica_ports(LauncherSettings(replicas=2))
    assert len({port for pair in free for port in pair}) == 4  # picked, all different


def up_args_launcher(*argv):
    return {k: v for k, v in up_args(*argv).items() if k in LauncherSettings.model_fields}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--replicas", "3", "--replica-ports", "65531"), "needs ports up to 65536, past 65535"),
        (("--replicas", "2", "--port", "9102", "--replica-ports", "9100"),
         "port 9102 \\(Nginx's\\) lies inside the replica ports 9100-9103"),
    ],
)  # fmt: skip
def test_replica_ports_must_fit_and_miss_nginx(flags, message):
    with pytest.raises(ValueError, match=message):
        LauncherSettings(**up_args_launcher(*flags))


def test_replica_ports_in_use_fail_before_starting_anything(tmp_path, caplog):
    from server.cli import main

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        taken = held.getsockname()[1]
        # One replica: HTTP on START, metrics on START+1, which is taken.
        argv = ["up", "--nginx", "/bin/true", "--workdir", str(tmp_path / "up"), "--replicas", "1",
                "--port", str(free_port()), "--replica-ports", str(taken - 1)]  # fmt: skip
        assert main(argv) == 1
    assert f"port(s) {taken} on 127.0.0.1 are already in use" in caplog.text
    assert not list((tmp_path / "up").glob("replica-*.log"))  # no replica was started


@pytest.mark.parametrize(
    ("returncode", "said"),
    [
        (0, "exited with 0"),
        (1, "exited with 1"),
        (-9, "exited with -9 (killed by SIGKILL (the kernel's OOM killer sends this one))"),
        (-15, "exited with -15 (killed by SIGTERM)"),
        (-200, "exited with -200 (killed by signal 200)"),
    ],
)
def test_describe_exit_names_the_signal(returncode, said):
    assert describe_exit(returncode) == said


@pytest.mark.parametrize(
    ("previous_s", "uptime_s", "expected_s"),
    [
        (0.0, 0.5, 1.0),  # first death: the first wait
        (1.0, 2.0, 2.0),  # died again quickly: doubled
        (16.0, 2.0, 30.0),  # capped
        (30.0, 2.0, 30.0),
        (16.0, 61.0, 1.0),  # up longer than the reset time: healthy again
    ],
)
def test_restart_backoff_doubles_caps_and_resets(previous_s, uptime_s, expected_s):
    assert next_backoff(previous_s, uptime_s, first_s=1.0, max_s=30.0, reset_after_s=60.0) == (
        expected_s
    )


def test_repeated_model_flags_reach_every_replica():
    given = up_args("--model", "e=all-MiniLM-L6-v2", "--model", "rr=/m/ce", "--task", "rr=rerank")
    replica = {k: v for k, v in given.items() if k in Settings.model_fields}
    argv = passthrough_argv(replica)
    assert argv == ["--model", "e=all-MiniLM-L6-v2", "--model", "rr=/m/ce", "--task", "rr=rerank"]
    serve = vars(build_parser().parse_args(["serve", *argv]))
    assert Settings(**{k: v for k, v in serve.items() if k in Settings.model_fields}).model == (
        "e=all-MiniLM-L6-v2", "rr=/m/ce",
    )  # fmt: skip


STOP_WAITER = """
import os, signal
from server.supervise.launcher import StopRequest
while True:
    stop = StopRequest()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop.handle)
    os.write(1, b"w")  # waiting for a stop, as the launcher's loop does
    while not stop.wait(0.01):
        pass
"""


def test_two_signals_close_together_never_deadlock_the_stop_request():
    # A wrapper that forwards the signal it got to a launcher that got it too sends two
    # signals microseconds apart: one handler runs while the other is still setting the flag.
    with subprocess.Popen([sys.executable, "-c", STOP_WAITER], cwd=ROOT,
                          stdout=subprocess.PIPE) as child:  # fmt: skip
        out = child.stdout.fileno()

        def stops_waited(deadline_s: float = 10.0) -> int:
            """The waits begun since the last call; at least one (else it deadlocked)."""
            ready, _, _ = select.select([out], [], [], deadline_s)
            return len(os.read(out, 4096)) if ready else 0

        try:
            assert stops_waited(60) >= 1  # started
            for pair in range(200):
                time.sleep(0.002)  # inside its wait
                os.kill(child.pid, signal.SIGINT)
                gap_s, sent = (50 + 10 * (pair % 10)) * 1e-6, time.perf_counter()
                while time.perf_counter() - sent < gap_s:
                    pass
                os.kill(child.pid, signal.SIGTERM)
                assert stops_waited() >= 1, f"deadlocked by pair {pair} ({gap_s * 1e6:.0f} us)"
        finally:
            child.kill()


def test_a_replica_that_never_answers_its_liveness_question_never_holds_the_loop(tmp_path):
    # A hung replica accepts the connection (the kernel does) and answers nothing: asked on
    # the launcher's loop, each question held it for the whole timeout.
    settings = LauncherSettings(liveness_timeout_s=0.5, liveness_failures=2,
                                liveness_period_s=0.01)  # fmt: skip
    runner = launcher.Launcher(settings, Settings(), [])
    with socket.create_server(("127.0.0.1", 0)) as hung, \
            subprocess.Popen(["sleep", "60"]) as process:  # fmt: skip
        child = launcher.Child("replica-0", process, tmp_path / "log",
                               url=f"http://127.0.0.1:{hung.getsockname()[1]}")  # fmt: skip
        try:
            for asked in (1, 2):
                runner._check_liveness(child, time.monotonic())
                assert child.unanswered == asked - 1  # returned at once: the question is out
                assert child.liveness is not None and not child.liveness.done()
                child.liveness.result(timeout=30)  # the timeout passes meanwhile
                runner._check_liveness(child, time.monotonic())
                assert child.unanswered == asked and child.liveness is None
                time.sleep(0.02)  # the period
            assert process.wait(30) == -signal.SIGKILL
        finally:
            process.kill()
            runner._questions.shutdown()


def test_a_restarted_replica_is_asked_whether_it_is_ready_without_holding_the_loop(tmp_path):
    class Ready(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    runner = launcher.Launcher(LauncherSettings(), Settings(), [], out=io.StringIO())
    with socket.create_server(("127.0.0.1", 0)) as hung, \
            http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ready) as ready, \
            subprocess.Popen(["sleep", "60"]) as process:  # fmt: skip
        threading.Thread(target=ready.serve_forever, daemon=True).start()
        child = launcher.Child("replica-0", process, tmp_path / "log",
                               url=f"http://127.0.0.1:{hung.getsockname()[1]}")  # fmt: skip
        try:
            runner._check_ready(child)  # returns at once: the question is out
            assert child.readiness is not None and not child.readiness.done()
            assert child.readiness.result(timeout=30) is False  # its 2 s passed meanwhile
            runner._check_ready(child)
            assert not child.ready and child.readiness is None
            child.url = f"http://127.0.0.1:{ready.server_address[1]}"
            runner._check_ready(child)
            child.readiness.result(timeout=30)
            runner._check_ready(child)
            assert child.ready
        finally:
            process.kill()
            ready.shutdown()
            runner._questions.shutdown()
