"""Greedy generation equals transformers' own ``generate`` reading the same folder, token for
token, for every family: alone, with 15 other sequences of other lengths running, and with
prompts prefilled in chunks; where a token differs, it is a tie (``generators.differences``)."""

import pytest

from generation import EngineConfig
from models import SamplingParams
from tests.generators import (
    FAMILIES,
    differences,
    engine_outputs,
    load,
    prompts_for,
    reference,
    tiny_generator,
)

LENGTHS = [3, 40, 170, 9, 65, 120, 21, 200, 5, 88, 31, 14, 150, 7, 50, 101]
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    folder = tiny_generator(tmp_path_factory.mktemp("generators"), request.param)
    model = load(folder)
    prompts = prompts_for(model, LENGTHS)
    return folder, model, prompts, reference(folder, prompts, MAX_TOKENS)


async def test_alone_equals_generate(family):
    _, model, prompts, references = family
    for prompt, ref in zip(prompts[:4], references[:4], strict=True):
        (ours,) = await engine_outputs(model, [prompt], MAX_TOKENS)
        assert ours == ref.tokens


async def test_with_fifteen_others_equals_generate(family):
    _, model, prompts, references = family
    outputs = await engine_outputs(model, prompts, MAX_TOKENS)
    differing = sum(differences(o, r) for o, r in zip(outputs, references, strict=True))
    assert differing <= 1, f"{differing} of {len(prompts)} sequences differ (ties)"


async def test_prefilled_in_chunks_equals_generate(family):
    """Chunks of 24 tokens: every long prompt crosses chunk boundaries (and Gemma 3's
    16-token window) while the others decode."""
    _, model, prompts, references = family
    config = EngineConfig(max_step_tokens=64, default_prefill_tokens=24, prefill_time_factor=1.01)
    outputs = await engine_outputs(model, prompts, MAX_TOKENS, config=config)
    differing = sum(differences(o, r) for o, r in zip(outputs, references, strict=True))
    assert differing <= 1


async def test_a_seed_gives_the_same_text_whatever_else_runs(family):
    _, model, prompts, _ = family
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7)
    (alone,) = await engine_outputs(model, [prompts[1]], MAX_TOKENS, sampling=[seeded])
    others = [SamplingParams(temperature=0.8, seed=i) for i in range(len(prompts))]
    others[1] = seeded
    batched = await engine_outputs(model, prompts, MAX_TOKENS, sampling=others)
    assert batched[1] == alone
