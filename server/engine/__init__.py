"""API processes in front of one engine (``batchfit serve --api-workers N``).

The engine process owns the device, the queue, the batcher, the sizer and the model thread
(a ``Runtime``); N API processes, its children, accept HTTP on one shared listening socket,
validate, tokenize and encode answers. They talk over one Unix socket pair each
(``link.py``, ``wire.py``).
"""

from .host import serve_engine

__all__ = ["serve_engine"]
