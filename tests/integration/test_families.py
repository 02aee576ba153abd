"""Every model family people serve, each a tiny random-weight model in its real layout, all
served by one real replica and compared with sentence-transformers (or transformers'
pipeline) reading the same folder: embeddings, prompts, decoders with either padding side,
cross-encoders, a multi-label classifier, Matryoshka dimensions, the model card and the
errors. ``python -m scripts.parity_table`` prints the same comparison as a table."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from transformers import AutoTokenizer

from tests.families import FAMILIES, LABELS, MAX_TOKENS, TEXTS, build_all, measure, quiet
from tests.servers import run_server

pytestmark = pytest.mark.integration

BY_NAME = {family.name: family for family in FAMILIES}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    # Each model is served under a name other than its folder's: what a client is told names
    # the model as it called it.
    built = build_all(tmp_path_factory.mktemp("families"))
    return {
        name: folder.rename(folder.with_name(f"{name}-files")) for name, folder in built.items()
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory, folders):
    flags = [flag for name, folder in folders.items() for flag in ("--model", f"{name}={folder}")]
    with run_server(
        tmp_path_factory.mktemp("families-server"), *flags, "--max-batch-size", "16",
        "--max-wait-ms", "2",
    ) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_every_family_equals_its_reference_batched_and_alone(server, folders, family):
    parity = measure(server.url, family, folders[family.name])
    assert parity.checked >= len(TEXTS)
    assert parity.notes == []
    if family.kind == "embed":
        assert parity.worst_cosine is not None and parity.worst_cosine >= 0.9999, parity
        assert parity.max_abs_diff <= 1e-4, parity
    else:
        assert parity.max_abs_diff <= 1e-5, parity
    assert parity.batched_vs_single <= 1e-5, parity


def reference_model(folder):
    from sentence_transformers import SentenceTransformer

    with quiet():
        return SentenceTransformer(str(folder), device="cpu")


def encode(model, **kwargs):
    with quiet():
        return model.encode(TEXTS, show_progress_bar=False, convert_to_numpy=True, **kwargs)


@pytest.mark.parametrize("name", ["bert-prompts", "qwen3", "bert-mean-raw"])
def test_matryoshka_dimensions_keep_the_first_values_renormalised(client, folders, name):
    reference = reference_model(folders[name])
    normalises = name != "bert-mean-raw"
    # sentence-transformers truncates; it renormalises when asked to.
    expected = encode(reference, truncate_dim=8, normalize_embeddings=normalises)
    infer = client.post("/v1/infer", json={"model": name, "inputs": TEXTS, "dimensions": 8})
    embeddings = client.post("/v1/embeddings", json={"model": name, "input": TEXTS,
                                                     "dimensions": 8})  # fmt: skip
    assert infer.status_code == embeddings.status_code == 200, (infer.text, embeddings.text)
    for vectors in (
        np.array(infer.json()["outputs"]),
        np.array([d["embedding"] for d in embeddings.json()["data"]]),
    ):
        assert vectors.shape == (len(TEXTS), 8)
        norms = np.linalg.norm(vectors, axis=1)
        if normalises:
            np.testing.assert_allclose(norms, 1.0, atol=1e-5)
        else:
            assert np.abs(norms - 1).max() > 0.1  # really not renormalised
        np.testing.assert_allclose(vectors, expected, atol=1e-5)
    full = np.array(
        client.post("/v1/infer", json={"model": name, "inputs": TEXTS}).json()["outputs"]
    )
    np.testing.assert_allclose(
        client.post("/v1/infer", json={"model": name, "inputs": TEXTS, "dimensions": 32}).json()[
            "outputs"
        ],
        full, atol=0,
    )  # fmt: skip


def hf_token_counts(folder, texts):
    with quiet():
        tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(texts, truncation=True, max_length=MAX_TOKENS)["input_ids"]
    return [len(row) for row in ids], ids, tokenizer


@pytest.mark.parametrize(
    ("name", "body", "prompt"),
    [
        ("bert-prompts", {}, "query: "),  # the model's default prompt
        ("bert-prompts", {"prompt_name": "passage"}, "passage: "),
        ("bert-prompts", {"prompt": ""}, ""),
        ("qwen3", {"prompt_name": "query"}, None),
    ],
)  # fmt: skip
def test_prompt_tokens_count_in_usage(client, folders, name, body, prompt):
    if prompt is None:  # the instruction, as the model's configuration holds it
        prompt = reference_model(folders[name]).prompts["query"]
    counts, ids, tokenizer = hf_token_counts(folders[name], [prompt + t for t in TEXTS])
    if name == "qwen3":  # the family's convention: every input ends with end-of-text
        assert {row[-1] for row in ids} == {tokenizer.eos_token_id}
    answer = client.post("/v1/infer", json={"model": name, "inputs": TEXTS, **body}).json()
    assert answer["usage"]["input_tokens"] == sum(counts)
    openai = client.post("/v1/embeddings", json={"model": name, "input": TEXTS, **body}).json()
    assert openai["usage"]["prompt_tokens"] == sum(counts)


def test_classifier_top_k_ranks_every_label_and_caps_at_their_number(client):
    body = {"model": "multi-label", "inputs": TEXTS[:3]}
    capped = client.post("/v1/infer", json=body | {"top_k": 10}).json()["outputs"]
    two = client.post("/v1/infer", json=body | {"top_k": 2}).json()["outputs"]
    assert [len(row) for row in capped] == [len(LABELS)] * 3
    assert [row[:2] for row in capped] == two
    assert {o["label"] for o in capped[0]} == set(LABELS.values())
    for row in capped:  # best first
        assert [o["score"] for o in row] == sorted((o["score"] for o in row), reverse=True)


def test_the_model_card_shows_pooling_normalisation_prompts_and_dimensions(client, server):
    cards = {card["name"]: card for card in client.get("/v1/models").json()["models"]}
    assert list(cards) == [family.name for family in FAMILIES]
    expected = {
        "pooling": "cls", "normalize": True, "output_dim": 32, "architecture": "encoder",
        "prompts": {"query": "", "document": ""}, "default_prompt_name": None,
        "activation": None,
    }  # fmt: skip
    assert {key: cards["bert-cls"][key] for key in expected} == expected
    assert (cards["bert-mean-raw"]["pooling"], cards["bert-mean-raw"]["normalize"]) == (
        "mean", False,
    )  # fmt: skip
    assert cards["bert-dense"]["output_dim"] == 16
    assert cards["bert-instructor"]["pooling"] == "weightedmean+mean_sqrt_len_tokens"
    assert cards["bert-instructor"]["output_dim"] == 64
    prompts = cards["bert-prompts"]
    assert prompts["prompts"]["passage"] == "passage: "
    assert prompts["default_prompt_name"] == "query"
    assert (cards["qwen3"]["architecture"], cards["qwen3"]["pooling"]) == ("decoder", "lasttoken")
    assert cards["ce-identity"]["activation"] == "identity"
    assert cards["ce-sigmoid"]["activation"] == "sigmoid"
    assert cards["multi-label"]["activation"] == "sigmoid"
    log = server.log()
    assert "bert-cls (embed: cls pooling, normalised, 32 dims; prompts document, query " in log
    assert (
        "bert-prompts (embed: mean pooling, normalised, 32 dims; prompts document, passage, "
        "query (default query))" in log
    )
    assert "ce-identity (rerank: identity), ce-sigmoid (rerank: sigmoid)" in log


@pytest.mark.parametrize(
    ("path", "body", "status", "error_type", "needle"),
    [
        ("/v1/infer", {"model": "bert-prompts", "prompt_name": "title"}, 400, "unknown_prompt",
         "'passage', 'query'"),
        ("/v1/infer", {"model": "bert-cls", "dimensions": 33}, 400, "invalid_dimensions",
         "from 1 to 32"),
        ("/v1/infer", {"model": "bert-cls", "dimensions": 0}, 400, "invalid_dimensions",
         "got 0"),
        ("/v1/infer", {"model": "multi-label", "dimensions": 2}, 400, "unsupported_parameter",
         "embedding models"),
        ("/v1/infer", {"model": "bert-cls", "top_k": 2}, 400, "unsupported_parameter",
         "classifiers"),
        ("/v1/infer", {"model": "multi-label", "top_k": 0}, 422, "invalid_top_k", "at least 1"),
        ("/v1/infer", {"model": "bert-prompts", "prompt_name": "query", "prompt": "x"}, 422,
         "invalid_request", "not both"),
    ],
)  # fmt: skip
def test_bad_options_are_refused_with_their_message(client, path, body, status, error_type, needle):
    response = client.post(path, json={"inputs": ["hello"], **body})
    assert response.status_code == status, response.text
    assert response.json()["error_type"] == error_type
    message = response.json()["error"]
    assert needle in message
    if error_type in ("unknown_prompt", "invalid_dimensions", "unsupported_parameter"):
        assert repr(body["model"]) in message  # the name it is served under
    assert "-files" not in message


@pytest.mark.parametrize(
    ("body", "code", "param", "needle"),
    [
        ({"prompt_name": "title"}, "unknown_prompt", "prompt_name", "'passage'"),
        ({"dimensions": 33}, "invalid_dimensions", "dimensions", "from 1 to 32"),
        ({"dimensions": -1}, "invalid_dimensions", "dimensions", "got -1"),
    ],
)  # fmt: skip
def test_openai_route_refuses_bad_options_in_its_shape(client, body, code, param, needle):
    response = client.post(
        "/v1/embeddings", json={"model": "bert-prompts", "input": "hello", **body}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param)
    assert needle in error["message"]
    assert "'bert-prompts'" in error["message"] and "-files" not in error["message"]


def test_kserve_v2_parameters_choose_the_prompt_too(client):
    texts = TEXTS[:3]
    v2 = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [3], "data": texts}]}
    native = client.post(
        "/v1/infer", json={"model": "bert-prompts", "inputs": texts, "prompt_name": "passage"}
    ).json()["outputs"]
    answer = client.post(
        "/v2/models/bert-prompts/infer", json=v2 | {"parameters": {"prompt_name": "passage"}}
    )
    assert answer.status_code == 200, answer.text
    [tensor] = answer.json()["outputs"]
    np.testing.assert_allclose(np.array(tensor["data"]).reshape(3, -1), native, atol=1e-6)
    unknown = client.post(
        "/v2/models/bert-prompts/infer", json=v2 | {"parameters": {"prompt_name": "title"}}
    )
    assert unknown.status_code == 400 and "'passage'" in unknown.json()["error"]
