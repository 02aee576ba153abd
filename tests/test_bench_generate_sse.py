"""Server-sent events as OpenAI streams them, cut anywhere, and what each chunk says."""

import orjson
import pytest

from bench.generate.sse import EventSplitter, parse_chunk


def _completion(text, finish=None):
    choice = {"index": 0, "text": text, "finish_reason": finish}
    return orjson.dumps({"id": "cmpl-1", "object": "text_completion", "choices": [choice]})


STREAM = (
    b"data: " + _completion(" the") + b"\n\n"
    b": a comment\n\n"
    b"data: " + _completion("") + b"\r\n\r\n"
    b"event: message\ndata: " + _completion(" river") + b"\n\n"
    b"data: " + _completion("", "length") + b"\n\n"
    b'data: {"id":"cmpl-1","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}\n\n'
    b"data: [DONE]\n\n"
)


def _split(pieces):
    splitter = EventSplitter()
    events = []
    for piece in pieces:
        events += splitter.feed(piece)
    return events + splitter.close()


def test_a_stream_fed_whole_gives_every_event_and_skips_comments():
    events = _split([STREAM])
    assert len(events) == 6
    assert events[-1] == "[DONE]"


@pytest.mark.parametrize("cut", range(1, len(STREAM)))
def test_a_stream_cut_at_any_byte_gives_the_same_events(cut):
    assert _split([STREAM[:cut], STREAM[cut:]]) == _split([STREAM])


def test_a_stream_fed_byte_by_byte_gives_the_same_events():
    assert _split([STREAM[i : i + 1] for i in range(len(STREAM))]) == _split([STREAM])


def test_data_lines_of_one_event_join_with_newlines_and_a_lone_cr_ends_a_line():
    assert _split([b"data: a\rdata:b\r\rdata: c\n\n"]) == ["a\nb", "c"]


def test_an_event_without_its_blank_line_is_given_at_close():
    splitter = EventSplitter()
    assert splitter.feed(b"data: [DONE]") == []
    assert splitter.close() == ["[DONE]"]


def test_what_each_chunk_of_a_completion_stream_says():
    chunks = [parse_chunk(e) for e in _split([STREAM])]
    assert [c.is_token for c in chunks] == [True, True, True, False, False, False]
    assert chunks[1].text == ""  # a token whose bytes are not a whole character yet
    assert chunks[3].finish_reason == "length"
    assert (chunks[4].completion_tokens, chunks[4].prompt_tokens) == (3, 5)
    assert chunks[5].done


def test_a_last_chunk_with_text_and_a_finish_reason_is_a_token():
    assert parse_chunk(_completion(".", "length").decode()).is_token


@pytest.mark.parametrize(
    ("data", "error"),
    [
        ('{"error": {"message": "model not loaded", "type": "x"}}', "model not loaded"),
        ('{"error": "overloaded"}', "overloaded"),
        ("not json", "not JSON"),
        ("[1, 2]", "not an object"),
    ],
)
def test_errors_in_the_stream_are_errors(data, error):
    chunk = parse_chunk(data)
    assert not chunk.is_token
    assert error in (chunk.error or "")


def test_chat_deltas_count_their_content_not_the_role():
    role = '{"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": null}]}'
    word = '{"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": null}]}'
    assert not parse_chunk(role).is_token
    assert parse_chunk(word).is_token
    assert parse_chunk(word).text == "Hi"
