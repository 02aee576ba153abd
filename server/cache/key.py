"""What identifies one input's output: the model and exactly what that model's forward reads.

The key is built from the item after tokenization, not from the request's text: the token
ids once the prompt is in front and truncation (on the model's side, left or right) has cut
them, a pair's segment ids, how many leading tokens are a prompt that pooling leaves
out, and the token spans of late chunks. Two inputs with the same key give the forward pass
the same tensors, so the same output; two with any difference in what the model sees get
different keys. ``dimensions`` (a Matryoshka cut) is part of the key because the stored
value is the answer after the cut.
"""

from __future__ import annotations

import struct
from array import array
from typing import Any

from models import Item, Tokens

CacheKey = tuple[str, int, bytes]
"""(model name, dimensions or 0 for the model's full output, what the model reads)."""

_HEADER = struct.Struct("<cIIB")


def _ids(values: list[int]) -> bytes:
    try:
        return array("I", values).tobytes()
    except OverflowError:  # an id beyond 32 bits (no tokenizer has one): 64-bit codes
        return b"\x00" + array("q", values).tobytes()


def item_payload(data: Any) -> bytes | None:
    """The exact bytes of what the forward pass reads from one item's data; None for data
    of a kind this cannot encode exactly (such items are always computed)."""
    if isinstance(data, Tokens):
        has_types = data.type_ids is not None
        header = _HEADER.pack(b"T", len(data.ids), data.prompt_length, has_types)
        body = _ids(data.ids)
        if has_types:
            body += _ids(data.type_ids)  # type: ignore[arg-type]
        if data.spans is not None:  # late chunks: one vector per span, another answer
            body += b"L" + _ids([bound for span in data.spans for bound in span])
        return header + body
    if isinstance(data, str):
        return b"S" + data.encode("utf-8", "surrogatepass")
    if isinstance(data, bytes):
        return b"B" + data
    key = getattr(data, "cache_key", None)
    if callable(key):  # a custom model's item data can name its own exact encoding
        encoded = key()
        if isinstance(encoded, bytes):
            return b"C" + encoded
    return None


def cache_key(model: str, item: Item, dimensions: int | None) -> CacheKey | None:
    payload = item_payload(item.data)
    if payload is None:
        return None
    return (model, dimensions or 0, payload)


def key_bytes(key: CacheKey) -> int:
    """What a key holds: its payload and model name (the tuple itself is in the overhead)."""
    return len(key[2]) + len(key[0])
