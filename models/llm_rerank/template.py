"""An LLM reranker's inputs: each (query, document) pair written into Qwen3-Reranker's prompt
and tokenized as its model card does. Needs the ``tokenizers`` library, never torch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath

from tokenizers import Tokenizer

from ..base import Item
from ..errors import InputTooLong, ModelLoadError
from ..tokenizing import TRUNCATION_SIDES, TextTokenizer, Tokens


@dataclass(frozen=True, slots=True)
class RelevanceTemplate:
    """The prompt around each pair and the two answer tokens whose logits make the score."""

    prefix: str
    body: str
    """With ``{instruction}``, ``{query}`` and ``{document}``; tokenized on its own and cut to
    the room the prefix and suffix leave."""
    suffix: str
    default_instruction: str
    true_token: str = "yes"
    false_token: str = "no"


QWEN3_RERANKER = RelevanceTemplate(
    prefix=(
        "<|im_start|>system\nJudge whether the Document meets the requirements based on the "
        'Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
        "<|im_end|>\n<|im_start|>user\n"
    ),
    body="<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}",
    suffix="<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    default_instruction=(
        "Given a web search query, retrieve relevant passages that answer the query"
    ),
)


def names_a_reranker(model_type: str | None, source: str) -> bool:
    """Whether a causal LM is read as Qwen3-Reranker without being told: a Qwen3 whose folder
    or hub name (its last part) says ``reranker``. Other causal LMs rerank only when their
    task is given, as the prompt is Qwen3-Reranker's."""
    name = PurePosixPath(source.replace("\\", "/").rstrip("/")).name
    return model_type == "qwen3" and "reranker" in name.lower()


class RelevanceTokenizer:
    """Pairs as the model card encodes them: ``prefix + body + suffix`` token ids, where the
    prefix and suffix are encoded without special tokens and the body with the tokenizer's
    own, cut from the tokenizer's truncation side to what the prefix and suffix leave of the
    model's maximum. Plain inputs (``prepare``) and warm-up items are ``text``'s.

    It pickles, so another process can tokenize for the model."""

    def __init__(
        self, text: TextTokenizer, tokenizer: Tokenizer, *,
        template: RelevanceTemplate = QWEN3_RERANKER,
    ) -> None:  # fmt: skip
        self.info = text.info
        self._text = text
        self._template = template
        source = tokenizer.to_str()
        self._full = Tokenizer.from_str(source)
        self._full.no_truncation()
        self._full.no_padding()
        self._prefix = self._full.encode(template.prefix, add_special_tokens=False).ids
        self._suffix = self._full.encode(template.suffix, add_special_tokens=False).ids
        limit = self.info.max_input_tokens
        room = limit - len(self._prefix) - len(self._suffix)
        if room < 1:
            raise ModelLoadError(
                f"model {self.info.name!r}: its reranking prompt takes "
                f"{len(self._prefix) + len(self._suffix)} tokens, leaving no room for a query "
                f"and a document within {limit} tokens; raise --max-input-tokens"
            )
        side = (
            self.info.truncation_side if self.info.truncation_side in TRUNCATION_SIDES else "right"
        )
        self._truncating = Tokenizer.from_str(source)
        self._truncating.enable_truncation(max_length=room, direction=side)
        self._truncating.no_padding()

    @property
    def template(self) -> RelevanceTemplate:
        return self._template

    def prepare_pairs(
        self, query: str, documents: Sequence[str], *, truncate: bool = True,
        prompt: str | None = None,
    ) -> list[Item]:  # fmt: skip
        """One item per document, scored against ``query``. A prompt is the instruction (the
        template's default without one)."""
        instruction = prompt or self._template.default_instruction
        body = self._template.body
        bodies = [body.format(instruction=instruction, query=query, document=document)
                  for document in documents]  # fmt: skip
        tokenizer = self._truncating if truncate else self._full
        limit = self.info.max_input_tokens
        items = []
        for index, encoding in enumerate(tokenizer.encode_batch_fast(bodies)):
            ids = [*self._prefix, *encoding.ids, *self._suffix]
            if len(ids) > limit:
                raise InputTooLong(index, len(ids), limit)
            items.append(Item(data=Tokens(ids), cost=len(ids)))
        return items

    def prepare(
        self, inputs: Sequence[str], *, truncate: bool, prompt: str | None = None,
        truncation_direction: str | None = None,
    ) -> list[Item]:  # fmt: skip
        """As ``TextTokenizer.prepare``: texts without the reranking prompt."""
        return self._text.prepare(
            inputs, truncate=truncate, prompt=prompt, truncation_direction=truncation_direction
        )

    def synthetic_items(self, num_items: int, length: int) -> list[Item]:
        """As ``TextTokenizer.synthetic_items``."""
        return self._text.synthetic_items(num_items, length)
