from bench.memory_limit import make_workload


def test_workload_is_seeded_and_has_the_long_share():
    first = make_workload(400, seed=3, long_share=0.4)
    assert first == make_workload(400, seed=3, long_share=0.4)
    assert first != make_workload(400, seed=4, long_share=0.4)
    inputs = [text for request in first for text in request]
    assert all(1 <= len(request) <= 4 for request in first)
    long = sum(len(text.split()) == 300 for text in inputs) / len(inputs)
    assert 0.35 < long < 0.45
