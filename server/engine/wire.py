"""What the API processes and the engine send each other over ZeroMQ: pure encoding.

Every message is one multipart ZeroMQ message: a kind (one short ASCII word), a header (a
pickled tuple) and, for inputs and outputs, their payload frames. Inputs travel as the
prepared items (token ids), pickled. Outputs that are equal-shaped float32 vectors, as
embedders return them, travel as one frame of their raw bytes, read back without a copy;
anything else (a classifier's labels, a custom model's lists) is pickled.

Both ends are processes of one replica, started together from the same code, talking over
a Unix socket in a directory only the replica's user can open: pickle is safe here.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np

# Worker to engine.
HELLO = b"hello"
INFER = b"infer"
CANCEL = b"cancel"
METRICS = b"metrics"
SNAPSHOT = b"snapshot"
# Engine to worker.
MODELS = b"models"
STATE = b"state"
RESULT = b"result"
ERROR = b"error"
EXPOSITION = b"exposition"
COLLECT = b"collect"
STOP = b"stop"

PICKLED = "pickle"
FLOAT32 = "float32"


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
