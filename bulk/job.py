"""A bulk job: every input row through the model, into Parquet parts, resumably.

The calling thread loads the model and runs every forward pass (the model thread); a reader
thread reads and tokenizes the next part meanwhile, and a writer thread writes the last one.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batching import limit_address_space
from models import (
    BUNDLED_MODEL,
    Model,
    ModelSpec,
    load_model,
    resolve_prompt,
)

from .hang import PassWatch, report_hang
from .manifest import Manifest
from .model_io import (
    JobError,
    check_task,
    finish_outputs,
    freeze_loaded_heap,
    job_identity,
    model_fingerprint,
    output_dimensions,
    prepare,
)
from .pipeline import END, PartInput, PartOutput, PartReader, PartWriter, Worker
from .progress import Progress, describe_budget, duration, size
from .readers import Fields, Reject, check_fields, count_rows, expand_inputs
from .readers import read_rows as read_input_rows
from .runner import OutOfMemoryInput, Reserve, Runner, build_runner
from .writer import output_schema, output_table

log = logging.getLogger("batchfit.bulk")

TASKS = ("embed", "classify", "rerank")
EXIT_HUNG = 3
"""The exit status of a job ended by a hung forward pass (``forward_timeout_s``)."""
HUNG_WRITE_S = 60.0
"""How long a hung job waits for the parts already computed to be written before it ends."""
MIN_INPUT_TOKENS = 2
"""The shortest truncation length (``--max-input-tokens``), as ``batchfit serve`` allows:
a model's two special tokens."""


@dataclass(frozen=True, slots=True)
class JobSpec:
    inputs: tuple[str, ...]
    out: str
    task: str = "embed"
    model: str = BUNDLED_MODEL
    dtype: str = "auto"
    device: str = "auto"
    quantize: str = "none"
    num_threads: int | None = None
    max_input_tokens: int | None = None
    prompt_name: str | None = None
    dimensions: int | None = None
    text_field: str = "text"
    id_field: str | None = None
    query_field: str = "query"
    """Reranking only: the field holding each row's query (``text_field`` is its document)."""
    input_format: str | None = None
    part_rows: int = 10_000
    max_batch_size: int = 128
    max_batch_tokens: int = 4096
    memory_headroom: float = 0.15
    memory_limit: int | None = None
    strict: bool = False
    overwrite: bool = False
    forward_timeout_s: float = 300.0
    """Once warmed up, a pass running this long ends the job (``EXIT_HUNG``); 0: never."""

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise JobError(f"unknown task {self.task!r}; expected one of {', '.join(TASKS)}")
        for flag, value, least in (
            ("--part-rows", self.part_rows, 1),
            ("--max-batch-size", self.max_batch_size, 1),
            ("--max-batch-tokens", self.max_batch_tokens, 1),
            ("--num-threads", self.num_threads, 1),
            ("--max-input-tokens", self.max_input_tokens, MIN_INPUT_TOKENS),
            ("--dimensions", self.dimensions, 1),
            ("--memory-limit", self.memory_limit, 1),
        ):
            if value is not None and value < least:
                raise JobError(f"{flag} must be at least {least}, got {value}")
        if self.dimensions is not None and self.task != "embed":
            raise JobError("--dimensions applies to embeddings only")
        if not 0 <= self.memory_headroom < 1:
            raise JobError(
                f"--memory-headroom must be from 0 to less than 1, got {self.memory_headroom}"
            )
        if not self.forward_timeout_s >= 0:
            raise JobError(f"--forward-timeout-s must be 0 or more, got {self.forward_timeout_s}")

    def fields(self) -> Fields:
        query = self.query_field if self.task == "rerank" else None
        return Fields(text=self.text_field, id=self.id_field, query=query)

    def model_spec(self) -> ModelSpec:
        return ModelSpec(
            model=self.model, device=self.device, dtype=self.dtype, quantize=self.quantize,
            max_input_tokens=self.max_input_tokens, num_threads=self.num_threads,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class JobSummary:
    out: str
    rows: int
    outputs: int
    rejects: int
    memory_rejects: int
    elapsed_s: float
    compute_s: float
    computed: int
    tokens: int
    peak_bytes: int
    oom_splits: int
    parts_written: int
    parts_skipped: int

    def describe(self) -> str:
        rate = self.computed / self.compute_s if self.compute_s > 0 else 0.0
        tokens = self.tokens / self.compute_s if self.compute_s > 0 else 0.0
        return (
            f"done: {self.rows:,} inputs in {duration(self.elapsed_s)} ({self.computed:,} run "
            f"at {rate:,.1f} inputs/s, {tokens:,.0f} tokens/s): {self.outputs:,} outputs, "
            f"{self.rejects:,} rejected ({self.memory_rejects:,} for memory); peak memory "
            f"{size(self.peak_bytes)}; {self.oom_splits} OOM splits; parts: "
            f"{self.parts_written} written, {self.parts_skipped} skipped, in {self.out}"
        )


def run_job(
    spec: JobSpec,
    *,
    model: Model | None = None,
    progress: Progress | None = None,
    freeze_heap: bool = False,
) -> JobSummary:
    """Run ``spec`` to the end (or resume it); ``model`` replaces loading ``spec.model``.
    ``freeze_heap``: the process does nothing else (the command line): once the model is
    loaded, what is alive is moved out of garbage collection (``freeze_loaded_heap``).
    A forward pass that hangs past ``spec.forward_timeout_s`` ends the process
    (``_end_hung_job``): nothing else can end the thread it holds."""
    started = time.perf_counter()
    progress = progress or Progress()
    files = expand_inputs(spec.inputs, spec.input_format, exclude=spec.out)
    fields = spec.fields()
    check_fields(files, fields)
    _make_folder(Path(spec.out))  # before the model loads: a bad --out fails at once
    counter = Worker("batchfit-count", lambda: progress.set_total(count_rows(files)))
    counter.start()
    # Hashing the model's files (hundreds of MB) overlaps loading them; hashlib lets go of
    # the GIL.
    fingerprint: list[str] = []
    hasher = Worker("batchfit-hash", lambda: fingerprint.append(model_fingerprint(spec.model)))
    hasher.start()
    if model is None:
        model = load_model(spec.model_spec())
    if freeze_heap:
        freeze_loaded_heap()
    info = model.info
    check_task(model, spec.task)
    if spec.max_input_tokens is not None and spec.max_input_tokens > info.max_input_tokens:
        log.warning(
            "--max-input-tokens %d is above the most model %r takes; inputs are truncated at "
            "its maximum, %d tokens", spec.max_input_tokens, info.name, info.max_input_tokens,
        )  # fmt: skip
    dimensions = output_dimensions(model, spec)
    prompt = resolve_prompt(info, spec.prompt_name, None)
    hasher.join()
    _raise_from(hasher)
    identity = job_identity(spec, model, dimensions, prompt, fingerprint[0])
    inputs = [dataclasses.asdict(f) for f in files]
    try:
        manifest = Manifest.open(Path(spec.out), identity, inputs, overwrite=spec.overwrite)
    except OSError as exc:
        raise JobError(f"--out {spec.out}: {_reason(exc)}") from None
    stop, go = threading.Event(), threading.Event()
    runner: Runner | None = None
    try:
        if manifest.parts:
            log.info("resuming: %d parts finished earlier are skipped", len(manifest.parts))
        reserve = Reserve()
        # Its first pass starts torch's threads: every thread before a memory limit applies.
        runner = build_runner(
            model, max_items=spec.max_batch_size, max_tokens=spec.max_batch_tokens,
            headroom=spec.memory_headroom, memory_limit=spec.memory_limit, reserve=reserve,
        )  # fmt: skip
        reader = PartReader(
            read_input_rows(files, fields), part_rows=spec.part_rows, manifest=manifest,
            prepare=lambda rows: prepare(model, rows, prompt), strict=spec.strict,
            reserve=reserve,
            stop=stop,
        )  # fmt: skip
        reader_thread = Worker("batchfit-read", lambda: go.wait() and reader.run())
        schema = output_schema(spec.task, "int64", dimensions)  # the id type is set per part
        writer = PartWriter(
            manifest,
            lambda out: output_table(
                _with_id(schema, out), out.ids, finish_outputs(info, out.outputs, dimensions)
            ),
            reserve,
        )
        writer_thread = Worker("batchfit-write", writer.run)
        reader_thread.start()
        writer_thread.start()
        if spec.memory_limit is not None and info.device == "cpu":
            _limit_host_memory(runner.probe, spec.memory_limit)
        _log_memory_limit(runner)
        log.info("warming up: the largest batches the memory budget allows")
        runner.warm_up()
        lanes = runner.use_lanes()
        if lanes is not None:
            log.info("forward passes: %s (memory cannot bind them)", lanes)
        if spec.forward_timeout_s:
            runner.watch = PassWatch(
                spec.forward_timeout_s,
                lambda running_s, bound_s: _end_hung_job(
                    spec, running_s, bound_s, writer, writer_thread, progress
                ),
            )
            runner.watch.start()
        go.set()
        try:
            skipped, compute_s, memory_rejects = _run_parts(
                reader, reader_thread, writer, writer_thread, runner, progress
            )
        finally:
            # The parts already computed are written, even when the loop failed (Ctrl-C, a
            # crash): only a kill loses them.
            _finish_writing(writer, writer_thread)
        _raise_from(writer_thread)
        counter.join()
        rows = manifest.parts[-1].first_row + manifest.parts[-1].rows if manifest.parts else 0
        manifest.finish(rows)
    finally:
        stop.set()
        go.set()  # a reader still waiting to start sees the stop and ends
        if runner is not None:
            if runner.watch is not None:
                runner.watch.close()
            runner.close()
        progress.close()
        manifest.close()
    stats = runner.stats
    return JobSummary(
        out=spec.out, rows=rows, outputs=sum(p.outputs for p in manifest.parts),
        rejects=sum(p.rejects for p in manifest.parts), memory_rejects=memory_rejects,
        elapsed_s=time.perf_counter() - started, compute_s=compute_s, computed=stats.inputs,
        tokens=stats.tokens, peak_bytes=stats.peak_bytes, oom_splits=stats.oom_splits,
        parts_written=writer.written, parts_skipped=skipped,
    )  # fmt: skip


def _run_parts(
    reader: PartReader,
    reader_thread: Worker,
    writer: PartWriter,
    writer_thread: Worker,
    runner: Runner,
    progress: Progress,
) -> tuple[int, float, int]:
    """The model loop: each part from the reader through the runner to the writer. Returns
    the parts skipped, the seconds spent computing and the inputs rejected for memory."""
    skipped = memory_rejects = 0
    compute_s = 0.0
    progress.start_computing()
    while True:
        part = _next_part(reader, reader_thread, writer_thread)
        if part is END:
            break
        last = part.first_row + part.num_rows - 1
        if part.items is None:
            skipped += 1
            log.info("part %d (rows %d-%d) skipped: finished earlier", part.index,
                     part.first_row, last)  # fmt: skip
            progress.rows(part.num_rows)
            continue
        progress.rows(len(part.rejects))
        started = time.perf_counter()
        outputs = runner.run(
            part.items, lambda n, tokens: progress.batch(n, tokens, runner.stats.budget)
        )
        elapsed = time.perf_counter() - started
        compute_s += elapsed
        reader.release()
        runner.release_memory()  # the part's items are done with: their holes go back
        output = _part_output(part, outputs)
        memory_rejects += len(output.rejects) - len(part.rejects)
        log.info(
            "part %d (rows %d-%d): %d inputs in %.1fs (%.1f inputs/s), budget %s",
            part.index, part.first_row, last, len(part.items), elapsed,
            len(part.items) / elapsed if elapsed > 0 else 0.0,
            describe_budget(runner.stats.budget),
        )  # fmt: skip
        _put(writer, writer_thread, output)
    return skipped, compute_s, memory_rejects


def _next_part(reader: PartReader, reader_thread: Worker, writer_thread: Worker) -> Any:
    while True:
        _raise_from(writer_thread)
        try:
            part = reader.parts.get(timeout=0.5)
        except queue.Empty:
            _raise_from(reader_thread)
            continue
        if part is END:
            _raise_from(reader_thread)
        return part


def _put(writer: PartWriter, writer_thread: Worker, output: PartOutput) -> None:
    while True:
        _raise_from(writer_thread)
        try:
            writer.parts.put(output, timeout=0.5)
            return
        except queue.Full:
            continue


def _finish_writing(
    writer: PartWriter, writer_thread: Worker, timeout_s: float | None = None
) -> bool:
    """Let the writer write what it holds, then end; whether it ended (within ``timeout_s``,
    where given)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while writer_thread.is_alive() and (deadline is None or time.monotonic() < deadline):
        try:
            writer.parts.put(END, timeout=0.5)
            break
        except queue.Full:
            continue
    writer_thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return not writer_thread.is_alive()


def _end_hung_job(
    spec: JobSpec, running_s: float, bound_s: float, writer: PartWriter,
    writer_thread: Worker, progress: Progress,
) -> None:  # fmt: skip
    """On the watch's thread, once a forward pass has run past ``bound_s`` (at least
    ``spec.forward_timeout_s``): every thread's stack to standard error, the parts already
    computed written (within ``HUNG_WRITE_S``), then the process ends with ``EXIT_HUNG``.
    Nothing can interrupt the pass (it is in torch's C++ or the driver); the manifest lets a
    rerun resume."""
    then = "the job ends once the parts already computed are written"
    report_hang(running_s, bound_s, spec.forward_timeout_s, then)
    written = _finish_writing(writer, writer_thread, HUNG_WRITE_S)
    progress.close()
    if written:
        kept = "the parts computed before it are written"
    else:
        kept = f"the writer did not finish within {HUNG_WRITE_S:.0f}s"
    print(
        f"batchfit {spec.task}: a forward pass hung; {kept}: run the same command again "
        "to resume", file=sys.stderr, flush=True,
    )  # fmt: skip
    os._exit(EXIT_HUNG)


def _make_folder(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise JobError(f"--out {out} is a file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise JobError(f"--out {out}: cannot make the folder: {_reason(exc)}") from None


def _reason(exc: OSError) -> str:
    where = f" ({exc.filename})" if exc.filename else ""
    return f"{exc.strerror or exc}{where}"


def _raise_from(worker: Worker) -> None:
    if worker.error is not None:
        raise worker.error


def _part_output(part: PartInput, outputs: list[Any]) -> PartOutput:
    ids, kept, rejects = [], [], list(part.rejects)
    for row, output in zip(part.rows, outputs, strict=True):
        if isinstance(output, OutOfMemoryInput):
            rejects.append(Reject(row.number, row.file, row.line, output.reason))
        else:
            ids.append(row.id)
            kept.append(output)
    rejects.sort(key=lambda r: r.number)
    return PartOutput(part, ids, kept, rejects)


def _with_id(schema: Any, output: PartOutput) -> Any:
    import pyarrow as pa

    if output.part.id_type == "string":
        return schema.set(0, pa.field("id", pa.string(), nullable=False))
    return schema


def _log_memory_limit(runner: Runner) -> None:
    """Say which limit binds before the first batch: warm-up runs under it too."""
    reading = runner.read()
    if reading is None or reading.limit is None:
        log.info("memory limit: none read (no memory probe)")
        return
    log.info(
        "memory limit: %s, %d MiB free under it",
        reading.limit.describe(), (reading.free_bytes or 0) >> 20,
    )  # fmt: skip


def _limit_host_memory(probe: Any, limit_bytes: int) -> None:
    resident = probe.read().used_bytes or 0
    if resident >= limit_bytes:
        raise JobError(
            f"--memory-limit ({size(limit_bytes)}) is below what the loaded model already uses "
            f"({size(resident)})"
        )
    limit_address_space(limit_bytes - resident)
