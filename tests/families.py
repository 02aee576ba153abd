"""One tiny random-weight model per family people serve, in the layout its real models ship
(sentence-transformers' own ``save``), and its outputs measured against sentence-transformers
(``SentenceTransformer.encode``, ``CrossEncoder.predict``) or transformers' pipeline reading
the same folder. Used by ``tests/integration/test_families.py`` and
``scripts/parity_table.py``.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    ModernBertConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
    XLMRobertaConfig,
)

from models.loading import resolve_model_path
from models.spec import BUNDLED_MODEL
from models.testing import save_tiny_model

MAX_TOKENS = 128
# Short and long, code, emoji, seven languages; the long ones pass the tiny models' 128 tokens.
TEXTS = [
    "hi",
    "The cat sits on the mat.",
    "What is the capital of France?",
    "def add(a, b):\n    return a + b  # sum",
    "SELECT name FROM users WHERE id = 42;",
    "Great product!!! 🚀🔥 would buy again 👍",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "Le chat est assis sur le tapis, et il dort.",
    "¿Dónde está la biblioteca más cercana?",
    "東京は日本の首都です。",
    "Москва — столица России.",
    "猫がマットの上に座っています。",
    "القطة تجلس على السجادة",
    " ".join(["batching requests keeps the accelerator busy"] * 40),
    " ".join(["a long document about memory limits and budgets"] * 80),
]
QUERY = "what does the cat sit on?"
INSTRUCTION = "Instruct: Given a web search query, retrieve relevant passages\nQuery: "
LABELS = {0: "toxic", 1: "insult", 2: "threat"}
# Qwen3-Reranker's prompt, as its model card writes it.
RERANKER_SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".'
)
RERANKER_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@dataclass(frozen=True)
class Family:
    """A model family: how to build its tiny model, what it is like, how it is asked."""

    name: str
    like: str
    kind: str  # embed, rerank (a cross-encoder), llm-rerank (a causal LM) or classify
    build: Callable[..., None]
    """``build(folder)``; ``build(folder, True)``: the family at MiniLM's width."""
    requests: tuple[dict[str, Any], ...] = ({},)
    """Request options to try (each compared with the reference given the same prompt)."""
    padding_sides: tuple[str, ...] = ()
    """Tokenizer padding sides the reference also runs with (decoders)."""


# --- tokenizers --------------------------------------------------------------------------


def _train(tokenizer: Tokenizer, trainer: Any) -> Tokenizer:
    corpus = [*TEXTS, QUERY, INSTRUCTION, "query: passage: search_query: search_document:"]
    tokenizer.train_from_iterator(corpus * 3, trainer)
    return tokenizer


def _save_tokenizer(
    tokenizer: Tokenizer, folder: Path, tokenizer_class: str, max_tokens: int = MAX_TOKENS,
    **special_tokens: Any,
) -> None:  # fmt: skip
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, model_max_length=max_tokens, **special_tokens
    )
    fast.save_pretrained(folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = tokenizer_class
    config_path.write_text(json.dumps(config, indent=2))


def xlm_roberta_tokenizer(folder: Path, max_tokens: int = MAX_TOKENS) -> int:
    """A sentencepiece-style Unigram with XLM-R's ids (<s> 0, <pad> 1, </s> 2, <unk> 3) and
    its templates; returns the vocabulary size."""
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=400, special_tokens=specials, unk_token="<unk>", show_progress=False
    )
    _train(tokenizer, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", 0), ("</s>", 2)],
    )  # fmt: skip
    _save_tokenizer(
        tokenizer, folder, "XLMRobertaTokenizer", max_tokens, bos_token="<s>", eos_token="</s>",
        sep_token="</s>", cls_token="<s>", unk_token="<unk>", pad_token="<pad>",
        mask_token="<mask>",
    )  # fmt: skip
    return tokenizer.get_vocab_size()


def _byte_level_bpe(specials: list[str], vocab_size: int = 600) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return _train(tokenizer, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    ))  # fmt: skip


def modernbert_tokenizer(folder: Path, max_tokens: int = MAX_TOKENS) -> dict[str, int]:
    """Byte-level BPE with [CLS] text [SEP], as ModernBERT's; returns its special ids."""
    specials = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
    tokenizer = _byte_level_bpe(specials)
    ids = {token: tokenizer.token_to_id(token) for token in specials}
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])],
    )  # fmt: skip
    _save_tokenizer(
        tokenizer, folder, "PreTrainedTokenizerFast", max_tokens, unk_token="[UNK]",
        cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]", mask_token="[MASK]",
    )  # fmt: skip
    return ids | {"vocab_size": tokenizer.get_vocab_size()}


def qwen3_tokenizer(
    folder: Path, padding_side: str = "left", max_tokens: int = MAX_TOKENS
) -> tuple[int, int]:
    """Byte-level BPE that appends <|endoftext|> to every input, as Qwen3-Embedding's
    tokenizer does, padding on the left; returns (vocabulary size, end-of-text id)."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = _byte_level_bpe(specials)
    eos = tokenizer.token_to_id("<|endoftext|>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", pair="$A <|endoftext|> $B:1 <|endoftext|>:1",
        special_tokens=[("<|endoftext|>", eos)],
    )  # fmt: skip
    _save_tokenizer(
        tokenizer, folder, "Qwen2Tokenizer", max_tokens, eos_token="<|endoftext|>",
        pad_token="<|endoftext|>", unk_token=None, padding_side=padding_side,
    )  # fmt: skip
    return tokenizer.get_vocab_size(), eos


def qwen3_reranker_tokenizer(folder: Path, max_tokens: int = MAX_TOKENS) -> dict[str, int]:
    """Byte-level BPE with Qwen3-Reranker's chat tokens (<|im_start|>, <|im_end|>, and
    <think> </think> as added tokens), adding no special tokens, whose vocabulary has the
    "yes" and "no" tokens its score reads; returns its ids."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [*TEXTS, QUERY, RERANKER_SYSTEM, RERANKER_INSTRUCTION, "yes no yes no"]
    tokenizer.train_from_iterator(corpus * 3, trainers.BpeTrainer(
        vocab_size=700, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    ))  # fmt: skip
    tokenizer.add_tokens(["<think>", "</think>"])
    ids = {token: tokenizer.token_to_id(token) for token in (*specials, "yes", "no")}
    assert None not in ids.values(), ids
    _save_tokenizer(
        tokenizer, folder, "Qwen2Tokenizer", max_tokens, eos_token="<|im_end|>",
        pad_token="<|endoftext|>", unk_token=None,
    )  # fmt: skip
    return ids | {"vocab_size": tokenizer.get_vocab_size()}


# --- models ------------------------------------------------------------------------------


def _sentence_transformer(
    folder: Path, out: Path, pooling: dict[str, Any], *, dense: tuple[tuple[int, str], ...] = (),
    normalize: bool = True, prompts: dict[str, str] | None = None,
    default_prompt_name: str | None = None,
) -> None:  # fmt: skip
    """Wrap the transformers model in ``folder`` in sentence-transformers modules and save
    them to ``out`` with sentence-transformers' own ``save``."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    transformer = Transformer(str(folder))
    width = transformer.get_embedding_dimension()
    pool = Pooling(width, **pooling)
    modules: list[torch.nn.Module] = [transformer, pool]
    width = pool.get_embedding_dimension()
    for out_features, activation in dense:
        function = getattr(torch.nn, activation)()
        modules.append(Dense(width, out_features, activation_function=function))
        width = out_features
    if normalize:
        modules.append(Normalize())
    model = SentenceTransformer(
        modules=modules, prompts=prompts, default_prompt_name=default_prompt_name, device="cpu"
    )
    model.save(str(out))


# The parity models are tiny; ``wide=True`` builds each family at the width of
# all-MiniLM-L6-v2 with 512 positions, so that a forward pass's activations outweigh the
# allocator's few MiB of slack (scripts/memory_table.py).
WIDE_TOKENS = 512
BERT_WIDE = {"hidden_size": 384, "intermediate_size": 1536, "num_attention_heads": 12,
             "max_position_embeddings": WIDE_TOKENS}  # fmt: skip


def _bert(out: Path, seed: int, wide: bool = False, **st: Any) -> None:
    torch.manual_seed(seed)
    base = save_tiny_model(
        out.with_name(out.name + "-hf"), seed=seed, **(BERT_WIDE if wide else {})
    )
    _sentence_transformer(base, out, **st)


def build_bert_cls(out: Path, wide: bool = False) -> None:
    _bert(out, 11, wide, pooling={"pooling_mode": "cls"})


def build_bert_mean_raw(out: Path, wide: bool = False) -> None:
    _bert(out, 12, wide, pooling={"pooling_mode": "mean"}, normalize=False)


def build_bert_dense(out: Path, wide: bool = False) -> None:
    _bert(out, 13, wide, pooling={"pooling_mode": "max"}, dense=((24, "Tanh"), (16, "Identity")))


def build_bert_prompts(out: Path, wide: bool = False) -> None:
    _bert(
        out, 14, wide, pooling={"pooling_mode": "mean"},
        prompts={"query": "query: ", "passage": "passage: "}, default_prompt_name="query",
    )  # fmt: skip


def build_bert_instructor(out: Path, wide: bool = False) -> None:
    """Prompts left out of pooling (include_prompt false), two pooling modes concatenated."""
    _bert(
        out, 15, wide,
        pooling={"pooling_mode": ("weightedmean", "mean_sqrt_len_tokens"), "include_prompt": False},
        prompts={"query": "Represent the question for retrieving documents: "},
    )  # fmt: skip


def build_xlm_roberta(out: Path, wide: bool = False) -> None:
    base = out.with_name(out.name + "-hf")
    base.mkdir(parents=True, exist_ok=True)
    tokens = WIDE_TOKENS if wide else MAX_TOKENS
    vocab_size = xlm_roberta_tokenizer(base, tokens)
    torch.manual_seed(16)
    config = XLMRobertaConfig(
        vocab_size=vocab_size, num_hidden_layers=2, max_position_embeddings=tokens + 2,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1,
        architectures=["XLMRobertaModel"],
        **({k: v for k, v in BERT_WIDE.items() if k != "max_position_embeddings"} if wide else
           {"hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}),
    )  # fmt: skip
    AutoModel.from_config(config).save_pretrained(base, safe_serialization=True)
    _sentence_transformer(
        base, out, {"pooling_mode": "mean"},
        prompts={"query": "query: ", "passage": "passage: "},
    )  # fmt: skip


def build_modernbert(out: Path, wide: bool = False) -> None:
    base = out.with_name(out.name + "-hf")
    base.mkdir(parents=True, exist_ok=True)
    tokens = WIDE_TOKENS if wide else MAX_TOKENS
    ids = modernbert_tokenizer(base, tokens)
    torch.manual_seed(17)
    config = ModernBertConfig(
        vocab_size=ids["vocab_size"], hidden_size=384 if wide else 32,
        intermediate_size=1152 if wide else 48, num_hidden_layers=2,
        num_attention_heads=6 if wide else 2, max_position_embeddings=tokens,
        global_attn_every_n_layers=2, local_attention=128 if wide else 16,
        pad_token_id=ids["[PAD]"],
        bos_token_id=ids["[CLS]"], eos_token_id=ids["[SEP]"], cls_token_id=ids["[CLS]"],
        sep_token_id=ids["[SEP]"], architectures=["ModernBertModel"],
    )  # fmt: skip
    AutoModel.from_config(config).save_pretrained(base, safe_serialization=True)
    _sentence_transformer(
        base, out, {"pooling_mode": "mean"},
        prompts={"query": "search_query: ", "document": "search_document: "},
        default_prompt_name="document",
    )  # fmt: skip


def build_qwen3(out: Path, wide: bool = False) -> None:
    base = out.with_name(out.name + "-hf")
    base.mkdir(parents=True, exist_ok=True)
    tokens = WIDE_TOKENS if wide else MAX_TOKENS
    vocab_size, eos = qwen3_tokenizer(base, max_tokens=tokens)
    torch.manual_seed(18)
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=384 if wide else 32,
        intermediate_size=1024 if wide else 64, num_hidden_layers=2,
        num_attention_heads=8 if wide else 4, num_key_value_heads=2,
        head_dim=48 if wide else 8,
        max_position_embeddings=tokens, eos_token_id=eos, pad_token_id=eos,
        tie_word_embeddings=False, architectures=["Qwen3Model"],
    )  # fmt: skip
    AutoModel.from_config(config).save_pretrained(base, safe_serialization=True)
    _sentence_transformer(
        base, out, {"pooling_mode": "lasttoken"}, prompts={"query": INSTRUCTION, "document": ""}
    )


def build_qwen3_reranker(out: Path, wide: bool = False) -> None:
    """Qwen3-Reranker's layout: a Qwen3ForCausalLM (tied embeddings, as the 0.6B model) with
    its tokenizer and no sentence-transformers files; the folder's name says reranker. Its
    weights are drawn wide enough that the scores spread well away from 0.5."""
    out.mkdir(parents=True, exist_ok=True)
    tokens = WIDE_TOKENS if wide else MAX_TOKENS
    ids = qwen3_reranker_tokenizer(out, tokens)
    torch.manual_seed(22)
    config = Qwen3Config(
        vocab_size=ids["vocab_size"], hidden_size=384 if wide else 32,
        intermediate_size=1024 if wide else 64, num_hidden_layers=2,
        num_attention_heads=8 if wide else 4, num_key_value_heads=2,
        head_dim=48 if wide else 8, max_position_embeddings=tokens,
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=True, initializer_range=0.2, architectures=["Qwen3ForCausalLM"],
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(out, safe_serialization=True)


def build_ce_identity(out: Path, wide: bool = False) -> None:
    """A cross-encoder whose config.json names the Identity activation with the key
    sentence-transformers before 4.0 wrote (as the ms-marco cross-encoders do)."""
    save_tiny_model(out, task="rerank", seed=19, **(BERT_WIDE if wide else {}))
    config = json.loads((out / "config.json").read_text())
    config["sbert_ce_default_activation_function"] = "torch.nn.modules.linear.Identity"
    (out / "config.json").write_text(json.dumps(config, indent=2))


def build_ce_sigmoid(out: Path, wide: bool = False) -> None:
    """A cross-encoder saved by sentence-transformers' ``CrossEncoder`` naming Sigmoid."""
    from sentence_transformers import CrossEncoder

    base = save_tiny_model(
        out.with_name(out.name + "-hf"), task="rerank", seed=20, **(BERT_WIDE if wide else {})
    )
    CrossEncoder(str(base), activation_fn=torch.nn.Sigmoid(), device="cpu").save(str(out))


def build_multi_label(out: Path, wide: bool = False) -> None:
    torch.manual_seed(21)
    shape = BERT_WIDE if wide else {
        "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64,
        "max_position_embeddings": MAX_TOKENS,
    }  # fmt: skip
    config = BertConfig(
        vocab_size=30522, num_hidden_layers=2, **shape, num_labels=3,
        id2label=LABELS, label2id={v: k for k, v in LABELS.items()},
        problem_type="multi_label_classification",
        architectures=["BertForSequenceClassification"],
    )  # fmt: skip
    BertForSequenceClassification(config).save_pretrained(out, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(BUNDLED_MODEL))
    tokenizer.model_max_length = shape["max_position_embeddings"]
    tokenizer.save_pretrained(out)


FAMILIES = (
    Family("bert-cls", "BGE, GTE, Arctic (CLS + Normalize)", "embed", build_bert_cls),
    Family("bert-mean-raw", "fine-tunes without Normalize", "embed", build_bert_mean_raw),
    Family("bert-dense", "max pooling, two Dense layers", "embed", build_bert_dense),
    Family(
        "bert-prompts",
        "e5 (query: / passage:, a default prompt)",
        "embed",
        build_bert_prompts,
        requests=(
            {},
            {"prompt_name": "passage"},
            {"prompt": "title: "},
            {"prompt_name": "passage", "truncation_direction": "left"},
        ),
    ),
    Family(
        "bert-instructor",
        "INSTRUCTOR (prompt left out of pooling)",
        "embed",
        build_bert_instructor,
        requests=({}, {"prompt_name": "query"}),
    ),
    Family(
        "xlm-roberta",
        "multilingual-e5",
        "embed",
        build_xlm_roberta,
        requests=({"prompt_name": "query"},),
    ),
    Family(
        "modernbert",
        "nomic-embed-text-v2, gte-modernbert",
        "embed",
        build_modernbert,
        requests=({}, {"prompt_name": "query"}),
    ),
    Family(
        "qwen3",
        "Qwen3-Embedding (last token, instruction; left and right padding)",
        "embed",
        build_qwen3,
        requests=(
            {"prompt_name": "query"},
            {},
            {"prompt_name": "query", "truncation_direction": "left"},
        ),
        padding_sides=("left", "right"),
    ),
    Family(
        "qwen3-reranker",
        "Qwen3-Reranker (a causal LM's yes/no logits)",
        "llm-rerank",
        build_qwen3_reranker,
    ),
    Family("ce-identity", "ms-marco cross-encoders (Identity)", "rerank", build_ce_identity),
    Family("ce-sigmoid", "cross-encoders naming Sigmoid", "rerank", build_ce_sigmoid),
    Family("multi-label", "toxicity, topic tags", "classify", build_multi_label),
)


def build_all(
    root: Path, families: tuple[Family, ...] = FAMILIES, *, wide: bool = False
) -> dict[str, Path]:
    folders = {}
    with quiet():
        for family in families:
            folder = root / family.name
            family.build(folder, wide) if wide else family.build(folder)
            folders[family.name] = folder
    return folders


class quiet:
    """sentence-transformers and transformers log and warn freely while loading; the
    references are read quietly."""

    def __enter__(self) -> None:
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("ignore")
        self._levels = {}
        for name in ("sentence_transformers", "transformers"):
            logger = logging.getLogger(name)
            self._levels[name] = logger.level
            logger.setLevel(logging.ERROR)

    def __exit__(self, *exc: object) -> None:
        for name, level in self._levels.items():
            logging.getLogger(name).setLevel(level)
        self._warnings.__exit__(*exc)


# --- measuring ---------------------------------------------------------------------------


@dataclass
class Parity:
    family: str
    like: str
    worst_cosine: float | None = None
    max_abs_diff: float = 0.0
    """Largest difference of any value (embedding component or score) from the reference."""
    batched_vs_single: float = 0.0
    """Largest difference between an answer in a batch and the same input sent alone."""
    checked: int = 0
    notes: list[str] = field(default_factory=list)

    def add(self, ours: np.ndarray, reference: np.ndarray, *, cosine: bool) -> None:
        ours, reference = np.asarray(ours, np.float64), np.asarray(reference, np.float64)
        assert ours.shape == reference.shape, (self.family, ours.shape, reference.shape)
        self.max_abs_diff = max(self.max_abs_diff, float(np.abs(ours - reference).max()))
        if cosine:
            cos = (ours * reference).sum(-1) / (
                np.linalg.norm(ours, axis=-1) * np.linalg.norm(reference, axis=-1)
            )
            worst = float(cos.min())
            self.worst_cosine = (
                worst if self.worst_cosine is None else min(worst, self.worst_cosine)
            )
        self.checked += len(ours)


def _post(client: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(path, json=body)
    assert response.status_code == 200, (path, body.get("model"), response.text)
    return response.json()


def _reference_embeddings(
    folder: Path, request: dict[str, Any], padding_side: str | None
) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    with quiet():
        model = SentenceTransformer(str(folder), device="cpu")
        if padding_side is not None:
            model.tokenizer.padding_side = padding_side
        if request.get("truncation_direction") is not None:
            model.tokenizer.truncation_side = request["truncation_direction"]
        return model.encode(
            TEXTS, prompt_name=request.get("prompt_name"), prompt=request.get("prompt"),
            batch_size=8, show_progress_bar=False, convert_to_numpy=True,
        )  # fmt: skip


def qwen3_reranker_inputs(
    tokenizer: Any, query: str, documents: list[str], *, instruction: str | None = None,
    max_length: int = MAX_TOKENS,
) -> list[list[int]]:  # fmt: skip
    """Each pair's token ids as Qwen3-Reranker's model card builds them (``process_inputs``):
    the formatted pair, truncated to what the prefix and suffix leave, between the two."""
    prefix = f"<|im_start|>system\n{RERANKER_SYSTEM}<|im_end|>\n<|im_start|>user\n"
    suffix = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    prefix_tokens = tokenizer.encode(prefix, add_special_tokens=False)
    suffix_tokens = tokenizer.encode(suffix, add_special_tokens=False)
    instruction = instruction or RERANKER_INSTRUCTION
    pairs = [f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
             for doc in documents]  # fmt: skip
    inputs = tokenizer(
        pairs, padding=False, truncation="longest_first", return_attention_mask=False,
        max_length=max_length - len(prefix_tokens) - len(suffix_tokens),
    )  # fmt: skip
    return [prefix_tokens + ids + suffix_tokens for ids in inputs["input_ids"]]


def qwen3_reranker_scores(
    folder: Path, query: str, documents: list[str], *, instruction: str | None = None,
    max_length: int = MAX_TOKENS, batch_size: int | None = None,
) -> np.ndarray:  # fmt: skip
    """P("yes") per document as Qwen3-Reranker's model card computes it with transformers:
    batches padded on the left, the logits of "no" and "yes" at the last position, their
    softmax's "yes". ``batch_size=1``: one pair at a time, without padding."""
    with quiet():
        tokenizer = AutoTokenizer.from_pretrained(str(folder), padding_side="left")
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    token_false_id = tokenizer.convert_tokens_to_ids("no")
    token_true_id = tokenizer.convert_tokens_to_ids("yes")
    ids = qwen3_reranker_inputs(
        tokenizer, query, documents, instruction=instruction, max_length=max_length
    )
    scores: list[float] = []
    size = batch_size or len(ids)
    for start in range(0, len(ids), size):
        with quiet(), torch.no_grad():  # the card's max_length, ignored here, is warned about
            inputs = tokenizer.pad(
                {"input_ids": ids[start : start + size]}, padding=True, return_tensors="pt",
                max_length=max_length,
            )  # fmt: skip
            batch_scores = model(**inputs).logits[:, -1, :]
        true_vector = batch_scores[:, token_true_id]
        false_vector = batch_scores[:, token_false_id]
        batch_scores = torch.stack([false_vector, true_vector], dim=1)
        batch_scores = torch.nn.functional.log_softmax(batch_scores, dim=1)
        scores += batch_scores[:, 1].exp().tolist()
    return np.array(scores)


def _rerank_scores(client: httpx.Client, model: str, documents: list[str]) -> np.ndarray:
    results = _post(client, "/v1/rerank", {"model": model, "query": QUERY, "documents": documents})[
        "results"
    ]
    scores = np.zeros(len(documents))
    for result in results:
        scores[result["index"]] = result["relevance_score"]
    return scores


def measure(url: str, family: Family, folder: Path) -> Parity:
    """Our server's answers for the family's model (served as ``family.name``) against the
    reference, batched and one input at a time."""
    parity = Parity(family.name, family.like)
    with httpx.Client(base_url=url, timeout=120) as client:
        if family.kind == "embed":
            for request in family.requests:
                body = {"model": family.name, **request}
                batched = np.array(_post(client, "/v1/infer", {"inputs": TEXTS, **body})["outputs"])
                single = np.array([
                    _post(client, "/v1/infer", {"inputs": [text], **body})["outputs"][0]
                    for text in TEXTS
                ])  # fmt: skip
                parity.batched_vs_single = max(
                    parity.batched_vs_single, float(np.abs(batched - single).max())
                )
                for side in family.padding_sides or (None,):
                    parity.add(batched, _reference_embeddings(folder, request, side), cosine=True)
        elif family.kind in ("rerank", "llm-rerank"):
            from sentence_transformers import CrossEncoder

            batched = _rerank_scores(client, family.name, TEXTS)
            single = np.array([_rerank_scores(client, family.name, [t])[0] for t in TEXTS])
            parity.batched_vs_single = float(np.abs(batched - single).max())
            if family.kind == "llm-rerank":
                # The model card's batch (left padding) and each pair alone.
                for batch_size in (None, 1):
                    reference = qwen3_reranker_scores(folder, QUERY, TEXTS, batch_size=batch_size)
                    parity.add(batched, reference, cosine=False)
                return parity
            with quiet():
                reference = CrossEncoder(str(folder), device="cpu").predict(
                    [(QUERY, text) for text in TEXTS], show_progress_bar=False
                )
            parity.add(batched, reference, cosine=False)
        else:
            from transformers import pipeline

            body = {"model": family.name, "inputs": TEXTS}
            ranked = _post(client, "/v1/infer", body | {"top_k": len(LABELS)})["outputs"]
            best = _post(client, "/v1/infer", body)["outputs"]
            single = [_post(client, "/v1/infer", body | {"inputs": [t], "top_k": len(LABELS)})[
                "outputs"][0] for t in TEXTS]  # fmt: skip
            with quiet():
                classifier = pipeline("text-classification", model=str(folder), device="cpu")
                reference = classifier(TEXTS, top_k=None, truncation=True)
            labels = list(LABELS.values())
            ours = np.array([[{o["label"]: o["score"] for o in row}[k] for k in labels]
                             for row in ranked])  # fmt: skip
            theirs = np.array([[{o["label"]: o["score"] for o in row}[k] for k in labels]
                               for row in reference])  # fmt: skip
            alone = np.array([[{o["label"]: o["score"] for o in row}[k] for k in labels]
                              for row in single])  # fmt: skip
            parity.batched_vs_single = float(np.abs(ours - alone).max())
            parity.add(ours, theirs, cosine=False)
            for row, top in zip(ranked, best, strict=True):
                scores = [o["score"] for o in row]
                if scores != sorted(scores, reverse=True) or top != row[0]:
                    parity.notes.append(f"ranking: {row} / best {top}")
    return parity


def table(results: list[Parity]) -> str:
    lines = [
        "| family | like | inputs checked | worst cosine | max abs diff | batched vs alone |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        cosine = "-" if r.worst_cosine is None else f"{r.worst_cosine:.8f}"
        lines.append(
            f"| {r.family} | {r.like} | {r.checked} | {cosine} | {r.max_abs_diff:.1e} | "
            f"{r.batched_vs_single:.1e} |"
        )
    return "\n".join(lines)
