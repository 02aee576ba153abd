"""The load generator against the real naive server (uvicorn on a loopback port) serving a
tiny random-weight causal LM: streamed chunks, exact token counts, a joining prompt."""

import asyncio

import pytest

from bench.generate.client import closed_loop_streams, completion_body, join_run, served_model
from bench.generate.peers import naive_launch, start_server
from bench.generate.stats import summarize_join, summarize_level
from bench.generate.workload import GenerateSpec, long_prompt_request, make_generate_requests
from tests.generators import tiny_llama

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("tiny-lm"))


def test_streams_through_the_naive_server_count_every_token(tiny_lm, tmp_path):
    folder, tokenizer = tiny_lm

    def encode(text):
        return tokenizer(text)["input_ids"]

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    spec = GenerateSpec(min_prompt_tokens=8, max_prompt_tokens=64, min_new_tokens=4,
                        max_new_tokens=12)  # fmt: skip
    requests = make_generate_requests(spec, 4, encode, decode, salt="live")
    first = long_prompt_request(spec, 16, 40, encode, decode, salt="first")
    joining = long_prompt_request(spec, 256, 4, encode, decode, salt="join")
    with start_server(naive_launch(str(folder)), tmp_path) as server:
        model = asyncio.run(served_model(server.url))
        assert model == folder.name
        bodies = [completion_body(r, model) for r in requests]
        run = asyncio.run(closed_loop_streams(server.url, bodies, concurrency=2,
                                              max_duration_s=30, timeout_s=30))  # fmt: skip
        trial = asyncio.run(join_run(server.url, completion_body(first, model),
                                     completion_body(joining, model), join_after=5,
                                     timeout_s=30))  # fmt: skip
    assert [o.index for o in run.outcomes] == [0, 1, 2, 3]
    for outcome, request in zip(run.outcomes, requests, strict=True):
        assert outcome.ok, outcome.error
        # ignore_eos: exactly max_tokens, one chunk each, and the usage chunk agrees.
        assert outcome.completion_tokens == request.max_tokens
        assert len(outcome.token_times_s) == request.max_tokens
        assert outcome.prompt_tokens == request.num_prompt_tokens
        assert outcome.finish_reason == "length"
    summary = summarize_level("naive", 2, run.outcomes, run.wall_s,
                              max_tokens=[r.max_tokens for r in requests],
                              prompt_tokens=[r.num_prompt_tokens for r in requests])  # fmt: skip
    assert (
        summary.completion_tokens == summary.expected_tokens == sum(r.max_tokens for r in requests)
    )
    assert summary.ttft_p50_s > 0 and summary.tbt_p50_s > 0
    # One request at a time: the joining prompt waits for the running stream to end.
    assert trial.first.completion_tokens == 40 and trial.joined.completion_tokens == 4
    assert trial.join_sent_s + trial.joined.ttft_s >= trial.first.token_times_s[-1]
    assert summarize_join("naive", [trial]).num_gaps > 0
