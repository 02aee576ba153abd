"""LLM rerankers in-process: a tiny random Qwen3ForCausalLM in Qwen3-Reranker's layout scores
pairs as the model card computes them with transformers (``tests/families.py``), batched or
alone, with either padding side; its inputs are the card's token ids; the folder's name or
the task makes a causal LM a reranker; what it cannot do is refused clearly."""

from __future__ import annotations

import json
import pickle
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma2Config,
    GraniteConfig,
)

from models import InputTooLong, ModelLoadError, ModelSpec, load_model, resolve_prompt
from models.llm_rerank import QWEN3_RERANKER, LLMReranker, YesNoHead, names_a_reranker
from models.llm_rerank.model import load_llm_reranker
from models.loading import detect_task
from server.errors import ApiError
from server.runtime.slot import prepare_call
from tests.families import (
    QUERY,
    TEXTS,
    build_qwen3_reranker,
    quiet,
    qwen3_reranker_inputs,
    qwen3_reranker_scores,
    qwen3_reranker_tokenizer,
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("llm-rerank") / "Qwen3-Reranker-tiny"
    with quiet():
        build_qwen3_reranker(out)
    return out


@pytest.fixture(scope="module")
def reranker(folder):
    model = load_model(ModelSpec(model=str(folder), device="cpu", dtype="float32"))
    assert isinstance(model, LLMReranker)
    return model


def scores(model, documents, **options):
    return np.array(model.forward(model.prepare_pairs(QUERY, documents, **options)))


def test_scores_equal_the_model_cards_batched_and_alone(reranker, folder):
    batched = scores(reranker, TEXTS)
    alone = np.array([scores(reranker, [text])[0] for text in TEXTS])
    card_batch = qwen3_reranker_scores(folder, QUERY, TEXTS)
    card_alone = qwen3_reranker_scores(folder, QUERY, TEXTS, batch_size=1)
    # Random weights drawn wide: the scores spread, so a wrong token or position shows.
    assert batched.max() - batched.min() > 0.3, batched
    np.testing.assert_allclose(batched, card_batch, atol=1e-5)
    np.testing.assert_allclose(batched, card_alone, atol=1e-5)
    np.testing.assert_allclose(alone, card_alone, atol=1e-5)


def test_pairs_are_the_model_cards_token_ids(reranker, folder):
    with quiet():
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    items = reranker.prepare_pairs(QUERY, TEXTS)
    expected = qwen3_reranker_inputs(tokenizer, QUERY, TEXTS)
    assert [item.data.ids for item in items] == expected
    assert [item.cost for item in items] == [len(ids) for ids in expected]
    # The two long texts are cut to the model's 128 positions, the prompt's end kept.
    assert max(item.cost for item in items) == reranker.info.max_input_tokens == 128
    suffix = tokenizer.encode(QWEN3_RERANKER.suffix, add_special_tokens=False)
    assert items[-1].data.ids[-len(suffix) :] == suffix


def test_a_prompt_is_the_instruction(reranker, folder):
    instruction = "Find passages about cats"
    ours = scores(reranker, TEXTS[:6], prompt=instruction)
    card = qwen3_reranker_scores(folder, QUERY, TEXTS[:6], instruction=instruction)
    np.testing.assert_allclose(ours, card, atol=1e-5)
    assert np.abs(ours - scores(reranker, TEXTS[:6])).max() > 1e-3


def test_a_lower_max_input_tokens_cuts_as_the_card_does(folder):
    model = load_model(
        ModelSpec(model=str(folder), device="cpu", dtype="float32", max_input_tokens=110)
    )
    with quiet():
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    items = model.prepare_pairs(QUERY, TEXTS)
    assert [item.data.ids for item in items] == qwen3_reranker_inputs(
        tokenizer, QUERY, TEXTS, max_length=110
    )
    np.testing.assert_allclose(
        scores(model, TEXTS), qwen3_reranker_scores(folder, QUERY, TEXTS, max_length=110),
        atol=1e-5,
    )  # fmt: skip
    with pytest.raises(InputTooLong, match="more than the model's maximum of 110"):
        model.prepare_pairs(QUERY, TEXTS, truncate=False)


@pytest.mark.parametrize("side", ["left", "right"])
def test_the_head_reads_each_rows_last_real_token_on_either_padding_side(folder, side):
    with quiet():
        tokenizer = AutoTokenizer.from_pretrained(str(folder), padding_side=side)
        causal = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = qwen3_reranker_inputs(tokenizer, QUERY, TEXTS)
    head = YesNoHead.from_causal_lm(
        causal, tokenizer.convert_tokens_to_ids("no"), tokenizer.convert_tokens_to_ids("yes"),
        probe_ids=ids[0], name="tiny",
    )  # fmt: skip
    with quiet():
        batch = tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt")
    assert (batch["attention_mask"] == 0).any()  # really padded
    with torch.inference_mode():
        padded = torch.sigmoid(head(**batch).logits[:, 0]).numpy()
    card_alone = qwen3_reranker_scores(folder, QUERY, TEXTS, batch_size=1)
    np.testing.assert_allclose(padded, card_alone, atol=1e-5)


def test_the_model_card_says_a_decoder_scored_through_sigmoid(reranker):
    info = reranker.info
    assert (info.task, info.activation, info.shape.architecture) == ("rerank", "sigmoid", "decoder")
    assert info.output_dim is None


@pytest.mark.parametrize(
    ("model_type", "source", "expected"),
    [
        ("qwen3", "Qwen/Qwen3-Reranker-0.6B", True),
        ("qwen3", "/models/qwen3-reranker-4b/", True),
        ("qwen3", "Qwen/Qwen3-0.6B", False),
        ("qwen3", "/models/rerankers/qwen3-chat", False),  # only the last part counts
        ("llama", "/models/llama-reranker", False),  # another prompt: told, not guessed
        (None, "Qwen3-Reranker-0.6B", False),
    ],
)
def test_which_names_make_a_reranker(model_type, source, expected):
    assert names_a_reranker(model_type, source) is expected


def test_the_task_is_read_from_the_name_or_given(folder):
    config = AutoConfig.from_pretrained(str(folder))
    assert detect_task(config, "auto", folder, source=str(folder)) == "rerank"
    assert detect_task(config, "auto", folder, source="/models/qwen3-chat") == "generate"
    assert detect_task(config, "rerank", folder, source="/models/qwen3-chat") == "rerank"


def test_a_causal_lm_told_to_rerank_is_an_llm_reranker(folder, reranker, tmp_path):
    plain = shutil.copytree(folder, tmp_path / "tiny-qwen3")
    model = load_model(ModelSpec(model=str(plain), task="rerank", device="cpu", dtype="float32"))
    assert isinstance(model, LLMReranker)
    np.testing.assert_allclose(scores(model, TEXTS[:4]), scores(reranker, TEXTS[:4]), atol=0)


def test_a_vocabulary_without_the_answer_tokens_is_refused(folder):
    config = AutoConfig.from_pretrained(str(folder))
    template = replace(QWEN3_RERANKER, true_token="oui")
    with pytest.raises(ModelLoadError, match="has no 'oui' token to score with"):
        load_llm_reranker(
            str(folder), config, ModelSpec(model=str(folder)), name="tiny",
            dtype=torch.float32, device=torch.device("cpu"), template=template,
        )  # fmt: skip


def test_a_context_too_short_for_the_prompt_is_refused(folder):
    with pytest.raises(ModelLoadError, match="leaving no room for a query and a document"):
        load_model(ModelSpec(model=str(folder), device="cpu", max_input_tokens=40))


def test_the_preparer_pickles_and_tokenizes_alike(reranker):
    preparer = pickle.loads(pickle.dumps(reranker.preparer()))
    ours = reranker.prepare_pairs(QUERY, TEXTS, prompt="Find code")
    theirs = preparer.prepare_pairs(QUERY, TEXTS, prompt="Find code")
    assert [item.data.ids for item in theirs] == [item.data.ids for item in ours]


@pytest.mark.parametrize("owner", ["model", "preparer"])
def test_a_chosen_truncation_side_is_refused_with_400(reranker, owner):
    target = reranker if owner == "model" else reranker.preparer()
    with pytest.raises(ApiError) as raised:
        prepare_call(
            target, TEXTS, name="rr", truncate=True, query=QUERY, prompt=None,
            truncation_direction="left",
        )  # fmt: skip
    assert (raised.value.status, raised.value.error_type) == (400, "unsupported_parameter")


def test_sentence_transformers_layout_of_an_llm_reranker_is_refused(folder, tmp_path):
    from sentence_transformers import CrossEncoder

    out = tmp_path / "st-Qwen3-Reranker"
    with quiet():
        CrossEncoder(str(folder), device="cpu").save(str(out))  # Transformer + LogitScore
    with pytest.raises(ModelLoadError, match="LogitScore', which Batchfit cannot run"):
        load_model(ModelSpec(model=str(out), device="cpu"))


def tiny_causal_lm(folder, config_class, architecture, **options):
    """Another family's causal LM with the reranker's tokenizer (it has "yes" and "no")."""
    folder.mkdir(parents=True)
    with quiet():
        ids = qwen3_reranker_tokenizer(folder)
        torch.manual_seed(23)
        config = config_class(
            vocab_size=ids["vocab_size"], hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=128, initializer_range=0.2,
            pad_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
            bos_token_id=ids["<|im_start|>"], architectures=[architecture], **options,
        )  # fmt: skip
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def test_a_final_soft_cap_is_applied_as_the_causal_lm_applies_it(tmp_path):
    # Gemma 2 caps its logits with tanh; a cap this low changes every score.
    folder = tiny_causal_lm(
        tmp_path / "gemma2", Gemma2Config, "Gemma2ForCausalLM", head_dim=8,
        final_logit_softcapping=0.5,
    )  # fmt: skip
    model = load_model(ModelSpec(model=str(folder), task="rerank", device="cpu", dtype="float32"))
    card = qwen3_reranker_scores(folder, QUERY, TEXTS, batch_size=1)
    np.testing.assert_allclose(scores(model, TEXTS), card, atol=1e-5)


def test_a_head_that_does_more_than_its_rows_is_refused(tmp_path):
    # Granite divides its logits by logits_scaling after the head.
    folder = tiny_causal_lm(tmp_path / "granite", GraniteConfig, "GraniteForCausalLM",
                            logits_scaling=4.0)  # fmt: skip
    with pytest.raises(ModelLoadError, match="logits are not its head's rows applied"):
        load_model(ModelSpec(model=str(folder), task="rerank", device="cpu", dtype="float32"))


def test_the_models_default_prompt_is_its_instruction(folder, reranker, tmp_path):
    instruction = "Find code that answers the query"
    configured = shutil.copytree(folder, tmp_path / "Qwen3-Reranker-code")
    settings = {"prompts": {"code": instruction}, "default_prompt_name": "code"}
    (configured / "config_sentence_transformers.json").write_text(json.dumps(settings))
    model = load_model(ModelSpec(model=str(configured), device="cpu", dtype="float32"))
    assert model.info.default_prompt_name == "code"
    # As a request's tokenization gets it: the model's default prompt, resolved by name.
    prompt = resolve_prompt(model.info, None, None, name="rr")
    items = prepare_call(model, TEXTS[:4], name="rr", truncate=True, query=QUERY, prompt=prompt)()
    expected = reranker.prepare_pairs(QUERY, TEXTS[:4], prompt=instruction)
    assert [item.data.ids for item in items] == [item.data.ids for item in expected]
    card = qwen3_reranker_scores(folder, QUERY, TEXTS[:4], instruction=instruction)
    np.testing.assert_allclose(model.forward(items), card, atol=1e-5)
