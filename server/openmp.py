"""OpenMP's wait policy, set before torch loads its OpenMP runtime (imported first by
``server/__init__.py``; an operator's own value wins).

torch's CPU build here uses GNU OpenMP (libgomp). Its idle workers spin 300,000 rounds
(about 9 ms of CPU, measured) after every parallel region before they sleep, so with every
core in torch's pool the workers keep spinning on the core the event loop needs between
batches, and on a host where other work holds a core they spin at barriers waiting for a
descheduled peer. Measured on 2 vCPUs with the bundled model, 2 threads: 1,000 rounds
leave batch-1 and 32 x 32-token forwards as fast as the default (6.1 vs 6.0 ms, 135 vs
136 ms) and spin no CPU after a forward (0.1 vs 9 ms per 50 ms); a passive policy (no
spin) made batch-1 3 ms slower. Measured again A/B on a shared host, with the benchmark's
aiohttp client and with httpx (``python -m bench.defaults``, docs/frontend.md): every longer
spin (3,000 to 300,000) lost 1.3 to 6 times in one-client latency and in throughput at 32
clients, with both clients; on the same host with nothing else running, the best of them
(30,000) was at most 11% ahead, and 300,000 no better than 1,000. (An Intel OpenMP build
would read ``KMP_BLOCKTIME`` instead; none was measured, so it is left alone.)
"""

from __future__ import annotations

import os

GOMP_SPINCOUNT = "1000"

# NOTE: libgomp reads it once, when torch is first imported; a later change does nothing.
os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
