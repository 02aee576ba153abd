"""A CUDA device faked on a CPU-only torch (apart from ``tests/fakes.py``, whose scripted
models an API process unpickles without importing torch)."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


class FakeCuda(TorchFunctionMode):
    """A CUDA device on a CPU-only torch, for unit tests of the host-to-device path.

    Inside ``with FakeCuda():`` a ``pin_memory=True`` factory call makes an ordinary tensor
    and remembers it as pinned, and ``tensor.to(<cuda device>, ...)`` returns the tensor
    itself, recording whether it was pinned and whether the copy was non-blocking. Every
    other torch call runs as usual, on the CPU.
    """

    def __init__(self) -> None:
        super().__init__()
        self._pinned: list[torch.Tensor] = []
        self.copies: list[tuple[tuple[int, ...], bool, bool]] = []
        """(shape, source was pinned, non_blocking) of each tensor copied to the device."""

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return any(tensor is pinned for pinned in self._pinned)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
            out = func(*args, **kwargs)
            self._pinned.append(out)
            return out
        if func is torch.Tensor.to and isinstance(args[0], torch.Tensor):
            target = args[1] if len(args) > 1 else kwargs.get("device")
            if isinstance(target, str | torch.device) and torch.device(target).type == "cuda":
                source = args[0]
                pinned = self.is_pinned(source)
                self.copies.append((tuple(source.shape), pinned, bool(kwargs.get("non_blocking"))))
                return source
        return func(*args, **kwargs)
