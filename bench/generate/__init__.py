"""``batchfit bench --generate``: streamed text generation, batchfit against a naive server,
transformers' in-process continuous batching and vLLM's CPU build."""

from .client import JoinOutcome, StreamOutcome, StreamRun, closed_loop_streams, join_run
from .limit import CachePlan, cache_plan, measure_limit
from .report import Ratio, ratios, render_markdown, write_report
from .runner import GenerateOptions, GenerateResult, PeerResult, quick_options, run_generate
from .sse import Chunk, EventSplitter, parse_chunk
from .stats import GenLevelSummary, JoinSummary, summarize_join, summarize_level
from .workload import GenerateSpec, GenRequest, make_generate_requests

__all__ = [
    "CachePlan",
    "Chunk",
    "EventSplitter",
    "GenLevelSummary",
    "GenRequest",
    "GenerateOptions",
    "GenerateResult",
    "GenerateSpec",
    "JoinOutcome",
    "JoinSummary",
    "PeerResult",
    "Ratio",
    "StreamOutcome",
    "StreamRun",
    "cache_plan",
    "closed_loop_streams",
    "join_run",
    "make_generate_requests",
    "measure_limit",
    "parse_chunk",
    "quick_options",
    "ratios",
    "render_markdown",
    "run_generate",
    "summarize_join",
    "summarize_level",
    "write_report",
]
