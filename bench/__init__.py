"""``batchfit bench``: load generators, the in-process limit, and the report."""

from .limit import LimitResult, ideal_batches, measure_limit
from .loadgen import Outcome, RunResult, closed_loop, open_loop
from .plain import PlainEncoder, load_plain_encoder
from .report import render_markdown, write_report
from .runner import SERVER_CONFIGS, BenchOptions, BenchResult, run_bench
from .stats import LoadSummary, batching_figures, parse_scrape, percentile, summarize
from .targets import targets
from .workload import WorkloadSpec, arrival_times, make_requests

__all__ = [
    "SERVER_CONFIGS",
    "BenchOptions",
    "BenchResult",
    "LimitResult",
    "LoadSummary",
    "Outcome",
    "PlainEncoder",
    "RunResult",
    "WorkloadSpec",
    "arrival_times",
    "batching_figures",
    "closed_loop",
    "ideal_batches",
    "load_plain_encoder",
    "make_requests",
    "measure_limit",
    "open_loop",
    "parse_scrape",
    "percentile",
    "render_markdown",
    "run_bench",
    "summarize",
    "targets",
    "write_report",
]
