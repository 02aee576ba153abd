"""One stream against batchfit and the naive server in turn: both started, each request of
the one-stream level sent to one and then the other (which goes first alternates), so that
the two are measured at the same moments.

On this shared 2-CPU host the same server's figures drift by 10-15% over minutes, more than
the 10% the one-stream targets allow; peers measured one after the other would compare the
host's moods as much as the servers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from .client import completion_body, served_model, stream_one
from .host import OtherLoad, wait_for_quiet
from .options import GenerateOptions, Workload
from .peers import Launch, start_server
from .stats import GenLevelSummary, summarize_level

IN_TURN = "c=1, in turn"


def measure_in_turn(
    launches: Sequence[Launch], workload: Workload, options: GenerateOptions, log_dir: Path
) -> dict[str, GenLevelSummary]:
    """Each server's one-stream figures, their requests taking turns; a server's wall time
    is the time its own requests took."""
    requests = workload.levels[1]
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(start_server(launch, log_dir)) for launch in launches]
        models = [asyncio.run(served_model(server.url)) for server in servers]
        other = OtherLoad()
        wait_for_quiet(other, max_wait_s=options.quiet_wait_s)
        other.start()
        outcomes = asyncio.run(_in_turn(
            [s.url for s in servers], models, [workload.warm_up[:2], requests], options
        ))  # fmt: skip
        other_cpus = other.stop()
    return {
        launch.name: summarize_level(
            launch.name,
            1,
            found,
            sum(o.end_s for o in found),
            max_tokens=[r.max_tokens for r in requests],
            prompt_tokens=[r.num_prompt_tokens for r in requests],
            other_cpus=other_cpus,
        )
        for launch, found in zip(launches, outcomes, strict=True)
    }


async def _in_turn(
    urls: Sequence[str], models: Sequence[str | None], phases: Sequence[Sequence[object]],
    options: GenerateOptions,
) -> list[list]:  # fmt: skip
    """Warm-up requests, then the measured ones, each to every server in turn; the
    measured outcomes per server."""
    found: list[list] = [[] for _ in urls]
    async with aiohttp.ClientSession() as session:
        for phase, requests in enumerate(phases):
            for index, request in enumerate(requests):
                order = range(len(urls)) if index % 2 == 0 else reversed(range(len(urls)))
                for which in order:
                    body = completion_body(request, models[which])  # type: ignore[arg-type]
                    outcome = await stream_one(session, urls[which], body, index=index,
                                               timeout_s=options.request_timeout_s)  # fmt: skip
                    if phase == len(phases) - 1:
                        found[which].append(outcome)
    for outcomes in found:
        outcomes.sort(key=lambda o: o.index)
    return found
