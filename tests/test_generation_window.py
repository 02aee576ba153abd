"""Gemma 3's sliding-window layers keep only their window of keys and values: a sequence far
past its window decodes token for token as transformers' ``generate`` does, and the store
holds its full-attention layers' positions and a window's worth of the others."""

import pytest

from generation import EngineConfig
from models import SamplingParams, SeqChunk, StepRequest
from tests.generators import engine_outputs, load, prompts_for, reference, tiny_generator

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    folder = tiny_generator(tmp_path_factory.mktemp("window"), "gemma3_text")
    return folder, load(folder)


async def test_decoding_far_past_the_window_equals_generate(gemma):
    """A window of 16 and a store window of 128 positions: 160 tokens after a 40-token
    prompt move the live positions to the front twice; a 200-token prompt in chunks of 24
    crosses it too."""
    folder, model = gemma
    assert model.store.window_tokens == 128
    prompts = prompts_for(model, [40, 200])
    (ref_short, ref_long) = reference(folder, prompts, 160)
    (alone,) = await engine_outputs(model, prompts[:1], 160)
    assert alone == ref_short.tokens
    chunked = EngineConfig(max_step_tokens=64, default_prefill_tokens=24, prefill_time_factor=1.01)
    outputs = await engine_outputs(model, prompts, 160, config=chunked)
    assert outputs == [ref_short.tokens, ref_long.tokens]


def test_the_store_holds_a_window_of_the_sliding_layers(gemma):
    _, model = gemma
    store = model.store
    per_layer = store.bytes_per_token // 6
    assert store.window_bytes_per_token == 5 * per_layer  # five of six layers slide
    store.clear()  # what the engine of the test before left at its stop
    before, seq_id = store.bytes_held, 10_000
    # A 400-token prompt in one chunk holds every position while it is prefilled ...
    model.step(StepRequest([SeqChunk(seq_id, list(range(5, 405)), 0, GREEDY)]))
    assert store.bytes_held - before == 448 * store.bytes_per_token
    # ... and once it decodes, its sliding layers keep the window (128 positions) only.
    result = model.step(StepRequest([SeqChunk(seq_id, [7], 400, GREEDY)]))
    held = store.bytes_held - before
    assert held == (448 + 5 * 128) * per_layer
    # What it holds past its 401 positions: the full layer's capacity ahead of them.
    assert result.slack_bytes == (448 - 401) * per_layer
    assert held <= store.sequence_bytes(401) + 64 * per_layer
    assert held < 0.5 * 401 * store.bytes_per_token  # every layer would hold 401
    model.step(StepRequest([], free=[seq_id], forget=[seq_id]))
    assert store.bytes_held == before
