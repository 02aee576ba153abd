"""``python -m bench.lone``: lone calls through a real runtime, timed."""

from __future__ import annotations

from bench.lone import against_direct, lone_calls
from bench.lone_stages import DIRECT_STAGES, RUNTIME_STAGES, stages


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


async def test_stages_mark_every_boundary_in_order_and_leave_nothing_patched():
    import batching.model_thread as model_thread_module
    from server.runtime.waiting import RequestWait

    settle, item_done = model_thread_module._settle, RequestWait._item_done
    result = await stages(6, warm_up=2, gap_s=0.001)
    assert len(result.runtime) == len(result.direct) == 6
    for calls, path in ((result.runtime, RUNTIME_STAGES), (result.direct, DIRECT_STAGES)):
        order = [path[0][0], *(end for _, end, _ in path)]
        for times in calls:
            # A batch whose memory is not measured reads no baseline; every other mark is made.
            assert set(order) - set(times) <= {"baseline"}, times
            marked = [times[name] for name in order if name in times]
            assert marked == sorted(marked), times
    assert model_thread_module._settle is settle and RequestWait._item_done is item_done
    text = result.describe()
    assert "the memory baseline" in text and "to the caller" in text and "nan" not in text
