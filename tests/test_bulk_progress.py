"""The progress bar on a terminal, log lines elsewhere, and what they say."""

import io
import logging

from batching import BatchBudget
from bulk.progress import BarAwareHandler, Progress, bar_line, duration, log_line


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


BUDGET = BatchBudget(max_items=128, max_tokens=4096, max_bytes=1.5 * 2**30)


def progressed(stream, *, terminal):
    clock = Clock()
    progress = Progress(stream=stream, terminal=terminal, log_every_s=30, clock=clock)
    progress.set_total(10_000)
    progress.rows(1_000)  # a skipped part: done, not computed
    progress.start_computing()
    clock.t += 40
    progress.batch(2_000, 80_000, BUDGET)
    return progress, clock


def test_the_bar_shows_done_of_total_rates_eta_and_the_budget():
    stream = io.StringIO()
    progress, _ = progressed(stream, terminal=True)
    line = bar_line(progress.snapshot())
    assert "30% |" in line and "3,000/10,000 inputs" in line
    # 2,000 computed in 40 s (the skipped 1,000 count as done, not in the rate).
    assert "50.0 inputs/s" in line and "2,000 tokens/s" in line
    assert "ETA 2m20s" in line  # 7,000 left at 50/s
    assert "budget 128 x 4,096 tokens, 1.5 GiB" in line
    assert stream.getvalue().startswith("\r") and "3,000/10,000" in stream.getvalue()
    progress.close()
    assert stream.getvalue().endswith("\n")


def test_without_a_terminal_a_log_line_every_interval(caplog):
    caplog.set_level(logging.INFO, logger="batchfit.bulk")
    stream = io.StringIO()
    progress, clock = progressed(stream, terminal=False)
    assert stream.getvalue() == ""
    assert (
        "progress: 3,000 of 10,000 (30.0%) inputs, 50.0 inputs/s, 2,000 tokens/s, ETA 2m20s"
        in caplog.text
    )
    lines = caplog.text.count("progress:")
    clock.t += 5
    progress.batch(10, 100)
    assert caplog.text.count("progress:") == lines, "not again within 30 s"
    clock.t += 30
    progress.batch(10, 100)
    assert caplog.text.count("progress:") == lines + 1


def test_log_records_clear_the_bar_and_draw_it_again():
    stream = io.StringIO()
    progress, _ = progressed(stream, terminal=True)
    handler = BarAwareHandler(progress)
    handler.setFormatter(logging.Formatter("%(message)s"))
    before = len(stream.getvalue())
    handler.emit(logging.LogRecord("x", logging.INFO, "", 0, "part 3 written", None, None))
    after = stream.getvalue()[before:]
    assert after.startswith("\r\x1b[Kpart 3 written\n\r")
    assert "3,000/10,000" in after


def test_durations_and_an_unknown_total():
    assert [duration(s) for s in (5, 75, 3600 * 2 + 120)] == ["5s", "1m15s", "2h02m"]
    progress = Progress(stream=io.StringIO(), terminal=False)
    progress.batch(5, 50)
    assert log_line(progress.snapshot()).startswith("5 inputs,") and "ETA -" in log_line(
        progress.snapshot()
    )
