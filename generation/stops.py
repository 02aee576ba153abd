"""Stop strings: the text a sequence gives out, held back while it could still be the start
of one of them, and cut where one appears."""

from __future__ import annotations

from collections.abc import Sequence


class StopText:
    """Feed it each new piece of a sequence's text; it returns what may go out now and
    whether a stop string ended the sequence (the text up to it goes out, without it unless
    ``include``)."""

    __slots__ = ("_held", "_include", "_longest", "_stops")

    def __init__(self, stops: Sequence[str], *, include: bool = False) -> None:
        self._stops = tuple(s for s in stops if s)
        self._longest = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self._include = include

    def feed(self, text: str) -> tuple[str, bool]:
        if not self._stops:
            return text, False
        held = self._held + text
        found = -1
        which = ""
        for stop in self._stops:
            at = held.find(stop)
            if at != -1 and (found == -1 or at < found):
                found, which = at, stop
        if found != -1:
            self._held = ""
            return held[: found + (len(which) if self._include else 0)], True
        # Hold back the longest tail that could still begin a stop string.
        keep = 0
        for size in range(min(len(held), self._longest - 1), 0, -1):
            tail = held[-size:]
            if any(stop.startswith(tail) for stop in self._stops):
                keep = size
                break
        self._held = held[len(held) - keep :] if keep else ""
        return held[: len(held) - keep], False

    def flush(self) -> str:
        """What is held back, once the sequence ended another way."""
        held, self._held = self._held, ""
        return held
