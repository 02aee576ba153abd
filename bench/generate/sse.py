"""OpenAI's streamed completions as server-sent events: split a byte stream into events and
read what the benchmark needs from each chunk (does it carry a token, the usage, an error).

Pure: no I/O, so the tests feed it bytes cut at every awkward place.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

DONE = "[DONE]"


class EventSplitter:
    """Turns chunks of bytes, cut anywhere, into the ``data:`` payloads of whole events.

    An event ends at a blank line; its ``data:`` lines are joined with newlines (the SSE
    rule); comments (``:``) and other fields (``event:``, ``id:``) are skipped. Lines may end
    in ``\\n``, ``\\r\\n`` or ``\\r``."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events: list[str] = []
        while True:
            line, sep, rest = _next_line(self._buffer)
            if not sep:
                return events
            self._buffer = rest
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
                continue
            text = line.decode("utf-8", errors="replace")
            if text.startswith("data:"):
                value = text[5:]
                self._data.append(value[1:] if value.startswith(" ") else value)

    def close(self) -> list[str]:
        """Whatever event the stream ended in without its blank line."""
        events = self.feed(b"\n\n") if self._buffer else []
        if self._data:
            events.append("\n".join(self._data))
            self._data = []
        return events


def _next_line(buffer: bytes) -> tuple[bytes, bool, bytes]:
    cr, lf = buffer.find(b"\r"), buffer.find(b"\n")
    if cr == -1 and lf == -1:
        return b"", False, buffer
    if cr == -1 or (lf != -1 and lf < cr):
        return buffer[:lf], True, buffer[lf + 1 :]
    if cr == len(buffer) - 1:
        return b"", False, buffer  # a \r\n may be cut between the two
    end = cr + 2 if buffer[cr + 1 : cr + 2] == b"\n" else cr + 1
    return buffer[:cr], True, buffer[end:]


@dataclass(frozen=True, slots=True)
class Chunk:
    """What one streamed chunk says. ``is_token``: it carries a choice that is not the last
    (finish_reason null) or that has text: a step of generation. The usage chunk has no
    choices; its ``completion_tokens`` is the server's own count."""

    is_token: bool
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    error: str | None = None
    done: bool = False


def parse_chunk(data: str) -> Chunk:
    """One event's data: a JSON chunk of a completion (or a chat completion), ``[DONE]``, or
    an error object; anything else is an error chunk naming what came."""
    if data.strip() == DONE:
        return Chunk(is_token=False, done=True)
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError:
        return Chunk(is_token=False, error=f"not JSON: {data[:80]!r}")
    if not isinstance(body, dict):
        return Chunk(is_token=False, error=f"not an object: {data[:80]!r}")
    if "error" in body:
        error = body["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        return Chunk(is_token=False, error=str(message)[:200])
    usage = body.get("usage") or {}
    choices = body.get("choices") or []
    text, finish, is_token = "", None, False
    for choice in choices:
        finish = choice.get("finish_reason") or finish
        if "text" in choice:
            piece = choice["text"] or ""
            # A completion's last chunk may carry only the finish reason: not a step. An
            # empty text otherwise is a token whose bytes are not a whole character yet.
            step = bool(piece) or choice.get("finish_reason") is None
        else:  # a chat delta: the first carries the role alone
            piece = (choice.get("delta") or {}).get("content") or ""
            step = bool(piece)
        text += piece
        is_token = is_token or step
    return Chunk(
        is_token=is_token,
        text=text,
        finish_reason=finish,
        completion_tokens=usage.get("completion_tokens"),
        prompt_tokens=usage.get("prompt_tokens"),
    )
