"""Model contract and adapters. Imports nothing from ``server`` or ``batching``."""

from .base import ArchitectureShape, Item, Model, ModelInfo
from .errors import (
    DeviceError,
    InputTooLong,
    ModelError,
    ModelLoadError,
    ModelOutOfMemory,
    is_out_of_memory,
    translate_error,
)
from .loading import BUNDLED_MODEL, ModelSpec, load_model, resolve_device
from .text import TextModel

__all__ = [
    "BUNDLED_MODEL",
    "ArchitectureShape",
    "DeviceError",
    "InputTooLong",
    "Item",
    "Model",
    "ModelError",
    "ModelInfo",
    "ModelLoadError",
    "ModelOutOfMemory",
    "ModelSpec",
    "TextModel",
    "is_out_of_memory",
    "load_model",
    "resolve_device",
    "translate_error",
]
