"""A bounded least-recently-used store of outputs, with byte accounting. No asyncio, no I/O.

An entry's size is its key's payload, its value and a fixed overhead for the containers that
hold it (the dict entry, the key tuple, the array header), so the bytes reported are close to
what the entries keep resident. The store never holds more than ``max_bytes``: an insert
evicts the least recently used entries until the new one fits, and a value larger than the
whole bound is not stored.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from .key import CacheKey, key_bytes

ENTRY_OVERHEAD_BYTES = 264
"""The ordered dict's entry, the (value, size) pair, the key tuple and the key's bytes
header: 261 bytes an entry, measured with tracemalloc over 20,000 entries of the bundled
model, rounded up."""


def stored_value(output: Any) -> Any:
    """The value to keep: an array copied out of its batch (a view would keep the whole
    batch's array alive) and made read-only, so no answer can alter what later ones read."""
    if isinstance(output, np.ndarray):
        owned = np.array(output, copy=True, order="C")
        owned.flags.writeable = False
        return owned
    return output


def value_bytes(value: Any) -> int:
    """Memory one stored value holds: an array's buffer and header, a float's object, a
    classifier's ranked labels (a list of small dicts) as deep as they go."""
    if isinstance(value, np.ndarray):
        return sys.getsizeof(value)
    if isinstance(value, list | tuple):
        return sys.getsizeof(value) + sum(value_bytes(v) for v in value)
    if isinstance(value, dict):
        return sys.getsizeof(value) + sum(value_bytes(v) for v in value.values())
    return sys.getsizeof(value)  # a classifier's labels are shared: an overestimate


class OutputStore:
    """Outputs by key, at most ``max_bytes`` in all. ``on_evict(model)`` is called once per
    entry evicted; ``bytes_by_model`` says what each model's entries hold."""

    def __init__(self, max_bytes: int, *, on_evict: Callable[[str], None] | None = None) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be at least 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.bytes_by_model: dict[str, int] = {}
        self._entries: OrderedDict[CacheKey, tuple[Any, int]] = OrderedDict()
        self._on_evict = on_evict

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: CacheKey) -> tuple[bool, Any]:
        """(True, value) and the entry becomes the most recently used; (False, None)."""
        found = self._entries.get(key)
        if found is None:
            return False, None
        self._entries.move_to_end(key)
        return True, found[0]

    def put(self, key: CacheKey, value: Any) -> bool:
        """Store ``stored_value(value)`` under ``key``, evicting the least recently used
        entries for room; False if it cannot fit even alone."""
        value = stored_value(value)  # NOTE: before its size: a view owns none of its bytes
        size = key_bytes(key) + value_bytes(value) + ENTRY_OVERHEAD_BYTES
        if size > self.max_bytes:
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self._account(key[0], -old[1])
        while self.bytes + size > self.max_bytes:
            evicted, (_, evicted_size) = self._entries.popitem(last=False)
            self._account(evicted[0], -evicted_size)
            if self._on_evict is not None:
                self._on_evict(evicted[0])
        self._entries[key] = (value, size)
        self._account(key[0], size)
        return True

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0
        self.bytes_by_model = dict.fromkeys(self.bytes_by_model, 0)

    def _account(self, model: str, delta: int) -> None:
        self.bytes += delta
        self.bytes_by_model[model] = self.bytes_by_model.get(model, 0) + delta
