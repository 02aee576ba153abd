"""Long inputs: windows cut from an over-long input and pooled back (chunked processing),
character spans pooled from one pass (late chunking), and a request's ``truncate``. The
vectors are checked against sentence-transformers run on the same windows and spans."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer

from models import (
    InputTooLong,
    InvalidSpan,
    Item,
    ModelSpec,
    Tokens,
    Windows,
    cut_windows,
    load_model,
    pool_windows,
    token_spans,
    truncate_dimensions,
)
from models.loading import resolve_model_path
from models.spec import BUNDLED_MODEL
from server.cache.key import cache_key
from server.errors import ApiError
from server.long_inputs import Truncation, late_chunks_of, resolve_truncation

MAX_TOKENS = 256  # the bundled model's
LONG = (
    "Rivers and mountains of the north. "
    + " ".join(f"word{i % 50}" for i in range(400))
    + " Databases index rows by their keys."
)
DOC = "The cat sat on the mat. Dogs bark loudly at night. Databases index rows by keys."
SPANS = [(0, 23), (24, 50), (51, len(DOC)), (4, 7)]


@pytest.mark.parametrize(
    ("content", "room", "expected"),
    [
        (list(range(5)), 10, [list(range(5))]),  # fits: one window
        (list(range(6)), 3, [[0, 1, 2], [3, 4, 5]]),  # exact multiple
        (list(range(7)), 3, [[0, 1, 2], [3, 4, 5], [6]]),  # the last holds what is left
        ([], 3, [[]]),  # no content: one window of the special tokens alone
    ],
)
def test_windows_hold_every_token_once_within_the_maximum(content, room, expected):
    windows = cut_windows(content, prefix=[101], suffix=[102], max_tokens=room + 2)
    assert windows == [[101, *w, 102] for w in expected]
    assert all(len(w) <= room + 2 for w in windows)


def test_windows_need_room_for_content():
    with pytest.raises(ValueError, match="no room"):
        cut_windows([1, 2], prefix=[101, 5], suffix=[102], max_tokens=3)


def _items(*costs: int) -> list[Item]:
    return [Item(Tokens([0] * cost), cost) for cost in costs]


def test_pooling_is_the_token_weighted_mean_normalised_where_the_model_normalises():
    a, b, c = np.array([1.0, 0.0]), np.array([0.0, 1.0]), np.array([0.6, 0.8])
    windows = Windows(_items(300, 100, 7), [2, 1])
    pooled = pool_windows([a, b, c], windows, normalize=True)
    want = (300 * a + 100 * b) / 400
    np.testing.assert_allclose(pooled[0], want / np.linalg.norm(want), rtol=1e-6)
    np.testing.assert_array_equal(pooled[1], c.astype(np.float32))  # one window: as it is
    raw = pool_windows([a, b, c], windows, normalize=False)
    np.testing.assert_allclose(raw[0], want, rtol=1e-6)


@pytest.mark.parametrize(
    ("spans", "shift", "expected"),
    [
        ([(0, 3)], 0, ((1, 2),)),  # "The"
        ([(0, 4)], 0, ((1, 2),)),  # the space after belongs to no token
        ([(2, 6)], 0, ((1, 3),)),  # overlapping two tokens in part
        ([(4, 7), (0, 7)], 0, ((2, 3), (1, 3))),
        ([(0, 3)], 7, ((3, 4),)),  # after a prompt of 7 characters
    ],
)
def test_spans_map_to_the_tokens_they_overlap(spans, shift, expected):
    # [CLS] The cat [SEP] (offsets of "The cat"), or with a prompt "query: " in front.
    if shift:
        offsets = [(0, 0), (0, 5), (5, 6), (7, 10), (11, 14), (0, 0)]
        special = [1, 0, 0, 0, 0, 1]
    else:
        offsets = [(0, 0), (0, 3), (4, 7), (0, 0)]
        special = [1, 0, 0, 1]
    assert token_spans(offsets, special, spans, shift=shift) == expected


def test_a_span_between_tokens_is_refused():
    with pytest.raises(InvalidSpan, match=r"late chunk \[3, 4\] of input 2"):
        token_spans([(0, 0), (0, 3), (4, 7), (0, 0)], [1, 0, 0, 1], [(3, 4)], index=2)


@pytest.mark.parametrize(
    ("truncate", "direction", "default", "expected"),
    [
        (None, None, None, Truncation(True, None)),  # today's default: the model's side
        (True, "left", None, Truncation(True, "left")),
        (False, None, None, Truncation(False, None)),
        ("end", None, None, Truncation(True, "right")),
        ("start", None, None, Truncation(True, "left")),
        ("start", "left", None, Truncation(True, "left")),
        ("none", None, None, Truncation(False, None)),
        ("chunk", None, None, Truncation(False, None, chunk=True)),
        (None, None, "chunk", Truncation(False, None, chunk=True)),  # --truncate chunk
        (None, None, "none", Truncation(False, None)),
        (True, None, "none", Truncation(True, None)),  # true still cuts
        (True, None, "start", Truncation(True, "left")),
        ("end", None, "chunk", Truncation(True, "right")),  # the request wins
    ],
)
def test_truncate_resolves_the_request_against_the_server_default(
    truncate, direction, default, expected
):
    assert resolve_truncation(truncate, direction, default) == expected


def test_truncate_refuses_an_unknown_mode_and_a_contradiction():
    with pytest.raises(ApiError) as unknown:
        resolve_truncation("middle", None, None, schema_status=400)
    assert (unknown.value.status, unknown.value.error_type) == (400, "invalid_request")
    with pytest.raises(ApiError, match="cuts from the right"):
        resolve_truncation("end", "left", None)


class _Info:
    task = "embed"
    max_input_tokens = 8


def test_late_chunks_read_flat_for_a_lone_input_and_nested_for_several():
    cut = Truncation(True, None)
    assert late_chunks_of([[0, 3]], ["abcd"], _Info(), name="m", truncation=cut) == [[(0, 3)]]
    nested = late_chunks_of([[[0, 1]], [[1, 2], [0, 2]]], ["ab", "cd"], _Info(), name="m",
                            truncation=cut)  # fmt: skip
    assert nested == [[(0, 1)], [(1, 2), (0, 2)]]


@pytest.mark.parametrize(
    ("late_chunks", "inputs", "message"),
    [
        ([[0, 3]], ["abc", "def"], "1 list"),  # flat with two inputs
        ([[0, 4]], ["abc"], r"late chunk \[0, 4\]"),  # past the text
        ([[2, 2]], ["abc"], "start < end"),
        ([[0, 1, 2]], ["abc"], "start_char, end_char"),
        ([[[0, 1]], []], ["a", "b"], "input 1 is empty"),
        ([[0, 1]] * 9, ["a"], "9 late chunks, more than the model's maximum of 8"),
    ],
)
def test_late_chunks_that_do_not_fit_the_inputs_are_refused(late_chunks, inputs, message):
    with pytest.raises(ApiError, match=message) as error:
        late_chunks_of(late_chunks, inputs, _Info(), name="m", truncation=Truncation(True, None))
    assert (error.value.status, error.value.error_type) == (400, "invalid_late_chunks")


def test_late_chunks_with_chunked_windows_are_refused():
    with pytest.raises(ApiError, match="whole input in one pass"):
        late_chunks_of([[0, 1]], ["a"], _Info(), name="m", truncation=Truncation(False, None, True))


def test_matryoshka_cuts_each_late_chunk():
    rows = np.array([[3.0, 4.0, 12.0], [0.0, 2.0, 1.0]], dtype=np.float32)
    cut = truncate_dimensions(rows, 2, True)
    np.testing.assert_allclose(cut, [[0.6, 0.8], [0.0, 1.0]], rtol=1e-6)


def test_spans_are_part_of_the_cache_key():
    plain = Item(Tokens([101, 7, 8, 102]), 4)
    spanned = Item(Tokens([101, 7, 8, 102], spans=((1, 2),)), 4)
    other = Item(Tokens([101, 7, 8, 102], spans=((1, 3),)), 4)
    keys = {cache_key("m", item, None) for item in (plain, spanned, other)}
    assert len(keys) == 3
    assert cache_key("m", spanned, None) == cache_key("m", Item(spanned.data, 4), None)


# The bundled model against sentence-transformers on the same windows and spans.


@pytest.fixture(scope="module")
def minilm():
    return load_model(ModelSpec(device="cpu", num_threads=1))


@pytest.fixture(scope="module")
def st_model():
    return SentenceTransformer(str(resolve_model_path(BUNDLED_MODEL)), device="cpu")


def _st_vector(st_model, ids: list[int]) -> np.ndarray:
    features = {
        "input_ids": torch.tensor([ids]),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
        "token_type_ids": torch.zeros(1, len(ids), dtype=torch.long),
    }
    with torch.inference_mode():
        return st_model(features)["sentence_embedding"][0].numpy()


def chunked_reference(st_model, text: str) -> np.ndarray:
    """sentence-transformers on windows cut from the text's own tokens, each with [CLS] and
    [SEP], pooled by their token-weighted mean and normalised."""
    tokenizer = st_model.tokenizer
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    room = MAX_TOKENS - 2
    windows = [
        [tokenizer.cls_token_id, *ids[i : i + room], tokenizer.sep_token_id]
        for i in range(0, len(ids), room)
    ]
    vectors = np.stack([_st_vector(st_model, w) for w in windows])
    mean = np.average(vectors, axis=0, weights=[len(w) for w in windows])
    return mean / np.linalg.norm(mean)


def late_reference(st_model, text: str, spans: list[tuple[int, int]]) -> np.ndarray:
    """sentence-transformers' transformer module over the whole text once, mean pooled over
    the tokens each span overlaps (offsets from the tokenizer), normalised."""
    tokenizer = st_model.tokenizer
    encoded = tokenizer(text, return_offsets_mapping=True, return_tensors="pt")
    offsets = encoded.pop("offset_mapping")[0].tolist()
    with torch.inference_mode():
        hidden = st_model[0].auto_model(**encoded).last_hidden_state[0]
    vectors = []
    for start, end in spans:
        rows = [t for t, (a, b) in enumerate(offsets) if a < end and b > start and b > a]
        vector = hidden[rows].mean(0)
        vectors.append((vector / vector.norm()).numpy())
    return np.stack(vectors)


def test_chunked_vectors_match_sentence_transformers_on_the_same_windows(minilm, st_model):
    windows = minilm.prepare_windows([LONG, "A short one."])
    assert windows.counts == [4, 1]
    assert [item.cost for item in windows.items[:3]] == [MAX_TOKENS] * 3
    pooled = pool_windows(minilm.forward(windows.items), windows, normalize=True)
    assert float(pooled[0] @ chunked_reference(st_model, LONG)) > 0.9999
    # The first window alone (what truncation keeps) is another vector.
    assert float(pooled[0] @ minilm.forward(minilm.prepare([LONG], truncate=True))[0]) < 0.99
    # A short input is its ordinary item: the same cache key, the same vector.
    (short,) = minilm.prepare(["A short one."], truncate=False)
    assert windows.items[-1] == short
    assert float(pooled[1] @ st_model.encode("A short one.")) > 0.9999


def test_late_chunked_vectors_match_sentence_transformers_on_the_same_spans(minilm, st_model):
    items = minilm.prepare([DOC, "Another document."], truncate=False,
                           late_chunks=[SPANS, [(0, 7)]])  # fmt: skip
    # A batch mixing late-chunked items and an ordinary one.
    (ordinary,) = minilm.prepare(["A short one."], truncate=False)
    first, second, plain = minilm.forward([*items, ordinary])
    assert first.shape == (len(SPANS), 384) and second.shape == (1, 384)
    reference = late_reference(st_model, DOC, SPANS)
    np.testing.assert_array_less(0.9999, np.sum(first * reference, axis=1))
    assert float(second[0] @ late_reference(st_model, "Another document.", [(0, 7)])[0]) > 0.9999
    assert float(plain @ st_model.encode("A short one.")) > 0.9999
    # Each span is pooled from the whole document: not the span's text encoded alone.
    assert float(first[0] @ st_model.encode(DOC[:23])) < 0.99


def test_late_chunks_after_a_prompt_count_from_the_input(minilm, st_model):
    (item,) = minilm.prepare([DOC], truncate=False, prompt="query: ", late_chunks=[SPANS[:1]])
    (vectors,) = minilm.forward([item])
    shifted = [(s + len("query: "), e + len("query: ")) for s, e in SPANS[:1]]
    reference = late_reference(st_model, "query: " + DOC, shifted)
    assert float(vectors[0] @ reference[0]) > 0.9999


def test_many_overlapping_spans_are_pooled_in_groups_each_as_alone(minilm, st_model):
    # 21 tokens and spans up to the whole text: a group holds one span (a batch's worth).
    spans = [(0, end) for end in range(3, len(DOC) + 1, 4)] + [(0, len(DOC))]
    (item,) = minilm.prepare([DOC], truncate=False, late_chunks=[spans])
    (vectors,) = minilm.forward([item])
    reference = late_reference(st_model, DOC, spans)
    np.testing.assert_array_less(0.9999, np.sum(vectors * reference, axis=1))


def test_a_prompt_that_fills_a_window_is_refused(minilm):
    prompt = "instruction " * 300
    with pytest.raises(InputTooLong, match=r"input 0 .* prompt leaves no room"):
        minilm.prepare_windows([LONG], prompt=prompt)
