"""``python -m bench.lone``: lone calls through a real runtime, timed."""

from __future__ import annotations

from bench.lone import lone_calls


async def test_lone_calls_go_through_a_real_runtime_one_batch_each():
    result = await lone_calls(50, warm_up=5)
    assert result.calls == result.batches == 50
    assert 0 < result.loop_cpu_s <= result.wall_s * 1.5  # CPU of one thread, roughly its time
    assert result.wall_s < 0.05
