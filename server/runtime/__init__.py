"""The replica's runtime: composes models, queue and batcher and owns their lifetimes."""

from .runtime import INLINE_TOKENIZE_CHARS, Runtime
from .slot import ModelSlot, make_sizer
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
