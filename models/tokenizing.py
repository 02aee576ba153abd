"""Tokenizing for Hugging Face text models, apart from their weights: what a ``TextModel``
prepares its inputs with, and all that a process which only tokenizes for it (an API process
in front of an engine) holds. It needs the ``tokenizers`` library, never torch."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from .base import Item, ModelInfo
from .chunking import Span, Windows, cut_windows, token_spans
from .errors import InputTooLong

TRUNCATION_SIDES = ("right", "left")
LATE_CHUNKS_HINT = (
    "late chunks come from one pass over the whole input, which must fit; send a shorter "
    "input, or cut it with truncate: chunk instead"
)


@dataclass(frozen=True, slots=True)
class Tokens:
    """One input's token ids; a pair's segment ids; how many leading tokens are its prompt
    (0 unless pooling leaves the prompt out); with late chunks, the token ranges each of its
    vectors is pooled over (one vector per range instead of one per input)."""

    ids: list[int]
    type_ids: list[int] | None = None
    prompt_length: int = 0
    spans: tuple[Span, ...] | None = None


class TextTokenizer:
    """A model's inputs as items of token ids, for ``info`` (its name, maximum input length
    and truncation side).

    Three tokenizer copies are configured once (one truncating on each side, one not) and
    never mutated afterwards, so they can encode from any thread without the fast
    tokenizer's "Already borrowed" errors. It pickles, so another process can tokenize.
    """

    def __init__(
        self, tokenizer: Tokenizer, *, info: ModelInfo, special_ids: frozenset[int] = frozenset(),
        lowercase: bool = False, exclude_prompt: bool = False,
    ) -> None:  # fmt: skip
        self.info = info
        self._special_ids = special_ids
        self._exclude_prompt = exclude_prompt
        self._prompt_lengths: dict[str, int] = {}
        source = tokenizer.to_str()
        if lowercase:
            source = _lowercased(source)
        self._full = Tokenizer.from_str(source)
        self._full.no_truncation()
        self._full.no_padding()
        self._truncating: dict[str, Tokenizer] = {}
        for side in TRUNCATION_SIDES:
            truncating = Tokenizer.from_str(source)
            truncating.enable_truncation(max_length=info.max_input_tokens, direction=side)
            truncating.no_padding()
            self._truncating[side] = truncating
        self._truncation_side = info.truncation_side or "right"
        # Any non-special id works for warm-up: 1000 where the vocabulary has it.
        vocab_size = self._full.get_vocab_size()
        self._filler_id = next(
            i for i in (1000, *range(vocab_size - 1, -1, -1))
            if i < vocab_size and i not in special_ids
        )  # fmt: skip

    def prepare(
        self, inputs: Sequence[str], *, truncate: bool, prompt: str | None = None,
        truncation_direction: str | None = None,
        late_chunks: Sequence[Sequence[Span]] | None = None,
    ) -> list[Item]:  # fmt: skip
        """One item per input; a prompt goes in front of each input's text, as
        sentence-transformers puts it, and its tokens count in the item's cost. Truncation
        cuts the prompted text, as sentence-transformers does: from the end
        ``truncation_direction`` names (default: the tokenizer's side), so ``left`` cuts a
        long input's prompt before its end. ``late_chunks``: character spans of each input
        (one list per input); its item is never truncated and answers one vector per span,
        pooled over the tokens the span overlaps."""
        texts = [prompt + text for text in inputs] if prompt else list(inputs)
        if late_chunks is not None:
            return self._spanned(texts, late_chunks, prompt=prompt)
        return self._items(
            texts, truncate=truncate, pairs=False, prompt=prompt, side=truncation_direction
        )

    def prepare_windows(self, inputs: Sequence[str], *, prompt: str | None = None) -> Windows:
        """Each input as windows of at most the model's maximum length: an input that fits is
        one window, the item ``prepare`` makes of it; a longer one is cut into consecutive
        windows of its tokens, each with the model's special tokens (and the prompt) around
        it, so every window is an input the model reads as usual."""
        texts = [prompt + text for text in inputs] if prompt else list(inputs)
        limit = self.info.max_input_tokens
        prompt_length = self._prompt_length(prompt) if prompt and self._exclude_prompt else 0
        prompt_ids = self._content(prompt) if prompt else []
        items: list[Item] = []
        counts = []
        encodings = self._full.encode_batch_fast(texts)
        for encoding, text in zip(encodings, texts, strict=True):
            ids = encoding.ids
            if len(ids) <= limit:
                items.append(Item(data=Tokens(ids, None, prompt_length), cost=len(ids)))
                counts.append(1)
                continue
            special = encoding.special_tokens_mask
            lead = next((i for i, flag in enumerate(special) if not flag), len(ids))
            trail = next((i for i, flag in enumerate(reversed(special)) if not flag), 0)
            # The prompt goes in front of every window: the text's own tokens are cut.
            content = self._content(text[len(prompt) :]) if prompt else ids[lead : len(ids) - trail]
            prefix, suffix = [*ids[:lead], *prompt_ids], ids[len(ids) - trail :]
            if len(prefix) + len(suffix) >= limit:
                hint = "its prompt leaves no room for text in a window; send a shorter prompt"
                raise InputTooLong(len(counts), len(ids), limit, hint)
            windows = cut_windows(content, prefix=prefix, suffix=suffix, max_tokens=limit)
            items += [Item(Tokens(w, None, prompt_length), cost=len(w)) for w in windows]
            counts.append(len(windows))
        return Windows(items, counts)

    def _content(self, text: str) -> list[int]:
        """``text``'s tokens without the special tokens the tokenizer adds around an input."""
        return self._full.encode(text, add_special_tokens=False).ids

    def _spanned(
        self, texts: list[str], late_chunks: Sequence[Sequence[Span]], *, prompt: str | None
    ) -> list[Item]:
        """``prepare``'s items for late chunking: the whole text in one pass (too long:
        ``InputTooLong``), with each span's token range."""
        limit = self.info.max_input_tokens
        shift = len(prompt) if prompt else 0
        prompt_length = self._prompt_length(prompt) if prompt and self._exclude_prompt else 0
        items = []
        for index, (encoding, spans) in enumerate(
            zip(self._full.encode_batch(texts), late_chunks, strict=True)
        ):
            ids = encoding.ids
            if len(ids) > limit:
                raise InputTooLong(index, len(ids), limit, LATE_CHUNKS_HINT)
            ranges = token_spans(
                encoding.offsets, encoding.special_tokens_mask, spans, shift=shift, index=index
            )
            items.append(Item(data=Tokens(ids, None, prompt_length, ranges), cost=len(ids)))
        return items

    def prepare_pairs(
        self, query: str, documents: Sequence[str], *, truncate: bool = True,
        prompt: str | None = None, truncation_direction: str | None = None,
        max_tokens_per_doc: int | None = None,
    ) -> list[Item]:  # fmt: skip
        """One item per (query, document) pair, encoded as the tokenizer encodes a pair (with
        its separators and segment ids); truncation shortens the longer side first, from the
        end ``truncation_direction`` names. A prompt goes in front of the query. With
        ``max_tokens_per_doc``, each document is first cut to that many of its own tokens
        (special tokens aside), from the same end."""
        query = prompt + query if prompt else query
        if max_tokens_per_doc is not None:
            side = truncation_direction or self._truncation_side
            documents = self.cut_texts(documents, max_tokens_per_doc, side=side)
        pairs = [(query, document) for document in documents]
        return self._items(
            pairs, truncate=truncate, pairs=True, prompt=None, side=truncation_direction
        )

    def cut_texts(self, texts: Sequence[str], max_tokens: int, *, side: str) -> list[str]:
        """Each of ``texts`` cut to its first (``side`` right) or last (left) ``max_tokens``
        tokens, at the character offsets of the token boundary, so that encoding the cut
        text gives those tokens, as transformers' truncation of the text alone does."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        cut = list(texts)
        encodings = self._full.encode_batch(cut, add_special_tokens=False)
        for index, encoding in enumerate(encodings):
            offsets = encoding.offsets
            if len(offsets) <= max_tokens:
                continue
            text = cut[index]
            if side == "left":
                cut[index] = text[offsets[-max_tokens][0] :]
            else:
                cut[index] = text[: offsets[max_tokens - 1][1]]
        return cut

    def _items(
        self, inputs: list[Any], *, truncate: bool, pairs: bool, prompt: str | None,
        side: str | None = None,
    ) -> list[Item]:  # fmt: skip
        side = side or self._truncation_side
        if side not in TRUNCATION_SIDES:
            raise ValueError(f"truncation_direction must be right or left, got {side!r}")
        tokenizer = self._truncating[side] if truncate else self._full
        limit = self.info.max_input_tokens
        prompt_length = self._prompt_length(prompt) if prompt and self._exclude_prompt else 0
        items = []
        for index, encoding in enumerate(tokenizer.encode_batch_fast(inputs)):
            ids = encoding.ids
            if len(ids) > limit:
                raise InputTooLong(index, len(ids), limit)
            data = Tokens(ids, encoding.type_ids if pairs else None, prompt_length)
            items.append(Item(data=data, cost=len(ids)))
        return items

    def _prompt_length(self, prompt: str) -> int:
        """The prompt's tokens as sentence-transformers counts them: the prompt encoded alone,
        less a trailing special token (an end-of-sequence or separator)."""
        found = self._prompt_lengths.get(prompt)
        if found is None:
            ids = self._truncating[self._truncation_side].encode(prompt).ids
            found = len(ids) - 1 if ids and ids[-1] in self._special_ids else len(ids)
            if len(self._prompt_lengths) < 256:  # literal prompts come from clients
                self._prompt_lengths[prompt] = found
        return found

    def codec(self) -> TokenCodec:
        """Token ids of texts as the model reads them (lowercased where it lowercases), and
        back."""
        return TokenCodec(self._full)

    def synthetic_items(self, num_items: int, length: int) -> list[Item]:
        """``num_items`` inputs padded to ``length``. NOTE: in a batch of several the last
        is one token shorter, as in a served batch: a batch without padding needs no
        attention mask under sdpa, and would measure a peak smaller than served batches
        of its shape reach (an ``n x L x L`` mask; half the peak at 2 x 4096 tokens)."""
        length = max(2, min(length, self.info.max_input_tokens))
        tokens = Tokens([self._filler_id] * length)
        items = [Item(data=tokens, cost=length) for _ in range(num_items)]
        if num_items > 1:
            items[-1] = Item(data=Tokens([self._filler_id] * (length - 1)), cost=length - 1)
        return items


@dataclass(frozen=True, slots=True)
class TokenizedText:
    """One text's token ids and each token's character span (``[start, end)``; special tokens
    the tokenizer adds span ``(0, 0)``)."""

    ids: list[int]
    offsets: list[tuple[int, int]]


class TokenCodec:
    """Text to token ids and back, as the model's own tokenizer does it (``/tokenize``,
    ``/detokenize``); no truncation."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    def tokenize(
        self, texts: Sequence[str], *, add_special_tokens: bool = True
    ) -> list[TokenizedText]:
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [TokenizedText(e.ids, e.offsets) for e in encodings]

    def detokenize(
        self, ids: Sequence[Sequence[int]], *, skip_special_tokens: bool = False
    ) -> list[str]:
        """Each id list's text; ids outside the vocabulary raise ``ValueError``."""
        for sequence in ids:
            bad = next((i for i in sequence if not 0 <= i < self.vocab_size), None)
            if bad is not None:
                raise ValueError(
                    f"token id {bad} is outside the vocabulary (ids 0 to {self.vocab_size - 1})"
                )
        return self._tokenizer.decode_batch(
            [list(sequence) for sequence in ids], skip_special_tokens=skip_special_tokens
        )


def _lowercased(tokenizer_json: str) -> str:
    """The tokenizer with a Lowercase normalizer in front, unless it lowercases already
    (sentence-transformers' ``do_lower_case``)."""
    spec = json.loads(tokenizer_json)
    existing = spec.get("normalizer")
    if _lowercases(existing):
        return tokenizer_json
    if existing is None:
        rest = []
    elif existing.get("type") == "Sequence":
        rest = list(existing.get("normalizers", []))
    else:
        rest = [existing]
    spec["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "Lowercase"}, *rest]}
    return json.dumps(spec)


def _lowercases(spec: Any) -> bool:
    if not isinstance(spec, dict):
        return False
    kind = spec.get("type")
    if kind == "Lowercase" or (kind == "BertNormalizer" and spec.get("lowercase")):
        return True
    return kind == "Sequence" and any(_lowercases(n) for n in spec.get("normalizers", []))
