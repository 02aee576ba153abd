"""Figures of a generation level: output tokens/s, time to first token, time between tokens,
and the one stream's time between tokens while a long prompt joins it."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.stats import percentile

from .client import JoinOutcome, StreamOutcome


@dataclass(frozen=True, slots=True)
class GenLevelSummary:
    """One peer at one load level (``concurrency`` streams, closed loop)."""

    peer: str
    concurrency: int
    num_requests: int
    """Requests sent (finished, failed or cut)."""
    num_ok: int
    num_cut: int
    """Streams still open when the level's time ran out (their tokens so far count)."""
    errors: dict[str, int]
    wall_s: float
    completion_tokens: int
    """Every token received, of finished and cut streams alike."""
    expected_tokens: int
    """What the finished streams asked for (``max_tokens``): more than they got where a peer
    stopped at end-of-sequence."""
    output_tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tbt_p50_s: float
    tbt_p99_s: float
    tbt_max_s: float
    mean_prompt_tokens: float
    other_cpus: float = math.nan
    """CPUs that other work on the host took during the level (neither the peer nor the
    benchmark): figures taken beside much of it are not the peer's alone."""

    def to_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def _error_key(outcome: StreamOutcome) -> str:
    if outcome.status and outcome.status != 200:
        return str(outcome.status)
    return (outcome.error or "error").split(":")[0][:60]


def summarize_level(
    peer: str,
    concurrency: int,
    outcomes: Sequence[StreamOutcome],
    wall_s: float,
    *,
    max_tokens: Sequence[int],
    prompt_tokens: Sequence[int],
    other_cpus: float = math.nan,
) -> GenLevelSummary:
    """TTFT over the streams that got a token; TBT over every gap of every stream (finished
    or cut); tokens/s counts every token received over the level's wall time.
    ``max_tokens[i]`` and ``prompt_tokens[i]`` belong to request ``outcomes[k].index == i``."""
    ok = [o for o in outcomes if o.ok]
    cut = [o for o in outcomes if o.cut]
    failed = [o for o in outcomes if not o.ok and not o.cut]
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None and o.status == 200]
    gaps = [gap for o in outcomes if o.status == 200 for gap in o.gaps_s()]
    tokens = sum(o.completion_tokens for o in outcomes if o.status == 200)
    sent_prompts = [prompt_tokens[o.index] for o in outcomes]
    return GenLevelSummary(
        peer=peer,
        concurrency=concurrency,
        num_requests=len(outcomes),
        num_ok=len(ok),
        num_cut=len(cut),
        errors=dict(sorted(Counter(_error_key(o) for o in failed).items())),
        wall_s=wall_s,
        completion_tokens=tokens,
        expected_tokens=sum(max_tokens[o.index] for o in ok),
        output_tokens_per_s=tokens / wall_s if wall_s > 0 else math.nan,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        tbt_p50_s=percentile(gaps, 50),
        tbt_p99_s=percentile(gaps, 99),
        tbt_max_s=max(gaps, default=math.nan),
        mean_prompt_tokens=sum(sent_prompts) / len(sent_prompts) if sent_prompts else math.nan,
        other_cpus=other_cpus,
    )


@dataclass(frozen=True, slots=True)
class JoinSummary:
    """The running stream's time between tokens while a long prompt joined it.

    The window of one trial opens when the long prompt is sent and closes when its own
    stream ends (or the first stream does, if sooner): the gaps of the first stream that
    ended inside it, pooled over the trials. Its p99 is close to the maximum (a window holds
    about as many gaps as the joining request's ``max_tokens``), which is the point: a
    prefill that stalls the running stream shows there."""

    peer: str
    num_trials: int
    num_gaps: int
    tbt_p50_s: float
    tbt_p99_s: float
    tbt_max_s: float
    join_ttft_p50_s: float
    """The long prompt's own time to first token."""
    alone_tbt_p50_s: float
    """The first stream's time between tokens before the long prompt was sent."""
    errors: dict[str, int] = field(default_factory=dict)
    other_cpus: float = math.nan

    @property
    def p99_over_p50(self) -> float:
        return self.tbt_p99_s / self.tbt_p50_s if self.tbt_p50_s > 0 else math.nan

    def to_dict(self) -> dict[str, object]:
        values = {name: getattr(self, name) for name in self.__dataclass_fields__}
        return {**values, "p99_over_p50": self.p99_over_p50}


def window_gaps(trial: JoinOutcome) -> tuple[list[float], list[float]]:
    """The first stream's gaps inside the trial's window, and those before it."""
    first, joined = trial.first, trial.joined
    opens = trial.join_sent_s
    joined_end = opens + (joined.token_times_s[-1] if joined.token_times_s else joined.end_s)
    closes = min(joined_end, first.token_times_s[-1] if first.token_times_s else opens)
    inside, before = [], []
    times = first.token_times_s
    for a, b in itertools.pairwise(times):
        if b <= opens:
            before.append(b - a)
        elif a < closes:  # ends after the window opens, starts before it closes
            inside.append(b - a)
    return inside, before


def summarize_join(
    peer: str, trials: Sequence[JoinOutcome], *, other_cpus: float = math.nan
) -> JoinSummary:
    inside: list[float] = []
    before: list[float] = []
    ttfts: list[float] = []
    errors: Counter[str] = Counter()
    for trial in trials:
        for outcome in (trial.first, trial.joined):
            if not outcome.ok:
                errors[_error_key(outcome)] += 1
        if not trial.first.ok:
            continue
        gaps_in, gaps_before = window_gaps(trial)
        inside += gaps_in
        before += gaps_before
        if trial.joined.ttft_s is not None:
            ttfts.append(trial.joined.ttft_s)
    return JoinSummary(
        peer=peer,
        num_trials=len(trials),
        num_gaps=len(inside),
        tbt_p50_s=percentile(inside, 50),
        tbt_p99_s=percentile(inside, 99),
        tbt_max_s=max(inside, default=math.nan),
        join_ttft_p50_s=percentile(ttfts, 50),
        alone_tbt_p50_s=percentile(before, 50),
        errors=dict(errors),
        other_cpus=other_cpus,
    )
