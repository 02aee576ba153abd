"""Bulk jobs: embed, classify or rerank a whole corpus in-process, resumably.

Composes ``models`` and ``batching`` (never ``server``): a reader feeds windows of inputs,
the planner cuts them into ideal batches under the live memory budget, one model thread runs
them, and a writer appends Parquet parts recorded in a manifest.
"""

import os

# As ``batchfit serve`` does (server/openmp.py), before torch loads: OpenMP's idle workers
# would otherwise spin for milliseconds after each pass on the cores the reader and writer
# threads need. ``batchfit embed`` sets it already; this covers bulk.ray's actors. An
# operator's own value wins.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")

from .job import JobError, JobSpec, JobSummary, run_job
from .manifest import Manifest, ManifestMismatch
from .progress import Progress
from .readers import ReaderError

__all__ = [
    "JobError",
    "JobSpec",
    "JobSummary",
    "Manifest",
    "ManifestMismatch",
    "Progress",
    "ReaderError",
    "run_job",
]
