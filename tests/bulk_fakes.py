"""A fake embedder for unit tests of bulk jobs: cost is words + 2, the embedding a function of
the text alone (so any batching gives the same bytes), batches recorded."""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from models import Item, ModelInfo, ModelOutOfMemory
from tests.fakes import SHAPE

DIM = 4


def expected_embedding(text: str) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")
    vector = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    return vector / np.linalg.norm(vector)


class FakeEmbedder:
    """``oom_above_tokens``: a batch with more padded tokens raises ``ModelOutOfMemory``.
    ``stop_after`` batches (not counting warm-up), ``interrupt`` is raised: a crash."""

    def __init__(
        self,
        *,
        task: str = "embed",
        name: str = "fake",
        max_input_tokens: int = 64,
        oom_above_tokens: int | None = None,
        stop_after: int | None = None,
        interrupt: BaseException | None = None,
    ) -> None:
        self.info = ModelInfo(
            name=name, task=task, device="cpu", dtype="float32",
            max_input_tokens=max_input_tokens, num_parameters=1,
            output_dim=DIM if task == "embed" else None, shape=SHAPE,
        )  # fmt: skip
        self.oom_above_tokens = oom_above_tokens
        self.stop_after = stop_after
        self.interrupt = interrupt or KeyboardInterrupt()
        self.batches: list[list[str]] = []
        self.prepared_on: set[str] = set()

    def prepare(self, inputs: Sequence[str], *, truncate: bool) -> list[Item]:
        self.prepared_on.add(threading.current_thread().name)
        limit = self.info.max_input_tokens
        return [Item(data=text, cost=min(limit, len(text.split()) + 2)) for text in inputs]

    def prepare_pairs(self, query: str, documents: Sequence[str], *, truncate: bool = True):
        return self.prepare([orjson.dumps([query, d]).decode() for d in documents], truncate=True)

    def synthetic_items(self, num_items: int, length: int) -> list[Item]:
        return [Item(data=None, cost=length) for _ in range(num_items)]

    def forward(self, items: Sequence[Item]) -> list[Any]:
        padded = len(items) * max(item.cost for item in items)
        if self.oom_above_tokens is not None and padded > self.oom_above_tokens:
            raise ModelOutOfMemory(f"fake OOM at {len(items)} items", requested_bytes=2**20)
        if all(item.data is None for item in items):
            return [np.zeros(DIM, np.float32) for _ in items]  # warm-up
        self.batches.append([item.data for item in items])
        if self.stop_after is not None and len(self.batches) > self.stop_after:
            raise self.interrupt
        if self.info.task == "classify":
            return [{"label": f"L{len(t) % 3}", "score": 0.5} for t in (i.data for i in items)]
        if self.info.task == "rerank":
            return [len(item.data) / 1000 for item in items]
        return [expected_embedding(item.data) for item in items]


def fake_embedder() -> FakeEmbedder:
    """Entry point for ``--model python:tests.bulk_fakes:fake_embedder``."""
    return FakeEmbedder()


def other_fake_embedder() -> FakeEmbedder:
    return FakeEmbedder(name="other")


HANG_ONCE = "hang once: "
HANG_ALWAYS = "hang: "
HANG_HOLDING_GIL = "hang holding the GIL: "
SLOW_WRITE_ENV = "BATCHFIT_FAKE_SLOW_WRITE_S"


class HangingEmbedder(FakeEmbedder):
    """A pass holding the input ``HANG_ONCE + path`` never returns (a hung device) where no
    file is at ``path``, which it makes first: a rerun, or a retry in a process started
    again, goes through. A pass holding an input that starts with ``HANG_ALWAYS`` never
    returns, whenever it runs; with ``HANG_HOLDING_GIL``, it never returns and holds the GIL
    all the while (a regular expression that backtracks for ever: C code that does not let
    the GIL go), so that no other Python thread runs. With ``BATCHFIT_FAKE_SLOW_WRITE_S``,
    the job's writer takes that long over each part (a slow disk), so that parts are still
    being written when a pass hangs."""

    def forward(self, items: Sequence[Item]) -> list[Any]:
        for item in items:
            if isinstance(item.data, str) and item.data.startswith(HANG_ALWAYS):
                threading.Event().wait()
            if isinstance(item.data, str) and item.data.startswith(HANG_HOLDING_GIL):
                re.match(r"(a+)+$", "a" * 64 + "!")
            if isinstance(item.data, str) and item.data.startswith(HANG_ONCE):
                marker = Path(item.data.removeprefix(HANG_ONCE))
                if not marker.exists():
                    marker.touch()
                    threading.Event().wait()
        return super().forward(items)


def hanging_embedder() -> HangingEmbedder:
    """Entry point for ``--model python:tests.bulk_fakes:hanging_embedder``."""
    slow_write_s = float(os.environ.get(SLOW_WRITE_ENV, "0"))
    if slow_write_s:
        import bulk.pipeline

        write = bulk.pipeline.write_atomically

        def slow_write(*args: Any, **kwargs: Any) -> Any:
            time.sleep(slow_write_s)
            return write(*args, **kwargs)

        bulk.pipeline.write_atomically = slow_write
    return HangingEmbedder()
