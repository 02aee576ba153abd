"""Custom models by entry point: ``python:package.module:factory``."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import TYPE_CHECKING

from .base import Model
from .errors import ModelLoadError

if TYPE_CHECKING:
    from .loading import ModelSpec

PREFIX = "python:"


def is_entry_point(model: str) -> bool:
    return model.startswith(PREFIX)


def parse_entry_point(model: str) -> tuple[str, str]:
    """``python:package.module:factory`` -> (``package.module``, ``factory``)."""
    target = model.removeprefix(PREFIX)
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute.isidentifier():
        raise ModelLoadError(
            f"bad model entry point {model!r}; expected python:package.module:factory"
        )
    return module_name, attribute


def load_entry_point(spec: ModelSpec) -> Model:
    """Import the factory and call it with the spec; the result must follow the contract.

    A factory that takes one argument receives the ``ModelSpec`` (device, dtype, quantize,
    max_input_tokens); one that takes none is called without it.
    """
    module_name, attribute = parse_entry_point(spec.model)
    # As uvicorn does for its app: the working directory is importable, also from the
    # ``batchfit`` console script (which, unlike ``python -m``, does not put it on the path).
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelLoadError(f"cannot import {module_name!r} for {spec.model!r}: {exc}") from exc
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ModelLoadError(f"{module_name}.{attribute} is not a callable factory")
    takes_spec = bool(inspect.signature(factory).parameters)
    model = factory(spec) if takes_spec else factory()
    missing = [
        name for name in ("info", "prepare", "forward", "synthetic_items")
        if not hasattr(model, name)
    ]  # fmt: skip
    if missing or not isinstance(model, Model):
        raise ModelLoadError(
            f"{module_name}.{attribute}() returned {type(model).__name__}, which lacks "
            f"{', '.join(missing) or 'the Model protocol'} (see models/base.py)"
        )
    return model
