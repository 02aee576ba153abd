"""Per request, after the model: Matryoshka ``dimensions`` and a classifier's ``top_k``
shape the answer. numpy only: an API process in front of an engine runs these."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np


class SparseVector(NamedTuple):
    """A sparse embedder's output: its non-zero entries, by ascending index."""

    indices: np.ndarray
    """int32 positions in the vocabulary."""
    values: np.ndarray
    """float32, one per index, all non-zero."""

    def pairs(self) -> list[dict[str, Any]]:
        """TEI's shape: ``[{"index": i, "value": v}, ...]``."""
        return [
            {"index": i, "value": v}
            for i, v in zip(self.indices.tolist(), self.values.tolist(), strict=True)
        ]


def truncate_dimensions(vector: Any, dimensions: int, normalize: bool) -> np.ndarray:
    """A Matryoshka embedding's first ``dimensions`` values, renormalised to unit length when
    the model's own output is normalised. Late chunks (one vector per row): each row's."""
    kept = np.asarray(vector, dtype=np.float32)[..., :dimensions]
    if normalize:
        norm = np.linalg.norm(kept.astype(np.float64), axis=-1, keepdims=True)
        kept = (kept / np.maximum(norm, 1e-12)).astype(np.float32)
    return kept


def top_labels(output: Any, top_k: int | None) -> Any:
    """A classifier's answer: the best ``{label, score}``, or with ``top_k`` the best ``top_k``
    of them, best first."""
    ranked = output if isinstance(output, list) else [output]
    return ranked[0] if top_k is None else ranked[:top_k]
