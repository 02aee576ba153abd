"""Tiny random-weight causal LMs, one per family people serve, saved as their real models
ship (config, safetensors, tokenizer with a chat template, generation config); the engine
that runs them in-process; and the reference: transformers' own ``generate`` reading the
same folder."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry
from transformers import AutoConfig, AutoModelForCausalLM

from batching import ModelThread, MonotonicClock
from generation import (
    EngineConfig,
    GenerationEngine,
    GenerationMetrics,
    RequestStream,
    SequenceSpec,
)
from models import Generator, ModelSpec, SamplingParams, load_model
from tests.families import TEXTS, _byte_level_bpe, _save_tokenizer

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GREEDY = SamplingParams(temperature=0.0)
TIE = 1e-3
"""Where a token differs from the reference's, its top two logits there must be this close."""

# Small, but with what makes each family itself: grouped-query attention, Qwen3's q/k norms,
# Gemma 3's sliding-window layers (a window of 16, so that prompts pass it), experts.
_COMMON = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 512, "tie_word_embeddings": False,
}  # fmt: skip
FAMILIES: dict[str, dict[str, object]] = {
    "llama": {"architectures": ["LlamaForCausalLM"]},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"]},
    "gemma3_text": {
        "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 6, "sliding_window": 16,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "query_pre_attn_scalar": 16, "tie_word_embeddings": True,
    },
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "decoder_sparse_step": 1,
    },
}  # fmt: skip


def tiny_generator(root: Path, family: str, *, seed: int = 0, chat_template: bool = True) -> Path:
    """A tiny causal LM of ``family`` in ``root/family``: a byte-level BPE with <|endoftext|>
    as end of sequence, ChatML's template (unless not ``chat_template``), random weights."""
    folder = root / family
    folder.mkdir(parents=True, exist_ok=True)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = _byte_level_bpe(specials)
    eos = tokenizer.token_to_id("<|endoftext|>")
    _save_tokenizer(
        tokenizer, folder, "PreTrainedTokenizerFast", 512, eos_token="<|endoftext|>",
        pad_token="<|endoftext|>", unk_token=None,
    )  # fmt: skip
    if chat_template:
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["chat_template"] = CHATML
        config_path.write_text(json.dumps(config, indent=2))
    torch.manual_seed(seed)
    options = {**_COMMON, **FAMILIES[family]}
    config = AutoConfig.for_model(
        family, vocab_size=tokenizer.get_vocab_size(), eos_token_id=eos, pad_token_id=eos,
        bos_token_id=eos, **options,
    )  # fmt: skip
    module = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # logits far apart: a tie between the top two is rare
        for parameter in module.parameters():
            parameter.mul_(4.0)
    module.save_pretrained(folder, safe_serialization=True)
    return folder


def prompts_for(model: Generator, lengths: Sequence[int]) -> list[list[int]]:
    """Prompts of exactly these lengths, cut from the families' texts."""
    text = " ".join(TEXTS * 40)
    ids = model.preparer().encode(text, add_special_tokens=False)
    return [ids[7 * i : 7 * i + length] for i, length in enumerate(lengths)]


def load(folder: Path) -> Generator:
    model = load_model(ModelSpec(model=str(folder), device="cpu", task="generate"))
    assert isinstance(model, Generator)
    return model


@dataclass
class Reference:
    """transformers' ``generate`` on one prompt: its tokens, and each step's top two
    logits (to tell a tie broken differently from a real difference)."""

    tokens: list[int]
    top_two: list[tuple[float, float]]


def reference(folder: Path, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[Reference]:
    module = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    module.generation_config.eos_token_id = None  # as ignore_eos: max_tokens tokens each
    found = []
    for prompt in prompts:
        with torch.inference_mode():
            out = module.generate(
                torch.tensor([list(prompt)]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_tokens, do_sample=False,
                output_scores=True, return_dict_in_generate=True,
            )  # fmt: skip
        tops = [tuple(score[0].topk(2).values.tolist()) for score in out.scores]
        found.append(Reference(out.sequences[0, len(prompt) :].tolist(), tops))  # type: ignore[arg-type]
    return found


def differences(ours: Sequence[int], ref: Reference) -> int:
    """How many sequences' positions differ from the reference (0 or 1: after the first,
    the continuations diverge); a difference must be a tie (top two within ``TIE``)."""
    for position, (mine, theirs) in enumerate(zip(ours, ref.tokens, strict=True)):
        if mine != theirs:
            first, second = ref.top_two[position]
            assert first - second < TIE, (
                f"token {position} differs ({mine} vs {theirs}) where the reference's top two "
                f"logits are {first - second:.2e} apart, not a tie"
            )
            return 1
    return 0


async def engine_outputs(
    model: Generator, prompts: Sequence[Sequence[int]], max_tokens: int, *,
    config: EngineConfig | None = None, sampling: Sequence[SamplingParams] | None = None,
    thread: ModelThread | None = None,
) -> list[list[int]]:  # fmt: skip
    """Every prompt through one engine at once (``ignore_eos``, so that each gives
    ``max_tokens`` tokens); the tokens of each, in order."""
    own_thread = thread is None
    thread = thread or ModelThread("batchfit-test-model")
    engine = GenerationEngine(
        name="test", model=model, model_thread=thread, clock=MonotonicClock(),
        metrics=GenerationMetrics(CollectorRegistry(), max_step_tokens=2048).for_model("test"),
        config=config or EngineConfig(),
    )  # fmt: skip
    task = asyncio.create_task(engine.run())
    streams = []
    for index, prompt in enumerate(prompts):
        params = sampling[index] if sampling is not None else GREEDY
        stream, _ = engine.submit(
            [SequenceSpec(list(prompt), max_tokens, params, ignore_eos=True)], timeout_s=300
        )
        streams.append(stream)

    async def tokens(stream: RequestStream) -> list[int]:
        found: list[int] = []
        while True:
            try:
                events = await stream.next_events()
            except EOFError:
                return found
            for event in events:
                found.extend(event.token_ids)

    try:
        return list(await asyncio.gather(*(tokens(s) for s in streams)))
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert engine.cache_bytes == 0 or engine.running == []
        if own_thread:
            thread.close()


def tiny_llama(folder: Path) -> tuple[Path, Any]:
    """A two-layer random Llama with the bundled embedder's WordPiece tokenizer (a vocabulary
    real prose tokenizes into): the load generator's and the benchmarks' stand-in."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from models.loading import BUNDLED_MODEL, resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(BUNDLED_MODEL))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=512, eos_token_id=tokenizer.sep_token_id,
                         bos_token_id=tokenizer.cls_token_id,
                         pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, tokenizer
