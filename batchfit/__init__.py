"""``batchfit``: one command line above every room. ``server`` brings serve, plan and up,
``bench`` brings bench, ``bulk`` brings embed, classify and rerank; this package only
composes them."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["build_parser", "main"]
# Imported when first used: the ``batchfit`` script imports ``batchfit.__main__``, which
# imports the command line (and with it torch) with garbage collection off.
_EXPORTS = {"build_parser": ".cli", "main": ".cli"}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
