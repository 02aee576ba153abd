"""A model as the batcher sees it (``Lane``), and what the batcher keeps for it (``LaneState``):
its time models, the budget of its last batch and its metric series, with what each pass
records in them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from .measure import Forward
from .metrics import ModelBatchingMetrics, ModelMemoryMetrics
from .planner import BatchBudget, BatchPlan
from .queue import Pending
from .sizer import Sizer
from .timing import BatchTimeModel

if TYPE_CHECKING:
    from prometheus_client import Gauge


@dataclass(frozen=True, slots=True)
class Lane:
    """One model as the batcher sees it: queue entries tagged ``name`` run through
    ``forward``, in batches that ``sizer`` budgets."""

    name: str
    forward: Forward
    sizer: Sizer
    side_forward: Forward | None = None
    """The same pass on its share of the CPUs, for passes side by side (``side_by_side``);
    None: this model's passes run one at a time."""


class LaneState:
    """A lane with what the batcher keeps for it: its time model, its metric series and
    the budget of its last batch."""

    def __init__(
        self,
        lane: Lane,
        *,
        metrics: ModelBatchingMetrics,
        memory_metrics: ModelMemoryMetrics | None,
        plan_by_time: bool,
    ) -> None:
        self.name = lane.name
        self.forward = lane.forward
        self.side_forward = lane.side_forward
        self.sizer = lane.sizer
        self.metrics = metrics
        self.memory_metrics = memory_metrics
        self.time_model = BatchTimeModel() if plan_by_time else None
        self.side_time_model = BatchTimeModel() if plan_by_time else None
        """Passes side by side (``side.py``): each on its share of the cores, beside others."""
        self.budget: BatchBudget | None = None
        self._shown: dict[Gauge, float] = {}

    def show(self, gauge: Gauge, value: float) -> None:
        """Set one of this lane's gauges, unless it shows ``value`` already: most batches
        leave the budget as the last one left it, and each update costs the loop a lock."""
        if self._shown.get(gauge) != value:
            self._shown[gauge] = value
            gauge.set(value)

    def record_budget(self, budget: BatchBudget) -> None:
        """The budget that plans the next batch, and the ceiling behind it."""
        self.budget = budget
        self.show(self.metrics.budget_items, budget.max_items)
        self.show(self.metrics.budget_tokens, budget.max_tokens)
        if self.memory_metrics is not None and budget.max_bytes is not None:
            self.show(self.memory_metrics.budget_bytes, budget.max_bytes)
        self.record_ceiling()

    def record_ceiling(self) -> None:
        ceiling = getattr(self.sizer, "ceiling_bytes", None)
        if self.memory_metrics is not None and ceiling is not None and math.isfinite(ceiling):
            self.show(self.memory_metrics.ceiling_bytes, ceiling)

    def record_dispatch(self, batch: Sequence[Pending], plan: BatchPlan, now: float) -> None:
        metrics = self.metrics
        for pending in batch:
            metrics.queue_wait.observe(now - pending.arrival_s)
        metrics.real_tokens.inc(plan.real_tokens)
        metrics.padded_tokens.inc(plan.padded_tokens)
        if plan.real_tokens:
            metrics.padding_ratio.observe(plan.padded_tokens / plan.real_tokens)

    def record_prediction(self, num_items: int, padded_len: int) -> float | None:
        """The peak the last budget predicts for a pass of this shape (None: no memory model)."""
        budget = self.budget
        if budget is None or budget.predict_bytes is None:
            return None
        predicted = budget.predict_bytes(num_items, padded_len)
        metrics = self.memory_metrics
        if metrics is not None:
            self.show(metrics.predicted_peak, predicted)
            free = getattr(self.sizer, "last_free_bytes", None)
            if free is not None:
                self.show(metrics.headroom_bytes, free - predicted)
        return predicted

    def record_peak(self, predicted: float | None, peak: int | None) -> None:
        metrics = self.memory_metrics
        if metrics is None or peak is None:
            return
        metrics.measured_peak.set(peak)
        if predicted:
            metrics.peak_ratio.observe(peak / predicted)

    def count_oom(self, outcome: str) -> None:
        """A batch ran out of memory: ``outcome`` is ``split`` or ``failed``."""
        metrics = self.memory_metrics
        if metrics is not None:
            (metrics.oom_split if outcome == "split" else metrics.oom_failed).inc()


class Planned(NamedTuple):
    """A batch taken out of the queue for its lane's next pass, and the plan that chose it
    (recorded once the pass has started: the model need not wait for the metrics)."""

    lane: LaneState
    batch: list[Pending]
    plan: BatchPlan
