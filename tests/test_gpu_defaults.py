"""GPU defaults on a CPU host, with the CUDA side faked: ``--dtype auto`` and pinned inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from bench.plain import load_plain_encoder
from models import ModelLoadError, ModelSpec, load_model
from models.loading import resolve_dtype
from models.testing import save_tiny_model
from server import Settings
from server.app import create_app
from tests.fake_cuda import FakeCuda

TEXTS = ["a short one", "a somewhat longer input sentence for the fake device", "third"]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def cuda_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.mark.parametrize(
    ("dtype", "device", "expected"),
    [
        ("auto", "cuda", "float16"),
        ("auto", "cuda:1", "float16"),
        ("auto", "cpu", "float32"),
        ("float32", "cuda", "float32"),
        ("bfloat16", "cpu", "bfloat16"),
        ("float16", "cpu", "float16"),
    ],
)
def test_resolve_dtype(dtype, device, expected):
    assert resolve_dtype(dtype, torch.device(device)) == expected


def test_unknown_dtype_is_refused_with_the_choices():
    with pytest.raises(ModelLoadError, match=r"'float8'.*auto, float32"):
        resolve_dtype("float8", torch.device("cpu"))


def test_auto_is_the_default_everywhere():
    assert Settings().dtype == "auto"
    assert Settings().model_spec().dtype == "auto"
    assert ModelSpec().dtype == "auto"


def test_auto_on_faked_cuda_loads_float16_and_says_so(tiny_folder, cuda_available):
    with FakeCuda():
        model = load_model(ModelSpec(model=str(tiny_folder)))
    assert model.info.device == "cuda"
    assert model.info.dtype == "float16"
    assert {p.dtype for p in model._module.parameters()} == {torch.float16}
    assert model.info.shape.element_bytes == 2


@pytest.fixture
def cudnn_attention_restored():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def test_a_model_on_cuda_leaves_cudnn_out_of_attention(
    tiny_folder, cuda_available, cudnn_attention_restored, monkeypatch
):
    """cuDNN builds a plan per new batch shape (stalls of up to a second on a GPU); the other
    attention kernels stay."""
    with FakeCuda():
        load_model(ModelSpec(model=str(tiny_folder)))
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.flash_sdp_enabled()
    assert torch.backends.cuda.mem_efficient_sdp_enabled()

    torch.backends.cuda.enable_cudnn_sdp(True)
    monkeypatch.setattr("models.loading.load_entry_point", lambda spec: spec)
    load_model(ModelSpec(model="python:x:y"))  # a factory's model runs on the same device
    assert not torch.backends.cuda.cudnn_sdp_enabled()


def test_the_in_process_limit_runs_attention_as_a_replica_does_on_cuda(
    tiny_folder, cuda_available, cudnn_attention_restored
):
    with FakeCuda():
        load_plain_encoder(str(tiny_folder), device="cuda")
    assert not torch.backends.cuda.cudnn_sdp_enabled()


def test_a_model_on_the_cpu_leaves_attention_kernels_alone(tiny_folder, cudnn_attention_restored):
    load_model(ModelSpec(model=str(tiny_folder), device="cpu"))
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_auto_on_cpu_loads_float32(tiny_folder):
    model = load_model(ModelSpec(model=str(tiny_folder), device="cpu"))
    assert (model.info.device, model.info.dtype) == ("cpu", "float32")
    assert {p.dtype for p in model._module.parameters()} == {torch.float32}


def test_an_entry_point_gets_the_resolved_dtype(cuda_available, monkeypatch):
    seen = []
    monkeypatch.setattr("models.loading.load_entry_point", lambda spec: seen.append(spec) or spec)
    load_model(ModelSpec(model="python:x:y"))
    load_model(ModelSpec(model="python:x:y", device="cpu"))
    assert [spec.dtype for spec in seen] == ["float16", "float32"]


async def test_models_endpoint_and_info_metric_report_the_dtype_used(tiny_folder):
    import httpx

    registry = CollectorRegistry()
    settings = Settings(model=str(tiny_folder), device="cpu", sizer="fixed")
    app = create_app(settings, registry=registry)
    runtime = app.state.runtime
    await runtime.start()
    try:
        assert runtime.startup_error is None
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            card = (await client.get("/v1/models")).json()["models"][0]
        assert card["dtype"] == "float32"
        labels = {
            "model": tiny_folder.name,
            "name": tiny_folder.name,
            "task": "embed",
            "device": "cpu",
            "dtype": "float32",
        }
        assert registry.get_sample_value("batchfit_model_info", labels) == 1
    finally:
        await runtime.stop()


def test_inputs_travel_pinned_and_non_blocking_to_a_cuda_device(tiny_folder, cuda_available):
    on_cpu = load_model(ModelSpec(model=str(tiny_folder), device="cpu"))
    expected = np.stack(on_cpu.forward(on_cpu.prepare(TEXTS, truncate=True)))
    with FakeCuda() as device:
        model = load_model(ModelSpec(model=str(tiny_folder), device="cuda", dtype="float32"))
        device.copies.clear()  # the weights' move at load
        out = np.stack(model.forward(model.prepare(TEXTS, truncate=True)))
    longest = max(item.cost for item in model.prepare(TEXTS, truncate=True))
    # Input ids, attention mask and segment ids: all pinned, all copied without blocking.
    assert device.copies == [((3, longest), True, True)] * 3
    np.testing.assert_allclose(out, expected, atol=1e-6)


def test_inputs_stay_pageable_on_the_cpu(tiny_folder):
    model = load_model(ModelSpec(model=str(tiny_folder), device="cpu"))
    with FakeCuda() as device:
        model.forward(model.prepare(TEXTS, truncate=True))
    assert device.copies == []
    assert not device._pinned
