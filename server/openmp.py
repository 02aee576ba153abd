"""OpenMP's wait policy, set before torch loads its OpenMP runtime (imported first by
``server/__init__.py``; an operator's own value wins).

torch's CPU build here uses GNU OpenMP (libgomp). Its idle workers spin 300,000 rounds
(about 9 ms of CPU, measured) after every parallel region before they sleep. Between the
regions of one forward pass a short spin lets them sleep, and waking them costs more than it
saves: a lone all-MiniLM-L6-v2 input on 2 vCPUs ran no faster on 2 threads than on one with
1,000 rounds. 30,000 rounds (about 1 ms) keep them awake through a pass and let them sleep
soon after it. Measured A/B, every setting in turn (``python -m bench.defaults --settings
1000,30000``, 3 rounds, aiohttp and httpx clients): on a quiet host one client's p50 was
17.3 and 21.6 ms against 24.1 and 26.0 ms, and 32 clients got 101.9 and 85.0 inputs/s against
84.5 and 83.5. A long spin used to collapse where other work holds a CPU (a spinning worker
waits at each step for a peer that is off its CPU: 132 ms and 29 inputs/s with two fixed
threads and one CPU held by a busy process); with the server's own thread count the model
thread falls back to one thread there (``runtime/contention.py``), and with one busy process
30,000 rounds measured 22.1 and 24.2 ms, 54.0 and 58.7 inputs/s, against 24.1 and 33.2 ms,
55.9 and 53.7 inputs/s at 1,000. (An Intel OpenMP build would read ``KMP_BLOCKTIME``
instead; none was measured, so it is left alone.)
"""

from __future__ import annotations

import os

GOMP_SPINCOUNT = "30000"

OPERATOR_SPINCOUNT = os.environ.get("GOMP_SPINCOUNT")
"""The value the process started with (None: the server's), before the server sets its own."""

# NOTE: libgomp reads it once, when torch is first imported; a later change does nothing.
os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
