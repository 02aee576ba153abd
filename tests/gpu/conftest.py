"""The GPU tests (``-m gpu``): on CUDA by default, on their CPU counterparts with
``BATCHFIT_GPU_CHECK_DEVICE=cpu`` (the dry run). Figures go to ``$BATCHFIT_GPU_CHECK_OUT``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

DEVICE = os.environ.get("BATCHFIT_GPU_CHECK_DEVICE", "cuda")
_FIGURES: dict[str, dict[str, object]] = {}


@pytest.fixture(scope="session")
def device() -> str:
    if DEVICE.startswith("cuda") and not torch.cuda.is_available():
        pytest.fail(
            "the GPU tests need CUDA; BATCHFIT_GPU_CHECK_DEVICE=cpu runs their CPU counterparts"
        )
    if DEVICE.startswith("cuda"):
        # This process's CUDA context exists before any test reads memory, so that its few
        # hundred MiB never show up as a test's own allocation.
        torch.zeros(1, device=DEVICE)
        torch.cuda.synchronize(DEVICE)
    return DEVICE


@pytest.fixture
def figures(request) -> dict[str, object]:
    """What the test measured, written out at the end of the session."""
    return _FIGURES.setdefault(request.node.name, {})


def pytest_sessionfinish(session, exitstatus) -> None:
    out = os.environ.get("BATCHFIT_GPU_CHECK_OUT")
    if out and _FIGURES:
        path = Path(out) / "gpu_tests.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_FIGURES, indent=2, sort_keys=True) + "\n")
