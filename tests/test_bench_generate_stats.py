"""Figures of a generation level and of a stream a long prompt joins, and the report."""

import json
import math
import os

import pytest

from bench.generate.client import JoinOutcome, StreamOutcome
from bench.generate.host import host_busy_seconds
from bench.generate.report import ratios, render_markdown, write_report
from bench.generate.runner import GenerateResult, PeerResult, quick_options
from bench.generate.stats import summarize_join, summarize_level, window_gaps


def _stream(index, times, *, status=200, tokens=None, cut=False, error=None):
    return StreamOutcome(index=index, sent_s=0.0, status=status, token_times_s=tuple(times),
                         completion_tokens=len(times) if tokens is None else tokens,
                         cut=cut, error=error)  # fmt: skip


def test_a_level_counts_every_token_received_over_its_wall_time():
    outcomes = [
        _stream(0, [0.5, 0.6, 0.7, 0.8]),
        _stream(1, [1.0, 1.1, 1.3], cut=True),
        _stream(2, [], status=503, error="busy"),
        _stream(3, [], status=0, error="ClientConnectorError: refused"),
    ]
    s = summarize_level("p", 4, outcomes, 2.0, max_tokens=[4, 8, 8, 8],
                        prompt_tokens=[10, 20, 30, 40])  # fmt: skip
    assert (s.num_requests, s.num_ok, s.num_cut) == (4, 1, 1)
    assert s.errors == {"503": 1, "ClientConnectorError": 1}
    assert s.completion_tokens == 7
    assert s.output_tokens_per_s == pytest.approx(3.5)
    assert s.expected_tokens == 4  # the finished stream's max_tokens only
    assert s.ttft_p50_s == 0.5
    assert s.ttft_p99_s == 1.0
    # Gaps: 0.1 x 3 from the first, 0.1 and 0.2 from the cut one.
    assert s.tbt_p50_s == pytest.approx(0.1)
    assert s.tbt_max_s == pytest.approx(0.2)
    assert s.mean_prompt_tokens == 25


def test_a_level_without_answers_has_no_latency_figures():
    s = summarize_level("p", 1, [_stream(0, [], status=404, error="not found")], 1.0,
                        max_tokens=[8], prompt_tokens=[10])  # fmt: skip
    assert s.completion_tokens == 0
    assert math.isnan(s.ttft_p50_s) and math.isnan(s.tbt_p99_s)
    assert s.errors == {"404": 1}


def _join(first_times, join_sent, joined_times):
    return JoinOutcome(_stream(0, first_times), _stream(1, joined_times), join_sent)


def test_the_join_window_runs_from_the_send_to_the_joining_stream_end():
    # The first stream: a token every 0.1 s, one gap of 1.0 s (the prefill) after 1.0.
    first = [0.1 * i for i in range(1, 11)] + [2.0, 2.1, 2.2, 2.3, 2.4, 2.5]
    trial = _join(first, join_sent=0.95, joined_times=[1.0, 1.1])  # ends at 0.95 + 1.1
    inside, before = window_gaps(trial)
    assert inside == pytest.approx([0.1, 1.0, 0.1])  # ends at 1.0, 2.0 and 2.1 (the closing one)
    assert len(before) == 8
    summary = summarize_join("p", [trial])
    assert summary.tbt_max_s == pytest.approx(1.0)
    assert summary.tbt_p99_s == pytest.approx(1.0)
    assert summary.tbt_p50_s == pytest.approx(0.1)
    assert summary.p99_over_p50 == pytest.approx(10.0)
    assert summary.join_ttft_p50_s == 1.0
    assert summary.alone_tbt_p50_s == pytest.approx(0.1)


def test_a_join_whose_first_stream_failed_counts_as_an_error_and_adds_no_gaps():
    trial = JoinOutcome(_stream(0, [], status=500, error="boom"), _stream(1, [0.5]), 0.1)
    summary = summarize_join("p", [trial])
    assert summary.num_gaps == 0
    assert summary.errors == {"500": 1}


def _level(peer, c, tokens_per_s, ttft=0.2, tbt=0.05):
    outcomes = [_stream(0, [ttft, ttft + tbt, ttft + 2 * tbt])]
    s = summarize_level(peer, c, outcomes, 3 / tokens_per_s, max_tokens=[3], prompt_tokens=[9])
    return s


def _result():
    options = quick_options(concurrency=(1, 16, 64))
    result = GenerateResult(options=options, model="m.gguf", folder="/f", workload={
        "c=1": {"num_requests": 4, "prompt_tokens_min": 16, "prompt_tokens_median": 40,
                "prompt_tokens_mean": 50.0, "prompt_tokens_max": 200, "max_tokens_min": 8,
                "max_tokens_median": 12, "max_tokens_mean": 14.0, "max_tokens_max": 32,
                "max_tokens_total": 56}})  # fmt: skip
    vllm = PeerResult("vllm", levels=[_level("vllm", 16, 100.0), _level("vllm", 64, 150.0)])
    sweep = PeerResult("vllm max_num_seqs=32", levels=[_level("vllm max_num_seqs=32", 64, 200.0)])
    ours = PeerResult("batchfit", levels=[_level("batchfit", 1, 20.0, ttft=0.1, tbt=0.04),
                                          _level("batchfit", 16, 80.0),
                                          _level("batchfit", 64, 100.0)])  # fmt: skip
    failed = summarize_level("naive", 16, [_stream(0, [], status=0, error="timed out")], 9.0,
                             max_tokens=[3], prompt_tokens=[9])  # fmt: skip
    naive = PeerResult("naive", levels=[_level("naive", 1, 15.0, ttft=0.2, tbt=0.05), failed])
    first = [0.1 * i for i in range(1, 11)] + [1.5, 1.6, 1.7]
    ours.join = summarize_join("batchfit", [_join(first, 0.95, [0.5, 0.6])])
    result.peers = [naive, vllm, ours]
    result.vllm_sweep = [sweep, PeerResult("vllm max_num_seqs=16", error="not ready\nlog")]
    result.limit = {"c=16": {"output_tokens_per_s": 160.0, "num_requests": 32, "errors": 0,
                             "output_tokens": 999, "wall_s": 6.2},
                    "c=64": {"error": "MemoryError: too big"}}  # fmt: skip
    return result


def test_the_ratios_set_batchfit_against_the_limit_the_best_vllm_and_naive():
    found = {r.name: r for r in ratios(_result())}
    assert found["batchfit / limit output tokens/s at 16 streams"].value == pytest.approx(0.5)
    assert found["batchfit / limit output tokens/s at 64 streams"].value is None
    assert found["batchfit / vLLM-best output tokens/s at 16 streams"].value == pytest.approx(0.8)
    best_64 = found["batchfit / vLLM-best output tokens/s at 64 streams"]
    assert best_64.value == pytest.approx(0.5)  # the sweep's 200, not the default's 150
    assert "max_num_seqs=32" in best_64.detail
    assert found["batchfit / naive TTFT p50 at 1 stream"].value == pytest.approx(0.5)
    assert found["batchfit / naive TBT p50 at 1 stream"].value == pytest.approx(0.8)
    join = found["batchfit TBT p99 / p50 while a 512-token prompt joins"]  # quick: 512
    assert join.value == pytest.approx(5.0)


def test_ratios_without_batchfit_are_all_missing():
    result = _result()
    result.peers = [p for p in result.peers if p.name != "batchfit"]
    assert all(r.value is None for r in ratios(result))


def test_the_report_has_a_table_per_level_the_failures_and_json_without_nan(tmp_path):
    result = _result()
    text = render_markdown(result, command="batchfit bench --generate --quick")
    for heading in ("### 1 stream", "### 16 streams", "### 64 streams",
                    "## One stream while a 512-token prompt joins", "## Ratios for the targets",
                    "## Failures"):  # fmt: skip
        assert heading in text
    assert "| limit | failed: MemoryError: too big |" in text
    assert "| vllm max_num_seqs=32 | 200.0 |" in text
    assert "**vllm max_num_seqs=16**" in text
    paths = write_report(result, tmp_path, command="batchfit bench --generate --quick")
    data = json.loads(paths[1].read_text())  # strict JSON: NaN would not parse back as null
    assert data["command"] == "batchfit bench --generate --quick"
    assert data["peers"][0]["levels"][0]["output_tokens_per_s"] == pytest.approx(15.0)
    assert data["peers"][1]["levels"][0]["tbt_p99_s"] == pytest.approx(0.05)
    assert len(data["ratios"]) == 7
    assert data["peers"][0]["levels"][1]["ttft_p50_s"] is None  # NaN in the summary
    assert "| naive | 0.0 | - | - |" in text


def test_the_host_is_busy_in_every_state_but_idle_and_io_wait():
    stat = "cpu  100 10 50 1000 30 5 5 2 0 0\ncpu0 50 5 25 500 15 2 3 1 0 0\n"
    assert host_busy_seconds(stat) == pytest.approx(172 / os.sysconf("SC_CLK_TCK"))
    assert math.isnan(host_busy_seconds("nonsense"))


def test_one_stream_ratios_read_the_figures_measured_in_turn_where_there_are_some():
    result = _result()
    result.in_turn = {"naive": _level("naive", 1, 15.0, ttft=0.3, tbt=0.06),
                      "batchfit": _level("batchfit", 1, 20.0, ttft=0.24, tbt=0.063)}  # fmt: skip
    found = {r.name: r for r in ratios(result)}
    assert found["batchfit / naive TTFT p50 at 1 stream (c=1, in turn)"].value == pytest.approx(0.8)
    assert found["batchfit / naive TBT p50 at 1 stream (c=1, in turn)"].value == pytest.approx(1.05)
    text = render_markdown(result, command="batchfit bench --generate")
    assert "### 1 stream, in turn" in text and "| batchfit | 240 | 240 | 63 |" in text
    result.in_turn, result.in_turn_error = {}, "PeerError: naive could not start"
    text = render_markdown(result, command="batchfit bench --generate")
    assert "Failed: PeerError: naive could not start" in text
    assert "batchfit / naive TBT p50 at 1 stream" in {r.name for r in ratios(result)}
