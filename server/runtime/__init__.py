"""The replica's runtime: composes models, queue and batcher and owns their lifetimes."""

from .runtime import INLINE_TOKENIZE_CHARS, Runtime, make_sizer
from .slot import ModelSlot
from .trace import RequestTrace
from .tracking import WorkTracker

__all__ = [
    "INLINE_TOKENIZE_CHARS",
    "ModelSlot",
    "RequestTrace",
    "Runtime",
    "WorkTracker",
    "make_sizer",
]
