"""The repeated-traffic workload of ``batchfit bench --repeated-traffic``: pure and seeded."""

from bench.repeated import RepeatedOptions, RepeatedResult, repeated_requests, report
from bench.workload import WorkloadSpec, make_requests


def test_a_share_of_the_inputs_comes_from_a_small_hot_set():
    options = RepeatedOptions(requests=2000, hot_share=0.3, hot_size=32, seed=1)
    requests = repeated_requests(options)
    assert requests == repeated_requests(options)  # the same for the same seed
    plain = make_requests(WorkloadSpec(seed=1), 2000)
    assert [len(r) for r in requests] == [len(r) for r in plain]  # the usual request mix
    replaced = [new for r, p in zip(requests, plain, strict=True)
                for new, old in zip(r, p, strict=True) if new != old]  # fmt: skip
    inputs = sum(len(r) for r in requests)
    assert 0.25 < len(replaced) / inputs < 0.35
    assert len(set(replaced)) <= 32
    assert repeated_requests(RepeatedOptions(requests=50, hot_share=0.0, seed=1)) == plain[:50]


def test_the_report_gives_inputs_per_second_on_and_off():
    results = [
        RepeatedResult("cache-off", 100, 50.0, 10.0, 30.0, 100, 2000, 0, 0, 0),
        RepeatedResult("cache-on", 100, 80.0, 6.0, 20.0, 70, 1500, 25, 5, 0),
    ]
    text = report(RepeatedOptions(), results, "batchfit bench --repeated-traffic")
    assert "| cache-on | 80.0 | 6.0 | 20.0 | 70 of 100 | 1500 | 25 | 5 | 0 |" in text
    assert "cache on / off, inputs/s: 1.60" in text


def test_benchmark_replicas_compute_every_input_unless_told(monkeypatch):
    """The batching benchmark replays its requests at every level: a cache would answer them."""
    from bench import servers

    launched = []
    monkeypatch.setattr(servers, "_launch", lambda arguments, log_dir: launched.append(arguments))
    servers.launch_replica(["--max-batch-size", "8"])
    servers.launch_replica(["--cache-bytes", "1048576"])
    assert launched[0][-5:] == ["--cache-bytes", "0", "--no-deduplicate", "--max-batch-size", "8"]
    assert "--no-deduplicate" not in launched[1] and launched[1][-2:] == [
        "--cache-bytes",
        "1048576",
    ]
