"""Compact embeddings, per request: an embedding as float numbers, as base64 of float32,
float16 or bfloat16 bytes, or quantized (packed sign bits, int8, uint8).

numpy only: an API process in front of an engine encodes the answers it sends.

- ``base64`` with an ``embed_dtype``: the vector's little-endian bytes in that dtype, as vLLM's
  ``embed_dtype`` writes them (bfloat16 rounds to nearest even, as torch casts).
- ``binary`` and ``ubinary``: one bit per dimension, 1 where the value is above 0, packed
  eight to a byte, first dimension in the high bit (``numpy.packbits``); ``binary`` shifts
  each byte by -128 into int8. Exactly sentence-transformers' ``quantize_embeddings``.
- ``int8`` and ``uint8``: ``quantize_embeddings`` with the fixed range -1 to 1 for every
  dimension, which holds every value of a unit vector. Ranges calibrated on each request's own
  embeddings would quantize one text differently in each request, so only models that
  normalise their outputs offer these two.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from models import ModelInfo

from .errors import ApiError

EmbedDtype = Literal["float32", "float16", "bfloat16"]
EmbeddingType = Literal["float", "int8", "uint8", "binary", "ubinary"]
EMBED_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")
QUANTIZED_TYPES = ("int8", "uint8", "binary", "ubinary")
NEEDS_UNIT_VECTORS = ("int8", "uint8")


@dataclass(frozen=True, slots=True)
class Encoding:
    """How one embedding is written: its ``kind`` (float or a quantized type), and for float
    whether as numbers or base64 of ``dtype`` bytes. A quantized type as base64 is its bytes."""

    kind: str = "float"
    base64: bool = False
    dtype: str = "float32"


FLOATS = Encoding()


def check_encoding(
    info: ModelInfo, name: str, *, kind: str = "float", encoding_format: str = "float",
    embed_dtype: str | None = None, schema_status: int = 422,
) -> Encoding:  # fmt: skip
    """The encoding a request asks for, or the error for one the model cannot honour:
    ``unsupported_parameter`` for a compact output of a model that does not embed (or int8
    of one that does not normalise), ``invalid_request`` (``schema_status``) for an
    ``embed_dtype`` without base64 floats."""
    asked = Encoding(kind, encoding_format == "base64", embed_dtype or "float32")
    if asked == FLOATS:
        return asked
    if info.task != "embed" or not info.output_dim:
        raise ApiError(
            400, "unsupported_parameter",
            f"compact outputs apply to embedding models; {name!r} does {info.task}",
        )  # fmt: skip
    if embed_dtype is not None and embed_dtype != "float32" and not asked.base64:
        raise ApiError(
            schema_status, "invalid_request",
            f"embed_dtype {embed_dtype} applies to base64 output (encoding_format base64)",
        )  # fmt: skip
    if embed_dtype is not None and embed_dtype != "float32" and kind != "float":
        raise ApiError(
            schema_status, "invalid_request",
            f"embed_dtype applies to float embeddings, not to {kind}",
        )  # fmt: skip
    if kind in NEEDS_UNIT_VECTORS and not info.normalize:
        raise ApiError(
            400, "unsupported_parameter",
            f"{kind} embeddings are quantized over the range -1 to 1 of unit vectors; "
            f"{name!r} does not normalise its embeddings (binary and ubinary apply to any "
            "embedder)",
        )  # fmt: skip
    return asked


def one_embedding_type(types: str | Sequence[str] | None, schema_status: int = 422) -> str:
    """The one type of a route whose answer holds one vector per input (``embedding_types``
    as a string or a list of one)."""
    if types is None:
        return "float"
    if isinstance(types, str):
        return types
    if len(types) != 1:
        raise ApiError(
            schema_status, "invalid_request",
            f"embedding_types holds one type on this route, got {len(types)}",
        )  # fmt: skip
    return types[0]


def quantize(vectors: np.ndarray, kind: str) -> np.ndarray:
    """Rows of float32 values as ``kind``, as ``quantize_embeddings`` packs them (int8 and
    uint8 over the fixed range -1 to 1)."""
    if kind in ("binary", "ubinary"):
        packed = np.packbits(vectors > 0, axis=-1)
        return (packed - 128).astype(np.int8) if kind == "binary" else packed
    if kind in NEEDS_UNIT_VECTORS:
        steps = np.float32(2.0 / 255)
        levels = np.clip(np.floor((vectors + np.float32(1.0)) / steps), 0, 255)
        return (levels - 128).astype(np.int8) if kind == "int8" else levels.astype(np.uint8)
    raise ValueError(f"unknown embedding type {kind!r}")


def to_dtype_bytes(vectors: np.ndarray, dtype: str) -> np.ndarray:
    """Rows of float32 values as little-endian ``dtype`` values (bfloat16 as its 16 bits)."""
    if dtype == "float32":
        return vectors.astype("<f4", copy=False)
    if dtype == "float16":
        with np.errstate(over="ignore"):  # beyond 65504: infinity, as torch casts
            return vectors.astype("<f2")
    if dtype == "bfloat16":
        bits = np.ascontiguousarray(vectors, dtype=np.float32).view(np.uint32)
        # Round to nearest, ties to even, as torch casts; a NaN stays a (quiet) NaN.
        rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16
        nan = np.isnan(vectors)
        rounded = np.where(nan, (bits >> 16) | 0x40, rounded)
        return rounded.astype("<u2")
    raise ValueError(f"unknown embed_dtype {dtype!r}")


def encode_rows(vectors: np.ndarray, encoding: Encoding) -> list[Any]:
    """Each row as the encoding writes it: float32 arrays (orjson writes them), lists of
    ints, or base64 strings."""
    if encoding.kind != "float":
        rows = quantize(vectors, encoding.kind)
    else:
        rows = to_dtype_bytes(vectors, encoding.dtype) if encoding.base64 else vectors
    if encoding.base64:
        return [base64.b64encode(np.ascontiguousarray(row).data).decode("ascii") for row in rows]
    if encoding.kind != "float":
        return rows.tolist()
    return list(rows)


def encode_embeddings(outputs: Sequence[Any], encoding: Encoding) -> list[Any]:
    """A request's embeddings (one vector each) in ``encoding``."""
    if not outputs:
        return []
    vectors = np.stack([np.asarray(output, dtype=np.float32) for output in outputs])
    return encode_rows(vectors, encoding)
