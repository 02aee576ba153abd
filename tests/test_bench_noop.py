"""The no-op model the benchmark measures the server's own overhead with."""

from bench.comparisons import NOOP_MODEL
from bench.runner import BenchOptions, quick_options
from models import Model, ModelSpec, load_model


def test_the_noop_model_loads_by_entry_point_and_follows_the_contract():
    model = load_model(ModelSpec(model=NOOP_MODEL, device="cpu"))
    assert isinstance(model, Model)
    items = model.prepare(["one two three", "x"], truncate=True)
    assert [item.cost for item in items] == [3, 1]
    assert model.forward(items) == [[0.5] * 4, [0.5] * 4]
    assert [item.cost for item in model.synthetic_items(2, 7)] == [7, 7]


def test_overhead_levels_run_by_default_and_can_be_skipped():
    assert BenchOptions().overhead_requests > 0 and quick_options().overhead_requests > 0
    assert BenchOptions(overhead_requests=0).overhead_requests == 0
