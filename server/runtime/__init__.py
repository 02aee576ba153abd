"""The replica's runtime: composes models, queue and batcher and owns their lifetimes.

``Runtime`` loads with its module on first use (PEP 562): an API process in front of an
engine imports this package for the request-side pieces and never loads a model, nor torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .generating import GenerationRun
from .slot import ModelSlot, make_sizer
from .startup import INLINE_TOKENIZE_CHARS
from .trace import RequestTrace
from .tracking import WorkTracker
from .waiting import ClientDisconnected, ClientWatch, RequestWait

if TYPE_CHECKING:
    from .runtime import Runtime


def __getattr__(name: str) -> Any:
    if name != "Runtime":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from .runtime import Runtime

    return Runtime


__all__ = [
    "INLINE_TOKENIZE_CHARS",
    "ClientDisconnected",
    "ClientWatch",
    "GenerationRun",
    "ModelSlot",
    "RequestTrace",
    "RequestWait",
    "Runtime",
    "WorkTracker",
    "make_sizer",
]
