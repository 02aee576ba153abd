"""What a bulk job asks of its model and keeps of its answers, the same in one process and
on a Ray actor: rows tokenized as the server tokenizes them, outputs shaped as it answers,
the task check, and what a job's parts depend on (the model's fingerprint, the job's
identity).
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import inspect
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from models import Item, Model, ModelInfo, top_labels, truncate_dimensions
from models.custom import is_entry_point
from models.loading import resolve_model_path

from .readers import Row

if TYPE_CHECKING:
    from .job import JobSpec

log = logging.getLogger("batchfit.bulk")

COMMAND_OF_TASK = {"embed": "embed", "classify": "classify", "rerank": "rerank"}


class JobError(Exception):
    """The job cannot run as asked (a wrong model for the task, a bad option)."""


def prepare(model: Model, rows: Sequence[Row], prompt: str | None = None) -> list[Item]:
    """Tokenize rows as the server does (truncating at the model's limit, ``prompt`` before
    each text, or before each query for pairs); pairs grouped by consecutive rows that share
    a query."""
    if rows and rows[0].query is not None:
        items: list[Item] = []
        start = 0
        while start < len(rows):
            end = start
            while end < len(rows) and rows[end].query == rows[start].query:
                end += 1
            documents = [row.text for row in rows[start:end]]
            items += _prepare_pairs(model, rows[start].query or "", documents, prompt)
            start = end
        return items
    texts = [row.text for row in rows]
    if prompt and "prompt" in inspect.signature(model.prepare).parameters:
        return model.prepare(texts, truncate=True, prompt=prompt)  # type: ignore[call-arg]
    return model.prepare([prompt + t for t in texts] if prompt else texts, truncate=True)


def _prepare_pairs(
    model: Model, query: str, documents: list[str], prompt: str | None
) -> list[Item]:
    pairs = model.prepare_pairs  # type: ignore[attr-defined]
    if prompt and "prompt" in inspect.signature(pairs).parameters:
        return pairs(query, documents, truncate=True, prompt=prompt)
    return pairs(prompt + query if prompt else query, documents, truncate=True)


def finish_outputs(info: ModelInfo, outputs: list[Any], dimensions: int | None) -> list[Any]:
    """As the server answers: a classifier's best label, embeddings cut to ``dimensions``
    (renormalised where the model normalises)."""
    if info.task == "classify":
        return [top_labels(output, None) for output in outputs]
    if dimensions is not None and dimensions != info.output_dim:
        return [truncate_dimensions(o, dimensions, bool(info.normalize)) for o in outputs]
    return outputs


def check_task(model: Model, task: str) -> None:
    found = model.info.task
    if found != task:
        raise JobError(
            f"model {model.info.name!r} is a {found} model; use batchfit {COMMAND_OF_TASK[found]}"
            if found in COMMAND_OF_TASK
            else f"model {model.info.name!r} does {found}, not {task}"
        )
    if task == "rerank" and not hasattr(model, "prepare_pairs"):
        raise JobError(f"model {model.info.name!r} is a reranker but cannot encode pairs")


def output_dimensions(model: Model, spec: JobSpec) -> int | None:
    if spec.task != "embed":
        return None
    full = model.info.output_dim
    if full is None:
        raise JobError(f"model {model.info.name!r} does not say the size of its embeddings")
    if spec.dimensions is None:
        return full
    if not 1 <= spec.dimensions <= full:
        raise JobError(
            f"--dimensions must be from 1 to {full} (the size of {model.info.name!r}'s "
            f"embeddings), got {spec.dimensions}"
        )
    return spec.dimensions


def job_identity(
    spec: JobSpec, model: Model, dimensions: int | None, prompt: str | None,
    fingerprint: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Everything that changes what the parts hold; a rerun must match it to resume.
    ``fingerprint``: ``model_fingerprint(spec.model)``, if already computed."""
    info = model.info
    return {
        "task": spec.task,
        "model": info.name,
        "model_sha256": fingerprint or model_fingerprint(spec.model),
        "dtype": info.dtype,
        "device": info.device.partition(":")[0],
        "quantize": info.quantize,
        "max_input_tokens": info.max_input_tokens,
        "prompt": prompt,
        "dimensions": dimensions,
        "fields": dataclasses.asdict(spec.fields()),
        "part_rows": spec.part_rows,
    }


def model_fingerprint(source: str) -> str:
    """A hash of every file of a model folder (names, sizes and contents); a hub name or a
    custom entry point stands for itself."""
    if is_entry_point(source):
        return hashlib.sha256(source.encode()).hexdigest()
    path = Path(resolve_model_path(source))
    if not path.is_dir():
        return hashlib.sha256(f"hub:{source}".encode()).hexdigest()
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file() and not _hidden(p, path)):
        digest.update(f"{file.relative_to(path)}\0{file.stat().st_size}\0".encode())
        with open(file, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()


def freeze_loaded_heap() -> None:
    """Collect once, then move every object alive (torch, transformers, the model: some
    300,000) to the collector's permanent generation, as ``batchfit serve`` does once it is
    ready. Unfrozen, each full collection walked them all (0.7 s in three during a 1,500-input
    job on 2 cores), and so did the interpreter's collections at exit (1-2 s more)."""
    gc.collect()
    gc.freeze()
    log.debug("%d objects of the loaded model frozen out of garbage collection",
              gc.get_freeze_count())  # fmt: skip


def _hidden(file: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in file.relative_to(root).parts)
