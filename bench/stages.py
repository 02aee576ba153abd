"""Where a server's CPU goes per request, by stage, from py-spy's raw samples.

Each sample is one thread's Python stack. A sampler that does not stop the process cannot
tell a thread on a CPU from one waiting for a CPU on a busy host, so the samples only give
each thread's split between stages; the thread's CPU time, read from ``/proc``, gives the
microseconds. The innermost frame that a rule recognises names
the stage; generic helpers (the standard library's mappings, dataclass ``__init__``,
``contextlib``) are transparent, so their time goes to whoever called them. A C function
(orjson, pydantic-core, the tokenizer) has no frame of its own: its time lands on the Python
frame that called it, which is why the hot path calls each of them from a function named for
its stage. Pure functions, so the table is testable without a profiler.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

LOOP_THREAD = "MainThread"

# Stage names in the order the table lists them.
HTTP_PARSE = "HTTP parse"
HTTP_WRITE = "HTTP write"
MIDDLEWARE = "middleware"
FRAMEWORK = "routing, dependencies, request/response objects"
VALIDATION = "validation (body parse included)"
TOKENIZE = "tokenize"
ADMISSION = "admission (queue, tracking)"
HOP = "hop to the model thread and back"
FUTURES = "futures, tasks, timeouts"
METRICS = "metrics and status counters"
JSON = "JSON (answer)"
REQUEST_ID = "request id"
PROBE = "memory probe"
BATCHER = "batcher (planning)"
ENDPOINT = "endpoint (our code)"
EVENT_LOOP = "event loop"
FORWARD = "model forward"
OTHER = "other"
STAGES = (
    HTTP_PARSE, HTTP_WRITE, MIDDLEWARE, FRAMEWORK, VALIDATION, TOKENIZE, ADMISSION, HOP,
    FUTURES, METRICS, JSON, REQUEST_ID, PROBE, BATCHER, ENDPOINT, EVENT_LOOP, FORWARD, OTHER,
)  # fmt: skip

# (stage, file prefix or None, function pattern or None); the first rule that matches a frame
# wins, so specific functions come before their file's catch-all.
_RULES: tuple[tuple[str, str | None, str | None], ...] = (
    # Functions named for their stage, wherever they live.
    (TOKENIZE, None, r"(\w+\.)?(prepare|prepare_pairs|_items|tokenize\w*|_tokenize\w*)"),
    (JSON, None, r"(\w+\.)?(_json|encode_\w+|_encode\w*|json_response|_answer\w*)"),
    (VALIDATION, None, r"(\w+\.)?(validate_\w+|_validate\w*|check_inputs|parse_\w+|_parse\w*)"),
    (REQUEST_ID, None, r"_request_id|new_request_id"),
    (METRICS, None, r"\w*\._record|record_request|\w*Metrics\.\w+|StatusHistory\.\w+"),
    (FORWARD, None, r"\w+\.forward|Batcher\._measured_forward"),
    (HOP, None, r"ModelThread\.\w+|\w*Handoff\.\w+|_resolve\w*|_deliver\w*"),
    (HOP, "concurrent/futures/", None),
    (HOP, "asyncio/futures.py", r"_chain_future.*|_copy_future_state|_set_state|_call_\w+"),
    (HOP, "asyncio/base_events.py", r"\w+\.run_in_executor|\w+\.call_soon_threadsafe"),
    (HOP, "threading.py", None),
    (HOP, "queue.py", None),
    (HTTP_WRITE, "uvicorn/protocols/http/", r"RequestResponseCycle\.send"),
    (HTTP_WRITE, "server/one_write.py", None),
    (HTTP_PARSE, "uvicorn/protocols/", None),
    (HTTP_PARSE, "httptools/", None),
    (HTTP_PARSE, "h11/", None),
    (MIDDLEWARE, "server/middleware.py", None),
    (MIDDLEWARE, "server/auth.py", None),
    (MIDDLEWARE, "server/access_log.py", None),
    (MIDDLEWARE, "starlette/middleware/", None),
    (MIDDLEWARE, "starlette/_exception_handler.py", None),
    (MIDDLEWARE, "starlette/applications.py", None),
    (MIDDLEWARE, "fastapi/middleware/", None),
    (MIDDLEWARE, "fastapi/telemetry/", None),
    (MIDDLEWARE, "fastapi/_body_limit.py", None),
    (MIDDLEWARE, "fastapi/applications.py", None),
    (MIDDLEWARE, "uvicorn/middleware/", None),
    (VALIDATION, "pydantic/", None),
    (VALIDATION, "pydantic_core/", None),
    (VALIDATION, "json/", None),
    (VALIDATION, "fastapi/", r"request_body_to_args|_validate_value_with_model_field"),
    (VALIDATION, "fastapi/_compat", None),
    (VALIDATION, "starlette/requests.py", r"Request\.json"),
    (FRAMEWORK, "fastapi/", None),
    (FRAMEWORK, "starlette/", None),
    (FRAMEWORK, "email/", None),
    (FRAMEWORK, "anyio/", None),
    (ADMISSION, "batching/queue.py", None),
    (ADMISSION, "server/runtime/tracking.py", None),
    (ADMISSION, "server/runtime/trace.py", None),
    (METRICS, "prometheus_client/", None),
    (METRICS, "batching/metrics.py", None),
    (METRICS, "server/metrics.py", None),
    (METRICS, "server/status/", None),
    (REQUEST_ID, "uuid.py", None),
    (REQUEST_ID, "secrets.py", None),
    (PROBE, "batching/probes.py", None),
    (PROBE, "batching/procfs.py", None),
    (FUTURES, "asyncio/tasks.py", None),
    (FUTURES, "asyncio/timeouts.py", None),
    (FUTURES, "asyncio/futures.py", None),
    (FUTURES, "asyncio/locks.py", None),
    (BATCHER, "batching/", None),
    (BATCHER, "numpy/", None),
    (EVENT_LOOP, "asyncio/", None),
    (EVENT_LOOP, "selectors.py", None),
    (EVENT_LOOP, "uvloop/", None),
    (ENDPOINT, "server/", None),
    (ENDPOINT, "bench/", None),
    (ENDPOINT, "models/", None),
)
# Generic helpers: their time belongs to the caller.
_TRANSPARENT_FILES = (
    "collections/", "copy.py", "inspect.py", "typing.py", "enum.py", "functools.py",
    "contextlib.py", "abc.py", "os.py", "re/", "<frozen", "dataclasses.py", "<string>",
    "types.py", "weakref.py", "_weakrefset.py", "operator.py", "reprlib.py", "base64.py",
    "asyncio/coroutines.py", "asyncio/base_futures.py", "asyncio/mixins.py",
)  # fmt: skip
_THREAD = re.compile(r"thread \((?P<tid>\d+)\): (?P<name>.*)")
_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")
# The outermost frames of a thread that is only running the loop (the loop itself is C) or
# idling in a worker's loop.
_RUNNER_FUNCTIONS = frozenset(
    {"Runner.run", "asyncio_run", "run", "Server.run", "_run_module_as_main", "_run_code",
     "<module>", "main", "serve", "BaseEventLoop.run_forever", "BaseEventLoop.run_until_complete",
     "Thread._bootstrap", "Thread._bootstrap_inner", "Thread.run"}
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Frame:
    function: str
    file: str


@dataclass(frozen=True, slots=True)
class Sample:
    thread: str
    tid: int
    frames: tuple[Frame, ...]
    """Outermost first, as py-spy writes them."""
    count: int


def parse_frame(text: str) -> Frame:
    match = _FRAME.match(text.strip())
    if match is None:
        return Frame(text.strip(), "")
    return Frame(match["function"], match["file"])


def parse_raw(lines: Iterable[str]) -> list[Sample]:
    """py-spy's ``--format raw --threads`` output: ``thread (tid): name;frame;...;frame N``."""
    samples = []
    for line in lines:
        line = line.rstrip("\n")
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        parts = stack.split(";")
        match = _THREAD.match(parts[0])
        thread, tid = (match["name"], int(match["tid"])) if match else (parts[0], 0)
        frames = tuple(parse_frame(p) for p in parts[1:])
        samples.append(Sample(thread, tid, frames, int(count)))
    return samples


def _rule_for(frame: Frame) -> str | None:
    for stage, prefix, pattern in _RULES:
        if prefix is not None and not frame.file.startswith(prefix):
            continue
        # A pattern may name the function alone: a nested one's last name counts too.
        last = frame.function.rsplit(".", 1)[-1]
        if pattern is not None and not (
            re.fullmatch(pattern, frame.function) or re.fullmatch(pattern, last)
        ):
            continue
        return stage
    return None


def _transparent(frame: Frame) -> bool:
    return frame.file.startswith(_TRANSPARENT_FILES) or frame.function.startswith("__create_fn__")


def classify(frames: Sequence[Frame]) -> str:
    """The stage of one stack: its innermost recognised frame's."""
    for frame in reversed(frames):
        if _transparent(frame):
            continue
        if frame.function in _RUNNER_FUNCTIONS:
            # Nothing of ours or of the libraries' on top: the loop's own C code.
            return EVENT_LOOP
        stage = _rule_for(frame)
        if stage is not None:
            return stage
    return EVENT_LOOP if not frames else OTHER


@dataclass(frozen=True, slots=True)
class StageTable:
    """Microseconds of one thread group per request, by stage."""

    us_per_request: dict[str, float]
    num_samples: int

    @property
    def total_us(self) -> float:
        return sum(self.us_per_request.values())


def stage_table(
    samples: Iterable[Sample],
    *,
    cpu_s_by_tid: Mapping[int, float],
    num_requests: int,
    loop_only: bool,
) -> StageTable:
    """Each thread's CPU seconds (``cpu_s_by_tid``, over the sampled span) split between
    stages as its samples are, summed over threads and divided by the requests answered in
    that span. ``loop_only`` keeps the event loop's thread; otherwise every other thread."""
    by_thread: dict[int, Counter[str]] = {}
    total = 0
    for sample in samples:
        if (sample.thread == LOOP_THREAD) != loop_only:
            continue
        by_thread.setdefault(sample.tid, Counter())[classify(sample.frames)] += sample.count
        total += sample.count
    us: Counter[str] = Counter()
    for tid, counts in by_thread.items():
        per_sample = cpu_s_by_tid.get(tid, 0.0) * 1e6 / max(1, num_requests) / counts.total()
        for stage, count in counts.items():
            us[stage] += count * per_sample
    return StageTable({s: us[s] for s in STAGES if us[s]}, total)


def render(columns: dict[str, StageTable]) -> str:
    """A Markdown table, one column per profiled run, one row per stage."""
    names = list(columns)
    lines = [
        "| stage | " + " | ".join(names) + " |",
        "| --- |" + " ---: |" * len(names),
    ]
    for stage in STAGES:
        if not any(stage in t.us_per_request for t in columns.values()):
            continue
        cells = [f"{columns[n].us_per_request.get(stage, 0.0):.0f}" for n in names]
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    totals = [f"**{columns[n].total_us:.0f}**" for n in names]
    lines.append("| **total** | " + " | ".join(totals) + " |")
    return "\n".join(lines)
