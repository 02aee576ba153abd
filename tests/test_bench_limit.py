"""The benchmark's limit runs plain transformers calls, not the server's forward pass, so the
two must do the same work: a product forward that ran the module twice (2x) would otherwise
leave every ratio of the benchmark unchanged. Counted in floating-point operations (torch's
``FlopCounterMode``), not timed: on a shared VM even one thread's CPU time moved by half
between two interleaved runs of the same work."""

from __future__ import annotations

import random
import threading

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from bench.limit import measure_limit
from bench.plain import load_plain_encoder
from models import ModelSpec, load_model
from tests.reference import reference_embeddings

FACTOR = 1.01
"""The product's forward (collate, model, pooling) over the plain calls (tokenizer, model,
pooling), in floating-point operations: within this factor either way. Equal here; running
the module twice is 2."""
WORDS = ["memory", "batch", "split", "token", "model", "server", "queue", "latency", "probe"]


def texts(seed: int, count: int, words: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(count)]


def on_one_thread(fn):
    """Run ``fn`` on a fresh thread with one torch thread (torch's count is per thread)."""
    found = []

    def run():
        torch.set_num_threads(1)
        found.append(fn())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(300)
    return found[0]


def flops(fn) -> int:
    """The floating-point operations torch counts while ``fn`` runs."""
    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return counter.get_total_flops()


def test_the_products_forward_costs_what_the_plain_calls_cost():
    batch = texts(seed=1, count=8, words=120)  # 8 inputs of about 120 tokens

    def measure():
        plain = load_plain_encoder()
        product = load_model(ModelSpec(device="cpu", num_threads=1))

        def run_product():
            return product.forward(product.prepare(batch, truncate=True))

        got, want = np.asarray(run_product()), plain.encode(batch).numpy()
        cosines = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
        return cosines.min(), flops(run_product), flops(lambda: plain.encode(batch))

    worst_cosine, product_flops, plain_flops = on_one_thread(measure)
    assert worst_cosine >= 0.9999
    assert plain_flops > 0
    ratio = product_flops / plain_flops
    assert 1 / FACTOR <= ratio <= FACTOR, (product_flops, plain_flops)


def test_the_limit_encodes_what_plain_transformers_encodes():
    inputs = texts(seed=2, count=12, words=40) + texts(seed=3, count=4, words=300)  # truncated
    encoder = load_plain_encoder()
    assert encoder.max_length == 256
    assert encoder.token_counts(inputs)[-1] == 256
    expected = reference_embeddings(inputs)  # tests/reference.py: the suite's own reference
    got = encoder.encode(inputs).numpy()
    assert np.abs(got - expected).max() < 1e-4
    result = measure_limit(encoder, inputs, max_items=8, max_tokens=4096)
    assert result.num_inputs == 16 and result.inputs_per_s > 0
    assert result.num_threads == torch.get_num_threads()
