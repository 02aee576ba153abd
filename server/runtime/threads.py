"""How many intra-op threads torch gets on CPU, and where that number comes from.

An operator's number wins (``--num-threads``, then ``OMP_NUM_THREADS``, which ``batchfit up``
sets to share the cores among its replicas); otherwise every CPU the process may run on, but
no more than its cgroup's CPU quota allows: under a quota of 4 CPUs on a 64-core node, 64
threads would spend most of each period throttled.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from batching.measure import Forward
from batching.procfs import CpuQuota, own_cpu_quota
from models.spec import available_cpus, omp_num_threads

FLAG, OMP, QUOTA, AFFINITY = "--num-threads", "OMP_NUM_THREADS", "cgroup cpu quota", "CPU affinity"


@dataclass(frozen=True, slots=True)
class ThreadCount:
    num_threads: int
    source: str  # FLAG, OMP, QUOTA or AFFINITY
    where: str = ""  # the quota's cgroup, when it binds

    def describe(self) -> str:
        """``threads: 4 (cgroup cpu quota /kubepods/pod1)``, as the start-up log says it."""
        where = f" {self.where}" if self.where else ""
        return f"threads: {self.num_threads} ({self.source}{where})"


def cpu_capacity(affinity: int, quota: CpuQuota | None) -> ThreadCount:
    """The CPUs this process can keep busy: the smaller of its affinity and its quota
    (rounded up: a quota of 1.5 CPUs still runs 2 threads part of each period), at least 1."""
    if quota is not None and math.ceil(quota.cpus) < affinity:
        return ThreadCount(max(1, math.ceil(quota.cpus)), QUOTA, quota.path)
    return ThreadCount(max(1, affinity), AFFINITY)


def choose_threads(
    requested: int | None, omp: int | None, affinity: int, quota: CpuQuota | None
) -> ThreadCount:
    """The first of: the flag, ``OMP_NUM_THREADS``, ``cpu_capacity``."""
    if requested is not None:
        return ThreadCount(requested, FLAG)
    if omp is not None:
        return ThreadCount(omp, OMP)
    return cpu_capacity(affinity, quota)


def host_capacity() -> ThreadCount:
    """``cpu_capacity`` of this process, read now."""
    return cpu_capacity(available_cpus(), own_cpu_quota())


def thread_count(requested: int | None, environ: Mapping[str, str] = os.environ) -> ThreadCount:
    """``choose_threads`` for this process, read now."""
    return choose_threads(requested, omp_num_threads(environ), available_cpus(), own_cpu_quota())


def side_shape(num_threads: int, requested: int) -> tuple[int, int]:
    """(passes at once, intra-op threads each) on ``num_threads`` threads: ``requested``
    passes (0: one per thread, up to ``MAX_SIDE_PASSES``), at most one per thread."""
    passes = requested or MAX_SIDE_PASSES
    passes = max(1, min(passes, num_threads))
    return passes, max(1, num_threads // passes)


MAX_SIDE_PASSES = 4
"""The most passes at once by default: each holds the GIL for its Python between operators,
so past a few they wait on each other."""


def on_threads(
    forward: Forward, num_threads: int, before_each: Callable[[], None] | None = None
) -> Forward:
    """``forward`` run on ``num_threads`` intra-op threads, the calling thread's own count
    restored after it (the model thread also runs passes on every thread); ``before_each``
    is called before each pass."""
    from models import current_cpu_threads, set_cpu_threads

    def forward_on_threads(items: Sequence[Any]) -> list[Any]:
        if before_each is not None:
            before_each()
        before = current_cpu_threads()
        if before == num_threads:
            return forward(items)
        set_cpu_threads(num_threads)
        try:
            return forward(items)
        finally:
            set_cpu_threads(before)

    return forward_on_threads
