"""Load a causal LM for generation: its weights (a safetensors folder, or a GGUF file
converted once by ``models/gguf.py``), its tokenizer and chat template, and its generation
config's defaults."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PretrainedConfig

from ..base import ArchitectureShape, ModelInfo
from ..chat import PromptTokenizer
from ..errors import ModelLoadError
from ..generative import GenerationDefaults
from ..quantization import module_bytes
from .model import CausalLM

log = logging.getLogger(__name__)


def load_generator(
    path: str, config: PretrainedConfig, *, name: str, dtype: torch.dtype, device: torch.device,
    max_context_tokens: int | None, chat_template: str | None,
) -> CausalLM:  # fmt: skip
    """The causal LM in the folder ``path`` (``config`` already read). ``chat_template``: a
    Jinja file that replaces the tokenizer's own template."""
    try:
        module = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, use_safetensors=True, trust_remote_code=False
        )
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load generator {name!r}: {exc}") from exc
    if not getattr(tokenizer, "is_fast", False):
        raise ModelLoadError(f"model {name!r} has no fast tokenizer (tokenizer.json)")
    module.eval().to(device)
    context = int(getattr(config, "max_position_embeddings", 0) or 0) or 2048
    if max_context_tokens:
        context = min(context, max_context_tokens)
    info = ModelInfo(
        name=name,
        task="generate",
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        max_input_tokens=context,
        num_parameters=sum(p.numel() for p in module.parameters()),
        output_dim=None,
        shape=_shape(config, module),
    )
    template = _chat_template(tokenizer, chat_template, name)
    defaults = generation_defaults(Path(path), tokenizer.eos_token_id)
    prompts = PromptTokenizer(
        tokenizer.backend_tokenizer,
        info=info,
        chat_template=template,
        special_tokens={
            key: str(value)
            for key, value in tokenizer.special_tokens_map.items()
            if isinstance(value, str)
        },
        defaults=defaults,
    )
    log.info(
        "generator %s: context %d tokens, end-of-sequence ids %s, chat template %s, sampling "
        "defaults temperature %g top_p %g top_k %d",
        name, context, sorted(defaults.eos_token_ids),
        "none" if template is None else ("from " + chat_template if chat_template else "its own"),
        defaults.temperature, defaults.top_p, defaults.top_k,
    )  # fmt: skip
    return CausalLM(module=module, info=info, prompts=prompts, device=device)


def generation_defaults(folder: Path, tokenizer_eos: int | None) -> GenerationDefaults:
    """The sampling defaults the folder's ``generation_config.json`` sets explicitly (as vLLM
    reads them: temperature, top_p, top_k, max_new_tokens), and every end-of-sequence id it
    or the tokenizer names."""
    eos: set[int] = {tokenizer_eos} if tokenizer_eos is not None else set()
    given: dict[str, object] = {}
    if (folder / "generation_config.json").is_file():
        config = GenerationConfig.from_pretrained(folder)
        given = config.to_diff_dict()
        ids = config.eos_token_id
        eos.update([ids] if isinstance(ids, int) else (ids or []))
    return GenerationDefaults(
        eos_token_ids=frozenset(int(i) for i in eos),
        temperature=float(given.get("temperature", 1.0)),  # type: ignore[arg-type]
        top_p=float(given.get("top_p", 1.0)),  # type: ignore[arg-type]
        top_k=int(given.get("top_k", 0) or 0),  # type: ignore[call-overload]
        max_new_tokens=given.get("max_new_tokens"),  # type: ignore[arg-type]
    )


def _chat_template(tokenizer: object, path: str | None, name: str) -> str | None:
    if path is not None:
        try:
            return Path(path).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"cannot read chat template {path!r}: {exc}") from None
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one
        template = template.get("default")
    if not template:
        log.warning("generator %s has no chat template: chat requests get 400", name)
        return None
    return str(template)


def _shape(config: PretrainedConfig, module: torch.nn.Module) -> ArchitectureShape:
    from ..loading import _gated_mlp, sliding_window

    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    kv_heads = getattr(config, "num_key_value_heads", None)
    head_dim = getattr(config, "head_dim", None)
    return ArchitectureShape(
        hidden_size=hidden,
        num_layers=int(config.num_hidden_layers),
        num_heads=heads,
        intermediate_size=int(getattr(config, "intermediate_size", 4 * hidden)),
        element_bytes=next(module.parameters()).element_size(),
        parameter_bytes=module_bytes(module),
        architecture="decoder",
        num_kv_heads=int(kv_heads) if kv_heads else None,
        head_dim=int(head_dim) if head_dim else hidden // max(1, heads),
        attention="sdpa",
        sliding_window=sliding_window(config),
        gated_mlp=_gated_mlp(config, module),
    )
