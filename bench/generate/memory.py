"""``batchfit bench --generate --memory-limit``: 64 streams under a real kernel memory limit
(a child memory cgroup), where the kernel kills instead of failing an allocation.

Each server starts in its own fresh cgroup under a loose limit; once it is ready, the limit
is set to its loaded usage (less page cache nothing maps) plus the room (300 MiB), and the
streams run. Then the same with a sibling process in the cgroup that takes 200 MiB halfway
through (half of batchfit's unlimited run). Peers:

- ``batchfit``: ``batchfit serve`` at its defaults (its cache follows the live reading), and
  once more without a limit: the reference for its own speed;
- ``transformers``: its continuous batching in-process at its defaults (the cache sized from
  the host's RAM), in a cgroup at batchfit's limit (the same weights, loaded the same way);
- ``vllm``: vLLM's CPU build at its defaults (``VLLM_CPU_KVCACHE_SPACE`` unset);
- ``vllm-fitted``: vLLM with a cache chosen to fit (``--kv-cache-memory-bytes`` 200 MiB,
  allocated before it is ready: its loaded usage holds it, so it has the room besides), its
  context cut to the workload's longest request (a cache must hold one sequence of it).

Each run reports finished, failed and killed (the cgroup's ``oom_kill`` events), its peak
(the cgroup's, page cache included) and output tokens/s. batchfit's requests get a deadline
of 900 s (its default of 60 s would cut streams that wait for room; the others have none).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.cgroups import ChildCgroup, make_child_cgroup

from . import vllm_env
from .client import closed_loop_streams, completion_body, served_model
from .limit import measure_limit
from .peers import Launch, PeerError, batchfit_launch, start_server, vllm_launch
from .watch import watch
from .workload import GenerateSpec, GenRequest, make_generate_requests

log = logging.getLogger("batchfit.bench")
MiB = 2**20
GiB = 2**30
MEMORY_PEERS = ("batchfit", "transformers", "vllm", "vllm-fitted")
NO_LIMIT, LIMIT, SIBLING = "no limit", "limit", "limit + sibling"
DEADLINE_FLAGS = ("--default-timeout-s", "900", "--max-timeout-s", "900")
SIBLING_CODE = (
    # As a process that grows does: 8 MiB every 40 ms; says "held", then holds it until it
    # is killed.
    "import sys, time\n"
    "blocks = []\n"
    "for _ in range(int(sys.argv[1]) // (8 << 20)):\n"
    "    blocks.append(bytearray(b'x' * (8 << 20)))\n"
    "    time.sleep(0.04)\n"
    "print('held', flush=True)\n"
    "time.sleep(3600)\n"
)


@dataclass(frozen=True, slots=True)
class MemoryOptions:
    peers: tuple[str, ...] = MEMORY_PEERS
    streams: int = 64
    room_mib: int = 300
    sibling_mib: int = 200
    loose_gib: float = 8.0
    """The cgroup's limit while a server loads (vLLM at its defaults asks for most of the
    host's RAM: this keeps the host whole)."""
    vllm_fitted_kv_mib: int = 200
    max_run_s: float = 900.0
    model: str | None = None
    vllm_venv: Path = field(default_factory=vllm_env.default_venv)
    batchfit_flags: tuple[str, ...] = ()
    spec: GenerateSpec = field(default_factory=GenerateSpec)
    seed: int = 0
    quick: bool = False
    log_dir: Path = Path("/tmp/batchfit-bench-gen-memory")

    def __post_init__(self) -> None:
        unknown = [p for p in self.peers if p not in MEMORY_PEERS]
        if unknown or not self.peers:
            raise ValueError(f"unknown peers {unknown}; expected some of {list(MEMORY_PEERS)}")
        if self.streams < 1 or self.room_mib < 1 or self.sibling_mib < 0:
            raise ValueError("streams and room must be positive, the sibling not negative")


@dataclass
class MemoryRun:
    peer: str
    case: str
    requests: int
    limit_bytes: int | None = None
    finished: int = 0
    failed: int = 0
    killed: int = 0
    peak_bytes: int = 0
    output_tokens_per_s: float = math.nan
    wall_s: float = 0.0
    error: str | None = None
    errors: dict[str, int] = field(default_factory=dict)
    """The failed streams' errors (status and the start of their message), counted."""
    mean_running: float = math.nan
    """Sequences running at once, averaged over the run (the server's own gauge)."""
    preempted: float = math.nan
    resumed: float = math.nan


@dataclass
class MemoryResult:
    options: MemoryOptions
    runs: list[MemoryRun] = field(default_factory=list)
    started_at: str = ""
    wall_s: float = 0.0

    def run(self, peer: str, case: str) -> MemoryRun | None:
        return next((r for r in self.runs if r.peer == peer and r.case == case), None)


def run_memory(
    options: MemoryOptions, *, progress: Callable[[str], None] = log.info
) -> MemoryResult:
    from transformers import AutoTokenizer

    from .runner import resolve_model

    started = time.perf_counter()
    model, folder = resolve_model(options.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    requests = make_generate_requests(
        GenerateSpec(**{**asdict(options.spec), "seed": options.seed}), options.streams,
        lambda text: tokenizer(text)["input_ids"],
        lambda ids: tokenizer.decode(ids, skip_special_tokens=True), salt="memory",
    )  # fmt: skip
    result = MemoryResult(options, started_at=time.strftime("%Y-%m-%d %H:%M:%S UTC"))
    runs = _Runs(options, requests, result, progress)
    # Streams may wait minutes for room to start: no deadline cuts them (nor vLLM's).
    batchfit = batchfit_launch(model, (*DEADLINE_FLAGS, *options.batchfit_flags))
    if "batchfit" in options.peers or "transformers" in options.peers:
        runs.server("batchfit", batchfit, NO_LIMIT)
    for peer in options.peers:
        if peer == "transformers":
            for case in (LIMIT, SIBLING):
                runs.in_process(folder, case)
            continue
        if peer == "batchfit":
            launch = batchfit
        else:
            try:
                venv = vllm_env.ensure(options.vllm_venv, log=progress)
            except Exception as exc:  # no environment: one line in the report
                for case in (LIMIT, SIBLING):
                    result.runs.append(MemoryRun(peer, case, len(requests),
                                                 error=f"its environment: {exc}"))  # fmt: skip
                continue
            fitted = int(options.vllm_fitted_kv_mib * MiB) if peer == "vllm-fitted" else None
            # A fitted cache must hold one sequence of the model's context (32,768 tokens
            # for Gemma 3): the context is cut to what the workload needs.
            longest = max(r.num_prompt_tokens + r.max_tokens for r in requests)
            launch = vllm_launch(venv, folder, kv_cache_gib=None, kv_cache_bytes=fitted,
                                 max_model_len=longest if fitted else None)  # fmt: skip
        for case in (LIMIT, SIBLING):
            if not runs.server(peer, launch, case):
                break  # it could not start: the sibling changes nothing
    result.wall_s = time.perf_counter() - started
    return result


class _Runs:
    def __init__(
        self,
        options: MemoryOptions,
        requests: Sequence[GenRequest],
        result: MemoryResult,
        progress: Callable[[str], None],
    ) -> None:
        self.options, self.requests, self.result = options, requests, result
        self.progress = progress
        self.sibling_after_s = 30.0
        self.batchfit_limit: int | None = None

    def _add(self, run: MemoryRun) -> None:
        self.result.runs.append(run)
        self.progress(
            f"{run.peer}, {run.case}: finished {run.finished}, failed {run.failed}, killed "
            f"{run.killed}, peak {run.peak_bytes / MiB:.0f} MiB of "
            f"{'none' if run.limit_bytes is None else f'{run.limit_bytes / MiB:.0f} MiB'}, "
            f"{run.output_tokens_per_s:.1f} output tokens/s"
            + (f"; {run.error.splitlines()[0]}" if run.error else "")
        )

    def server(self, peer: str, launch: Launch, case: str) -> bool:
        """One run of a server; False where it could not start."""
        options = self.options
        run = MemoryRun(peer, case, len(self.requests))
        with _cgroup(f"gen-mem-{peer}") as cgroup:
            cgroup.set_limit(int(options.loose_gib * GiB))
            kills = cgroup.oom_kills()
            try:
                with start_server(launch, options.log_dir, preexec=cgroup.join) as server:
                    limit = cgroup.resident() + options.room_mib * MiB
                    if peer == "batchfit" and self.batchfit_limit is None:
                        self.batchfit_limit = limit
                    if case != NO_LIMIT:
                        run.limit_bytes = limit
                        cgroup.set_limit(limit)
                    cgroup.reset_peak()
                    model = asyncio.run(served_model(server.url))
                    bodies = [completion_body(r, model) for r in self.requests]
                    with self._sibling(cgroup, case), watch(server.url, peer) as watched:
                        stream_run = asyncio.run(closed_loop_streams(
                            server.url, bodies, concurrency=len(bodies),
                            max_duration_s=options.max_run_s, drain_s=60,
                            timeout_s=options.max_run_s))  # fmt: skip
                    run.mean_running = watched.mean_running
                    run.preempted, run.resumed = watched.preempted, watched.resumed
                    ok = [o for o in stream_run.outcomes if o.ok]
                    for o in stream_run.outcomes:
                        if not o.ok:
                            why = f"{o.status} {'cut' if o.cut else (o.error or '')[:80]}"
                            run.errors[why] = run.errors.get(why, 0) + 1
                    run.finished, run.failed = len(ok), len(self.requests) - len(ok)
                    run.wall_s = stream_run.wall_s
                    tokens = sum(o.completion_tokens for o in ok)
                    run.output_tokens_per_s = tokens / stream_run.wall_s
                    run.peak_bytes = cgroup.peak()
                    if server.process.poll() is not None:
                        run.error = f"exited with {server.process.returncode}"
            except PeerError as exc:
                why = _first_error(options.log_dir, launch.name) or str(exc)
                run.failed, run.error = len(self.requests), f"did not start: {why}"
            run.killed = cgroup.oom_kills() - kills
        if peer == "batchfit" and case == NO_LIMIT and run.wall_s:
            self.sibling_after_s = run.wall_s / 2
        self._add(run)
        return run.error is None or not run.error.startswith("did not start")

    def in_process(self, folder: str, case: str) -> None:
        """transformers' continuous batching at its defaults, at batchfit's limit."""
        options = self.options
        limit = self.batchfit_limit
        run = MemoryRun("transformers", case, len(self.requests), limit_bytes=limit)
        if limit is None:
            run.failed, run.error = len(self.requests), "no batchfit limit to run under"
            self._add(run)
            return
        with _cgroup("gen-mem-transformers") as cgroup:
            cgroup.set_limit(limit)
            kills = cgroup.oom_kills()
            cgroup.reset_peak()
            with self._sibling(cgroup, case, after_s=self.sibling_after_s):
                figure = measure_limit(
                    folder, {case: self.requests}, [], timeout_s=options.max_run_s,
                    log_path=options.log_dir / "transformers.log", defaults=True,
                    preexec=cgroup.join,
                )[case]  # fmt: skip
            run.peak_bytes = cgroup.peak()
            run.killed = cgroup.oom_kills() - kills
        if "error" in figure:
            run.failed, run.error = len(self.requests), str(figure["error"])
        else:
            run.failed = int(figure["errors"])
            run.finished = len(self.requests) - run.failed
            run.output_tokens_per_s = float(figure["output_tokens_per_s"])
            run.wall_s = float(figure["wall_s"])
        self._add(run)

    @contextlib.contextmanager
    def _sibling(self, cgroup: ChildCgroup, case: str, after_s: float | None = None):
        """In ``SIBLING``: a process in the cgroup that takes the sibling's bytes, started
        ``after_s`` (half of batchfit's unlimited run) from now; killed at exit."""
        if case != SIBLING:
            yield
            return
        processes: list[subprocess.Popen[bytes]] = []

        def start() -> None:
            self.progress(f"a sibling takes {self.options.sibling_mib} MiB of the cgroup")
            processes.append(subprocess.Popen(
                [sys.executable, "-c", SIBLING_CODE, str(self.options.sibling_mib * MiB)],
                preexec_fn=cgroup.join, stdout=subprocess.DEVNULL))  # fmt: skip

        timer = threading.Timer(self.sibling_after_s if after_s is None else after_s, start)
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
            for process in processes:
                process.kill()
                process.wait()


ERROR_LINE = re.compile(r"\b(\w+Error): (.+)")
NOT_A_CAUSE = ("Engine core initialization failed", "Too many open files", "validation error")


def _first_error(log_dir: Path, name: str) -> str | None:
    """The error a server that did not start names as its cause, from its newest log."""
    logs = sorted(log_dir.glob(f"{name.replace(' ', '-')}-*.log"), key=lambda p: p.stat().st_mtime)
    if not logs:
        return None
    lines = logs[-1].read_text(errors="replace").splitlines()
    for number, line in enumerate(lines):
        found = ERROR_LINE.search(line)
        if found and not any(text in line for text in NOT_A_CAUSE):
            return f"{found.group(1)}: {found.group(2)}"[:400]
        if found and "validation error" in line and number + 1 < len(lines):
            return f"{found.group(1)}: {lines[number + 1].strip()}"[:400]
    return None


@contextlib.contextmanager
def _cgroup(name: str) -> Iterator[ChildCgroup]:
    cgroup = make_child_cgroup(name)
    try:
        yield cgroup
    finally:
        cgroup.remove()


def render(result: MemoryResult, command: str) -> str:
    options = result.options
    lines = [
        "# Generation under a memory limit",
        "",
        f"`{command}`, {result.started_at}, {result.wall_s / 60:.1f} min. {options.streams} "
        f"streams at once, each its own prompt and `max_tokens` (`ignore_eos`), in a memory "
        f"cgroup whose limit is the server's loaded usage (less page cache nothing maps) "
        f"plus {options.room_mib} MiB; "
        f"'{SIBLING}': a process in the same cgroup takes {options.sibling_mib} MiB halfway "
        "through. Killed: the cgroup's `oom_kill` events. Peak: the cgroup's, page cache "
        "included. Running, preempted and resumed: the server's own metrics, where it has "
        "them (running: sampled once a second).",
        "",
        "| peer | case | limit (MiB) | finished | failed | killed | peak (MiB) | output tok/s "
        "| running (mean) | preempted | resumed |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in result.runs:
        limit = "none" if run.limit_bytes is None else f"{run.limit_bytes / MiB:.0f}"
        speed, running, preempted, resumed = (
            "n/a" if math.isnan(value) else f"{value:.{digits}f}"
            for value, digits in ((run.output_tokens_per_s, 1), (run.mean_running, 1),
                                  (run.preempted, 0), (run.resumed, 0))
        )  # fmt: skip
        lines.append(f"| {run.peer} | {run.case} | {limit} | {run.finished} | {run.failed} | "
                     f"{run.killed} | {run.peak_bytes / MiB:.0f} | {speed} | {running} | "
                     f"{preempted} | {resumed} |")  # fmt: skip
    errors = [r for r in result.runs if r.error]
    if errors:
        lines += ["", "Errors:", ""]
        lines += [f"- {r.peer}, {r.case}: {r.error.splitlines()[0][:300]}" for r in errors]
    failed = [r for r in result.runs if r.errors]
    if failed:
        lines += ["", "Failed streams:", ""]
        for r in failed:
            lines.append(f"- {r.peer}, {r.case}: "
                         + "; ".join(f"{n} x {why}" for why, n in r.errors.items()))  # fmt: skip
    lines += ["", *(f"- {line}" for line in ratio_lines(result))]
    return "\n".join(lines) + "\n"


def ratio_lines(result: MemoryResult) -> Sequence[str]:
    free = result.run("batchfit", NO_LIMIT)
    lines = []
    for case in (LIMIT, SIBLING):
        run = result.run("batchfit", case)
        if free is None or run is None or not free.output_tokens_per_s > 0:
            continue
        lines.append(f"batchfit, {case} against its unlimited run: "
                     f"{run.output_tokens_per_s / free.output_tokens_per_s:.2f}x output "
                     "tokens/s (target 0.7x)")  # fmt: skip
    return lines
