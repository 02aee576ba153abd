"""The LM head's rows and the greedy pick: a few sampled rows padded up to a wider product
(the outputs still ``generate``'s), and the blocked argmax equal to torch's own."""

import pytest
import torch

from models.causal.head import PAD_ROWS, head_rows, padded_rows, padding_threshold
from models.causal.sampling import ARGMAX_BLOCK, first_argmax
from tests.generators import (
    differences,
    engine_outputs,
    load,
    prompts_for,
    reference,
    tiny_generator,
)

VOCAB = 16 * ARGMAX_BLOCK + 123
"""Whole blocks and a part of one."""


def test_the_blocked_argmax_is_argmax_with_ties_across_and_within_blocks():
    torch.manual_seed(0)
    logits = torch.randn(8, VOCAB)
    logits[0, [5, 3 * ARGMAX_BLOCK + 1]] = 50.0  # a tie across blocks: the first wins
    logits[1, [2 * ARGMAX_BLOCK + 9, 2 * ARGMAX_BLOCK + 7]] = 50.0  # within one block
    logits[2, VOCAB - 1] = 50.0  # in the part block at the end
    logits[3, [VOCAB - 2, VOCAB - 1]] = 50.0
    logits[4] = float("-inf")
    logits[5, ARGMAX_BLOCK - 1] = float("inf")
    assert first_argmax(logits) == logits.argmax(dim=-1).tolist()
    assert first_argmax(logits[[0, 2, 3]]) == [5, VOCAB - 1, VOCAB - 2]


def test_the_blocked_argmax_takes_nan_as_argmax_does():
    logits = torch.randn(3, VOCAB)
    logits[1, 7 * ARGMAX_BLOCK + 3] = float("nan")
    assert first_argmax(logits) == logits.argmax(dim=-1).tolist()


def test_a_few_rows_are_padded_up_to_the_wide_product_and_one_never():
    assert head_rows(1, 2) == 1
    assert head_rows(3, 4) == 3
    assert head_rows(4, 4) == PAD_ROWS
    assert head_rows(PAD_ROWS - 1, 4) == PAD_ROWS
    assert head_rows(PAD_ROWS + 1, 4) == PAD_ROWS + 1
    assert head_rows(7, None) == 7
    assert padded_rows([3, 9, 20, 41], 4) == [3, 9, 20] + [41] * (PAD_ROWS - 3)
    assert padded_rows([], 2) == []


def test_a_small_head_or_one_off_the_cpu_is_never_padded():
    small = torch.nn.Linear(64, 1000, bias=False)
    assert padding_threshold(small, torch.device("cpu")) is None
    assert padding_threshold(None, torch.device("cpu")) is None
    big = torch.nn.Linear(640, 65536, bias=False, device="meta")
    assert padding_threshold(big, torch.device("meta")) is None


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
async def test_padded_head_rows_still_give_generate_s_tokens(family, tmp_path):
    """Every step of 2 to 15 sampled rows computes 16, the last repeated: each sequence
    still gets its own row's token."""
    folder = tiny_generator(tmp_path, family)
    model = load(folder)
    model._pad_from = 2  # type: ignore[attr-defined]
    prompts = prompts_for(model, [3, 40, 17, 9, 65])
    references = reference(folder, prompts, 8)
    outputs = await engine_outputs(model, prompts, 8)
    differing = sum(differences(o, r) for o, r in zip(outputs, references, strict=True))
    assert differing <= 1
