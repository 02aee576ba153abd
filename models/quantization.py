"""Int8 dynamic quantization of a module's linear layers, for CPU serving."""

from __future__ import annotations

import warnings

import torch

from .errors import ModelLoadError

QUANTIZE_MODES = ("none", "int8")


def check_quantize(mode: str, device: torch.device, dtype: torch.dtype) -> None:
    if mode not in QUANTIZE_MODES:
        raise ModelLoadError(f"unknown quantize mode {mode!r}; expected one of none, int8")
    if mode == "none":
        return
    if device.type != "cpu":
        raise ModelLoadError(
            f"--quantize {mode} runs on CPU only (torch's dynamic quantization has no CUDA "
            f"kernels); the device is {device}"
        )
    if dtype != torch.float32:
        raise ModelLoadError(f"--quantize {mode} needs --dtype float32, not {dtype}")


def quantize_int8(module: torch.nn.Module) -> torch.nn.Module:
    """Replace every ``nn.Linear`` by a dynamically quantized one (int8 weights with one scale
    per output channel, activations quantized per batch at run time), in place so that no
    float32 copy raises the peak at load; other layers stay float32.

    NOTE: torch marks ``torch.ao.quantization`` deprecated in favour of torchao's
    ``quantize_``. We keep torch's own kernels because torchao's int8 dynamic config runs
    eagerly on CPU about 40x slower than float32 here (torchao 0.18, no ``torch.compile``),
    while these run faster than float32. The deprecation warnings are silenced only here.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*", category=UserWarning)
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        # Per-channel weight scales: per-tensor ones cost MiniLM about 0.03 of mean cosine.
        return quantize_dynamic(
            module,
            {torch.nn.Linear: per_channel_dynamic_qconfig},
            dtype=torch.qint8,
            inplace=True,
        )


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of weights, counting the packed int8 weights that ``parameters()`` does not see."""
    total = sum(p.numel() * p.element_size() for p in module.parameters())
    for sub in module.modules():
        packed = getattr(sub, "_packed_params", None)
        if packed is not None and hasattr(packed, "_weight_bias"):
            weight, bias = packed._weight_bias()
            total += weight.numel() * weight.element_size()
            if bias is not None:
                total += bias.numel() * bias.element_size()
    return total
