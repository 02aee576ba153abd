"""--access-log: one JSON line per request, with sizes and times and never the text."""

import json

from tests.fakes import ScriptedModel
from tests.test_app import running

SECRET = "confidential words"


def _entries(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]


async def test_one_json_line_per_request_without_the_text(registry, capsys):
    model = ScriptedModel(oom_above_items=2)
    async with running(model, registry, access_log=True) as client:
        capsys.readouterr()  # the readiness polls are not logged; start clean anyway
        ok = await client.post(
            "/v1/infer", json={"inputs": [SECRET, "b", "c d"]}, headers={"X-Request-ID": "r-1"}
        )
        bad = await client.post("/v1/infer", json={"inputs": 5}, headers={"X-Request-ID": "r-2"})
        await client.get("/health/ready")
        await client.get("/metrics")
        single = await client.post("/v1/infer", json={"inputs": SECRET + " again"})
        repeated = await client.post("/v1/infer", json={"inputs": ["b", SECRET + " too"]})
    assert ok.status_code == 200 and bad.status_code == 422 and single.status_code == 200
    assert repeated.status_code == 200
    captured = capsys.readouterr().out
    assert SECRET not in captured and "confidential" not in captured
    entries = [json.loads(line) for line in captured.splitlines()]
    assert [e["endpoint"] for e in entries] == ["/v1/infer"] * 4
    first, second, third, fourth = entries
    assert first["request_id"] == "r-1" and first["method"] == "POST"
    assert first["status"] == 200 and first["error_type"] is None
    assert first["inputs"] == 3
    assert first["tokens"] == (2 + 2) + 3 + 4
    # The batch of 3 ran out of memory and was split; its halves ran as two passes.
    assert first["batch_sizes"] == [1, 2]
    assert 0 <= first["queue_wait_s"] <= first["duration_s"]
    assert second["status"] == 422 and second["error_type"] == "invalid_request"
    assert second["inputs"] is None and second["batch_sizes"] is None
    assert third["inputs"] == 1 and third["batch_sizes"] == [1]
    assert first["cache_hits"] == third["cache_hits"] == 0
    # "b" is answered from the output cache; only the other input runs.
    assert fourth["cache_hits"] == 1 and fourth["batch_sizes"] == [1]
    assert set(first) == {
        "time", "request_id", "method", "endpoint", "status", "error_type", "inputs", "tokens",
        "queue_wait_s", "batch_sizes", "cache_hits", "generated_tokens", "duration_s",
    }  # fmt: skip
    assert first["generated_tokens"] is None  # a generation request's count


async def test_no_access_log_unless_asked(registry, capsys):
    async with running(ScriptedModel(), registry) as client:
        assert (await client.post("/v1/infer", json={"inputs": "a"})).status_code == 200
    assert capsys.readouterr().out == ""
