"""The API processes as the engine sees them: the public socket they share, one
``WorkerProcess`` each (its link, its requests in the engine), and the engine's answers to
those requests: an ``INFER``'s outputs as one ``RESULT``, a ``GENERATE``'s events as they
come, a failure as ``ERROR``.
"""

from __future__ import annotations

import socket
import subprocess
from typing import TYPE_CHECKING, Any

from ..disconnect import ConnectionWatch
from ..errors import ApiError, to_api_error
from ..runtime import ClientDisconnected, RequestTrace
from . import wire
from .link import Link

if TYPE_CHECKING:
    from ..runtime import Runtime


def listening_socket(host: str, port: int) -> socket.socket:
    """The public port, bound once here and shared by every API process."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class WorkerProcess:
    """One API process, as the engine sees it."""

    def __init__(self, index: int, process: subprocess.Popen[bytes]) -> None:
        self.index = index
        self.process = process
        self.link: Link | None = None
        self.greeted = False
        """Whether it has said hello: from then on it hears the engine's state."""
        self.said_hello = False
        """Whether it ever did (``greeted`` is cleared once it has exited)."""
        self.open: dict[int, ConnectionWatch] = {}
        """Its requests in the engine, by its request number: their watch tells the
        runtime when the request is gone (cancelled, or the process died)."""
        self.models_sent = False

    def send(self, kind: bytes, header: Any, *frames: Any) -> None:
        """A message to it, on its link once it has one."""
        if self.link is not None:
            self.link.send(kind, header, *frames)


async def answer_infer(
    runtime: Runtime, worker: WorkerProcess, header: Any, items_frame: bytes,
    watch: ConnectionWatch,
) -> None:  # fmt: skip
    """Run an ``INFER``'s items (queued, cached, batched as a request of this process's
    own) and answer with one ``RESULT``, or ``ERROR``."""
    number, model, timeout_s, priority, request_id, dimensions = header
    trace = RequestTrace()
    try:
        outputs, tokens = await runtime.infer_items(
            wire.loads(items_frame), timeout_s=timeout_s, request_id=request_id,
            priority=priority, model=model, trace=trace, client=watch,
            dimensions=dimensions,
        )  # fmt: skip
        meta, frames = wire.encode_outputs(outputs)
        answer = (
            number, meta, tokens, trace.queue_wait_s, trace.batch_sizes, trace.cache_hits,
            trace.batches,
        )  # fmt: skip
        worker.send(wire.RESULT, answer, *frames)
    except ClientDisconnected:
        pass  # the API process has answered its client already
    except Exception as exc:
        worker.send(wire.ERROR, error_detail(number, to_api_error(exc)))
    finally:
        worker.open.pop(number, None)


async def answer_generation(
    runtime: Runtime, worker: WorkerProcess, header: Any, specs_frame: bytes,
    watch: ConnectionWatch,
) -> None:  # fmt: skip
    """Admit a generation request and send its events on as they come: each batch read
    from its stream (one step's events for it travel together) as one ``TOKENS``, then
    ``END``. A ``CANCEL`` (or the API process gone) loses ``watch``: its sequences are
    cancelled and the stream fails with ``ClientDisconnected``."""
    number, model, priority, timeout_s = header
    run = None
    try:
        run = runtime.generate(
            wire.loads(specs_frame), model=model, priority=priority, timeout_s=timeout_s,
            client=watch,
        )  # fmt: skip
        while True:
            try:
                events = await run.next_events()
            except EOFError:
                worker.send(wire.END, (number,))
                return
            worker.send(wire.TOKENS, (number,), wire.dumps(events))
    except ClientDisconnected:
        pass  # the API process has ended it already
    except Exception as exc:
        worker.send(wire.ERROR, error_detail(number, to_api_error(exc)))
    finally:
        if run is not None:
            run.close()
        worker.open.pop(number, None)


def error_detail(number: int, error: ApiError) -> tuple[Any, ...]:
    """An ``ERROR`` message's header: the API process raises ``error`` again from it."""
    return (number, error.status, error.error_type, error.message, error.retry_after_s)
