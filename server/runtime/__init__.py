"""The replica's runtime: composes models, queue and batcher and owns their lifetimes."""

from .runtime import Runtime
from .slot import ModelSlot, make_sizer
from .startup import INLINE_TOKENIZE_CHARS
from .trace import RequestTrace
from .tracking import WorkTracker
from .waiting import ClientDisconnected, ClientWatch, RequestWait

__all__ = [
    "INLINE_TOKENIZE_CHARS",
    "ClientDisconnected",
    "ClientWatch",
    "ModelSlot",
    "RequestTrace",
    "RequestWait",
    "Runtime",
    "WorkTracker",
    "make_sizer",
]
