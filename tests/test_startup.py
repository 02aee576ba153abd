"""What the replica says while it starts: progress, and one line when it is ready."""

import logging
import re

from server.cli import ListeningMessage
from tests.fakes import ScriptedModel, ScriptedProbe
from tests.test_app import running


def test_uvicorns_listening_line_says_the_model_is_still_loading():
    # As uvicorn logs it: the message format and its arguments.
    record = logging.LogRecord(
        "uvicorn.error", logging.INFO, __file__, 1,
        "Uvicorn running on %s://%s:%d (Press CTRL+C to quit)", ("http", "127.0.0.1", 8000), None,
    )  # fmt: skip
    record.color_message = "Uvicorn running on ..."
    assert ListeningMessage().filter(record)
    assert record.getMessage() == (
        "listening on http://127.0.0.1:8000; loading the model (/health/ready is 503 until ready)"
    )
    assert not hasattr(record, "color_message")


def _ready_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("ready in")]


async def test_ready_line_names_url_model_device_dtype_and_fixed_budget(registry, caplog):
    caplog.set_level(logging.INFO, logger="batchfit")
    async with running(ScriptedModel(), registry, port=9123, max_batch_size=8):
        pass
    [line] = _ready_lines(caplog)
    assert line.endswith(
        ": http://127.0.0.1:9123 serves scripted (embed: 1 dims) on cpu, float32; fixed batches "
        "(at most 8 items, 4096 padded tokens); longest proven input 64 tokens of 64; "
        "status page http://127.0.0.1:9123/status"
    ), line


async def test_ready_line_gives_the_adaptive_memory_budget(registry, caplog):
    caplog.set_level(logging.INFO, logger="batchfit")
    probe = ScriptedProbe(free_bytes=1000 * 2**20)
    async with running(
        ScriptedModel(), registry, sizer="adaptive", probe=probe, host="0.0.0.0",
        memory_headroom=0.25,
    ):  # fmt: skip
        pass
    [line] = _ready_lines(caplog)
    assert "http://0.0.0.0:8000 (all interfaces) serves scripted" in line
    budget = r"memory budget [\d,]+ MiB per batch \((the ceiling proven at warm-up; )?free 1,000 "
    assert re.search(budget + r"MiB less 25% headroom", line), line
