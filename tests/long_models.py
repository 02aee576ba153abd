"""Long-context models small enough for a CPU, built in the layout real ones ship, and long
texts of a known token count for them. Used by the integration tests of long inputs,
``scripts/memory_table.py`` and ``bench/long_context.py``.

- ``build_long_decoder``: Qwen3-shaped (4 layers, hidden 256, 4 query and 2 key/value heads
  of 64, a gated feed-forward), 32,768 positions, saved by sentence-transformers with
  last-token pooling and Normalize, as Qwen3-Embedding ships.
- ``build_long_modernbert``: ModernBERT with 8,192 positions (local and global attention),
  mean pooling.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import AutoModel, ModernBertConfig, Qwen3Config

from tests.families import _sentence_transformer, modernbert_tokenizer, qwen3_tokenizer

DECODER_MAX_TOKENS = 32768
MODERNBERT_MAX_TOKENS = 8192
WORDS = ["memory", "batch", "split", "token", "model", "server", "queue", "latency", "budget",
         "long", "context", "window", "decoder", "attention", "kernel", "cgroup"]  # fmt: skip


def build_long_decoder(out: Path, *, seed: int = 31) -> Path:
    base = out.with_name(out.name + "-hf")
    base.mkdir(parents=True, exist_ok=True)
    vocab_size, eos = qwen3_tokenizer(base, max_tokens=DECODER_MAX_TOKENS)
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=DECODER_MAX_TOKENS, eos_token_id=eos, pad_token_id=eos,
        tie_word_embeddings=False, architectures=["Qwen3Model"],
    )  # fmt: skip
    AutoModel.from_config(config).save_pretrained(base, safe_serialization=True)
    _sentence_transformer(base, out, {"pooling_mode": "lasttoken"})
    return out


def build_long_modernbert(out: Path, *, seed: int = 32) -> Path:
    base = out.with_name(out.name + "-hf")
    base.mkdir(parents=True, exist_ok=True)
    ids = modernbert_tokenizer(base, max_tokens=MODERNBERT_MAX_TOKENS)
    torch.manual_seed(seed)
    config = ModernBertConfig(
        vocab_size=ids["vocab_size"], hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=MODERNBERT_MAX_TOKENS,
        global_attn_every_n_layers=2, local_attention=128, pad_token_id=ids["[PAD]"],
        bos_token_id=ids["[CLS]"], eos_token_id=ids["[SEP]"], cls_token_id=ids["[CLS]"],
        sep_token_id=ids["[SEP]"], architectures=["ModernBertModel"],
    )  # fmt: skip
    AutoModel.from_config(config).save_pretrained(base, safe_serialization=True)
    _sentence_transformer(base, out, {"pooling_mode": "mean"})
    return out


def text_of(folder: Path, num_tokens: int, *, seed: int = 0) -> str:
    """A text the model in ``folder`` encodes to exactly ``num_tokens`` tokens (special
    tokens included), or to one more where the last word is two tokens."""
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_truncation()
    rng = random.Random(seed)
    words: list[str] = []
    # Grow by whole words, then trim: each word is a token or two in these vocabularies.
    while len(tokenizer.encode(" ".join(words)).ids) < num_tokens:
        words.extend(rng.choice(WORDS) for _ in range(max(1, num_tokens // 8)))
    low, high = 0, len(words)
    while low < high:  # the most words within num_tokens
        middle = (low + high + 1) // 2
        if len(tokenizer.encode(" ".join(words[:middle])).ids) <= num_tokens:
            low = middle
        else:
            high = middle - 1
    return " ".join(words[:low])
