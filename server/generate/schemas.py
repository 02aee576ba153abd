"""OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` bodies, as Batchfit reads them.

Every field of OpenAI's API is named, so that a client's request is never refused for a
field it may send; the ones Batchfit does not honour are refused only when set to something
other than their neutral value (``params.py``). Unknown fields are schema errors (400).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..schemas import MAX_PRIORITY, MIN_PRIORITY

MAX_CHOICES = 8
MAX_TOP_LOGPROBS = 5
MAX_STOPS = 4


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = Field(
        False, description="Send a last chunk with the usage (and no choices) before [DONE]."
    )
    continuous_usage_stats: bool = Field(False, description="Accepted and ignored.")


class _Sampling(BaseModel):
    """The fields both routes share."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="The served generator's name, as GET /v1/models lists it.")
    temperature: float | None = Field(
        None, ge=0, le=2, allow_inf_nan=False,
        description="0 is greedy (the likeliest token each step). Default: the model's "
        "generation config, else 1.",
    )  # fmt: skip
    top_p: float | None = Field(
        None, gt=0, le=1, allow_inf_nan=False,
        description="Sample among the likeliest tokens whose probability adds up to top_p. "
        "Default: the model's generation config, else 1.",
    )  # fmt: skip
    top_k: int | None = Field(
        None, ge=-1,
        description="Not in OpenAI's API: sample among the top_k likeliest tokens (0 or -1: "
        "all). Default: the model's generation config, else all.",
    )  # fmt: skip
    seed: int | None = Field(
        None,
        description="Seeds this request's own random generator (choice i uses seed + i): the "
        "same request gives the same text whatever else the server runs.",
    )
    stop: str | list[str] | None = Field(
        None, description=f"Up to {MAX_STOPS} strings; the text ends before the first of them."
    )
    n: int = Field(1, ge=1, description=f"Choices per prompt, at most {MAX_CHOICES}.")
    stream: bool = Field(False, description="Answer as server-sent events, token by token.")
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, description="Only 0 is supported.")
    frequency_penalty: float | None = Field(None, description="Only 0 is supported.")
    logit_bias: dict[str, float] | None = Field(None, description="Only {} is supported.")
    user: str | None = Field(None, description="Accepted and ignored.")
    ignore_eos: bool = Field(
        False,
        description="Not in OpenAI's API: generate past the end-of-sequence token, up to "
        "max_tokens (for benchmarks).",
    )
    priority: int = Field(
        0, ge=MIN_PRIORITY, le=MAX_PRIORITY,
        description="Not in OpenAI's API: higher joins the running sequences first; a waiting "
        "sequence gains one level every priority_aging_s seconds.",
    )  # fmt: skip
    timeout_s: float | None = Field(
        None, gt=0, allow_inf_nan=False,
        description="Not in OpenAI's API: seconds from arrival within which the first token "
        "must come (else 504 deadline_exceeded); capped by --max-timeout-s. Default: "
        "--default-timeout-s.",
    )  # fmt: skip


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="A prompt, a list of prompts, or token ids (one list, or a list of lists)."
    )
    max_tokens: int | None = Field(
        16, ge=1,
        description="Most tokens to generate per choice (OpenAI's default, 16); null: up to "
        "the context.",
    )  # fmt: skip
    logprobs: int | None = Field(
        None, ge=0,
        description=f"Log probabilities of each token and of the up to {MAX_TOP_LOGPROBS} "
        "likeliest ones at its place.",
    )  # fmt: skip
    echo: bool = Field(False, description="Put the prompt in front of the completion's text.")
    suffix: str | None = Field(None, description="Not supported (only null).")
    best_of: int | None = Field(None, description="Only null or n.")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: str = Field(description="system (or developer), user or assistant.")
    content: str | list[TextPart] | None = Field(
        description="Text, or a list of text parts (joined with newlines)."
    )
    name: str | None = Field(None, description="Accepted and ignored.")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessageIn] = Field(description="The conversation so far.")
    max_tokens: int | None = Field(
        None, ge=1, description="Most tokens to generate per choice (deprecated by OpenAI)."
    )
    max_completion_tokens: int | None = Field(
        None, ge=1,
        description="Most tokens to generate per choice; default: up to the context (or the "
        "model's generation config's max_new_tokens).",
    )  # fmt: skip
    logprobs: bool = Field(False, description="Log probabilities of each output token.")
    top_logprobs: int | None = Field(
        None, ge=0,
        description=f"With logprobs: the up to {MAX_TOP_LOGPROBS} likeliest tokens at each "
        "place too.",
    )  # fmt: skip
    response_format: dict[str, Any] | None = Field(
        None, description='Only {"type": "text"} is supported.'
    )
    tools: list[dict[str, Any]] | None = Field(None, description="Not supported (only []).")
    tool_choice: str | dict[str, Any] | None = Field(None, description='Only "none".')
    parallel_tool_calls: bool | None = Field(None, description="Accepted and ignored.")
    store: bool | None = Field(None, description="Accepted and ignored.")
    metadata: dict[str, str] | None = Field(None, description="Accepted and ignored.")
    service_tier: str | None = Field(None, description="Accepted and ignored.")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length"] | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length"] | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
