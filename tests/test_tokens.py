"""``POST /tokenize`` and ``POST /detokenize`` on real uvicorn, per model on a replica serving
three with different tokenizers (WordPiece, byte-level BPE, a generator's), against each
model's transformers tokenizer called directly."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from models import BUNDLED_MODEL, ModelSpec, load_model
from models.loading import resolve_model_path
from tests.fakes import ScriptedModel
from tests.families import TEXTS, build_modernbert
from tests.generators import tiny_generator
from tests.inprocess import serve_in_thread

KEY = "tokens-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokens")
    build_modernbert(root / "modernbert")
    generator = tiny_generator(root, "qwen3")
    return {
        "minilm": resolve_model_path(BUNDLED_MODEL), "modernbert": root / "modernbert",
        "generator": generator,
    }  # fmt: skip


@pytest.fixture(scope="module")
def tokenizers(folders):
    return {name: AutoTokenizer.from_pretrained(str(f)) for name, f in folders.items()}


@pytest.fixture(scope="module")
def server(folders):
    models = {
        name: load_model(
            ModelSpec(
                model=str(folder), device="cpu", task="generate" if name == "generator" else "auto"
            )
        )
        for name, folder in folders.items()
    }
    models["scripted"] = ScriptedModel()
    with serve_in_thread(None, models=models, api_key=KEY) as live:
        yield live


def post(server, path: str, body: dict, headers=HEADERS) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("model", ["minilm", "modernbert", "generator"])
def test_tokenize_is_the_models_tokenizer(server, tokenizers, model, add_special_tokens):
    body = {"model": model, "inputs": TEXTS, "add_special_tokens": add_special_tokens,
            "return_offsets": True}  # fmt: skip
    response = post(server, "/tokenize", body)
    assert response.status_code == 200, response.text
    answer = response.json()
    expected = tokenizers[model](
        TEXTS, add_special_tokens=add_special_tokens, return_offsets_mapping=True
    )
    assert answer["model"] == model
    assert answer["tokens"] == expected["input_ids"]
    assert answer["offsets"] == [[list(span) for span in row] for row in expected["offset_mapping"]]
    assert answer["max_input_tokens"] > 0


def test_one_text_without_offsets_and_the_default_model(server, tokenizers):
    answer = post(server, "/tokenize", {"inputs": "The cat sits."}).json()
    assert answer["model"] == "minilm"  # the first served
    assert answer["tokens"] == [tokenizers["minilm"]("The cat sits.")["input_ids"]]
    assert "offsets" not in answer


def test_the_model_field_picks_the_tokenizer(server):
    tokens = {
        model: post(server, "/tokenize", {"model": model, "inputs": TEXTS[1]}).json()["tokens"]
        for model in ("minilm", "modernbert")
    }
    assert tokens["minilm"] != tokens["modernbert"]


@pytest.mark.parametrize("skip_special_tokens", [False, True])
@pytest.mark.parametrize("model", ["minilm", "modernbert", "generator"])
def test_detokenize_is_the_models_decode(server, tokenizers, model, skip_special_tokens):
    tokenizer = tokenizers[model]
    ids = [tokenizer(text)["input_ids"] for text in TEXTS]
    body = {"model": model, "ids": ids, "skip_special_tokens": skip_special_tokens}
    response = post(server, "/detokenize", body)
    assert response.status_code == 200, response.text
    expected = [tokenizer.decode(row, skip_special_tokens=skip_special_tokens) for row in ids]
    assert response.json()["texts"] == expected
    one = post(server, "/detokenize", {"model": model, "ids": ids[2]}).json()
    assert one["texts"] == [tokenizer.decode(ids[2])]


@pytest.mark.parametrize(
    ("path", "body", "status", "error_type"),
    [
        ("/tokenize", {"inputs": []}, 400, "empty_input"),
        ("/tokenize", {"inputs": ["a", ""]}, 400, "empty_input"),
        ("/tokenize", {"inputs": "a", "model": "nope"}, 404, "model_not_found"),
        ("/tokenize", {"inputs": "a", "model": "scripted"}, 400, "no_tokenizer"),
        ("/tokenize", {"inputs": 5}, 422, "invalid_request"),
        ("/tokenize", {"inputs": ["a"] * 10_000}, 413, "too_many_inputs"),
        ("/detokenize", {"ids": []}, 400, "empty_input"),
        ("/detokenize", {"ids": [101, 10**9]}, 400, "invalid_parameter"),
        ("/detokenize", {"ids": [[101], [-1]]}, 400, "invalid_parameter"),
        ("/detokenize", {"ids": ["a"]}, 422, "invalid_request"),
    ],
)
def test_errors_in_our_shape(server, path, body, status, error_type):
    response = post(server, path, body)
    assert response.status_code == status, response.text
    assert response.json()["error_type"] == error_type
    assert response.json()["request_id"]


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_the_api_key_is_asked_for(server, path):
    response = post(server, path, {"inputs": "a", "ids": [1]}, headers={})
    assert (response.status_code, response.json()["error_type"]) == (401, "unauthorized")
