"""Seeded workloads: a realistic length mix, single- and multi-input requests, and bursts.

Pure functions of a seed, so every configuration of one run sees the same requests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# Common English words; one word is one or two WordPiece tokens for the bundled model.
_WORD_TEXT = (
    "the of and to in is was for on that with as by at from it an be this are which or his "
    "had not but first one their new after also who they two her she been other when there "
    "all into more during time can only years some would over most about state many then "
    "later up world year made school university city where between under known used being "
    "three national because american through such while people family part both them since "
    "its against however several four early same before called government each well team "
    "music season war series area work born may film members including until game could "
    "local company second these high league based public group life best last until river "
    "model batch memory server request latency throughput token sentence vector search "
    "cluster language small large queue budget device thread answer quick brown fox jumps"
)
WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True, slots=True)
class LengthBand:
    """Inputs of ``min_words`` to ``max_words`` words, drawn with relative ``weight``."""

    name: str
    min_words: int
    max_words: int
    weight: float


# Mostly short, some medium, a few near the bundled model's 256-token maximum.
DEFAULT_BANDS = (
    LengthBand("short", 4, 24, 0.75),
    LengthBand("medium", 40, 100, 0.20),
    LengthBand("long", 170, 230, 0.05),
)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    seed: int = 0
    bands: tuple[LengthBand, ...] = DEFAULT_BANDS
    multi_input_fraction: float = 0.2
    """Share of requests that carry several inputs (2 to ``max_inputs``)."""
    max_inputs: int = 8
    burst_fraction: float = 0.1
    """Open loop: share of arrival events that bring a burst instead of one request."""
    burst_size: int = 16

    def __post_init__(self) -> None:
        if not self.bands or any(b.min_words < 1 or b.max_words < b.min_words for b in self.bands):
            raise ValueError(f"bad length bands: {self.bands}")
        if not 0 <= self.multi_input_fraction <= 1 or not 0 <= self.burst_fraction <= 1:
            raise ValueError("fractions must be within [0, 1]")
        if self.max_inputs < 2 or self.burst_size < 2:
            raise ValueError("max_inputs and burst_size must be at least 2")


def make_text(rng: random.Random, num_words: int) -> str:
    words = [rng.choice(WORDS) for _ in range(num_words)]
    words[0] = words[0].capitalize()
    return " ".join(words) + "."


def make_input(rng: random.Random, bands: tuple[LengthBand, ...]) -> str:
    band = rng.choices(bands, weights=[b.weight for b in bands])[0]
    return make_text(rng, rng.randint(band.min_words, band.max_words))


def make_requests(
    spec: WorkloadSpec, num_requests: int, *, single_input: bool = False
) -> list[list[str]]:
    """``num_requests`` requests, each a list of inputs; the same for the same spec."""
    rng = random.Random(f"{spec.seed}:requests:{single_input}")
    requests = []
    for _ in range(num_requests):
        multi = not single_input and rng.random() < spec.multi_input_fraction
        count = rng.randint(2, spec.max_inputs) if multi else 1
        requests.append([make_input(rng, spec.bands) for _ in range(count)])
    return requests


def arrival_times(spec: WorkloadSpec, rate_per_s: float, duration_s: float) -> list[float]:
    """Open-loop send times (seconds from start) of a Poisson process of ``rate_per_s``
    requests per second; a ``burst_fraction`` of arrival events bring ``burst_size`` at once.
    The event rate is lowered so that the mean request rate stays ``rate_per_s``."""
    if rate_per_s <= 0 or duration_s <= 0:
        raise ValueError(f"rate and duration must be positive, got {rate_per_s}, {duration_s}")
    rng = random.Random(f"{spec.seed}:arrivals:{rate_per_s}:{duration_s}")
    per_event = 1 + spec.burst_fraction * (spec.burst_size - 1)
    event_rate = rate_per_s / per_event
    times: list[float] = []
    t = rng.expovariate(event_rate)
    while t < duration_s:
        size = spec.burst_size if rng.random() < spec.burst_fraction else 1
        times.extend([t] * size)
        t += rng.expovariate(event_rate)
    return times
