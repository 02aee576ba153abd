"""The memory benchmark's reading of a server's own scheduling figures from /metrics."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from bench.generate.watch import total, watch

VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 7.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 3.0
"""


def batchfit_scrape(running: int, preempted: tuple[int, int], resumed: int) -> str:
    return (
        "# TYPE batchfit_generation_running_sequences gauge\n"
        f'batchfit_generation_running_sequences{{model="g"}} {running}\n'
        "# TYPE batchfit_generation_preemptions counter\n"
        f'batchfit_generation_preemptions_total{{model="g",reason="memory"}} {preempted[0]}\n'
        f'batchfit_generation_preemptions_total{{model="g",reason="oom"}} {preempted[1]}\n'
        "# TYPE batchfit_generation_resumed_sequences counter\n"
        f'batchfit_generation_resumed_sequences_total{{model="g"}} {resumed}\n'
    )


def test_total_sums_every_sample_whatever_its_labels():
    assert total(VLLM, "vllm:num_requests_running") == 7.0
    assert total(VLLM, "vllm:num_preemptions_total") == 3.0
    assert total(batchfit_scrape(4, (2, 5), 1), "batchfit_generation_preemptions_total") == 7
    assert total(VLLM, "batchfit_generation_running_sequences") is None


@contextlib.contextmanager
def metrics_server(states: list[str]):
    """A real HTTP server whose /metrics answers ``states[0]``, which the test replaces."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = states[0].encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_watch_averages_the_running_gauge_and_counts_what_the_run_added():
    states = [batchfit_scrape(0, (2, 1), 4)]
    with metrics_server(states) as url, watch(url, "batchfit", every_s=0.05) as watched:
        states[0] = batchfit_scrape(6, (2, 1), 4)
        time.sleep(0.3)
        states[0] = batchfit_scrape(6, (5, 2), 8)
        time.sleep(0.1)
    assert watched.mean_running == 6
    # Counted from the run's start: 4 preemptions (both reasons) and 4 resumed.
    assert (watched.preempted, watched.resumed) == (4, 4)


def test_watch_leaves_a_peer_without_such_metrics_unmeasured():
    with metrics_server([VLLM]) as url:
        with watch(url, "vllm-fitted", every_s=0.05) as vllm:
            time.sleep(0.2)
        with watch(url, "transformers") as other:
            pass
    assert vllm.mean_running == 7 and vllm.preempted == 0 and math.isnan(vllm.resumed)
    assert math.isnan(other.mean_running) and math.isnan(other.preempted)
