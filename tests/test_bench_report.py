"""The benchmark's figures and report writer, over a hand-made result."""

import json
import math
from dataclasses import replace

import pytest

from bench.limit import LimitResult, cheapest_batches, ideal_batches
from bench.loadgen import IN_TURN, Outcome
from bench.report import BATCH_COLOR, load_table, plot_timeline, render_markdown, write_report
from bench.runner import BenchOptions, BenchResult, quick_options
from bench.sampler import Sample, batch_size_series
from bench.stats import batching_figures, parse_scrape, percentile, summarize
from bench.targets import targets
from server.settings import Settings

LIMIT = LimitResult(
    num_inputs=100, num_batches=4, compute_s=0.5, inputs_per_s=200.0, mean_batch_size=25.0,
    padding_ratio=1.1, tokenize_s=0.01, num_threads=2,
)  # fmt: skip
SATURATION = "saturation throughput vs in-process limit (all cores)"


def outcomes(latencies_ms, status=200, inputs=2):
    return [Outcome(i * 0.01, ms / 1e3, status, inputs) for i, ms in enumerate(latencies_ms)]


@pytest.mark.parametrize(
    ("q", "expected"), [(0, 1), (50, 50), (90, 90), (99, 99), (100, 100)]
)  # fmt: skip
def test_percentile_is_nearest_rank(q, expected):
    assert percentile(list(range(100, 0, -1)), q) == expected


def test_percentile_of_nothing_is_nan():
    assert math.isnan(percentile([], 50))


def test_summary_counts_successes_and_errors_by_status():
    runs = outcomes([10] * 8) + outcomes([1, 2], status=429) + outcomes([30000], status=0)
    s = summarize("adaptive", "c=4", runs, wall_s=2.0)
    assert (s.num_requests, s.num_inputs) == (8, 16)
    assert (s.requests_per_s, s.inputs_per_s) == (4.0, 8.0)
    assert s.p50_s == s.p99_s == pytest.approx(0.010)
    assert s.errors == {"0": 1, "429": 2}


def test_batching_figures_from_two_scrapes():
    before = parse_scrape(
        "batchfit_batch_size_sum 10\nbatchfit_batch_size_count 5\n"
        "batchfit_batch_real_tokens_total 100\nbatchfit_batch_padded_tokens_total 120\n"
    )
    after = {
        "batchfit_batch_size_sum": 50.0, "batchfit_batch_size_count": 10.0,
        "batchfit_batch_real_tokens_total": 300.0, "batchfit_batch_padded_tokens_total": 420.0,
    }  # fmt: skip
    assert before["batchfit_batch_size_count"] == 5
    assert batching_figures(before, after) == (8.0, 1.5)
    assert all(math.isnan(x) for x in batching_figures(after, after))


def test_batch_size_series_uses_deltas_between_scrapes():
    samples = [Sample(0.0, 1, 0, 0), Sample(1.0, 2, 40, 5), Sample(2.0, 3, 40, 5),
               Sample(3.0, 4, 70, 8), Sample(3.5, 5)]  # fmt: skip
    assert batch_size_series(samples) == [(1.0, 8.0), (3.0, 10.0)]


@pytest.mark.parametrize(
    ("costs", "max_items", "max_tokens", "expected"),
    [
        ([5, 1, 3, 2], 2, 100, [[1, 3], [2, 0]]),
        ([10, 10, 10, 30], 8, 40, [[0, 1, 2], [3]]),
        ([50, 1], 4, 20, [[1], [0]]),  # an item over budget runs alone
    ],
)
def test_ideal_batches_are_sorted_and_as_big_as_the_budget_allows(
    costs, max_items, max_tokens, expected
):
    assert ideal_batches(costs, max_items, max_tokens) == expected


def test_cheapest_batches_cover_every_input_once_in_length_runs():
    def seconds(n, length):
        return 0.013 + 0.00025 * n * length

    costs = [10, 30, 12, 10, 35, 200, 11] + [20] * 9
    batches = cheapest_batches(costs, max_items=4, max_tokens=4096, predict_time=seconds)
    assert sorted(i for b in batches for i in b) == list(range(len(costs)))
    assert all(len(b) <= 4 for b in batches)
    # The nine inputs of 20 tokens need three passes, three each: equal passes, not 4 + 4 + 1.
    assert sorted(len(b) for b in batches if costs[b[0]] == 20) == [3, 3, 3]
    # The long input is not padded onto short ones.
    assert [costs[i] for b in batches if 5 in b for i in b] == [200]


def make_result():
    result = BenchResult(options=BenchOptions(concurrency=(1, 16)), limit=LIMIT)
    result.summaries = [
        summarize("off", "c=1", outcomes([10] * 10), 1.0),
        summarize("off", "c=16", outcomes([100] * 20), 1.0),
        summarize("adaptive", "c=1", outcomes([9] * 10), 1.0),
        summarize("adaptive", "c=16", outcomes([50] * 90 + [400], status=200), 1.0),
    ]
    result.idle = {"adaptive": summarize("adaptive", "idle c=1", outcomes([5] * 10), 1.0)}
    result.batch1_p50_s = {"adaptive": 0.004}
    result.timeline_config, result.timeline_load = "adaptive", "c=16"
    result.timeline = [Sample(0.0, 300 * 2**20, 0, 0), Sample(0.5, 320 * 2**20, 40, 4)]
    return result


def test_saturation_uses_the_limit_measured_just_before_adaptive():
    result = make_result()
    result.limit_before_top = {"adaptive": replace(LIMIT, inputs_per_s=182.0)}
    by_name = {t.name: t for t in targets(result)}
    assert by_name[SATURATION].ratio == pytest.approx(1.0)
    text = render_markdown(result, command="batchfit bench", plots=False)
    assert "just before each configuration's highest level: adaptive 182.0 inputs/s" in text


def test_saturation_uses_the_mean_of_the_limits_either_side_of_adaptive_s_top_level():
    result = make_result()
    result.limit_before_top = {"adaptive": replace(LIMIT, inputs_per_s=150.0)}
    result.limit_after_top = {"adaptive": replace(LIMIT, inputs_per_s=250.0)}
    saturation = {t.name: t for t in targets(result)}[SATURATION]
    assert saturation.ratio == pytest.approx(182 / 200) and saturation.met
    assert "200.0 (mean of 150.0 just before and 250.0 just after)" in saturation.measured
    text = render_markdown(result, command="batchfit bench", plots=False)
    assert "adaptive 150.0 inputs/s; just after adaptive's, 250.0." in text


def test_targets_are_ratios_against_the_limit_and_batching_off():
    by_name = {t.name: t for t in targets(make_result())}
    saturation = by_name[SATURATION]
    assert saturation.ratio == pytest.approx(182 / 200) and saturation.met
    idle = by_name["one-client p50 vs batch-1 latency + 1.5 ms"]
    assert idle.ratio == pytest.approx(5 / 5.5) and idle.met
    on_off = by_name["batching on vs off at saturation (throughput)"]
    assert on_off.ratio == pytest.approx(182 / 40) and on_off.met
    p99 = by_name["p99 on vs off at the highest load"]
    assert p99.ratio == pytest.approx(400 / 100) and p99.met is False


def test_markdown_has_the_table_and_targets():
    text = render_markdown(make_result(), command="batchfit bench --quick", plots=True)
    assert "batchfit bench --quick" in text
    assert "| limit | in-process, 2 threads, largest batches | 200.0 |" in text
    assert "torch's default thread count (2 threads, every CPU" in text
    assert "| adaptive | c=16 | 182.0 | 91.0 | 50.0 | 50.0 | 400.0 | 400.0 | 0 |" in text
    assert (
        "| p99 on vs off at the highest load | 400.0 vs 100.0 ms (c=16) | <= 1.00 | 4.00 |" in text
    )
    assert "![throughput vs p99](throughput_vs_p99.png)" in text
    assert load_table(make_result()).count("\n") == 2 + 4


def test_write_report_writes_markdown_json_and_pngs(tmp_path):
    paths = write_report(make_result(), tmp_path / "out", command="batchfit bench")
    names = sorted(p.name for p in paths)
    assert names == ["report.md", "results.json", "throughput_vs_p99.png", "timeline.png"]
    for png in ("throughput_vs_p99.png", "timeline.png"):
        data = (tmp_path / "out" / png).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000
    figures = json.loads((tmp_path / "out" / "results.json").read_text())
    assert figures["limit"]["inputs_per_s"] == 200.0
    assert len(figures["summaries"]) == 4 and len(figures["targets"]) == 4


def test_summary_reads_queue_wait_and_cpu_per_input():
    before = {"batchfit_queue_wait_seconds_sum": 1.0, "batchfit_queue_wait_seconds_count": 10}
    after = {"batchfit_queue_wait_seconds_sum": 1.5, "batchfit_queue_wait_seconds_count": 110}
    s = summarize("adaptive", "c=1", outcomes([10] * 5), 1.0, metrics_before=before,
                  metrics_after=after, cpu_s=0.2)  # fmt: skip
    assert s.mean_queue_wait_s == pytest.approx(0.005)
    assert s.cpu_ms_per_input == pytest.approx(20.0)


def test_cpu_time_target_when_both_sides_were_measured():
    result = make_result()
    result.limit = replace(LIMIT, cpu_ms_per_input=9.0)
    result.summaries[-1] = replace(result.summaries[-1], cpu_ms_per_input=10.0)
    cpu = {t.name: t for t in targets(result)}["CPU time per input, limit vs server at saturation"]
    assert cpu.ratio == pytest.approx(0.9) and cpu.met


def test_adaptive_against_the_best_fixed_configuration_at_its_worst_level():
    result = make_result()
    result.summaries += [
        summarize("fixed-64", "c=1", outcomes([9] * 10), 1.0),  # 20 inputs/s, as adaptive
        summarize("fixed-64", "c=16", outcomes([50] * 80), 1.0),  # 160
        summarize("fixed-128", "c=16", outcomes([50] * 100), 1.0),  # 200: the best at c=16
    ]
    fixed = {t.name: t for t in targets(result)}[
        "adaptive vs the best fixed configuration at every level"
    ]
    assert fixed.ratio == pytest.approx(182 / 200) and fixed.met is False
    assert "vs fixed-128 200.0 inputs/s (c=16" in fixed.measured


def test_fixed_128_at_the_servers_default_caps_shows_the_runs_own_spread():
    assert (Settings().max_batch_size, Settings().max_batch_tokens) == (
        BenchOptions().max_batch_size, BenchOptions().max_batch_tokens,
    )  # fmt: skip
    result = make_result()
    result.summaries += [
        summarize("fixed-128", "c=1", outcomes([9] * 10), 1.0),  # 20 inputs/s, as adaptive
        summarize("fixed-128", "c=16", outcomes([50] * 100), 1.0),  # 200 against 182
    ]
    spread = "Adaptive / fixed-128 inputs/s by level: c=1 1.00, c=16 0.91."
    assert spread in render_markdown(result, command="batchfit bench", plots=False)
    result.options = replace(result.options, extra_server_flags=("--max-batch-size=64",))
    assert "fixed-128 runs with" not in render_markdown(result, command="", plots=False)


def test_no_fixed_target_without_a_fixed_configuration():
    names = {t.name for t in targets(make_result())}
    assert "adaptive vs the best fixed configuration at every level" not in names


def test_overhead_section_shows_server_cpu_per_request_beside_the_bare_stack():
    result = make_result()
    result.overhead = [summarize("no-op model", "c=1", outcomes([1.2] * 10, inputs=1), 0.5,
                                 cpu_s=0.011)]  # fmt: skip
    result.bare = [summarize("bare stack", "c=1", outcomes([0.4] * 10, inputs=1), 0.25,
                             cpu_s=0.003)]  # fmt: skip
    text = render_markdown(result, command="batchfit bench", plots=False)
    assert "## Server overhead" in text
    assert "| no-op model | c=1 | 20 | 1.20 | 1.20 | 1.20 | 1.100 | 0 |" in text
    assert "| bare stack | c=1 | 40 | 0.40 | 0.40 | 0.40 | 0.300 | 0 |" in text
    assert "## Server overhead" not in render_markdown(make_result(), command="b", plots=False)


def test_a_quick_run_says_it_is_a_smoke_test_and_leaves_the_targets_out(tmp_path):
    result = make_result()
    result.options = quick_options()
    assert any(t.met is False for t in targets(result))  # the same figures would miss one
    text = render_markdown(result, command="batchfit bench --quick", plots=False)
    targets_section = text[text.index("## Targets") :]
    assert "a smoke test" in targets_section and "not comparable with the targets" in text
    assert "| target | measured |" not in text and "**no**" not in text
    write_report(result, tmp_path, command="batchfit bench --quick")
    assert json.loads((tmp_path / "results.json").read_text())["targets"] == []
    # A full run's report keeps them.
    assert "| target | measured |" in render_markdown(make_result(), command="b", plots=False)


def test_the_timeline_draws_a_batch_size_series_of_one_point(tmp_path):
    """A load level that yields one batch-size point still shows in the plot: points are drawn
    as well as lines (a one-point line draws nothing)."""
    import matplotlib.image

    result = make_result()
    result.timeline = [Sample(0.0, 300 * 2**20, 0, 0), Sample(0.5, 320 * 2**20, 40, 4)]
    assert len(batch_size_series(result.timeline)) == 1
    plot_timeline(result, tmp_path / "timeline.png")
    image = matplotlib.image.imread(tmp_path / "timeline.png")[..., :3]
    top = image[: image.shape[0] // 2]
    r, g, b = (int(BATCH_COLOR[i : i + 2], 16) / 255 for i in (1, 3, 5))
    close = (
        (abs(top[..., 0] - r) < 0.1) & (abs(top[..., 1] - g) < 0.1) & (abs(top[..., 2] - b) < 0.1)
    )
    assert close.sum() >= 9, close.sum()


def single(config, load, latency_ms, wall_s, *, client="aiohttp", count=10):
    return summarize(config, load, outcomes([latency_ms] * count, inputs=1), wall_s,
                     client=client)  # fmt: skip


def test_targets_against_the_bare_stack_the_no_batching_server_and_another_client():
    result = make_result()
    result.overhead = [single("no-op model", "c=1", 0.5, 0.005),
                       single("no-op model", "c=32", 4, 0.05, count=100)]  # fmt: skip
    result.bare = [single("bare stack", "c=1", 0.4, 0.004),
                   single("bare stack", "c=32", 3, 0.04, count=100)]  # fmt: skip
    result.no_batching = [single("no batching", "idle c=1", 6.0, 1.0),
                          single("no batching", "idle c=1", 4.0, 1.0, client="httpx")]  # fmt: skip
    result.other_clients = [
        single("adaptive", "idle c=1", 5.0, 1.0, client="httpx"),
        single("adaptive", "c=16", 50, 0.5, client="httpx", count=50),
    ]
    result.no_batching.append(single("no batching", IN_TURN, 8.0, 1.0))
    result.beside_no_batching = [single("adaptive", IN_TURN, 7.0, 1.0)]
    by_name = {t.name: t for t in targets(result)}
    busy = by_name["no-op model vs the bare stack, c=32: throughput"]
    assert busy.ratio == pytest.approx(2000 / 2500) and busy.met
    quiet = by_name["no-op model vs the bare stack, c=1: mean latency vs bare + 0.15 ms"]
    assert quiet.ratio == pytest.approx(0.5 / 0.55) and quiet.met
    assert quiet.measured == "0.500 vs 0.400 + 0.15 ms (aiohttp)"
    alone = by_name["one-client p50 vs the no-batching server (aiohttp)"]
    assert alone.ratio == pytest.approx(5 / 6) and alone.met
    # Measured in turn, each row is set against the other one measured in turn.
    in_turn = by_name["one-client p50 vs the no-batching server (aiohttp, in turn)"]
    assert in_turn.ratio == pytest.approx(7 / 8) and in_turn.measured == "7.00 vs 8.00 ms"
    httpx = by_name["one-client p50 vs the no-batching server (httpx)"]
    assert httpx.ratio == pytest.approx(5 / 4) and httpx.met is False
    other = by_name["saturation throughput vs in-process limit (httpx client)"]
    assert other.ratio == pytest.approx(100 / 200) and other.met is None
    text = render_markdown(result, command="batchfit bench", plots=False)
    assert "## Against a server without batching, and with another client" in text
    assert "| no batching | idle c=1 | httpx | 10.0 | 4.0 |" in text
    assert "| saturation throughput vs in-process limit (httpx client) |" in text
