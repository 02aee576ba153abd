"""LLM rerankers: a causal LM that scores a (query, document) pair by how likely its next
token is "yes" rather than "no", after Qwen3-Reranker's prompt.

``template`` turns pairs into token ids with the ``tokenizers`` library only (an API process
tokenizes with it and never imports torch); ``model`` loads and runs the weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .template import QWEN3_RERANKER, RelevanceTemplate, RelevanceTokenizer, names_a_reranker

if TYPE_CHECKING:
    from .model import LLMReranker, YesNoHead, load_llm_reranker

_LAZY = {"LLMReranker", "YesNoHead", "load_llm_reranker"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import model

    value = getattr(model, name)
    globals()[name] = value
    return value


__all__ = [
    "QWEN3_RERANKER",
    "LLMReranker",
    "RelevanceTemplate",
    "RelevanceTokenizer",
    "YesNoHead",
    "load_llm_reranker",
    "names_a_reranker",
]
