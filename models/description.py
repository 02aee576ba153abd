"""What a model folder says it is, read once at load into a frozen description.

The sentence-transformers layout (``modules.json`` and each module's folder) is the source
where present; transformers' ``config.json`` otherwise. Nothing here runs a model: the
postprocess (``models/postprocess.py``) is built from the description afterwards.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from transformers import PretrainedConfig
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
)

from .errors import ModelLoadError
from .splade import Splade, read_splade

log = logging.getLogger(__name__)

POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
# sentence-transformers' boolean keys before ``pooling_mode``, in its concatenation order.
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
# The Transformer module's config file, and the names sentence-transformers 1.x gave it.
_TRANSFORMER_CONFIGS = (
    "sentence_bert_config.json", "sentence_roberta_config.json",
    "sentence_distilbert_config.json", "sentence_camembert_config.json",
    "sentence_albert_config.json", "sentence_xlm-roberta_config.json",
    "sentence_xlnet_config.json",
)  # fmt: skip
_RUNNABLE = ("Transformer", "Pooling", "Dense", "Normalize", "MLMTransformer", "SpladePooling")
_TASK_OUTPUTS = {
    "feature-extraction": "last_hidden_state",
    "sequence-classification": "logits",
    "fill-mask": "logits",  # a SparseEncoder's (SPLADE) only
}
TANH = "torch.nn.modules.activation.Tanh"
SIGMOID = "torch.nn.modules.activation.Sigmoid"
IDENTITY = "torch.nn.modules.linear.Identity"


@dataclass(frozen=True, slots=True)
class Pooling:
    """Token embeddings to one vector: each mode's vector, concatenated in order."""

    modes: tuple[str, ...] = ("mean",)
    include_prompt: bool = True
    """False: the prompt's tokens take no part in pooling (they still run through the model)."""

    @property
    def name(self) -> str:
        return "+".join(self.modes)


@dataclass(frozen=True, slots=True)
class Dense:
    """A linear layer with its activation (a ``torch.nn`` class), weights in ``weights``."""

    in_features: int
    out_features: int
    weights: Path
    bias: bool = True
    activation: str = TANH
    use_residual: bool = False


@dataclass(frozen=True, slots=True)
class Normalize:
    """L2 normalisation."""


@dataclass(frozen=True, slots=True)
class Truncate:
    """Keep the first ``dimensions`` values (a model saved with ``truncate_dim``)."""

    dimensions: int


Step = Pooling | Dense | Normalize | Truncate | Splade


@dataclass(frozen=True, slots=True)
class ModelDescription:
    """A served model as its folder describes it; everything after the forward pass follows
    from ``steps`` (embedders) or ``head_activation`` (classifiers and cross-encoders)."""

    task: str
    architecture: Literal["encoder", "decoder"]
    hidden_size: int
    steps: tuple[Step, ...] = ()
    head_activation: str | None = None
    """``softmax``, ``sigmoid``, ``identity``, or a ``torch.nn`` class for a cross-encoder."""
    prompts: Mapping[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    max_seq_length: int | None = None
    do_lower_case: bool = False
    source: Literal["sentence-transformers", "transformers"] = "transformers"

    @property
    def pooling(self) -> Pooling | None:
        return next((s for s in self.steps if isinstance(s, Pooling)), None)

    @property
    def normalize(self) -> bool:
        """Whether the output has unit length (its last step normalises)."""
        return bool(self.steps) and isinstance(self.steps[-1], Normalize)

    @property
    def splade(self) -> Splade | None:
        """A sparse embedder's (SPLADE) pooling."""
        return next((s for s in self.steps if isinstance(s, Splade)), None)

    @property
    def output_dim(self) -> int | None:
        """An embedder's vector size; a sparse embedder's vocabulary size."""
        if self.task == "sparse" and self.splade is not None:
            return self.splade.dimensions
        if self.task != "embed":
            return None
        dim = self.hidden_size
        for step in self.steps:
            if isinstance(step, Pooling):
                dim = len(step.modes) * self.hidden_size
            elif isinstance(step, Dense):
                dim = step.out_features
            elif isinstance(step, Truncate):
                dim = min(dim, step.dimensions)
        return dim


def convert_hint(source: Path, target: Path) -> str:
    """One command that rewrites a pickle checkpoint as safetensors (loading it with
    ``weights_only=True``, which runs no code from the file)."""
    return (
        'convert it to safetensors in one command: python -c "import sys, torch; '
        "from safetensors.torch import save_file; state = torch.load(sys.argv[1], "
        "map_location='cpu', weights_only=True); save_file({k: v.contiguous().clone() "
        "for k, v in state.items()}, sys.argv[2], metadata={'format': 'pt'})\" "
        f"{source} {target}"
    )


def architecture_of(config: PretrainedConfig) -> Literal["encoder", "decoder"]:
    """A decoder is a model type transformers knows only as a causal language model (Qwen,
    Llama, Mistral, Gemma...); BERT-likes also have a causal head but are masked LMs first."""
    model_type = getattr(config, "model_type", "")
    if getattr(config, "is_decoder", False) or (
        model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        and model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES
    ):
        return "decoder"
    return "encoder"


def describe(
    root: Path, config: PretrainedConfig, task: str, *, name: str, default_prompt_name: str | None
) -> ModelDescription:
    """Read the folder at ``root`` (its ``config`` already loaded) for a model of ``task``.

    ``default_prompt_name``: the operator's choice (``""`` for none), else the folder's own."""
    architecture = architecture_of(config)
    hidden_size = int(config.hidden_size)
    settings = _read_json(root / "config_sentence_transformers.json", name) or {}
    modules_file = root / "modules.json"
    transformer = _transformer_config(root, name)
    if modules_file.is_file():
        steps = _read_modules(
            root, modules_file, task, hidden_size, name, settings=settings,
            vocab_size=int(getattr(config, "vocab_size", 0) or 0),
        )  # fmt: skip
        source: Literal["sentence-transformers", "transformers"] = "sentence-transformers"
    elif task == "sparse":
        raise ModelLoadError(
            f"model {name!r}: --task sparse serves a sentence-transformers SparseEncoder "
            "folder (modules.json with SpladePooling), and this folder has no modules.json"
        )
    else:
        steps = _default_steps(task, architecture, name)
        source = "transformers"
    truncate_dim = settings.get("truncate_dim")
    if task == "embed" and truncate_dim:
        steps = (*steps, Truncate(int(truncate_dim)))
    prompts = {str(k): str(v) for k, v in (settings.get("prompts") or {}).items()}
    chosen = settings.get("default_prompt_name")
    if default_prompt_name is not None:
        chosen = default_prompt_name or None
    if chosen is not None and chosen not in prompts:
        known = ", ".join(map(repr, prompts)) or "none"
        raise ModelLoadError(
            f"model {name!r} has no prompt named {chosen!r} to use by default; its prompts: {known}"
        )
    return ModelDescription(
        task=task,
        architecture=architecture,
        hidden_size=hidden_size,
        steps=steps,
        head_activation=_head_activation(config, settings, task),
        prompts=prompts,
        default_prompt_name=chosen,
        max_seq_length=_max_seq_length(transformer),
        do_lower_case=bool(transformer.get("do_lower_case", False)),
        source=source,
    )


def _default_steps(task: str, architecture: str, name: str) -> tuple[Step, ...]:
    if task != "embed":
        return ()
    # NOTE: decoder embedders (e5-mistral, gte-Qwen2, Qwen3-Embedding) read their last token;
    # mean pooling one of them gives plausible but wrong vectors.
    pooling = Pooling(("lasttoken",) if architecture == "decoder" else ("mean",))
    log.warning(
        "model %s has no modules.json: assuming %s pooling and L2 normalisation", name, pooling.name
    )
    return pooling, Normalize()


def _read_json(path: Path, name: str) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"model {name!r}: cannot read {path.name}: {exc}") from exc
    if not isinstance(data, dict | list):
        raise ModelLoadError(f"model {name!r}: {path.name} is not a JSON object")
    return data  # type: ignore[return-value]


def _transformer_config(folder: Path, name: str) -> dict[str, Any]:
    for filename in _TRANSFORMER_CONFIGS:
        config = _read_json(folder / filename, name)
        if config is not None:
            return config
    return {}


def _max_seq_length(transformer: Mapping[str, Any]) -> int | None:
    limits = [transformer.get("max_seq_length")]
    for key in ("processor_kwargs", "tokenizer_args"):
        limits.append((transformer.get(key) or {}).get("model_max_length"))
    found = [int(v) for v in limits if v]
    return min(found) if found else None


def _read_modules(
    root: Path, modules_file: Path, task: str, hidden_size: int, name: str, *,
    settings: Mapping[str, Any], vocab_size: int,
) -> tuple[Step, ...]:  # fmt: skip
    entries = _read_json(modules_file, name)
    if not isinstance(entries, list) or not entries:
        raise ModelLoadError(f"model {name!r}: modules.json holds no list of modules")
    kinds = []
    for entry in sorted(entries, key=lambda e: int(e.get("idx", 0))):
        kind = str(entry.get("type", ""))
        short = kind.rsplit(".", 1)[-1]
        if not kind.startswith("sentence_transformers.") or short not in _RUNNABLE:
            raise ModelLoadError(
                f"model {name!r}: modules.json lists a module of type {kind!r}, which Batchfit "
                f"cannot run (it runs {', '.join(_RUNNABLE)})"
            )
        kinds.append((short, root / str(entry.get("path", ""))))
    if kinds[0][0] not in ("Transformer", "MLMTransformer"):
        raise ModelLoadError(f"model {name!r}: the first module is {kinds[0][0]}, not Transformer")
    if kinds[0][1].resolve() != root.resolve():
        raise ModelLoadError(
            f"model {name!r}: its Transformer lives in {kinds[0][1].name!r}; serve that folder "
            "after moving modules.json and the other module folders beside it"
        )
    transformer = _transformer_config(root, name)
    splade = read_splade(kinds, transformer, settings, task=task, vocab_size=vocab_size, name=name)
    if splade is not None:
        _check_transformer({"transformer_task": "fill-mask", **transformer}, task, name)
        return (splade,)
    _check_transformer(transformer, task, name)
    steps: list[Step] = []
    for short, folder in kinds[1:]:
        if task != "embed":
            raise ModelLoadError(
                f"model {name!r} is a {task} model whose modules.json adds a {short} module "
                "after its Transformer; Batchfit runs a classifier's own head only"
            )
        if short in ("Transformer", "MLMTransformer"):
            raise ModelLoadError(f"model {name!r}: modules.json lists a second Transformer")
        config = _read_json(folder / "config.json", name) or {}
        if short == "Pooling":
            if any(isinstance(s, Pooling) for s in steps):
                raise ModelLoadError(f"model {name!r}: modules.json lists two Pooling modules")
            steps.append(_pooling(config, name))
        elif not any(isinstance(s, Pooling) for s in steps):
            raise ModelLoadError(
                f"model {name!r}: its {short} module works on token embeddings (before any "
                "Pooling), which Batchfit does not run"
            )
        elif short == "Dense":
            steps.append(_dense(folder, config, name))
        else:
            _check_io(config, "Normalize", name)
            steps.append(Normalize())
    if task == "embed" and not any(isinstance(s, Pooling) for s in steps):
        raise ModelLoadError(
            f"model {name!r}: modules.json has no Pooling module, so the model gives no "
            "sentence embedding"
        )
    return tuple(steps)


def _check_transformer(config: Mapping[str, Any], task: str, name: str) -> None:
    transformer_task = config.get("transformer_task", "feature-extraction")
    if transformer_task not in _TASK_OUTPUTS:
        raise ModelLoadError(
            f"model {name!r}: its Transformer's transformer_task is {transformer_task!r}; "
            f"Batchfit runs {' and '.join(map(repr, _TASK_OUTPUTS))}"
        )
    modality_config = config.get("modality_config")
    if modality_config is not None:
        expected = {"method": "forward", "method_output_name": _TASK_OUTPUTS[transformer_task]}
        if "message" in modality_config:
            raise ModelLoadError(
                f"model {name!r}: its sentence_bert_config.json sends text through the "
                "tokenizer's chat template (modality 'message'), which Batchfit does not apply"
            )
        text = modality_config.get("text")
        if set(modality_config) != {"text"} or not isinstance(text, dict) or any(
            text.get(key) != value for key, value in expected.items()
        ):  # fmt: skip
            raise ModelLoadError(
                f"model {name!r}: its modality_config {modality_config!r} is not the plain text "
                f"forward pass ({expected!r}) Batchfit runs"
            )
    if config.get("processing_kwargs"):
        raise ModelLoadError(
            f"model {name!r}: its sentence_bert_config.json sets processing_kwargs "
            f"{config['processing_kwargs']!r}, which Batchfit does not apply"
        )


def _pooling(config: Mapping[str, Any], name: str) -> Pooling:
    if "pooling_mode" in config:
        mode = config["pooling_mode"]
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
    else:
        modes = tuple(m for key, m in _LEGACY_POOLING_KEYS.items() if config.get(key)) or ("mean",)
    unknown = [m for m in modes if m not in POOLING_MODES]
    if unknown or not modes:
        raise ModelLoadError(
            f"model {name!r}: unknown pooling mode {unknown or modes!r}; expected "
            f"{', '.join(POOLING_MODES)}"
        )
    return Pooling(modes, include_prompt=bool(config.get("include_prompt", True)))


def _check_io(config: Mapping[str, Any], module: str, name: str) -> None:
    for key in ("module_input_name", "module_output_name"):
        value = config.get(key)
        if value not in (None, "sentence_embedding"):
            raise ModelLoadError(
                f"model {name!r}: its {module} module's {key} is {value!r}; Batchfit runs "
                f"{module} on the sentence embedding only"
            )


def _dense(folder: Path, config: Mapping[str, Any], name: str) -> Dense:
    _check_io(config, "Dense", name)
    weights = folder / "model.safetensors"
    if not weights.is_file():
        pickled = folder / "pytorch_model.bin"
        if pickled.is_file():
            raise ModelLoadError(
                f"model {name!r}: its Dense module {folder.name!r} has pickle weights only "
                "(pytorch_model.bin), which are refused; " + convert_hint(pickled, weights)
            )
        raise ModelLoadError(f"model {name!r}: its Dense module {folder.name!r} has no weights")
    try:
        return Dense(
            in_features=int(config["in_features"]),
            out_features=int(config["out_features"]),
            weights=weights,
            bias=bool(config.get("bias", True)),
            activation=str(config.get("activation_function") or TANH),
            use_residual=bool(config.get("use_residual", False)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"model {name!r}: bad Dense config in {folder.name!r}: {exc}") from exc


def _head_activation(
    config: PretrainedConfig, settings: Mapping[str, Any], task: str
) -> str | None:
    """A cross-encoder's activation as sentence-transformers' ``CrossEncoder`` resolves it
    (its own config, then ``config.json``, then the pre-4.0 key; sigmoid when none is named);
    a classifier's as transformers' text-classification pipeline does (``problem_type``)."""
    if task == "rerank":
        named = settings.get("activation_fn")
        legacy = getattr(config, "sentence_transformers", None) or {}
        if named is None and isinstance(legacy, dict):
            named = legacy.get("activation_fn")
        if named is None:
            named = getattr(config, "sbert_ce_default_activation_function", None)
        return str(named) if named else SIGMOID
    if task == "classify":
        problem_type = getattr(config, "problem_type", None)
        if problem_type == "regression":
            return "identity"
        if problem_type == "multi_label_classification" or int(config.num_labels) == 1:
            return "sigmoid"
        return "softmax"
    return None


def activation_name(activation: str | None) -> str | None:
    """How the model card names an activation: ``sigmoid``, ``identity``, ``tanh``..."""
    if activation is None:
        return None
    return activation.rsplit(".", 1)[-1].lower()


def step_name(step: Step) -> str:
    """A step as the load log names it: ``cls pooling``, ``Dense 768->256 tanh``..."""
    if isinstance(step, Pooling):
        return f"{step.name} pooling" + ("" if step.include_prompt else " (prompt left out)")
    if isinstance(step, Dense):
        return f"Dense {step.in_features}->{step.out_features} {activation_name(step.activation)}"
    if isinstance(step, Truncate):
        return f"first {step.dimensions} values"
    if isinstance(step, Splade):
        kept = f", at most {step.max_active_dims} active" if step.max_active_dims else ""
        return f"SPLADE {step.strategy} pooling of {step.activation} over the vocabulary{kept}"
    return "L2 normalisation"
