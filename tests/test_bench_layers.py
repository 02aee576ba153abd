"""The layers ``python -m bench.layers`` builds the no-op replica's path from."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from bench.baselines import bare_app, bare_hop_app, bare_hop_probe_app
from bench.layers import LayerRun, render


@pytest.mark.parametrize("factory", [bare_hop_app, bare_hop_probe_app])
def test_each_layer_answers_as_the_bare_stack_does(factory):
    body = {"inputs": ["the quick brown fox", "jumps"]}
    with TestClient(bare_app()) as bare, TestClient(factory()) as layered:
        expected = bare.post("/v1/infer", json=body)
        answered = layered.post("/v1/infer", json=body)
    assert answered.status_code == expected.status_code == 200
    assert answered.json() == expected.json()


def test_the_table_gives_each_layer_s_median_over_the_rounds():
    rounds = [
        [
            LayerRun("bare stack", 1, mean_s, 3e-4, 0.0),
            LayerRun("no-op replica", 1, 9e-4, 5e-4, 1e-4),
        ]
        for mean_s in (3e-4, 5e-4, 4e-4)
    ]
    table = render(rounds)
    assert "| bare stack | 1 | 400 | 300 | 0 |" in table
    assert "| no-op replica | 1 | 900 | 500 | 100 |" in table
