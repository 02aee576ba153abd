"""The replica's runtime: composes models, queue and batcher and owns their lifetimes."""

from .runtime import INLINE_TOKENIZE_CHARS, Runtime, make_sizer
from .slot import ModelSlot
from .tracking import WorkTracker

__all__ = ["INLINE_TOKENIZE_CHARS", "ModelSlot", "Runtime", "WorkTracker", "make_sizer"]
