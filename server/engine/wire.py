"""What the API processes and the engine send each other over their Unix socket: pure
encoding.

Every message is a list of frames: a kind (one short ASCII word), a header (a pickled
tuple) and, for inputs and outputs, their payload frames. On the socket, a message is its
length, its number of frames and each frame's length (``frame``), then the frames;
``Unframer`` cuts a byte stream back into messages, however the reads split it. Inputs
travel as the prepared items (token ids), pickled. Outputs that are equal-shaped float32
vectors, as embedders return them, travel as one frame of their raw bytes; anything else (a
classifier's labels, a custom model's lists) is pickled. A generation request travels as its
sequences' specs, pickled; its tokens come back as they are generated, each ``TOKENS``
message one batch of pickled events, then ``END`` (or ``ERROR``).

Both ends are processes of one replica, started together from the same code, talking over
a socket pair the engine made for each API process: pickle is safe here.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

# Worker to engine.
HELLO = b"hello"
INFER = b"infer"
GENERATE = b"generate"
CANCEL = b"cancel"
METRICS = b"metrics"
SNAPSHOT = b"snapshot"
STATUS = b"status"
TALLY = b"tally"
PROFILE = b"profile"
# Engine to worker.
MODELS = b"models"
STATE = b"state"
RESULT = b"result"
TOKENS = b"tokens"
END = b"end"
ERROR = b"error"
EXPOSITION = b"exposition"
COLLECT = b"collect"
SAMPLES = b"samples"
TAKE = b"take"
PROFILED = b"profiled"
STOP = b"stop"

PICKLED = "pickle"
FLOAT32 = "float32"


_LENGTH = struct.Struct("<I")
_PREFIX = struct.Struct("<IB")  # the frames' total length, then their number
MAX_FRAMES = 255


def frame(parts: Sequence[bytes | memoryview]) -> bytes:
    """The bytes on the socket before ``parts``: lengths only, so the payload is not
    copied into one buffer here."""
    if len(parts) > MAX_FRAMES:
        raise ValueError(f"a message has at most {MAX_FRAMES} frames, not {len(parts)}")
    sizes = [memoryview(part).nbytes for part in parts]
    body = 1 + 4 * len(sizes) + sum(sizes)
    return _PREFIX.pack(body, len(sizes)) + b"".join(_LENGTH.pack(n) for n in sizes)


class Unframer:
    """Messages back out of a byte stream that arrives in pieces of any size."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[list[bytes]]:
        """Take ``data``; return every message it completes, in order."""
        buffer = self._buffer
        buffer += data
        messages = []
        start, end = 0, len(buffer)
        while end - start >= 4:
            (body,) = _LENGTH.unpack_from(buffer, start)
            if end - start - 4 < body:
                break
            count = buffer[start + 4]
            sizes = struct.unpack_from(f"<{count}I", buffer, start + 5)
            offset = start + 5 + 4 * count
            parts = []
            for size in sizes:
                parts.append(bytes(buffer[offset : offset + size]))
                offset += size
            messages.append(parts)
            start = offset
        del buffer[:start]
        return messages


def dumps(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes | memoryview) -> Any:
    return pickle.loads(data)


def encode_outputs(outputs: Sequence[Any]) -> tuple[tuple[Any, ...], list[Any]]:
    """The outputs as a small description and the frames to send: one buffer of float32
    values for equal-shaped float32 arrays (no copy when they are rows of one array), else
    one pickle."""
    if outputs and all(isinstance(o, np.ndarray) for o in outputs):
        first = outputs[0]
        if first.dtype == np.float32 and all(
            o.dtype == np.float32 and o.shape == first.shape for o in outputs
        ):
            stacked = np.ascontiguousarray(np.stack(outputs))
            return (FLOAT32, stacked.shape), [memoryview(stacked).cast("B")]
    return (PICKLED,), [dumps(list(outputs))]


def decode_outputs(meta: tuple[Any, ...], frames: Sequence[bytes | memoryview]) -> list[Any]:
    """``encode_outputs``'s outputs again: float32 vectors as read-only rows of one array
    over the received buffer."""
    if meta[0] == FLOAT32:
        shape = tuple(meta[1])
        array = np.frombuffer(frames[0], dtype=np.float32).reshape(shape)
        return list(array)
    if meta[0] == PICKLED:
        return loads(frames[0])
    raise ValueError(f"unknown output encoding {meta[0]!r}")
