"""Seeded generation workloads: prompts of real-looking prose cut to an exact token count, and
how many tokens each request generates.

Prompt lengths and ``max_tokens`` are drawn log-uniformly and independently, so short
requests are common and long ones still come: with the defaults (16 to 1,024 prompt tokens,
32 to 256 new tokens) the median prompt is 128 tokens and the mean 242, the median
``max_tokens`` 91 and the mean 108. Every prompt opens with a sentence of its own, so no two
share more than a token or two of prefix: a server's prefix cache cannot skip their prefill.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

Encode = Callable[[str], list[int]]
"""Text to the token ids a server sees (special tokens such as BOS included)."""
Decode = Callable[[list[int]], str]
"""Token ids to text, special tokens left out."""

_PROSE = (
    "The river rises in the hills north of the old market town and runs south for about "
    "forty miles before it reaches the sea. "
    "In the early years the settlement was little more than a ferry crossing, a mill and a "
    "handful of farms along the eastern bank. "
    "Trade grew quickly once the railway arrived, and by the end of the century the port "
    "handled timber, grain and coal from the whole valley. "
    "The town council met every second Tuesday in a room above the bakery, where the minutes "
    "were written by hand in a ledger that still survives. "
    "Most families kept a small garden behind the house, with beans, potatoes and a row of "
    "apple trees that had been planted by the first owners. "
    "During the long winter of that year the river froze from bank to bank, and children "
    "skated where the barges usually moored. "
    "A new bridge was finally opened in the spring, after three years of arguments about its "
    "cost, its height and the colour of its iron railings. "
    "The school had two classrooms, one stove and a teacher who had come from the city with "
    "a trunk full of books and very firm opinions. "
    "Visitors often remarked on the quiet of the streets in the evening, broken only by the "
    "bells of the church and the whistle of the last train. "
    "The library keeps a collection of letters written by the engineers who surveyed the "
    "line, full of complaints about the weather and the food. "
    "Each autumn the fair filled the meadow by the water with stalls, music and animals "
    "brought in from farms as far as a day's walk away. "
    "When the factory closed, many younger people left for the coast, and the population "
    "fell by almost a third within a decade. "
    "Recent work on the harbour has brought some of them back, along with small companies "
    "that repair boats, build furniture and write software. "
    "The museum occupies the old customs house, whose cellars still smell faintly of tar, "
    "rope and the tea that was once stored there. "
    "Local historians disagree about the origin of the name, which appears in three "
    "different spellings in the earliest surviving maps. "
    "A study of the water quality last year found that the fish had returned to stretches of "
    "the river that had been empty for half a century. "
    "The main road follows the line of an older track used by drovers, who moved cattle "
    "from the uplands to the markets in the south. "
    "Several of the houses on the square were rebuilt after a fire, which started in a "
    "stable and spread along the rooftops in a single night. "
    "Researchers measuring the model's memory use found that the cache grew with every "
    "token, while the weights themselves stayed the same size. "
    "The committee asked for a report on the server's latency under load, with figures for "
    "the median request and for the slowest one in a hundred. "
    "A good benchmark runs each system on the same requests, one at a time, and writes down "
    "exactly what it measured and how. "
    "The new timetable added an early service on weekdays, which was popular with workers "
    "and unpopular with the people living near the station. "
    "On clear days the hills to the west are visible from the top of the tower, and on the "
    "clearest the smoke of the city beyond them. "
    "The garden club publishes a small booklet each year with advice on pruning, planting "
    "and keeping slugs away from the lettuce. "
)
SENTENCES = tuple(s.strip() + "." for s in _PROSE.split(". ") if s.strip())
_NAMES = ("Ada", "Ben", "Cora", "Dev", "Elif", "Femi", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lena")


@dataclass(frozen=True, slots=True)
class GenerateSpec:
    """The shape of one workload: token ranges (both log-uniform) and the seed."""

    seed: int = 0
    min_prompt_tokens: int = 16
    max_prompt_tokens: int = 1024
    min_new_tokens: int = 32
    max_new_tokens: int = 256

    def __post_init__(self) -> None:
        if not 4 <= self.min_prompt_tokens <= self.max_prompt_tokens:
            raise ValueError(
                f"prompt tokens must satisfy 4 <= min <= max, got "
                f"{self.min_prompt_tokens}..{self.max_prompt_tokens}"
            )
        if not 1 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"new tokens must satisfy 1 <= min <= max, got "
                f"{self.min_new_tokens}..{self.max_new_tokens}"
            )


@dataclass(frozen=True, slots=True)
class GenRequest:
    """One completion request: its prompt as text and as the ids a server makes of it."""

    prompt: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def log_uniform(rng: random.Random, low: int, high: int) -> int:
    """An integer in [low, high] whose logarithm is uniform."""
    if low == high:
        return low
    value = math.exp(rng.uniform(math.log(low), math.log(high + 1)))
    return min(high, max(low, int(value)))


def prose(rng: random.Random, min_chars: int) -> str:
    """Sentences of the built-in prose, in a seeded order, opening with one of their own."""
    lead = f"Note {rng.randrange(10**6):06d}, kept by {rng.choice(_NAMES)}."
    parts = [lead]
    length = len(lead)
    order = list(SENTENCES)
    while length < min_chars:
        rng.shuffle(order)
        for sentence in order:
            parts.append(sentence)
            length += len(sentence) + 1
            if length >= min_chars:
                break
    return " ".join(parts)


def exact_prompt(
    rng: random.Random, num_tokens: int, encode: Encode, decode: Decode
) -> tuple[str, tuple[int, ...]]:
    """A prompt of prose that encodes to ``num_tokens`` ids (or as close as the tokenizer
    allows: cutting a text's ids and decoding them does not always encode back to the same
    count, so the cut moves by a token until it does, at most 8 tries)."""
    text = prose(rng, num_tokens * 8)
    while len(encode(text)) < num_tokens + 8:
        text += " " + prose(rng, num_tokens * 4)
    ids = encode(text)
    best: tuple[str, tuple[int, ...]] | None = None
    cut = num_tokens
    for _ in range(8):
        candidate = decode(ids[:cut]).strip()
        got = tuple(encode(candidate))
        if best is None or abs(len(got) - num_tokens) < abs(len(best[1]) - num_tokens):
            best = (candidate, got)
        if len(got) == num_tokens:
            break
        cut += num_tokens - len(got)
    assert best is not None
    return best


def make_generate_requests(
    spec: GenerateSpec, num_requests: int, encode: Encode, decode: Decode, *, salt: str = ""
) -> list[GenRequest]:
    """``num_requests`` requests, the same for the same spec, tokenizer and ``salt`` (each load
    level has its own salt, so no level repeats another's prompts)."""
    rng = random.Random(f"{spec.seed}:generate:{salt}")
    requests = []
    for _ in range(num_requests):
        num_prompt = log_uniform(rng, spec.min_prompt_tokens, spec.max_prompt_tokens)
        max_tokens = log_uniform(rng, spec.min_new_tokens, spec.max_new_tokens)
        prompt, ids = exact_prompt(rng, num_prompt, encode, decode)
        requests.append(GenRequest(prompt, ids, max_tokens))
    return requests


def long_prompt_request(
    spec: GenerateSpec,
    num_tokens: int,
    max_tokens: int,
    encode: Encode,
    decode: Decode,
    *,
    salt: str,
) -> GenRequest:
    """One request of a given prompt length (the one that joins a running stream)."""
    rng = random.Random(f"{spec.seed}:long:{salt}")
    prompt, ids = exact_prompt(rng, num_tokens, encode, decode)
    return GenRequest(prompt, ids, max_tokens)
