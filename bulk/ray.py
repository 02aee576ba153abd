"""Bulk jobs on a Ray cluster: ``bulk.ray.embed(dataset, model=...)``.

Ray Data's ``map_batches`` over a pool of actors, one per device. Each actor loads the model
once, warms up and sizes its own batches from its own device's memory (the same runner as
``batchfit embed``), splits a batch that runs out of memory, and turns each Ray batch into
an output table. With ``out``, every finished batch is also written there as a Parquet part
named by a hash of its rows and the job, with a record beside it, and ``manifest.json``
names the job: a rerun computes only the batches whose part is missing, and a rerun with
another model is refused. ``out`` must be a folder every node sees (a shared filesystem).

Needs the ``ray`` extra (``pip install 'batchfit[ray]'``) on every node.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import tempfile
import uuid
from pathlib import Path
from typing import Any

import orjson

from models import BUNDLED_MODEL, Model, ModelSpec, load_model, resolve_prompt

from .attempts import MAX_DEATHS, BatchAttempts, PoisonBatch
from .hang import PassWatch, report_hang
from .job import EXIT_HUNG
from .manifest import Manifest, rows_digest
from .model_io import check_task, finish_outputs, freeze_loaded_heap, model_fingerprint, prepare
from .readers import Fields, Reject, Row, row_problem
from .runner import OutOfMemoryInput, Runner, build_runner
from .writer import output_schema, output_table, parquet_bytes, write_atomically

log = logging.getLogger("batchfit.bulk")

PART_PREFIX = "ray-part-"
ATTEMPTS_FOLDER = ".attempts"
"""Where, under ``out``, the actors note the batches they run (``bulk.attempts``)."""


def embed(dataset: Any, *, model: str = BUNDLED_MODEL, **options: Any) -> Any:
    """``dataset`` with each row's embedding: a Ray Dataset of ``id`` and ``embedding``
    columns. Options as ``run``'s."""
    return run(dataset, task="embed", model=model, **options)


def classify(dataset: Any, *, model: str, **options: Any) -> Any:
    """Each row's top label and its score (``id``, ``label``, ``score``)."""
    return run(dataset, task="classify", model=model, **options)


def rerank(dataset: Any, *, model: str, **options: Any) -> Any:
    """Each (query, document) row's relevance score (``id``, ``score``)."""
    return run(dataset, task="rerank", model=model, **options)


def run(
    dataset: Any,
    *,
    task: str,
    model: str = BUNDLED_MODEL,
    text_column: str = "text",
    id_column: str = "id",
    query_column: str = "query",
    out: str | None = None,
    overwrite: bool = False,
    num_actors: int | None = None,
    num_gpus_per_actor: float | None = None,
    num_cpus_per_actor: float | None = None,
    batch_rows: int = 10_000,
    device: str = "auto",
    dtype: str = "auto",
    max_input_tokens: int | None = None,
    prompt_name: str | None = None,
    dimensions: int | None = None,
    max_batch_size: int = 128,
    max_batch_tokens: int = 4096,
    memory_headroom: float = 0.15,
    forward_timeout_s: float = 300.0,
) -> Any:
    """Run ``task`` over every row of ``dataset`` (a ``ray.data.Dataset``) on an actor pool.

    ``batch_rows`` rows go to an actor at once: its window, sorted by length and cut into
    batches under its live memory budget. By default there is one actor per GPU in the
    cluster (one GPU each), or on a cluster without GPUs one per node (each with that node's
    CPUs but one, which Ray Data's read tasks need). Rows whose text is missing or empty are
    left out. Without ``out`` the result is lazy, as Ray Data's are; with it, the job runs to
    the end here (``materialize()``) and its parts and manifest are written. Returns the
    output Dataset.

    A forward pass that hangs (``bulk.hang``: ``forward_timeout_s``, and ten times what the
    actor's passes so far predict for it; 0: never) ends its actor's process with every
    thread's stack in the actor's log. Ray Data starts the actor again and retries the
    batch, as it does by default for any actor that dies; the batches finished before it
    are kept. A batch that has ended ``MAX_DEATHS`` actors' processes (a hang, a crash, an
    OOM kill) ends the job with ``PoisonBatch`` (raised here, inside Ray's task error)
    instead of being run again."""
    if not forward_timeout_s >= 0:
        raise ValueError(f"forward_timeout_s must be 0 or more, got {forward_timeout_s}")
    import ray

    num_actors, num_gpus, num_cpus = _actors(ray, num_actors, num_gpus_per_actor,
                                             num_cpus_per_actor)  # fmt: skip
    # Attempts are noted where every actor sees them: in ``out``, else in each node's
    # temporary folder (a batch retried on another node then counts again there).
    if out is not None:
        attempts = Path(out) / ATTEMPTS_FOLDER
    else:
        attempts = Path(tempfile.gettempdir()) / "batchfit-ray-attempts"
    config = {
        "task": task, "model": model, "device": device, "dtype": dtype,
        "max_input_tokens": max_input_tokens, "text_column": text_column,
        "prompt_name": prompt_name, "dimensions": dimensions,
        "id_column": id_column, "query_column": query_column if task == "rerank" else None,
        "max_batch_size": max_batch_size, "max_batch_tokens": max_batch_tokens,
        "memory_headroom": memory_headroom, "out": out,
        "forward_timeout_s": forward_timeout_s,
        "attempts": str(attempts), "run": uuid.uuid4().hex,  # a rerun counts anew
        "num_threads": math.ceil(num_cpus) if num_cpus and not num_gpus else None,
        "id_type": _id_type(dataset.schema(), id_column),
        "identity": job_identity(task, model, dtype, device, max_input_tokens, text_column,
                                 id_column, query_column) | {"prompt_name": prompt_name,
                                                              "dimensions": dimensions},
    }  # fmt: skip
    manifest = None
    if out is not None:
        manifest = Manifest.open(Path(out), config["identity"], [], overwrite=overwrite)
    result = dataset.map_batches(
        BulkActor,
        fn_constructor_kwargs={"config": config},
        batch_size=batch_rows,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=num_actors),
        num_gpus=num_gpus,
        num_cpus=num_cpus,
    )
    if manifest is None:
        return result
    try:
        result = result.materialize()
        records = [orjson.loads(p.read_bytes()) for p in Path(out).glob(f"{PART_PREFIX}*.json")]
        manifest.data["ray_parts"] = sorted(records, key=lambda r: r["key"])
        manifest.finish(sum(r["rows"] for r in records))
    finally:
        manifest.close()
        BatchAttempts(attempts, config["run"]).forget()
    return result


def job_identity(
    task: str, model: str, dtype: str, device: str, max_input_tokens: int | None,
    text_column: str, id_column: str, query_column: str,
) -> dict[str, Any]:  # fmt: skip
    """What the parts depend on, known without loading the model on the driver."""
    return {
        "layout": "ray", "task": task, "model_sha256": model_fingerprint(model),
        "dtype": dtype, "device": device.partition(":")[0],
        "max_input_tokens": max_input_tokens,
        "fields": {"text": text_column, "id": id_column,
                   "query": query_column if task == "rerank" else None},
    }  # fmt: skip


class BulkActor:
    """One device's model loop inside a Ray actor: called with one Ray batch at a time."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        spec = ModelSpec(
            model=config["model"], device=config["device"], dtype=config["dtype"],
            max_input_tokens=config["max_input_tokens"], num_threads=config["num_threads"],
        )  # fmt: skip
        self.model: Model = load_model(spec)
        freeze_loaded_heap()  # an actor's process does nothing else
        check_task(self.model, config["task"])
        self.runner: Runner = build_runner(
            self.model, max_items=config["max_batch_size"], max_tokens=config["max_batch_tokens"],
            headroom=config["memory_headroom"],
        )  # fmt: skip
        self.runner.warm_up()
        self._attempts = BatchAttempts(Path(config["attempts"]), config["run"])
        timeout_s = config["forward_timeout_s"]
        if timeout_s:
            self.runner.watch = PassWatch(
                timeout_s, lambda running_s, bound_s: self._end_hung(running_s, bound_s)
            )
            self.runner.watch.start()
        self.fields = Fields(config["text_column"], config["id_column"], config["query_column"])
        info = self.model.info
        self.prompt = resolve_prompt(info, config["prompt_name"], None)
        self.dimensions = None
        if config["task"] == "embed":
            self.dimensions = config["dimensions"] or info.output_dim
            if not 1 <= self.dimensions <= (info.output_dim or 0):
                raise ValueError(f"dimensions must be from 1 to {info.output_dim}")
        self.schema = output_schema(config["task"], config["id_type"], self.dimensions)
        self.out = Path(config["out"]) if config["out"] else None

    def __call__(self, batch: Any) -> Any:
        rows, rejects = self._rows(batch)
        digest = rows_digest(
            [(r.id, r.text, r.query) if isinstance(r, Row) else (r.line, r.reason)
             for r in (*rows, *rejects)]
        )  # fmt: skip
        identity = orjson.dumps(self.config["identity"], option=orjson.OPT_SORT_KEYS)
        key = hashlib.sha256(identity + digest.encode()).hexdigest()[:32]
        if self.out is not None:
            import pyarrow.parquet as pq

            done = self.out / f"{PART_PREFIX}{key}.parquet"
            if (self.out / f"{PART_PREFIX}{key}.json").exists():
                log.info("batch of %d rows skipped: finished earlier (%s)", len(rows), done.name)
                return pq.read_table(done)
        self._refuse_poison(key, rows)
        with self._attempts.attempt(key):
            outputs = self.runner.run(prepare(self.model, rows, self.prompt)) if rows else []
        ids, kept = [], []
        for row, output in zip(rows, outputs, strict=True):
            if isinstance(output, OutOfMemoryInput):
                rejects.append(Reject(row.number, "", row.line, output.reason))
            else:
                ids.append(row.id)
                kept.append(output)
        table = output_table(
            self.schema, ids, finish_outputs(self.model.info, kept, self.dimensions)
        )
        if rejects:
            log.warning("%d rows of a batch of %d left out: %s", len(rejects),
                        len(rows) + len(rejects), rejects[0].reason)  # fmt: skip
        if self.out is not None:
            written = write_atomically(self.out, f"{PART_PREFIX}{key}.parquet",
                                       parquet_bytes(table))  # fmt: skip
            record = {
                "key": key, "file": written.name, "rows": len(rows) + len(rejects),
                "outputs": len(ids), "rejects": [r.record() for r in rejects],
                "input_sha256": digest, "size_bytes": written.size_bytes,
                "sha256": written.sha256, "worker": self._attempts.worker,
            }  # fmt: skip
            write_atomically(self.out, f"{PART_PREFIX}{key}.json", orjson.dumps(record))
        return table

    def _rows(self, batch: Any) -> tuple[list[Row], list[Reject]]:
        """The batch's usable rows and its bad ones (``line``: the row within the batch)."""
        rows: list[Row] = []
        rejects: list[Reject] = []
        for number, values in enumerate(batch.select(self.fields.names()).to_pylist()):
            problem = row_problem(values, self.fields)
            if problem is not None:
                rejects.append(Reject(number, "", number + 1, problem))
                continue
            identifier = values[self.fields.id]
            if self.config["id_type"] == "string":
                identifier = str(identifier)
            query = values[self.fields.query] if self.fields.query else None
            rows.append(Row(number, identifier, values[self.fields.text], query, "", number + 1))
        return rows, rejects

    def _refuse_poison(self, key: str, rows: list[Row]) -> None:
        """Raise ``PoisonBatch`` where this batch has ended ``MAX_DEATHS`` actors."""
        ended = self._attempts.ended(key)
        if not ended:
            return
        if len(ended) < MAX_DEATHS:
            log.warning("a batch of %d rows that ended an actor's process (%s) runs again",
                        len(rows), ", ".join(ended))  # fmt: skip
            return
        ids = ", ".join(repr(r.id) for r in rows[:5]) + (", ..." if len(rows) > 5 else "")
        raise PoisonBatch(
            f"a batch of {len(rows)} rows (ids {ids}) ended the process of each of the "
            f"{len(ended)} actors that ran it ({', '.join(ended)}: a forward pass that hung "
            f"past forward_timeout_s {self.config['forward_timeout_s']:g}, a crash or a kill; "
            "each actor's log says which): the job stops rather than try it again. The "
            "batches finished before it are kept; rerun once the device or the model is "
            "fixed, or without the rows that end it"
        )

    def _end_hung(self, running_s: float, bound_s: float) -> None:
        """On the watch's thread: a forward pass of this actor hung. Every thread's stack
        goes to the actor's log, then its process ends, for Ray to start it again and hand it
        the batch (its attempt, left unfinished, counts)."""
        batch = self._attempts.current
        left = MAX_DEATHS - (len(self._attempts.ended(batch)) if batch is not None else 0)
        then = f"the actor exits with status {EXIT_HUNG}; " + (
            f"Ray retries its batch ({left} more end(s) stop the job)"
            if left > 0 else "the job stops when Ray hands its batch to an actor again"
        )  # fmt: skip
        report_hang(running_s, bound_s, self.config["forward_timeout_s"], then,
                    option="forward_timeout_s")  # fmt: skip
        os._exit(EXIT_HUNG)


def _id_type(schema: Any, id_column: str) -> str:
    import pyarrow as pa

    names = list(schema.names)
    if id_column not in names:
        raise ValueError(f"the dataset has no column {id_column!r} (its columns: {names})")
    column_type = schema.types[names.index(id_column)]
    return "int64" if pa.types.is_integer(column_type) else "string"


def _actors(
    ray: Any, num_actors: int | None, num_gpus: float | None, num_cpus: float | None
) -> tuple[int, float | None, float | None]:
    """One actor per GPU (one GPU each), else one per node (its CPUs), unless told."""
    resources = ray.cluster_resources()
    gpus = int(resources.get("GPU", 0))
    if num_gpus is None and gpus and num_cpus is None:
        num_gpus = 1.0
    if num_actors is None:
        if num_gpus:
            num_actors = max(1, int(gpus / num_gpus))
        else:
            nodes = [n for n in ray.nodes() if n.get("Alive")]
            num_actors = max(1, len(nodes))
            if num_cpus is None:
                # One CPU of each node stays free for Ray Data's read and write tasks, which
                # would otherwise wait for the actors forever.
                cpus = min(n["Resources"].get("CPU", 1) for n in nodes) if nodes else 1
                num_cpus = max(1.0, cpus - 1)
    return num_actors, num_gpus, num_cpus
