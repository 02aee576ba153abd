"""The batches a Ray actor was running when its process ended, counted where every actor sees
them (``bulk.ray``).

Before a batch, an actor adds its name (host:pid) to the batch's file (one per call and batch
key, in one folder); once the batch has returned or raised, it takes its name out again, and
the file goes with the last name. A name left behind is an actor whose process
ended inside the batch: a pass that hung (``bulk.hang`` ends the process), a crash, the
kernel's OOM kill. Ray Data starts the actor again and hands it the same batch; a batch that
has ended ``MAX_DEATHS`` actors is not run again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("batchfit.bulk")

MAX_DEATHS = 2
"""A batch that has ended this many actors' processes ends the job instead of being run again:
a batch holding an input that hangs or crashes the device or the model every time would
otherwise be retried for ever, each try costing an actor's start (and, for a hang, the
bound)."""


class PoisonBatch(RuntimeError):
    """A batch ended ``MAX_DEATHS`` actors' processes: the job stops rather than try again."""


class BatchAttempts:
    """The attempts at each batch of the call ``run``, by key, in ``folder`` (made on the
    first attempt)."""

    def __init__(self, folder: Path, run: str, worker: str | None = None) -> None:
        self.folder = folder
        self.run = run
        self.worker = worker or f"{socket.gethostname()}:{os.getpid()}"
        self.current: str | None = None
        """The key of the batch this actor is inside (``attempt``), if any."""

    def ended(self, key: str) -> list[str]:
        """The actors whose attempt at ``key`` has not ended (this one's, while inside
        ``attempt``): those whose process ended inside it."""
        try:
            return self._path(key).read_text().split()
        except OSError:
            return []

    def forget(self) -> None:
        """Remove what the call noted (the driver, once the call is over), and the folder
        where nothing else is in it."""
        for path in self.folder.glob(f"{self.run}-*"):
            with contextlib.suppress(OSError):
                path.unlink()
        with contextlib.suppress(OSError):
            self.folder.rmdir()

    @contextlib.contextmanager
    def attempt(self, key: str) -> Iterator[None]:
        """Around one attempt at ``key``: this actor's name is in its file while inside."""
        path = self._path(key)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as attempts:
                attempts.write(f"{self.worker}\n")
        except OSError as exc:
            log.error("cannot note the attempt at a batch in %s: %s", self.folder, exc)
        self.current = key
        try:
            yield
        finally:
            self.current = None
            left = self.ended(key)
            with contextlib.suppress(ValueError):
                left.remove(self.worker)
            with contextlib.suppress(OSError):
                if left:
                    path.write_text("".join(f"{name}\n" for name in left))
                else:
                    path.unlink()

    def _path(self, key: str) -> Path:
        return self.folder / f"{self.run}-{key}"
