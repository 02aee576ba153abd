"""Model contract and adapters. Imports nothing from ``server`` or ``batching``."""

from .base import ArchitectureShape, Item, Model, ModelInfo
from .custom import load_entry_point, parse_entry_point
from .description import ModelDescription, describe
from .errors import (
    DeviceError,
    InputTooLong,
    ModelError,
    ModelLoadError,
    ModelOutOfMemory,
    is_out_of_memory,
    translate_error,
)
from .loading import (
    BUNDLED_MODEL,
    ModelSpec,
    available_cpus,
    load_model,
    resolve_device,
    set_cpu_threads,
)
from .postprocess import top_labels, truncate_dimensions
from .profiling import BatchProfiler, ProfilerBusy, ProfileStatus
from .prompts import UnknownPrompt, resolve_prompt
from .quantization import quantize_int8
from .text import TextModel, Tokens

__all__ = [
    "BUNDLED_MODEL",
    "ArchitectureShape",
    "BatchProfiler",
    "DeviceError",
    "InputTooLong",
    "Item",
    "Model",
    "ModelDescription",
    "ModelError",
    "ModelInfo",
    "ModelLoadError",
    "ModelOutOfMemory",
    "ModelSpec",
    "ProfileStatus",
    "ProfilerBusy",
    "TextModel",
    "Tokens",
    "UnknownPrompt",
    "available_cpus",
    "describe",
    "is_out_of_memory",
    "load_entry_point",
    "load_model",
    "parse_entry_point",
    "quantize_int8",
    "resolve_device",
    "resolve_prompt",
    "set_cpu_threads",
    "top_labels",
    "translate_error",
    "truncate_dimensions",
]
