"""Bulk jobs: embed, classify or rerank a whole corpus in-process, resumably.

Composes ``models`` and ``batching`` (never ``server``): a reader feeds windows of inputs,
the planner cuts them into ideal batches under the live memory budget, one model thread runs
them, and a writer appends Parquet parts recorded in a manifest.
"""

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
