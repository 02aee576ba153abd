"""Small random-weight models built from a config, for tests of other architectures."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification, BertModel

from .loading import BUNDLED_MODEL, resolve_model_path


def tiny_bert_config(**overrides: object) -> BertConfig:
    base = {
        "vocab_size": 30522,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "max_position_embeddings": 128,
    }
    base.update(overrides)
    return BertConfig(**base)


def save_tiny_model(folder: Path, *, task: str = "embed", seed: int = 0, **config: object) -> Path:
    """Write a BERT with random weights and the bundled tokenizer to ``folder``: an encoder
    (embed), a three-label classifier (classify) or a one-label cross-encoder (rerank); tiny,
    unless ``config`` overrides its shape (hidden_size, num_hidden_layers, ...)."""
    torch.manual_seed(seed)
    if task == "rerank":
        bert_config = tiny_bert_config(
            num_labels=1, architectures=["BertForSequenceClassification"], **config
        )
        module = BertForSequenceClassification(bert_config)
    elif task == "classify":
        bert_config = tiny_bert_config(
            num_labels=3,
            id2label={0: "negative", 1: "neutral", 2: "positive"},
            label2id={"negative": 0, "neutral": 1, "positive": 2},
            architectures=["BertForSequenceClassification"],
            **config,
        )
        module = BertForSequenceClassification(bert_config)
    else:
        bert_config = tiny_bert_config(architectures=["BertModel"], **config)
        module = BertModel(bert_config)
    folder.mkdir(parents=True, exist_ok=True)
    module.save_pretrained(folder, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(BUNDLED_MODEL))
    tokenizer.model_max_length = bert_config.max_position_embeddings
    tokenizer.save_pretrained(folder)
    return folder
