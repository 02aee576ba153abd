"""``python -m bench.lone``: lone calls through a real runtime, timed."""

from __future__ import annotations

from bench.lone import against_direct, lone_calls


async def test_lone_calls_go_through_a_real_runtime_one_batch_each():
    result = await lone_calls(50, warm_up=5)
    assert result.calls == result.batches == 50
    assert 0 < result.loop_cpu_s <= result.wall_s * 1.5  # CPU of one thread, roughly its time
    assert result.wall_s < 0.05


async def test_bundled_calls_take_turns_with_the_same_inputs_on_the_model_thread():
    result = await against_direct(6, warm_up=2, gap_s=0.001)
    assert len(result.runtime_s) == len(result.direct_s) == 6
    assert all(0 < t < 5 for t in result.runtime_s + result.direct_s)
    assert "p50" in result.describe()
