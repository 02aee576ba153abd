"""API processes in front of one engine (``batchfit serve --api-workers N``).

The engine process owns the device, the queue, the batcher, the sizer and the model thread
(a ``Runtime``); N API processes, its children, accept HTTP on one shared listening socket,
validate, tokenize and encode answers. They talk over one Unix socket pair each
(``link.py``, ``wire.py``).
"""

from __future__ import annotations

from typing import Any


def serve_engine(settings: Any) -> int:
    """``batchfit serve`` with ``--api-workers`` of 2 or more (``host.serve_engine``),
    imported on call: an API process imports this package and never runs the engine."""
    from .host import serve_engine as serve

    return serve(settings)


__all__ = ["serve_engine"]
