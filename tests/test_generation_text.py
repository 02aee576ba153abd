"""Stop strings, held-back text, and the detokenizer's pieces adding up to the decoded text."""

import pytest

from generation import StopText
from tests.generators import load, tiny_generator


@pytest.mark.parametrize(
    ("stops", "pieces", "expected", "stopped"),
    [
        ((), ["a", "b"], ["a", "b"], False),
        (("END",), ["abc ", "E", "N", "D", "x"], ["abc ", "", "", ""], True),
        (("END",), ["abc ", "E", "x"], ["abc ", "", "Ex"], False),
        (("\n\n", "##"), ["one\n", "\ntwo"], ["one", ""], True),
        (("stop",), ["nonstop"], ["non"], True),
    ],
)
def test_stop_strings_hold_back_what_could_start_one_and_cut_where_one_appears(
    stops, pieces, expected, stopped
):
    text = StopText(stops)
    got = []
    ended = False
    for piece in pieces:
        out, ended = text.feed(piece)
        got.append(out)
        if ended:
            break
    assert got == expected and ended is stopped


def test_a_stop_string_kept_when_asked_and_held_text_flushed_at_the_end():
    assert StopText(["END"], include=True).feed("xxENDyy") == ("xxEND", True)
    text = StopText(["END"])
    assert text.feed("abcEN") == ("abc", False)
    assert text.flush() == "EN"


def test_the_detokenizer_pieces_add_up_to_the_decoded_text(tmp_path):
    model = load(tiny_generator(tmp_path, "llama"))
    prompts = model.preparer()
    for text in ["Hello, world! ünïcödé 東京 🚀🔥 done.", "  spaced   out\n\ntext"]:
        ids = prompts.encode(text, add_special_tokens=False)
        detokenizer = prompts.detokenizer(ids[:3])
        pieces = [detokenizer.add(token) for token in ids[3:]]
        assert (
            "".join(pieces) == prompts.decode(ids[3:])
            or "".join(pieces) == (prompts.decode(ids)[len(prompts.decode(ids[:3])) :])
        )
        assert all("\ufffd" not in piece for piece in pieces)
