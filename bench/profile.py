"""Profile a server under ``wrk``: microseconds of CPU per request, by stage.

``python -m bench.profile --target noop --connections 32`` starts a replica serving the no-op
model (``--target bare``: the bare-stack baseline), drives it with wrk, samples every thread
with py-spy (in the bench extra; it needs ptrace rights, e.g. root) and prints the stage
table of ``bench.stages`` for the event loop's thread, plus the other threads' total and the
process's CPU time per request from ``/proc`` to check the sampled sum against.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import orjson

from .baselines import BARE_APP
from .comparisons import NOOP_MODEL
from .servers import Replica, start_baseline, start_replica
from .stages import StageTable, parse_raw, render, stage_table
from .wrk import WrkResult, run_wrk

BODY = orjson.dumps({"inputs": "The quick brown fox jumps over the lazy dog by the river."})


@dataclass(frozen=True, slots=True)
class Profile:
    target: str
    wrk: WrkResult
    loop: StageTable
    others: StageTable
    cpu_us_per_request: float


@contextmanager
def start_target(target: str, flags: list[str]) -> Iterator[Replica]:
    if target == "bare":
        with start_baseline(BARE_APP) as replica:
            yield replica
    else:
        with start_replica(["--model", NOOP_MODEL, *flags]) as replica:
            yield replica


def profile(
    target: str, *, connections: int, duration_s: float, rate_hz: int = 250,
    flags: list[str] | None = None, body: bytes = BODY, keep: Path | None = None,
) -> Profile:  # fmt: skip
    """Run wrk for ``duration_s`` + 3 s and sample the middle ``duration_s`` of it; ``keep``
    saves py-spy's raw samples there."""
    with start_target(target, flags or []) as replica, tempfile.TemporaryDirectory() as folder:
        url = replica.url + "/v1/infer"
        run_wrk(url, body, connections=connections, duration_s=2)  # warm-up
        results: list[WrkResult] = []
        load = threading.Thread(
            target=lambda: results.append(
                run_wrk(url, body, connections=connections, duration_s=duration_s + 3)
            )
        )
        load.start()
        time.sleep(1.0)
        cpu_before = replica.cpu_seconds() or 0.0
        threads_before = thread_cpu_seconds(replica.process.pid)
        raw = Path(folder) / "samples.txt"
        started = time.perf_counter()
        record(replica.process.pid, raw, rate_hz=rate_hz, duration_s=duration_s)
        sampled_s = time.perf_counter() - started
        cpu_s = (replica.cpu_seconds() or 0.0) - cpu_before
        threads_after = thread_cpu_seconds(replica.process.pid)
        load.join()
        samples = parse_raw(raw.read_text().splitlines())
        if keep is not None:
            shutil.copy(raw, keep)
    result = results[0]
    # Requests answered while sampling, at the run's mean rate.
    num_requests = max(1, round(result.requests_per_s * sampled_s))
    cpu_by_tid = {
        tid: seconds - threads_before.get(tid, 0.0) for tid, seconds in threads_after.items()
    }
    return Profile(
        target=target,
        wrk=result,
        loop=stage_table(
            samples, cpu_s_by_tid=cpu_by_tid, num_requests=num_requests, loop_only=True
        ),
        others=stage_table(
            samples, cpu_s_by_tid=cpu_by_tid, num_requests=num_requests, loop_only=False
        ),
        cpu_us_per_request=cpu_s * 1e6 / num_requests,
    )


def record(pid: int, output: Path, *, rate_hz: int, duration_s: float, idle: bool = False) -> None:
    """py-spy samples every thread of ``pid`` for ``duration_s`` into ``output`` (its raw
    format, for ``parse_raw``); with ``idle``, threads that sleep too."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    subprocess.run(
        [py_spy, "record", "--pid", str(pid), "--rate", str(rate_hz), "--duration",
         str(int(duration_s)), "--format", "raw", "--threads", *(["--idle"] if idle else []),
         "--nonblocking", "--output", str(output)],
        check=True, capture_output=True, timeout=duration_s + 60,
    )  # fmt: skip


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """User + system CPU seconds of each thread of ``pid``, by thread id."""
    ticks = os.sysconf("SC_CLK_TCK")
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found[int(task.name)] = (int(fields[11]) + int(fields[12])) / ticks
    return found


def mean_table(tables: list[StageTable]) -> StageTable:
    stages = {stage for t in tables for stage in t.us_per_request}
    return StageTable(
        {s: sum(t.us_per_request.get(s, 0.0) for t in tables) / len(tables) for s in stages},
        sum(t.num_samples for t in tables),
    )


def describe(profiles: list[Profile]) -> str:
    """The stage table (the mean of each target's runs) and one line per run."""
    runs: dict[str, list[StageTable]] = {}
    for p in profiles:
        runs.setdefault(f"{p.target} c={p.wrk.connections}", []).append(p.loop)
    columns = {name: mean_table(tables) for name, tables in runs.items()}
    lines = [
        "Event loop thread, microseconds per request:",
        "",
        render(columns),
        "",
    ]
    for p in profiles:
        others = ", ".join(f"{k} {v:.0f}" for k, v in p.others.us_per_request.items())
        lines.append(
            f"- {p.target} c={p.wrk.connections}: {p.wrk.requests_per_s:,.0f} requests/s, "
            f"mean {p.wrk.mean_s * 1e3:.2f} ms, {p.wrk.errors} errors; process CPU "
            f"{p.cpu_us_per_request:.0f} us/request; other threads {p.others.total_us:.0f} "
            f"us/request ({others or 'none'})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    parser.add_argument("--target", choices=("noop", "bare"), action="append")
    parser.add_argument("--connections", type=int, action="append")
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each, interleaved")
    parser.add_argument("--server-flag", action="append", default=[], dest="flags")
    parser.add_argument("--keep", type=Path, help="folder for py-spy's raw samples")
    args = parser.parse_args(argv)
    profiles = []
    for repeat in range(args.repeats):
        for connections in args.connections or [32]:
            for target in args.target or ["noop"]:
                print(f"profiling {target} c={connections} ({repeat + 1}/{args.repeats})",
                      file=sys.stderr, flush=True)  # fmt: skip
                keep = None
                if args.keep is not None:
                    args.keep.mkdir(parents=True, exist_ok=True)
                    keep = args.keep / f"{target}-c{connections}-{repeat}.txt"
                run = profile(target, connections=connections, duration_s=args.duration_s,
                              rate_hz=args.rate, flags=args.flags, keep=keep)  # fmt: skip
                profiles.append(run)
    print(describe(profiles))
    return 0


if __name__ == "__main__":
    sys.exit(main())
