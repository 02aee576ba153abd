import asyncio
import re

import httpx
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from models import (
    InputTooLong,
    ModelLoadError,
    ModelOutOfMemory,
    ModelSpec,
    is_out_of_memory,
    load_model,
    loading,
    translate_error,
)
from models.errors import requested_bytes
from models.testing import save_tiny_model
from server import Settings, create_app
from tests.inprocess import serve_in_thread


@pytest.fixture(scope="module")
def tiny_embedder(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("tiny-embed"))
    return load_model(ModelSpec(model=str(folder), device="cpu"))


@pytest.fixture(scope="module")
def classifier_folder(tmp_path_factory):
    # A wide initial range, so that the label and score vary with the input.
    return save_tiny_model(
        tmp_path_factory.mktemp("tiny-cls"), task="classify", initializer_range=1.0
    )


@pytest.fixture(scope="module")
def tiny_classifier(classifier_folder):
    return load_model(ModelSpec(model=str(classifier_folder), device="cpu"))


# Chosen so that this random-weight classifier gives each of its three labels at least once.
CLASSIFIER_TEXTS = [
    "good",
    "bad movie",
    "an utterly forgettable film, long and slow",
    "I loved every minute",
]


def transformers_classification(folder, texts):
    """transformers' own forward pass and softmax, one text at a time (no padding)."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    module = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    answers = []
    for text in texts:
        with torch.inference_mode():
            logits = module(**tokenizer(text, return_tensors="pt")).logits[0]
        probs = torch.softmax(logits, dim=-1)
        best = int(probs.argmax())
        answers.append({"label": module.config.id2label[best], "score": float(probs[best])})
    return answers


def test_embedding_outputs_are_normalised_and_batch_independent(tiny_embedder):
    assert tiny_embedder.info.task == "embed"
    texts = ["short", "a somewhat longer sentence with more tokens in it"]
    items = tiny_embedder.prepare(texts, truncate=True)
    together = tiny_embedder.forward(items)
    alone = [tiny_embedder.forward([item])[0] for item in items]
    for a, b in zip(together, alone, strict=True):
        assert a.shape == (32,)
        assert float((a**2).sum()) == pytest.approx(1.0, abs=1e-5)
        # Padding must not change a result: masked pooling ignores pad positions.
        assert torch.allclose(torch.from_numpy(a), torch.from_numpy(b), atol=1e-5)


def test_classifier_matches_transformers_forward_and_softmax(tiny_classifier, classifier_folder):
    assert tiny_classifier.info.task == "classify"
    expected = transformers_classification(classifier_folder, CLASSIFIER_TEXTS)
    # The model ranks every label, best first; the best is the answer without top_k.
    ranked = tiny_classifier.forward(tiny_classifier.prepare(CLASSIFIER_TEXTS, truncate=True))
    assert all(len(r) == 3 for r in ranked)
    outputs = [r[0] for r in ranked]
    assert [o["label"] for o in outputs] == [e["label"] for e in expected]
    assert [o["score"] for o in outputs] == pytest.approx([e["score"] for e in expected], abs=1e-5)
    assert {e["label"] for e in expected} == {"negative", "neutral", "positive"}


def test_classifier_served_over_http(tiny_classifier, classifier_folder):
    expected = transformers_classification(classifier_folder, CLASSIFIER_TEXTS)
    with serve_in_thread(tiny_classifier) as server:
        response = httpx.post(
            f"{server.url}/v1/infer", json={"inputs": CLASSIFIER_TEXTS}, timeout=30
        )
    assert response.status_code == 200, response.text
    outputs = response.json()["outputs"]
    assert [o["label"] for o in outputs] == [e["label"] for e in expected]
    assert [o["score"] for o in outputs] == pytest.approx([e["score"] for e in expected], abs=1e-5)


def test_truncation_and_too_long(tiny_embedder):
    limit = tiny_embedder.info.max_input_tokens
    long_text = "word " * (limit * 2)
    (item,) = tiny_embedder.prepare([long_text], truncate=True)
    assert item.cost == limit
    with pytest.raises(InputTooLong, match=f"input 1 has .* maximum of {limit}"):
        tiny_embedder.prepare(["ok", long_text], truncate=False)


@pytest.mark.parametrize("side", ["right", "left"])
def test_truncation_direction_cuts_the_prompted_text_as_the_tokenizer_does(tmp_path, side):
    """Truncation cuts the text with its prompt in front, as sentence-transformers does: from
    the left, a long input loses its prompt and keeps its end."""
    from transformers import AutoTokenizer

    folder = save_tiny_model(tmp_path / "m", max_position_embeddings=12)
    model = load_model(ModelSpec(model=str(folder), device="cpu"))
    text = " ".join(f"w{i}" for i in range(40))
    (item,) = model.prepare([text], truncate=True, prompt="query: ", truncation_direction=side)
    reference = AutoTokenizer.from_pretrained(folder, truncation_side=side)
    expected = reference("query: " + text, truncation=True, max_length=12)["input_ids"]
    assert item.data.ids == expected
    assert item.cost == 12
    assert model.info.truncation_side == "right"  # the default: the tokenizer's own
    (default,) = model.prepare([text], truncate=True, prompt="query: ")
    assert (default.data.ids == expected) is (side == "right")


def test_cost_is_token_count(tiny_embedder):
    (item,) = tiny_embedder.prepare(["hello world"], truncate=True)
    assert item.cost == len(item.data.ids) == 4  # [CLS] hello world [SEP]


def test_pickle_checkpoint_is_refused(tmp_path):
    folder = save_tiny_model(tmp_path / "m")
    (folder / "model.safetensors").unlink()
    torch.save({"weights": 1}, folder / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="pickle checkpoints are refused"):
        load_model(ModelSpec(model=str(folder), device="cpu"))


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_model(ModelSpec(model=str(tmp_path), device="cpu"))


@pytest.mark.parametrize("name", ["/models/missing", "./missing", "../missing", "~/missing"])
def test_a_folder_that_does_not_exist_is_said_so_never_looked_up_on_the_hub(name, monkeypatch):
    def download(repo_id):
        raise AssertionError(f"{repo_id!r} was looked up on the hub")

    monkeypatch.setattr(loading, "download", download)
    with pytest.raises(ModelLoadError, match=rf"no such model folder: '{re.escape(name)}'"):
        load_model(ModelSpec(model=name, device="cpu"))


async def test_a_model_that_cannot_load_is_one_logged_line_without_a_traceback(caplog):
    app = create_app(Settings(model=("/models/missing",)))
    async with app.router.lifespan_context(app):
        runtime = app.state.runtime
        async with asyncio.timeout(60):
            while runtime.startup_error is None:
                await asyncio.sleep(0.01)
    (record,) = [r for r in caplog.records if r.getMessage().startswith("start-up failed")]
    assert record.getMessage() == (
        "start-up failed: no such model folder: '/models/missing' (/models/missing does not exist)"
    )
    assert record.exc_info is None


def test_unknown_device_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match=r"CUDA is not available|unknown device"):
        load_model(ModelSpec(model=str(save_tiny_model(tmp_path / "m")), device="cuda:3"))


CPU_OOM = (
    "[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: "
    "you tried to allocate 2147483648 bytes. Error code 12 (Cannot allocate memory)"
)


@pytest.mark.parametrize(
    ("error", "is_oom"),
    [
        (RuntimeError(CPU_OOM), True),
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"), True),
        (MemoryError(), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
        (ValueError("can't allocate memory"), False),
    ],
)
def test_only_allocation_failures_count_as_oom(error, is_oom):
    assert is_out_of_memory(error) is is_oom
    assert isinstance(translate_error(error), ModelOutOfMemory) is is_oom


def test_requested_bytes_are_read_from_the_message():
    assert requested_bytes(RuntimeError(CPU_OOM)) == 2147483648
    assert requested_bytes(RuntimeError("Tried to allocate 20.00 MiB")) == 20 * 2**20
    assert requested_bytes(RuntimeError("no size here")) is None


def test_real_cpu_allocation_failure_becomes_model_out_of_memory(tiny_embedder):
    # An allocation far beyond any machine's memory: torch's CPU allocator raises for real.
    with pytest.raises(ModelOutOfMemory) as info:
        try:
            torch.empty(2**62, dtype=torch.uint8)
        except Exception as exc:
            raise translate_error(exc) from None
    assert info.value.requested_bytes == 2**62


@pytest.fixture(scope="module")
def tiny_reranker_folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-rerank"), task="rerank")


def test_auto_task_picks_rerank_for_a_one_label_classifier(tiny_reranker_folder):
    model = load_model(ModelSpec(model=str(tiny_reranker_folder), device="cpu"))
    assert model.info.task == "rerank"
    with pytest.raises(ModelLoadError, match="3 labels"):
        folder = save_tiny_model(tiny_reranker_folder.parent / "three", task="classify")
        load_model(ModelSpec(model=str(folder), device="cpu", task="rerank"))


def test_pair_scores_match_transformers_with_a_sigmoid(tiny_reranker_folder):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = load_model(ModelSpec(model=str(tiny_reranker_folder), device="cpu"))
    query = "what do cats eat"
    documents = ["cats eat fish", "the stock market fell", "word " * 400, "mice, mostly"]
    items = model.prepare_pairs(query, documents)
    limit = model.info.max_input_tokens
    # The cost is the pair's length as the tokenizer truncates pairs.
    tokenizer = AutoTokenizer.from_pretrained(tiny_reranker_folder)
    encoded = tokenizer([query] * 4, documents, truncation=True, max_length=limit)
    assert [item.cost for item in items] == [len(ids) for ids in encoded["input_ids"]]
    assert items[2].cost == limit
    scores = model.forward(items)
    reference = AutoModelForSequenceClassification.from_pretrained(tiny_reranker_folder).eval()
    batch = tokenizer(
        [query] * 4, documents, truncation=True, max_length=limit, padding=True,
        return_tensors="pt",
    )  # fmt: skip
    with torch.inference_mode():
        expected = torch.sigmoid(reference(**batch).logits[:, 0]).tolist()
    assert scores == pytest.approx(expected, abs=1e-5)
    # Segment ids matter: the same pair scored as one sequence (all zeros) differs.
    assert any(item.data.type_ids[-1] == 1 for item in items)
