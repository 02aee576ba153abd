"""Samples a replica while load runs: resident memory always, batch size when asked."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from dataclasses import dataclass, field

import httpx

from .servers import Replica
from .stats import parse_scrape


@dataclass(frozen=True, slots=True)
class Sample:
    t_s: float
    rss_bytes: int | None
    batch_sum: float | None = None
    batch_count: float | None = None


@dataclass
class Sampler:
    """A background thread reading /proc (and ``/metrics`` when ``scrape``) every
    ``interval_s`` until stopped."""

    replica: Replica
    interval_s: float = 0.25
    scrape: bool = False
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Sampler:
        self._started = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, name="bench-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._take(None)

    def _loop(self) -> None:
        with httpx.Client(base_url=self.replica.url, timeout=5) as client:
            while not self._stop.is_set():
                self._take(client)
                self._stop.wait(self.interval_s)

    def _take(self, client: httpx.Client | None) -> None:
        batch_sum = batch_count = None
        if self.scrape and client is not None:
            with contextlib.suppress(httpx.HTTPError):
                values = parse_scrape(client.get("/metrics").text)
                batch_sum = values.get("batchfit_batch_size_sum")
                batch_count = values.get("batchfit_batch_size_count")
        self.samples.append(
            Sample(
                time.perf_counter() - self._started,
                self.replica.rss_bytes(),
                batch_sum,
                batch_count,
            )
        )

    @property
    def peak_rss_bytes(self) -> int | None:
        values = [s.rss_bytes for s in self.samples if s.rss_bytes is not None]
        return max(values, default=None)


def batch_size_series(samples: list[Sample]) -> list[tuple[float, float]]:
    """(time, mean batch size over the interval ending then), for intervals with batches."""
    scraped = [s for s in samples if s.batch_sum is not None and s.batch_count is not None]
    series = []
    for prev, cur in itertools.pairwise(scraped):
        batches = cur.batch_count - prev.batch_count  # type: ignore[operator]
        if batches > 0:
            series.append((cur.t_s, (cur.batch_sum - prev.batch_sum) / batches))  # type: ignore[operator]
    return series
