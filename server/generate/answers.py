"""Answers in OpenAI's shapes: a whole completion or chat completion, or its stream's
chunks (server-sent events), built from the engine's token events."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from generation import TokenEvent, TokenLogprob

from .params import GenerationCall

DONE = b"data: [DONE]\n\n"


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_output_tokens: int = 0
    started: bool = False
    """A stream's first chunk for this choice has gone (chat: with the role)."""
    offset: int = 0
    """Characters of its text so far (completions' ``text_offset``)."""


class Answer:
    """One request's answer, whole or as chunks. ``chat``: a chat completion (else a
    completion)."""

    def __init__(self, call: GenerationCall, *, chat: bool, request_id: str) -> None:
        self.call = call
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self._choices = [_Choice() for _ in call.specs]
        if call.echo_texts is not None:
            for index, choice in enumerate(self._choices):
                echo = call.echo_texts[index // call.n]
                choice.text.append(echo)
                choice.offset = len(echo)

    @property
    def completion_tokens(self) -> int:
        return sum(choice.num_output_tokens for choice in self._choices)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(prompt) for prompt in self.call.prompts)

    def usage(self) -> dict[str, int]:
        prompt, completion = self.prompt_tokens, self.completion_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def add(self, events: Iterable[TokenEvent]) -> None:
        """Take these events into the whole answer."""
        for event in events:
            choice = self._choices[event.index]
            choice.text.append(event.text)
            choice.logprobs.extend(event.logprobs)
            choice.num_output_tokens = event.num_output_tokens
            if event.finish_reason is not None:
                choice.finish_reason = event.finish_reason

    def body(self) -> bytes:
        """The whole answer, once every event was added."""
        choices = []
        for index, choice in enumerate(self._choices):
            text = "".join(choice.text)
            if self.chat:
                choices.append({
                    "index": index,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": self._chat_logprobs(choice.logprobs, index),
                    "finish_reason": choice.finish_reason,
                })  # fmt: skip
            else:
                offset = (
                    len(self.call.echo_texts[index // self.call.n]) if self.call.echo_texts else 0
                )
                choices.append({
                    "text": text,
                    "index": index,
                    "logprobs": self._completion_logprobs(choice.logprobs, index, offset),
                    "finish_reason": choice.finish_reason,
                })  # fmt: skip
        return orjson.dumps({
            "id": self.id, "object": self.object, "created": self.created,
            "model": self.call.model, "choices": choices, "usage": self.usage(),
        })  # fmt: skip

    def chunks(self, events: Iterable[TokenEvent]) -> bytes:
        """These events as server-sent events, one chunk per event with something to say."""
        out = []
        for event in events:
            choice = self._choices[event.index]
            choice.num_output_tokens = event.num_output_tokens
            if self.chat:
                if not choice.started:
                    choice.started = True
                    out.append(self._chunk({"index": event.index,
                                            "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}))  # fmt: skip
                if not (event.text or event.logprobs or event.finish_reason):
                    continue
                delta = {"content": event.text} if event.text else {}
                out.append(self._chunk({
                    "index": event.index, "delta": delta,
                    "logprobs": self._chat_logprobs(list(event.logprobs), event.index),
                    "finish_reason": event.finish_reason,
                }))  # fmt: skip
                continue
            text = event.text
            if not choice.started:
                choice.started = True
                text = "".join(choice.text) + text  # the echoed prompt, if any
                choice.text.clear()
            if not (text or event.logprobs or event.finish_reason):
                continue
            out.append(self._chunk({
                "index": event.index, "text": text,
                "logprobs": self._completion_logprobs(list(event.logprobs), event.index,
                                                      choice.offset),
                "finish_reason": event.finish_reason,
            }))  # fmt: skip
            choice.offset += len(text)
        return b"".join(out)

    def tail(self) -> bytes:
        """What ends a stream that ran to its end: the usage chunk where asked for, [DONE]."""
        if not self.call.include_usage:
            return DONE
        usage = orjson.dumps({
            "id": self.id, "object": self._chunk_object, "created": self.created,
            "model": self.call.model, "choices": [], "usage": self.usage(),
        })  # fmt: skip
        return b"data: " + usage + b"\n\n" + DONE

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, choice: dict[str, Any]) -> bytes:
        payload = {
            "id": self.id, "object": self._chunk_object, "created": self.created,
            "model": self.call.model, "choices": [choice],
        }  # fmt: skip
        return b"data: " + orjson.dumps(payload) + b"\n\n"

    def _wants_logprobs(self, index: int) -> bool:
        return self.call.specs[index].sampling.num_logprobs is not None

    def _chat_logprobs(self, entries: list[TokenLogprob], index: int) -> dict[str, Any] | None:
        if not self._wants_logprobs(index):
            return None
        return {
            "content": [
                {
                    "token": entry.text,
                    "logprob": entry.logprob,
                    "bytes": list(entry.text.encode("utf-8")),
                    "top_logprobs": [
                        {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
                        for _, text, lp in entry.top
                    ],
                }
                for entry in entries
            ]
        }

    def _completion_logprobs(
        self, entries: list[TokenLogprob], index: int, offset: int
    ) -> dict[str, Any] | None:
        if not self._wants_logprobs(index):
            return None
        offsets = []
        for entry in entries:
            offsets.append(offset)
            offset += len(entry.text)
        return {
            "tokens": [entry.text for entry in entries],
            "token_logprobs": [entry.logprob for entry in entries],
            "top_logprobs": [{text: lp for _, text, lp in entry.top} for entry in entries],
            "text_offset": offsets,
        }
