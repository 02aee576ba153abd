"""Where tokenizing belongs: inline on the event loop, or on the tokenizer thread.

``python -m bench.tokenize`` tokenizes requests of growing size with the bundled model's
tokenizer, as the server does (``model.prepare``), both ways, on an event loop like the
server's (uvloop), and prints what each costs the event loop's thread in CPU time and the
request in wall time. The Rust tokenizer lets go of the GIL while it encodes, so off the loop
the loop pays only for the hand-off, whatever the size; inline it pays for the whole encode.
The inline threshold belongs where the encode starts to cost the loop more than the hand-off.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from batching import ModelThread

from .workload import make_text

SIZES_CHARS = (64, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True, slots=True)
class TokenizeCost:
    chars: int
    tokens: int
    inline_loop_us: float
    """Event-loop CPU time of tokenizing inline (the whole encode)."""
    offloaded_loop_us: float
    """Event-loop CPU time of handing the encode to the tokenizer thread and back."""
    offloaded_wall_us: float
    """Wall time of the handed-off encode, as the request waits for it."""


def texts_of(chars: int, count: int, seed: int = 0) -> list[str]:
    rng = random.Random(f"{seed}:{chars}")
    texts = []
    for _ in range(count):
        text = ""
        while len(text) < chars:
            text += make_text(rng, 40) + " "
        texts.append(text[:chars])
    return texts


async def _measure(
    prepare: Callable[[Sequence[str]], Any], texts: list[str], repeats: int
) -> tuple[float, float, float]:
    pool = ModelThread("tokenize")  # the server's hand-off to its tokenizer thread
    await pool.call(int)
    inline, off_cpu, off_wall = [], [], []
    for i in range(repeats):
        batch = [texts[i % len(texts)]]
        started = time.thread_time()
        prepare(batch)
        inline.append(time.thread_time() - started)
        started, wall = time.thread_time(), time.perf_counter()
        await pool.call(prepare, batch)
        off_cpu.append(time.thread_time() - started)
        off_wall.append(time.perf_counter() - wall)
    pool.close()
    return (
        statistics.median(inline) * 1e6,
        statistics.median(off_cpu) * 1e6,
        statistics.median(off_wall) * 1e6,
    )


def measure(sizes: Sequence[int] = SIZES_CHARS, repeats: int = 200) -> list[TokenizeCost]:
    import uvloop

    from models import ModelSpec, load_model

    model = load_model(ModelSpec())

    def prepare(texts: Sequence[str]) -> Any:
        return model.prepare(texts, truncate=True)

    costs = []
    for chars in sizes:
        texts = texts_of(chars, 16)
        tokens = len(model.preparer()._full.encode(texts[0]).ids)  # type: ignore[attr-defined]
        inline, off_cpu, off_wall = uvloop.run(_measure(prepare, texts, repeats))
        costs.append(TokenizeCost(chars, tokens, inline, off_cpu, off_wall))
    return costs


def crossover(costs: Sequence[TokenizeCost]) -> int | None:
    """The smallest size from which inline costs the loop more than the hand-off."""
    for cost in costs:
        if cost.inline_loop_us > cost.offloaded_loop_us:
            return cost.chars
    return None


def render(costs: Sequence[TokenizeCost]) -> str:
    lines = [
        "| chars | tokens | inline: loop CPU us | off the loop: loop CPU us | off: wall us |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in costs:
        lines.append(
            f"| {c.chars} | {c.tokens} | {c.inline_loop_us:.0f} | {c.offloaded_loop_us:.0f} "
            f"| {c.offloaded_wall_us:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tokenize", description=__doc__)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)
    costs = measure(repeats=args.repeats)
    print(render(costs))
    print(f"\ninline costs the loop more than the hand-off from {crossover(costs)} characters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
