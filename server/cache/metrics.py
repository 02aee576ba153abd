"""The cache's series, each by model."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge


class CacheMetrics:
    """Children are resolved once per model (``labels()`` costs a lock and a key build)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.hits = Counter(
            "batchfit_cache_hits",
            "Inputs answered from the replica's output cache, without a forward pass, by model.",
            ["model"], registry=registry,
        )  # fmt: skip
        self.misses = Counter(
            "batchfit_cache_misses",
            "Inputs looked up in the output cache and not found there, by model: computed, "
            "or waiting for an equal input already in flight (batchfit_deduplicated_inputs).",
            ["model"], registry=registry,
        )  # fmt: skip
        self.evictions = Counter(
            "batchfit_cache_evictions",
            "Entries evicted from the output cache (least recently used) to make room, by model.",
            ["model"], registry=registry,
        )  # fmt: skip
        self.bytes = Gauge(
            "batchfit_cache_bytes",
            "Bytes the output cache holds for each model (keys, values and per-entry overhead); "
            "in all at most --cache-bytes.",
            ["model"], registry=registry,
        )  # fmt: skip
        self.deduplicated = Counter(
            "batchfit_deduplicated_inputs",
            "Inputs that waited for an equal input already queued or running (in the same "
            "request or another) instead of being computed again, by model.",
            ["model"], registry=registry,
        )  # fmt: skip
        self._children: dict[str, tuple[Counter, Counter, Counter, Counter]] = {}

    def add_model(self, model: str, held_bytes: Callable[[], float]) -> None:
        """Create ``model``'s series (at 0), its bytes read from ``held_bytes``."""
        self._children[model] = (
            self.hits.labels(model), self.misses.labels(model),
            self.evictions.labels(model), self.deduplicated.labels(model),
        )  # fmt: skip
        self.bytes.labels(model).set_function(held_bytes)

    def count(self, model: str, *, hits: int, misses: int, deduplicated: int) -> None:
        found = self._children.get(model)
        if found is None:
            self.add_model(model, lambda: 0.0)
            found = self._children[model]
        hit, miss, _, dedup = found
        if hits:
            hit.inc(hits)
        if misses:
            miss.inc(misses)
        if deduplicated:
            dedup.inc(deduplicated)

    def evicted(self, model: str) -> None:
        found = self._children.get(model)
        (found[2] if found is not None else self.evictions.labels(model)).inc()
