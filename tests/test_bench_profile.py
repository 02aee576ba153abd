"""The per-stage profile of a server (py-spy's samples) and the wrk load mode's parsing."""

import pytest

from bench import comparisons
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
from bench.wrk import WrkResult, lua_script, merge_runs, parse_output

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
    (LOOP, ["RequestPath.answer (server/runtime/requests.py:90)",
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


def test_rounds_of_one_level_merge_into_one_run():
    rounds = [
        WrkResult(1, 1000, 2.0, 400e-6, 380e-6, 900e-6, 2e-3, 0),
        WrkResult(1, 3000, 2.0, 600e-6, 560e-6, 1200e-6, 5e-3, 2),
        WrkResult(1, 2000, 2.0, 500e-6, 470e-6, 1000e-6, 3e-3, 1),
    ]
    run = merge_runs(rounds)
    assert run.requests == 6000 and run.duration_s == 6.0 and run.errors == 3
    assert run.mean_s == pytest.approx((0.4 + 1.8 + 1.0) / 6 * 1e-3)  # weighted by requests
    assert (run.p50_s, run.p99_s, run.max_s) == (470e-6, 1000e-6, 5e-3)
    with pytest.raises(ValueError):
        merge_runs([rounds[0], WrkResult(32, 1, 1.0, 1.0, 1.0, 1.0, 1.0, 0)])


class _Server:
    def __init__(self, url, cpu_s):
        self.url, self._cpu = url, iter(cpu_s)

    def cpu_seconds(self):
        return next(self._cpu)


def test_the_no_op_phase_runs_each_level_in_rounds_taking_turns(monkeypatch):
    calls = []

    def fake_wrk(url, body, *, connections, duration_s):
        calls.append((url, duration_s))
        return WrkResult(connections, 100, float(duration_s), 1e-3, 1e-3, 2e-3, 3e-3, 0)

    monkeypatch.setattr(comparisons.wrk, "run_wrk", fake_wrk)
    servers = {"a": _Server("http://a", [0.0, 0.1, 0.1, 0.3]),
               "b": _Server("http://b", [1.0, 1.5, 1.5, 1.6])}  # fmt: skip
    level = comparisons.wrk_in_turn(servers, b"{}", 1, duration_s=4)
    assert [url for url, _ in calls] == ["http://a/v1/infer", "http://b/v1/infer"] * 2
    assert {seconds for _, seconds in calls} == {2}
    assert level["a"].num_requests == 200 and level["a"].wall_s == 4.0
    assert level["a"].cpu_ms_per_input == pytest.approx(300 / 200)
    assert level["b"].cpu_ms_per_input == pytest.approx(600 / 200)
