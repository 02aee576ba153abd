"""Model contract and adapters. Imports nothing from ``server`` or ``batching``.

Names load with their submodule on first use (PEP 562), so that a process which only
tokenizes (an API process in front of an engine) never imports torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .answers import top_labels, truncate_dimensions
from .base import ArchitectureShape, Item, Model, ModelInfo
from .chat import ChatMessage, ChatTemplateError, Detokenizer, NoChatTemplate, PromptTokenizer
from .chunking import InvalidSpan, Span, Windows, cut_windows, pool_windows, token_spans
from .errors import (
    DeviceError,
    InputTooLong,
    ModelError,
    ModelLoadError,
    ModelOutOfMemory,
    is_out_of_memory,
    translate_error,
)
from .generative import (
    GenerationDefaults,
    Generator,
    SampledToken,
    SamplingParams,
    SeqChunk,
    StepRequest,
    StepResult,
)
from .prompts import STANDARD_PROMPT_NAMES, UnknownPrompt, resolve_prompt
from .spec import BUNDLED_MODEL, ModelSpec, available_cpus
from .tokenizing import TextTokenizer, TokenCodec, TokenizedText, Tokens

if TYPE_CHECKING:
    from .causal import CausalLM, load_generator
    from .custom import load_entry_point, parse_entry_point
    from .description import ModelDescription, describe
    from .loading import current_cpu_threads, load_model, resolve_device, set_cpu_threads
    from .profiling import BatchProfiler, ProfilerBusy, ProfileStatus
    from .quantization import quantize_int8
    from .text import TextModel

_LAZY = {
    "CausalLM": "causal",
    "load_generator": "causal",
    "load_entry_point": "custom",
    "parse_entry_point": "custom",
    "ModelDescription": "description",
    "describe": "description",
    "load_model": "loading",
    "resolve_device": "loading",
    "set_cpu_threads": "loading",
    "current_cpu_threads": "loading",
    "BatchProfiler": "profiling",
    "ProfilerBusy": "profiling",
    "ProfileStatus": "profiling",
    "quantize_int8": "quantization",
    "TextModel": "text",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "BUNDLED_MODEL",
    "STANDARD_PROMPT_NAMES",
    "ArchitectureShape",
    "BatchProfiler",
    "CausalLM",
    "ChatMessage",
    "ChatTemplateError",
    "Detokenizer",
    "DeviceError",
    "GenerationDefaults",
    "Generator",
    "InputTooLong",
    "InvalidSpan",
    "Item",
    "Model",
    "ModelDescription",
    "ModelError",
    "ModelInfo",
    "ModelLoadError",
    "ModelOutOfMemory",
    "ModelSpec",
    "NoChatTemplate",
    "ProfileStatus",
    "ProfilerBusy",
    "PromptTokenizer",
    "SampledToken",
    "SamplingParams",
    "SeqChunk",
    "Span",
    "StepRequest",
    "StepResult",
    "TextModel",
    "TextTokenizer",
    "TokenCodec",
    "TokenizedText",
    "Tokens",
    "UnknownPrompt",
    "Windows",
    "available_cpus",
    "current_cpu_threads",
    "cut_windows",
    "describe",
    "is_out_of_memory",
    "load_entry_point",
    "load_generator",
    "load_model",
    "parse_entry_point",
    "pool_windows",
    "quantize_int8",
    "resolve_device",
    "resolve_prompt",
    "set_cpu_threads",
    "token_spans",
    "top_labels",
    "translate_error",
    "truncate_dimensions",
]
