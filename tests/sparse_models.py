"""A tiny random-weight SPLADE model saved by sentence-transformers' own ``SparseEncoder``
(a BERT masked language model, then SpladePooling), and the reference that reads it back."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer, BertForMaskedLM

from models.loading import resolve_model_path
from models.spec import BUNDLED_MODEL
from models.testing import tiny_bert_config

# Short and long (past the tiny model's 128 tokens), code, emoji, several scripts.
TEXTS = [
    "hi",
    "The cat sits on the mat.",
    "def add(a, b):\n    return a + b  # sum",
    "Great product!!! 🚀🔥 would buy again 👍",
    "東京は日本の首都です。",
    "Москва — столица России.",
    " ".join(["a long document about sparse retrieval"] * 40),
]


def save_sparse_encoder(
    folder: Path, *, strategy: str = "max", activation: str = "relu",
    max_active_dims: int | None = None, seed: int = 0,
) -> Path:  # fmt: skip
    """A SparseEncoder of a tiny random BERT MLM and the bundled tokenizer, saved to
    ``folder`` by sentence-transformers (its ``modules.json``, configs and weights)."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    torch.manual_seed(seed)
    mlm = folder.with_name(folder.name + "-mlm")
    config = tiny_bert_config(architectures=["BertForMaskedLM"])
    BertForMaskedLM(config).save_pretrained(mlm)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(BUNDLED_MODEL))
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(mlm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        encoder = SparseEncoder(
            modules=[
                Transformer(str(mlm), transformer_task="fill-mask"),
                SpladePooling(pooling_strategy=strategy, activation_function=activation),
            ],
            max_active_dims=max_active_dims,
            device="cpu",
        )
        encoder.save(str(folder))
    return folder


def reference_vectors(folder: Path, texts: list[str], **kwargs: object) -> np.ndarray:
    """``SparseEncoder.encode`` reading ``folder``, as dense float32 rows."""
    from sentence_transformers import SparseEncoder

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        encoder = SparseEncoder(str(folder), device="cpu")
        encoded = encoder.encode(texts, convert_to_tensor=True, batch_size=4, **kwargs)
    return encoded.to_dense().float().numpy()


def assert_matches(
    indices: list[int] | np.ndarray, values: list[float] | np.ndarray, expected: np.ndarray
) -> None:
    """One sparse answer against one dense reference row: the same non-zero positions,
    values within float32 rounding."""
    (wanted,) = np.nonzero(expected)
    assert len(wanted) > 0
    np.testing.assert_array_equal(np.asarray(indices), wanted)
    np.testing.assert_allclose(np.asarray(values), expected[wanted], rtol=1e-5, atol=1e-6)
