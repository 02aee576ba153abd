"""--dtype, --quantize int8 and python: entry points, on the real bundled model (CPU)."""

from __future__ import annotations

import re
import sys
import types

import numpy as np
import pytest
import torch

from models import ModelLoadError, ModelSpec, load_model, parse_entry_point
from models.quantization import check_quantize
from tests.integration.test_server import SENTENCES

# Agreement with float32 that each option must keep (cosine of the pooled, normalised
# embeddings over SENTENCES). Measured here: bfloat16 >= 0.9999, float16 >= 0.99999,
# int8 min 0.95 / mean 0.97 (per-channel dynamic quantization of every Linear).
MIN_COSINE = {"bfloat16": 0.999, "float16": 0.999, "int8": 0.93}
MEAN_COSINE_INT8 = 0.96
MAX_ABS_DIFF = {"bfloat16": 0.01, "float16": 0.01}


def embed(model, texts=SENTENCES):
    return np.stack(model.forward(model.prepare(texts, truncate=True)))


def cosines(a, b):
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.fixture(scope="module")
def float32_model():
    return load_model(ModelSpec(device="cpu"))


@pytest.fixture(scope="module")
def reference(float32_model):
    return embed(float32_model)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_matches_float32_within_tolerance(dtype, float32_model, reference):
    model = load_model(ModelSpec(device="cpu", dtype=dtype))
    assert model.info.dtype == dtype
    assert all(p.dtype == getattr(torch, dtype) for p in model._module.parameters())
    out = embed(model)
    assert out.dtype == np.float32  # outputs are always float32 on the wire
    assert cosines(out, reference).min() >= MIN_COSINE[dtype]
    assert np.abs(out - reference).max() <= MAX_ABS_DIFF[dtype]
    assert model.info.shape.parameter_bytes * 2 == float32_model.info.shape.parameter_bytes


def test_int8_quantizes_every_linear_layer_and_agrees_with_float32(float32_model, reference):
    model = load_model(ModelSpec(device="cpu", quantize="int8"))
    linear = [m for m in model._module.modules() if type(m) is torch.nn.Linear]
    quantized = [
        m
        for m in model._module.modules()
        if type(m).__module__.startswith("torch.ao.nn.quantized.dynamic") and "Linear" in repr(m)
    ]
    assert not linear
    assert len(quantized) == 6 * 6 + 1  # 6 per encoder layer (q, k, v, out, ffn in/out) + pooler
    assert model.info.quantize == "int8"
    assert model.info.num_parameters == float32_model.info.num_parameters
    # The packed int8 weights are counted: well under float32, above the embeddings alone.
    assert (
        0.4 * float32_model.info.shape.parameter_bytes
        < model.info.shape.parameter_bytes
        < 0.75 * float32_model.info.shape.parameter_bytes
    )
    out = embed(model)
    agreement = cosines(out, reference)
    assert agreement.min() >= MIN_COSINE["int8"]
    assert agreement.mean() >= MEAN_COSINE_INT8


@pytest.mark.parametrize(
    ("device", "dtype", "message"),
    [
        ("cuda", torch.float32, "runs on CPU only"),
        ("cpu", torch.bfloat16, "needs --dtype float32"),
    ],
)
def test_int8_refuses_cuda_and_half_precision(device, dtype, message):
    with pytest.raises(ModelLoadError, match=message):
        check_quantize("int8", torch.device(device), dtype)


def test_int8_with_bfloat16_fails_at_load():
    with pytest.raises(ModelLoadError, match="needs --dtype float32"):
        load_model(ModelSpec(device="cpu", dtype="bfloat16", quantize="int8"))


# --- custom models by entry point ---------------------------------------------------------


def test_entry_point_example_serves_through_the_contract():
    model = load_model(ModelSpec(model="python:examples.byte_embedder:create", device="cpu"))
    assert model.info.name == "byte-embedder"
    items = model.prepare(["hello", "a longer text"], truncate=True)
    assert [item.cost for item in items] == [5, 13]
    together = model.forward(items)
    alone = [model.forward([item])[0] for item in items]
    for a, b in zip(together, alone, strict=True):
        assert a.shape == (64,)
        assert np.allclose(a, b, atol=1e-5)  # padding does not change a result


@pytest.mark.parametrize(
    "entry", ["python:", "python:examples.byte_embedder", "python:examples:", "python::create",
              "python:examples.byte_embedder:not-an-identifier"],
)  # fmt: skip
def test_bad_entry_points_are_refused(entry):
    with pytest.raises(ModelLoadError, match=re.escape("python:package.module:factory")):
        parse_entry_point(entry)


@pytest.fixture
def fake_module(monkeypatch):
    module = types.ModuleType("batchfit_test_factories")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def test_factory_without_arguments_is_called_plainly(fake_module):
    from examples.byte_embedder import ByteEmbedder

    fake_module.make = lambda: ByteEmbedder(torch.device("cpu"))
    model = load_model(ModelSpec(model="python:batchfit_test_factories:make"))
    assert model.info.output_dim == 64


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("python:no_such_module_here:create", "cannot import 'no_such_module_here'"),
        ("python:batchfit_test_factories:missing", "is not a callable factory"),
        ("python:batchfit_test_factories:not_a_model", "lacks prepare, forward, synthetic_items"),
    ],
)
def test_factory_problems_are_load_errors(fake_module, model, message):
    fake_module.not_a_model = lambda: types.SimpleNamespace(info=None)
    with pytest.raises(ModelLoadError, match=message):
        load_model(ModelSpec(model=model))
