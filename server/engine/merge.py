"""One scrape for the whole replica: the engine's series and every API process's, merged.

The engine records batching, memory and readiness; each API process records its own HTTP
requests, latencies and answered inputs. A scrape asks each API process for its registry's
families and merges them with the engine's: counters, histograms and gauges are summed per
label set (an API process never sets the engine's gauges, so those read as the engine's),
info and state-set series (and ``_created`` times, where enabled) are taken once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

_TAKEN_ONCE = frozenset({"info", "stateset"})


def merge_families(sources: Sequence[Iterable[Metric]]) -> list[Metric]:
    """The families of every source, each family once, in the order first seen."""
    merged: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], Sample]] = {}
    for families in sources:
        for family in families:
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
                values[family.name] = {}
            samples = values[family.name]
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                seen = samples.get(key)
                if seen is None:
                    samples[key] = sample
                elif family.type not in _TAKEN_ONCE and not sample.name.endswith("_created"):
                    samples[key] = seen._replace(value=seen.value + sample.value)
    for name, target in merged.items():
        target.samples = list(values[name].values())
    return list(merged.values())


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def exposition(families: list[Metric]) -> bytes:
    """The Prometheus text format of ``families``."""
    return generate_latest(_Families(families))  # type: ignore[arg-type]
