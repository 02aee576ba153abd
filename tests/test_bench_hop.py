"""``python -m bench.hop``: every model thread answers every call, and the figures are printed."""

import asyncio

from bench.hop import PollingModelThread, measure


async def test_the_polling_thread_answers_each_call_in_order():
    thread = PollingModelThread(spin_s=0.0005)
    try:
        assert [await thread.call(lambda i=i: i * 2) for i in range(5)] == [0, 2, 4, 6, 8]
    finally:
        thread.close()


def test_it_prints_each_threads_round_trips_busy_and_after_idle():
    lines = asyncio.run(measure(calls=5, idle_s=0.0002, spin_s=0.0002))
    assert [line.split(":")[0] for line in lines] == [
        "blocking, on any CPU",
        "blocking, on the event loop's CPU (the server's)",
        "polling 200 us",
    ]
    assert all("back to back median" in line and "after 200 us idle" in line for line in lines)
