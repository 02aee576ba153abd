"""The API processes' wire encoding and the merged scrape: pure functions."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.parser import text_string_to_metric_families

from models import Item
from models.text import Tokens
from server.engine import wire
from server.engine.merge import exposition, merge_families


def test_float32_vectors_travel_as_one_raw_frame_and_come_back_equal():
    outputs = list(np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32))
    meta, frames = wire.encode_outputs(outputs)
    assert meta == (wire.FLOAT32, (3, 5))
    assert len(frames) == 1 and bytes(frames[0]) == np.stack(outputs).tobytes()
    decoded = wire.decode_outputs(meta, [bytes(frames[0])])
    assert len(decoded) == 3
    for got, want in zip(decoded, outputs, strict=True):
        assert got.dtype == np.float32 and np.array_equal(got, want)


@pytest.mark.parametrize(
    "outputs",
    [
        [[0.5, 0.5], [0.5, 0.5]],  # plain lists (a custom model)
        [{"label": "POSITIVE", "score": 0.9}],  # a classifier
        [np.zeros(3, np.float32), np.zeros(4, np.float32)],  # unequal shapes
        [np.zeros(3, np.float64)],  # not float32
        [],
    ],
)
def test_anything_else_is_pickled_and_comes_back_equal(outputs):
    meta, frames = wire.encode_outputs(outputs)
    assert meta == (wire.PICKLED,)
    decoded = wire.decode_outputs(meta, [bytes(f) for f in frames])
    assert len(decoded) == len(outputs)
    for got, want in zip(decoded, outputs, strict=True):
        assert np.array_equal(np.asarray(got, dtype=object), np.asarray(want, dtype=object))


def test_prepared_items_survive_the_trip():
    items = [Item(Tokens([101, 7592, 102]), 3), Item(Tokens([101, 102], [0, 1], 1), 2)]
    assert wire.loads(wire.dumps(items)) == items


def test_an_unknown_encoding_is_refused():
    with pytest.raises(ValueError, match="unknown output encoding"):
        wire.decode_outputs(("bfloat16",), [b""])


def _registry(requests: float, ready: float | None, observed: list[float]) -> CollectorRegistry:
    registry = CollectorRegistry()
    counter = Counter("t_requests", "requests", ["code"], registry=registry)
    counter.labels("200").inc(requests)
    gauge = Gauge("t_ready", "ready", registry=registry)
    if ready is not None:
        gauge.set(ready)
    histogram = Histogram("t_latency_seconds", "latency", buckets=(0.1, 1.0), registry=registry)
    for value in observed:
        histogram.observe(value)
    Info("t_model", "model", registry=registry).info({"name": "m"})
    return registry


def test_a_merged_scrape_sums_every_process_and_takes_info_once():
    engine = _registry(0, 1, [])
    workers = [_registry(3, None, [0.05, 0.5]), _registry(4, None, [2.0])]
    families = merge_families([list(r.collect()) for r in (engine, *workers)])
    text = exposition(families).decode()
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert values[("t_requests_total", (("code", "200"),))] == 7
    assert values[("t_ready", ())] == 1
    assert values[("t_latency_seconds_count", ())] == 3
    assert values[("t_latency_seconds_bucket", (("le", "0.1"),))] == 1
    assert values[("t_latency_seconds_bucket", (("le", "1.0"),))] == 2
    assert values[("t_latency_seconds_sum", ())] == pytest.approx(2.55)
    assert values[("t_model_info", (("name", "m"),))] == 1
    assert text.count("# TYPE t_requests_total counter") == 1


def _stream(messages: list[list[bytes]]) -> bytes:
    return b"".join(wire.frame(parts) + b"".join(parts) for parts in messages)


def test_messages_come_back_whole_however_the_stream_is_cut():
    messages = [
        [wire.RESULT, wire.dumps((7, "x")), bytes(range(256)) * 40],
        [wire.STATE, wire.dumps((True, False, 3))],
        [wire.CANCEL, b""],  # an empty frame
    ]
    stream = _stream(messages)
    for piece in (1, 3, 7, 4096, len(stream)):
        unframer = wire.Unframer()
        got = []
        for start in range(0, len(stream), piece):
            got += unframer.feed(stream[start : start + piece])
        assert got == messages, piece


def test_a_message_with_too_many_frames_is_refused():
    with pytest.raises(ValueError, match="at most 255 frames"):
        wire.frame([b""] * 256)
