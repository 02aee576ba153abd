"""The per-stage profile of a server (py-spy's samples) and the wrk load mode's parsing."""

import pytest

from bench.stages import (
    ENDPOINT,
    EVENT_LOOP,
    HOP,
    JSON,
    METRICS,
    TOKENIZE,
    VALIDATION,
    classify,
    parse_raw,
    render,
    stage_table,
)
from bench.wrk import WrkResult, lua_script, parse_output

LOOP, MODEL = "thread (100): MainThread", "thread (101): batchfit-model_0"
RUNNER = "Runner.run (asyncio/runners.py:118)"
WORKER = "Thread.run (threading.py:982);ModelThread._work (batching/model_thread.py:80)"
STACKS = [
    (LOOP, [RUNNER, "RequestContextMiddleware.__call__ (server/middleware.py:120)",
            "handle_infer (server/routes.py:150)", "parse_body (server/lean/body.py:60)",
            "TypeAdapter.validate_json (pydantic/type_adapter.py:400)"], 6),
    (LOOP, [RUNNER, "handle_infer (server/routes.py:160)",
            "encode_infer_answer (server/routes.py:170)"], 2),
    (LOOP, [RUNNER], 10),
    (LOOP, ["Batcher._run (batching/batcher.py:330)",
            "Histogram.observe (prometheus_client/metrics.py:680)",
            "__create_fn__.<locals>.__init__ (<string>:3)"], 2),
    (LOOP, ["Runtime._infer (server/runtime/runtime.py:380)",
            "isfuture (asyncio/base_futures.py:10)"], 4),
    (MODEL, [WORKER], 3),
    (MODEL, [WORKER, "Batcher._measured_forward (batching/batcher.py:260)",
             "TextModel._items (models/text.py:120)"], 1),
]  # fmt: skip
RAW = "".join(f"{thread};{';'.join(frames)} {count}\n" for thread, frames, count in STACKS)


def test_raw_samples_parse_into_threads_frames_and_counts():
    samples = parse_raw(RAW.splitlines())
    assert [(s.thread, s.tid, s.count) for s in samples[:2]] == [
        ("MainThread", 100, 6), ("MainThread", 100, 2)
    ]  # fmt: skip
    assert samples[0].frames[-1].function == "TypeAdapter.validate_json"
    assert samples[0].frames[-1].file == "pydantic/type_adapter.py"


@pytest.mark.parametrize(
    ("index", "stage"),
    [
        (0, VALIDATION),  # pydantic's frame, innermost
        (1, JSON),  # a function named for its stage: orjson's C call lands on it
        (2, EVENT_LOOP),  # nothing on top of the runner: the loop's own C code
        (3, METRICS),  # prometheus_client's frame, innermost
        (4, ENDPOINT),  # asyncio's isfuture is transparent: not the event loop's time
        (5, HOP),
        (6, TOKENIZE),
    ],
)
def test_each_stack_goes_to_its_innermost_recognised_stage(index, stage):
    assert classify(parse_raw(RAW.splitlines())[index].frames) == stage


def test_a_threads_cpu_time_is_split_as_its_samples_are():
    samples = parse_raw(RAW.splitlines())
    # The loop's thread: 24 samples, 2.4 ms of CPU over 10 requests: 10 us a sample.
    loop = stage_table(samples, cpu_s_by_tid={100: 0.0024, 101: 0.004}, num_requests=10,
                       loop_only=True)  # fmt: skip
    assert loop.num_samples == 24
    assert loop.us_per_request[VALIDATION] == pytest.approx(60)
    assert loop.us_per_request[EVENT_LOOP] == pytest.approx(100)
    assert loop.total_us == pytest.approx(240)
    others = stage_table(samples, cpu_s_by_tid={100: 0.0024, 101: 0.004}, num_requests=10,
                         loop_only=False)  # fmt: skip
    assert others.us_per_request == {HOP: pytest.approx(300), TOKENIZE: pytest.approx(100)}
    table = render({"before": loop, "after": others})
    assert "| validation (body parse included) | 60 | 0 |" in table
    assert "| **total** | **240** | **400** |" in table


def test_wrk_script_posts_the_body_and_its_summary_parses():
    script = lua_script(b'{"inputs": "a"}')
    assert 'wrk.method = "POST"' in script and '[==[{"inputs": "a"}]==]' in script
    with pytest.raises(ValueError):
        lua_script(b'{"inputs": "]==]"}')
    stdout = (
        "Running 2s test\n"
        '{"requests": 2000, "duration_us": 2000000, "mean_us": 480.5, "p50_us": 450, '
        '"p99_us": 900, "max_us": 1500, "connect": 0, "read": 0, "write": 0, "status": 3, '
        '"timeout": 1}\n'
    )
    run = parse_output(stdout, connections=32)
    assert run == WrkResult(32, 2000, 2.0, 480.5e-6, 450e-6, 900e-6, 1500e-6, 4)
    assert run.requests_per_s == 1000
    with pytest.raises(RuntimeError, match="no summary"):
        parse_output("wrk died", connections=1)
