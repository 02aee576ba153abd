"""Sparse (SPLADE) embedders in-process: a SparseEncoder folder is recognised, and its
vectors equal sentence-transformers' ``SparseEncoder.encode`` reading the same folder."""

from __future__ import annotations

import json

import numpy as np
import pytest

from batching import prior_peak_model
from models import ModelLoadError, ModelSpec, load_model
from models.answers import SparseVector
from models.testing import save_tiny_model
from tests.sparse_models import TEXTS, assert_matches, reference_vectors, save_sparse_encoder

VARIANTS = {
    "max-relu": {},
    "sum-log1p_relu": {"strategy": "sum", "activation": "log1p_relu"},
    "max-active-dims": {"max_active_dims": 12},
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def folder(request, tmp_path_factory):
    return save_sparse_encoder(
        tmp_path_factory.mktemp("sparse") / request.param, **VARIANTS[request.param]
    )


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return save_sparse_encoder(tmp_path_factory.mktemp("sparse") / "plain")


def load(folder, **spec):
    return load_model(ModelSpec(model=str(folder), device="cpu", **spec))


def test_vectors_equal_the_sparse_encoder_batched_and_alone(folder):
    model = load(folder)
    expected = reference_vectors(folder, TEXTS)
    batched = model.forward(model.prepare(TEXTS, truncate=True))
    assert len(batched) == len(TEXTS)
    for text, vector, row in zip(TEXTS, batched, expected, strict=True):
        assert isinstance(vector, SparseVector)
        assert vector.indices.dtype == np.int32 and vector.values.dtype == np.float32
        assert_matches(vector.indices, vector.values, row)
        (alone,) = model.forward(model.prepare([text], truncate=True))
        assert_matches(alone.indices, alone.values, row)
    if folder.name == "max-active-dims":
        assert all(len(vector.indices) == 12 for vector in batched)


def test_the_folder_is_a_sparse_model_with_the_vocabulary_as_its_dimension(folder):
    info = load(folder).info
    assert info.task == "sparse"
    assert info.output_dim == 30522
    assert info.pooling == ("splade_sum" if folder.name.startswith("sum") else "splade_max")
    assert info.shape.token_logits == 30522
    assert info.normalize is None


def test_the_older_mlm_transformer_layout_reads_the_same(plain, tmp_path):
    """sentence-transformers 5 saved SPLADE models as MLMTransformer and SpladePooling under
    ``sparse_encoder.models``, its Transformer config without a transformer_task."""
    folder = plain
    old = tmp_path / "old"
    old.mkdir()
    for path in folder.rglob("*"):
        target = old / path.relative_to(folder)
        if path.is_dir():
            target.mkdir(exist_ok=True)
        else:
            target.write_bytes(path.read_bytes())
    modules = json.loads((old / "modules.json").read_text())
    modules[0]["type"] = "sentence_transformers.sparse_encoder.models.MLMTransformer"
    modules[1]["type"] = "sentence_transformers.sparse_encoder.models.SpladePooling"
    (old / "modules.json").write_text(json.dumps(modules))
    (old / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128}))
    model = load(old)
    assert model.info.task == "sparse"
    expected = reference_vectors(folder, TEXTS[:3])
    vectors = model.forward(model.prepare(TEXTS[:3], truncate=True))
    for vector, row in zip(vectors, expected, strict=True):
        assert_matches(vector.indices, vector.values, row)


def test_refusals_name_the_problem(plain, tmp_path):
    folder = plain
    with pytest.raises(ModelLoadError, match=r"SparseEncoder.*--task sparse"):
        load(folder, task="embed")
    dense = save_tiny_model(tmp_path / "dense")
    with pytest.raises(ModelLoadError, match="--task sparse serves a sentence-transformers"):
        load(dense, task="sparse")
    # A dense sentence-transformers layout: no SpladePooling to serve as sparse, and a
    # masked language model's logits are never mean-pooled into a dense vector.
    (dense / "1_Pooling").mkdir()
    (dense / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "mean"}))
    (dense / "modules.json").write_text(json.dumps([
        {"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]))  # fmt: skip
    with pytest.raises(ModelLoadError, match=r"which its modules\.json does not list"):
        load(dense, task="sparse")
    (dense / "sentence_bert_config.json").write_text(json.dumps({"transformer_task": "fill-mask"}))
    with pytest.raises(ModelLoadError, match=r"masked language model \(fill-mask\) without"):
        load(dense)
    pooling = folder / "1_SpladePooling" / "config.json"
    original = pooling.read_text()
    try:
        pooling.write_text(json.dumps({"pooling_strategy": "mean"}))
        with pytest.raises(ModelLoadError, match="pooling_strategy 'mean'"):
            load(folder)
    finally:
        pooling.write_text(original)


def test_the_memory_prior_counts_the_vocabulary_logits_of_every_token():
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "element_bytes": 4}
    plain = prior_peak_model(**shape)
    splade = prior_peak_model(**shape, token_logits=30522)
    assert splade.alpha == plain.alpha + 4 * 2 * 30522
    assert splade.beta == plain.beta
