"""``--access-log``: one JSON line per request on stdout. Sizes and times, never the text."""

from __future__ import annotations

import sys
import time
from typing import TextIO

import orjson

from .middleware import RequestRecord

# Probes, scrapes and the status page's polling would drown the requests that matter.
QUIET_PATHS = frozenset({"/health/live", "/health/ready", "/metrics", "/status.json"})
QUIET_PREFIXES = ("/v2/health/",)


def access_entry(record: RequestRecord, now_s: float) -> dict[str, object]:
    trace = record.trace
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now_s))
        + f".{int(now_s % 1 * 1000):03d}Z",
        "request_id": record.request_id,
        "method": record.method,
        "endpoint": record.path,
        "status": record.status,
        "error_type": record.error_type or None,
        "inputs": trace.inputs if trace is not None else None,
        "tokens": trace.tokens if trace is not None else None,
        "queue_wait_s": _round(trace.queue_wait_s) if trace is not None else None,
        "batch_sizes": trace.batch_sizes if trace is not None else None,
        "cache_hits": trace.cache_hits if trace is not None else None,
        "generated_tokens": trace.generated_tokens if trace is not None else None,
        "duration_s": _round(record.duration_s),
    }


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 6)


class AccessLog:
    """A request observer; ``stream`` defaults to the process's stdout at write time."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream

    def __call__(self, record: RequestRecord) -> None:
        if record.path in QUIET_PATHS or record.path.startswith(QUIET_PREFIXES):
            return
        stream = self._stream or sys.stdout
        stream.write(orjson.dumps(access_entry(record, time.time())).decode() + "\n")
        stream.flush()
