"""What to load and where, and the host's CPU count: read by the server's settings and
thread defaults in every process, so nothing here imports torch."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

BUNDLED_MODEL = "all-MiniLM-L6-v2"
TASKS = ("auto", "embed", "classify", "rerank", "generate", "sparse")
DTYPE_NAMES = ("float32", "float16", "bfloat16")
DTYPES = ("auto", *DTYPE_NAMES)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What to load and where; built from settings by the server."""

    model: str = BUNDLED_MODEL
    task: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    """float32, float16, bfloat16, or auto: see ``resolve_dtype``."""
    max_input_tokens: int | None = None
    quantize: str = "none"
    num_threads: int | None = None
    """torch intra-op threads on CPU; None: see ``cpu_threads``."""
    default_prompt_name: str | None = None
    """The prompt inputs get when a request names none; None: the model's own default, "":
    no prompt."""
    chat_template: str | None = None
    """A generator's chat template: a Jinja file read instead of the tokenizer's own."""


def cpu_threads(requested: int | None, environ: Mapping[str, str] = os.environ) -> int:
    """Intra-op threads for CPU inference: as asked, else ``OMP_NUM_THREADS`` where it is set
    (``batchfit up`` shares the cores out among its replicas with it), else every CPU this
    process may use (torch's own default). NOTE: measured on 2 vCPUs, leaving a core to the
    event loop cost a third of throughput and of one-client latency; what hurt with every
    core in the pool was OpenMP's idle workers spinning on the event loop's core, which the
    server bounds (``GOMP_SPINCOUNT``)."""
    if requested is not None:
        return requested
    return omp_num_threads(environ) or available_cpus()


def omp_num_threads(environ: Mapping[str, str] = os.environ) -> int | None:
    """``OMP_NUM_THREADS`` (its first level, as in ``4,2``); None where unset or not a
    positive count."""
    first = environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else None


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity; a cgroup's CPU quota is not seen here)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
