"""The cyclic garbage collector, tuned for a serving process once it has started.

By the time a replica is ready it holds some 300,000 objects that live as long as it does
(torch, the model, the libraries). Python's collector walks all of them in every full
collection: under load that was 0.6 s of the event loop each time, three times in 8 s of
no-op requests (170 us a request, and the p99 with it). Frozen, they are never walked again.
The request path makes little cyclic garbage (its objects go when their last reference
does), so the youngest generation is collected after 10,000 net allocations instead of 700:
measured, no collection at all ran in 8 s of load.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger("batchfit")

YOUNG_THRESHOLD = 10_000


def freeze_startup_heap() -> None:
    """Collect once, then move everything alive to the collector's permanent generation."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    log.info("%d start-up objects frozen out of garbage collection", gc.get_freeze_count())
