"""Bulk jobs over real tiny models, against sentence-transformers and transformers reading the
same folders: a named or default prompt, Matryoshka dimensions, a classifier's best label and
a cross-encoder's scores, each row with its own query."""

from __future__ import annotations

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from bulk import JobError, JobSpec, run_job
from models import UnknownPrompt
from models.testing import save_tiny_model
from tests.families import TEXTS, build_bert_prompts, quiet
from tests.reference import cosine


@pytest.fixture(scope="module")
def prompted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bert-prompts") / "model"
    with quiet():
        build_bert_prompts(folder)
    return folder


def corpus(path, rows):
    path.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    return (str(path),)


def parts(out) -> pa.Table:
    return pa.concat_tables([pq.read_table(p) for p in sorted(out.glob("part-*.parquet"))])


def st_encode(folder, **options) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    with quiet():
        model = SentenceTransformer(str(folder), device="cpu")
        return model.encode(TEXTS, batch_size=8, convert_to_numpy=True, **options)


@pytest.mark.parametrize(
    ("prompt_name", "dimensions"), [(None, None), ("passage", None), ("passage", 16)]
)
def test_prompts_and_dimensions_as_sentence_transformers_applies_them(
    prompted, tmp_path, prompt_name, dimensions
):
    inputs = corpus(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])
    spec = JobSpec(inputs, str(tmp_path / "out"), model=str(prompted), prompt_name=prompt_name,
                   dimensions=dimensions)  # fmt: skip
    run_job(spec)
    ours = np.array(parts(tmp_path / "out")["embedding"].to_pylist())
    # sentence-transformers applies the default prompt (query) when none is named.
    expected = st_encode(prompted, prompt_name=prompt_name, truncate_dim=dimensions)
    assert ours.shape == expected.shape
    assert min(cosine(a, b) for a, b in zip(ours, expected, strict=True)) >= 0.9999
    assert np.allclose(np.linalg.norm(ours, axis=1), 1, atol=1e-5), "renormalised when cut"


def test_an_unknown_prompt_or_too_many_dimensions_is_refused(prompted, tmp_path):
    inputs = corpus(tmp_path / "in.jsonl", [{"text": "x"}])
    with pytest.raises(UnknownPrompt, match=r"no prompt named 'nope'; its prompts: .*'passage'"):
        run_job(JobSpec(inputs, str(tmp_path / "a"), model=str(prompted), prompt_name="nope"))
    with pytest.raises(JobError, match="--dimensions must be from 1 to"):
        run_job(JobSpec(inputs, str(tmp_path / "b"), model=str(prompted), dimensions=10_000))


def test_a_classifier_writes_its_best_label_and_a_cross_encoder_each_rows_score(tmp_path):
    classifier = save_tiny_model(tmp_path / "classifier", task="classify", seed=3)
    inputs = corpus(tmp_path / "in.jsonl", [{"text": t, "query": TEXTS[i % 3]}
                                            for i, t in enumerate(TEXTS)])  # fmt: skip
    run_job(JobSpec(inputs, str(tmp_path / "c"), task="classify", model=str(classifier)))
    table = parts(tmp_path / "c")
    tokenizer = AutoTokenizer.from_pretrained(classifier)
    with quiet():
        reference = AutoModelForSequenceClassification.from_pretrained(classifier).eval()
    with torch.inference_mode():
        encoded = tokenizer(TEXTS, padding=True, truncation=True, return_tensors="pt")
        probs = torch.softmax(reference(**encoded).logits, dim=-1)
    best, index = probs.max(dim=-1)
    assert table["label"].to_pylist() == [reference.config.id2label[int(i)] for i in index]
    assert table["score"].to_pylist() == pytest.approx(best.tolist(), abs=1e-5)

    reranker = save_tiny_model(tmp_path / "reranker", task="rerank", seed=4)
    run_job(JobSpec(inputs, str(tmp_path / "r"), task="rerank", model=str(reranker)))
    scores = parts(tmp_path / "r")["score"].to_pylist()
    with quiet():
        reference = AutoModelForSequenceClassification.from_pretrained(reranker).eval()
    queries = [TEXTS[i % 3] for i in range(len(TEXTS))]
    with torch.inference_mode():
        encoded = tokenizer(queries, TEXTS, padding=True, truncation=True, return_tensors="pt")
        expected = torch.sigmoid(reference(**encoded).logits[:, 0])
    assert scores == pytest.approx(expected.tolist(), abs=1e-5)
