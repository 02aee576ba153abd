"""Errors the model layer raises; torch's own errors never cross this boundary."""

from __future__ import annotations

import re
import sys


class ModelError(Exception):
    """Base class for errors raised by a model adapter."""


class ModelLoadError(ModelError):
    """The model could not be loaded (missing files, unsafe format, unknown task)."""


class InputTooLong(ModelError):
    """An input exceeds the model's maximum length and truncation is off."""

    def __init__(
        self, index: int, num_tokens: int, max_tokens: int,
        hint: str = "send shorter text or allow truncation",
    ) -> None:  # fmt: skip
        super().__init__(
            f"input {index} has {num_tokens} tokens, more than the model's maximum of "
            f"{max_tokens}; {hint}"
        )
        self.index = index
        self.num_tokens = num_tokens
        self.max_tokens = max_tokens


class ModelOutOfMemory(ModelError):
    """A forward pass ran out of memory (CUDA or the CPU allocator)."""

    def __init__(self, message: str, requested_bytes: int | None = None) -> None:
        super().__init__(message)
        self.requested_bytes = requested_bytes


class DeviceError(ModelError):
    """A device failure that is not an OOM (a CUDA error): the replica cannot be trusted."""


_REQUESTED_BYTES = re.compile(r"allocate\s+(\d+(?:\.\d+)?)\s*(bytes|[KMG]i?B)")
_UNIT = {"bytes": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def _torch_error(name: str) -> type[BaseException] | tuple[()]:
    """torch's error class ``name``, or nothing where torch was never imported (then no torch
    error can have been raised): a process that only tokenizes never imports torch."""
    torch = sys.modules.get("torch")
    return getattr(torch, name, ()) if torch is not None else ()


def is_out_of_memory(exc: BaseException) -> bool:
    """True for torch's CUDA OOM and the CPU allocator's allocation failure, nothing else."""
    if isinstance(exc, (MemoryError, _torch_error("OutOfMemoryError"))):
        return True
    return isinstance(exc, RuntimeError) and (
        "can't allocate memory" in str(exc) or "not enough memory" in str(exc)
    )


def is_device_error(exc: BaseException) -> bool:
    return isinstance(exc, _torch_error("AcceleratorError")) or (
        isinstance(exc, RuntimeError) and "CUDA error" in str(exc)
    )


def requested_bytes(exc: BaseException) -> int | None:
    """The allocation size an OOM message names, if it names one."""
    match = _REQUESTED_BYTES.search(str(exc))
    if match is None:
        return None
    return int(float(match.group(1)) * _UNIT[match.group(2)])


def translate_error(exc: BaseException) -> BaseException:
    """Map a torch error to ours; other errors pass through unchanged."""
    if is_out_of_memory(exc):
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return ModelOutOfMemory(first_line[:300], requested_bytes(exc))
    if is_device_error(exc):
        return DeviceError(str(exc).strip().splitlines()[0][:300])
    return exc
