"""sentence-transformers' ``SparseEncoder`` folders (SPLADE): a masked language model whose
vocabulary logits are pooled into one sparse vector per input.

``modules.json`` lists the Transformer (``MLMTransformer``, or a ``Transformer`` whose
``transformer_task`` is ``fill-mask``) and then ``SpladePooling``. Read here without torch;
the pooling itself runs in ``postprocess.py``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .errors import ModelLoadError

SPLADE_STRATEGIES = ("max", "sum")
SPLADE_ACTIVATIONS = ("relu", "log1p_relu")
_TRANSFORMERS = ("Transformer", "MLMTransformer")


@dataclass(frozen=True, slots=True)
class Splade:
    """``log(1 + activation(logits))`` per token, then the max (or sum) over each input's
    real tokens: one value per vocabulary entry, most of them zero."""

    dimensions: int
    """The vocabulary's size: the sparse vector's dimension."""
    strategy: Literal["max", "sum"] = "max"
    activation: Literal["relu", "log1p_relu"] = "relu"
    """``log1p_relu``: ``log(1 + log(1 + relu(x)))``, as OpenSearch's SPLADE models."""
    max_active_dims: int | None = None
    """Keep only this many largest values per vector (the folder's ``max_active_dims``)."""


def module_kinds(modules: Any) -> list[str]:
    """The short class names of ``modules.json``'s entries, in order."""
    if not isinstance(modules, list):
        return []
    ordered = sorted(
        (e for e in modules if isinstance(e, dict)), key=lambda e: int(e.get("idx", 0))
    )
    return [str(entry.get("type", "")).rsplit(".", 1)[-1] for entry in ordered]


def is_sparse_encoder(folder: Path) -> bool:
    """Whether ``folder``'s ``modules.json`` lists SPLADE pooling."""
    try:
        modules = json.loads((folder / "modules.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return "SpladePooling" in module_kinds(modules)


def read_splade(
    kinds: list[tuple[str, Path]], transformer: Mapping[str, Any],
    settings: Mapping[str, Any], *, task: str, vocab_size: int, name: str,
) -> Splade | None:  # fmt: skip
    """The SPLADE step of a SparseEncoder whose modules are ``kinds`` (short class name,
    folder), refusing what sentence-transformers would run differently; None for a folder
    without SpladePooling (refused where ``task`` is ``sparse``)."""
    if not any(kind == "SpladePooling" for kind, _ in kinds):
        if task == "sparse":
            raise ModelLoadError(
                f"model {name!r}: --task sparse serves a SparseEncoder (a Transformer, then "
                "SpladePooling), which its modules.json does not list"
            )
        if kinds[0][0] == "MLMTransformer" or transformer.get("transformer_task") == "fill-mask":
            raise ModelLoadError(
                f"model {name!r}: its Transformer is a masked language model (fill-mask) "
                "without SpladePooling after it, which Batchfit does not run"
            )
        return None
    if task != "sparse":
        raise ModelLoadError(
            f"model {name!r} is a sentence-transformers SparseEncoder (SpladePooling); serve "
            f"it with --task sparse (or auto), not {task}"
        )
    names = [kind for kind, _ in kinds]
    if len(names) != 2 or names[0] not in _TRANSFORMERS or names[1] != "SpladePooling":
        raise ModelLoadError(
            f"model {name!r}: its modules.json lists {', '.join(names)}; Batchfit runs a "
            "SparseEncoder made of a Transformer and SpladePooling only"
        )
    default_task = "fill-mask" if names[0] == "MLMTransformer" else "feature-extraction"
    transformer_task = transformer.get("transformer_task", default_task)
    if transformer_task != "fill-mask":
        raise ModelLoadError(
            f"model {name!r}: SpladePooling reads a masked language model's logits, but its "
            f"Transformer's transformer_task is {transformer_task!r}, not 'fill-mask'"
        )
    config_file = kinds[1][1] / "config.json"
    try:
        config = (
            json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        )
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"model {name!r}: cannot read {config_file}: {exc}") from exc
    strategy = config.get("pooling_strategy", "max")
    activation = config.get("activation_function", "relu")
    if strategy not in SPLADE_STRATEGIES or activation not in SPLADE_ACTIVATIONS:
        raise ModelLoadError(
            f"model {name!r}: SpladePooling with pooling_strategy {strategy!r} and "
            f"activation_function {activation!r}; expected {' or '.join(SPLADE_STRATEGIES)} "
            f"and {' or '.join(SPLADE_ACTIVATIONS)}"
        )
    dimensions = config.get("embedding_dimension") or config.get("word_embedding_dimension")
    if dimensions not in (None, vocab_size):
        raise ModelLoadError(
            f"model {name!r}: SpladePooling's embedding_dimension {dimensions} is not the "
            f"vocabulary's size {vocab_size}"
        )
    max_active_dims = settings.get("max_active_dims")
    if max_active_dims is not None and (
        isinstance(max_active_dims, bool) or not isinstance(max_active_dims, int)
        or max_active_dims <= 0
    ):  # fmt: skip
        raise ModelLoadError(
            f"model {name!r}: max_active_dims must be a positive integer, got {max_active_dims!r}"
        )
    return Splade(
        dimensions=vocab_size, strategy=strategy, activation=activation,
        max_active_dims=max_active_dims,
    )  # fmt: skip
