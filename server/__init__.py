"""HTTP front end, settings and wiring. The only package that composes the others."""

from __future__ import annotations

import importlib
from typing import Any

# First: sets OpenMP's wait policy before anything imports torch.
from . import openmp  # noqa: F401  # isort: skip

__all__ = ["ApiError", "ServerConfig", "Settings", "create_app"]
# Imported when first used: ``batchfit embed`` imports this package (``batchfit/cli.py``
# composes server's commands with the bulk ones) but needs none of the HTTP stack, whose
# imports (FastAPI, the app) cost a bulk job 0.3 s on 2 cores.
_EXPORTS = {
    "ApiError": ".errors",
    "ServerConfig": ".settings",
    "Settings": ".settings",
    "create_app": ".app",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
