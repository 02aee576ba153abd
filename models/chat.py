"""A generator's prompts: its tokenizer, its chat template and the way back from tokens to text.

No torch and no transformers: an API process renders and tokenizes with this object alone
(it pickles). Chat templates are rendered as transformers renders them (a sandboxed Jinja2
environment with the same filters and globals, and the tokenizer's special tokens as
variables); ``tests/test_generation_contract.py`` checks that the two agree.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from tokenizers import Tokenizer

from .base import ModelInfo
from .generative import GenerationDefaults
from .tokenizing import TokenCodec


class NoChatTemplate(Exception):
    """The model has no chat template, so it cannot answer chat requests."""


class ChatTemplateError(Exception):
    """The chat template refused the conversation (its own ``raise_exception``)."""


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


class PromptTokenizer:
    """Turns a completion prompt or a chat into token ids, and token ids back into text."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        info: ModelInfo,
        chat_template: str | None,
        special_tokens: Mapping[str, str],
        defaults: GenerationDefaults | None = None,
    ) -> None:
        self.info = info
        self.defaults = defaults or GenerationDefaults()
        """The generation config's sampling defaults and end-of-sequence ids."""
        self._tokenizer = tokenizer
        self.chat_template = chat_template
        self._special_tokens = dict(special_tokens)
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    def __getstate__(self) -> dict[str, Any]:
        return {
            "info": self.info,
            "tokenizer": self._tokenizer.to_str(),
            "chat_template": self.chat_template,
            "special_tokens": self._special_tokens,
            "defaults": self.defaults,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            Tokenizer.from_str(state["tokenizer"]),
            info=state["info"],
            chat_template=state["chat_template"],
            special_tokens=state["special_tokens"],
            defaults=state["defaults"],
        )

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """A completion prompt's ids, with the tokens the tokenizer adds (Gemma's ``<bos>``)."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def render_chat(self, messages: Sequence[ChatMessage]) -> str:
        """The conversation as the model's chat template writes it, ending where the
        assistant's answer begins."""
        if self.chat_template is None:
            raise NoChatTemplate(
                f"model {self.info.name!r} has no chat template; use /v1/completions, or serve it "
                "with --chat-template FILE"
            )
        template = _compile(self.chat_template)
        import jinja2

        try:
            return template.render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=True,
                **self._special_tokens,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused the messages: {exc}") from None

    def encode_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        """A chat's ids: the rendered template, tokenized without adding special tokens (the
        template writes them), as transformers' ``apply_chat_template`` does."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def codec(self) -> TokenCodec:
        """Token ids of texts as the model reads them, and back."""
        return TokenCodec(self._tokenizer)

    def token_text(self, token_id: int) -> str:
        """One token as text on its own (special tokens included), for log probabilities."""
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def detokenizer(self, prompt_ids: Sequence[int]) -> Detokenizer:
        return Detokenizer(self, prompt_ids)


class Detokenizer:
    """Text of a sequence's generated tokens, a piece at a time.

    A token's text can depend on its neighbours (a leading space, a character split across
    byte tokens), so the text of the ids since ``prefix`` is decoded with and without the new
    ones, and only the difference is new; text that ends in an incomplete character waits
    for the next token. The prompt's last ids are the first context.
    """

    CONTEXT = 5

    __slots__ = ("_ids", "_prefix", "_read", "_tokenizer")

    def __init__(self, tokenizer: PromptTokenizer, prompt_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_ids[-self.CONTEXT :])
        self._prefix = 0
        self._read = len(self._ids)

    def add(self, token_id: int) -> str:
        """The text ``token_id`` adds ("" while a character is incomplete)."""
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        head = decode(self._ids[self._prefix : self._read])
        text = decode(self._ids[self._prefix :])
        if len(text) <= len(head) or text.endswith("\ufffd"):
            return ""
        if self._prefix > 4 * self.CONTEXT:  # bound what is decoded again each time
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(head) :]


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: int | None = None,
        separators: tuple[str, str] | None = None, sort_keys: bool = False,
    ) -> str:  # fmt: skip
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)
