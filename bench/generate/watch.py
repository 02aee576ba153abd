"""A server's own scheduling figures over a run, read from its ``/metrics`` once a second:
how many sequences ran at once on average, and how many were preempted and resumed."""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

NAMES = {
    # peer: (sequences running now, preemptions, resumed sequences)
    "batchfit": ("batchfit_generation_running_sequences", "batchfit_generation_preemptions_total",
                 "batchfit_generation_resumed_sequences_total"),
    "vllm": ("vllm:num_requests_running", "vllm:num_preemptions_total", None),
}  # fmt: skip


@dataclass
class Watched:
    mean_running: float = math.nan
    preempted: float = math.nan
    resumed: float = math.nan


def total(scrape: str, name: str) -> float | None:
    """Every sample of ``name`` summed, whatever its labels; None when there is none."""
    found = [
        sample.value
        for family in text_string_to_metric_families(scrape)
        for sample in family.samples
        if sample.name == name
    ]
    return sum(found) if found else None


@contextlib.contextmanager
def watch(url: str, peer: str, every_s: float = 1.0) -> Iterator[Watched]:
    """Read ``peer``'s figures (a vLLM peer by vLLM's names) while the block runs; filled in
    at its end. A peer with no such metrics, or a scrape that fails, leaves them NaN."""
    watched = Watched()
    names = NAMES.get("vllm" if peer.startswith("vllm") else peer)
    if names is None:
        yield watched
        return
    running_name, *counter_names = names
    stop = threading.Event()
    running: list[float] = []

    def scrape() -> str | None:
        try:
            return httpx.get(f"{url}/metrics", timeout=5).text
        except httpx.HTTPError:
            return None

    def counters(text: str | None) -> list[float | None]:
        return [None if text is None or n is None else total(text, n) for n in counter_names]

    def poll() -> None:
        while not stop.wait(every_s):
            text = scrape()
            value = None if text is None else total(text, running_name)
            if value is not None:
                running.append(value)

    before = counters(scrape())
    thread = threading.Thread(target=poll, name="bench-watch", daemon=True)
    thread.start()
    try:
        yield watched
    finally:
        stop.set()
        thread.join()
        after = counters(scrape())
        if running:
            watched.mean_running = sum(running) / len(running)
        deltas = [
            math.nan if a is None else a - (b or 0.0) for a, b in zip(after, before, strict=True)
        ]
        watched.preempted, watched.resumed = deltas
