"""A text encoder as a user's script runs it: transformers' tokenizer and model, mean pooling
and normalisation, nothing of the server's own code. The in-process limit times it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class PlainEncoder:
    tokenizer: Any
    model: Any
    max_length: int
    device: str = "cpu"

    def token_counts(self, texts: Sequence[str]) -> list[int]:
        """Each input's length in tokens, truncated as ``encode`` truncates it."""
        encoded = self.tokenizer(list(texts), truncation=True, max_length=self.max_length)
        return [len(ids) for ids in encoded["input_ids"]]

    def encode(self, texts: Sequence[str]) -> Any:
        """Normalised mean-pooled embeddings of one batch, on the CPU."""
        import torch

        batch = self.tokenizer(
            list(texts), padding=True, truncation=True, max_length=self.max_length,
            return_tensors="pt",
        ).to(self.device)  # fmt: skip
        with torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled.float(), dim=1).cpu()

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def dtype(self) -> str:
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")


def load_plain_encoder(
    model: str | None = None, *, device: str = "cpu", dtype: str = "auto"
) -> PlainEncoder:
    """The model (default: the bundled one) loaded with plain ``from_pretrained`` calls, at
    torch's default thread count, truncating at the shortest of the model's positions, the
    tokenizer's maximum and sentence-transformers' ``max_seq_length`` (as the server does).
    On CUDA, attention leaves cuDNN's kernel out, as the server does: with it every new batch
    shape pays for a plan, and the limit would be the slower one."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from models.loading import avoid_per_shape_attention_plans, resolve_model_path
    from models.spec import BUNDLED_MODEL

    path = resolve_model_path(model or BUNDLED_MODEL)
    avoid_per_shape_attention_plans(torch.device(device))
    if dtype == "auto":
        dtype = "float16" if device.startswith("cuda") else "float32"
    tokenizer = AutoTokenizer.from_pretrained(path)
    loaded = AutoModel.from_pretrained(path, dtype=getattr(torch, dtype)).eval().to(device)
    limits = [int(loaded.config.max_position_embeddings)]
    if tokenizer.model_max_length < 1e9:
        limits.append(int(tokenizer.model_max_length))
    sbert = Path(path) / "sentence_bert_config.json"
    if sbert.is_file() and json.loads(sbert.read_text()).get("max_seq_length"):
        limits.append(int(json.loads(sbert.read_text())["max_seq_length"]))
    return PlainEncoder(tokenizer, loaded, min(limits), device)
