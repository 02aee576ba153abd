"""From a completion or chat body to the sequences to generate: prompts as token ids, the
sampling of each choice, and every limit checked with a message that names it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from generation import SequenceSpec
from models import (
    ChatMessage,
    ChatTemplateError,
    GenerationDefaults,
    ModelInfo,
    NoChatTemplate,
    PromptTokenizer,
    SamplingParams,
)

from ..protocols.openai import ParamError
from .schemas import (
    MAX_CHOICES,
    MAX_STOPS,
    MAX_TOP_LOGPROBS,
    ChatCompletionRequest,
    CompletionRequest,
    _Sampling,
)

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass(frozen=True, slots=True)
class GenerationCall:
    """What one request asks of a generator, ready for its engine."""

    model: str
    prompts: list[list[int]]
    specs: list[SequenceSpec]
    """One per choice: prompt ``i``'s ``n`` choices are ``specs[i * n : (i + 1) * n]``."""
    n: int
    stream: bool
    include_usage: bool
    priority: int
    timeout_s: float
    echo_texts: list[str] | None = None
    """Completions with ``echo``: each prompt's text, put in front of its choices'."""


def bad(message: str, param: str | None, error_type: str = "invalid_parameter") -> ParamError:
    return ParamError(400, error_type, message, param)


def prompt_tokenizer(model: object) -> PromptTokenizer:
    """A generator slot's prompts: the model's preparer, or (in an API process) the
    preparer itself."""
    if isinstance(model, PromptTokenizer):
        return model
    return model.preparer()  # type: ignore[attr-defined]


def completion_call(
    body: CompletionRequest, *, name: str, prompts: PromptTokenizer, defaults: GenerationDefaults,
    timeout_s: float,
) -> GenerationCall:  # fmt: skip
    _check_unsupported(body)
    if body.suffix:
        raise bad("suffix is not supported", "suffix", "unsupported_parameter")
    if body.echo and body.logprobs is not None:
        raise bad("echo with logprobs (the prompt's log probabilities) is not supported",
                  "echo", "unsupported_parameter")  # fmt: skip
    if body.best_of is not None and body.best_of != body.n:
        raise bad(f"best_of must equal n ({body.n}), got {body.best_of}", "best_of",
                  "unsupported_parameter")  # fmt: skip
    if body.logprobs is not None and body.logprobs > MAX_TOP_LOGPROBS:
        raise bad(f"logprobs is at most {MAX_TOP_LOGPROBS}, got {body.logprobs}", "logprobs")
    texts: list[str] | None = None
    raw = body.prompt
    if isinstance(raw, str):
        texts = [raw]
    elif raw and all(isinstance(item, str) for item in raw):
        texts = list(raw)  # type: ignore[arg-type]
    if texts is not None:
        if not texts or any(not text for text in texts):
            raise bad("prompt is empty", "prompt", "empty_input")
        ids = [prompts.encode(text) for text in texts]
    elif raw and all(isinstance(item, int) for item in raw):
        ids = [list(raw)]  # type: ignore[arg-type]
    elif raw and all(isinstance(item, list) and item for item in raw):
        ids = [list(item) for item in raw]  # type: ignore[union-attr]
    else:
        raise bad("prompt is empty", "prompt", "empty_input")
    for tokens in ids:
        _check_token_ids(tokens, prompts.vocab_size)
    return _call(
        body, name=name, info=prompts.info, prompts=ids, defaults=defaults,
        max_tokens=(body.max_tokens, "max_tokens"), num_logprobs=body.logprobs,
        timeout_s=timeout_s, prompt_param="prompt",
        echo_texts=(texts or [prompts.decode(t) for t in ids]) if body.echo else None,
    )  # fmt: skip


def chat_call(
    body: ChatCompletionRequest, *, name: str, prompts: PromptTokenizer,
    defaults: GenerationDefaults, timeout_s: float,
) -> GenerationCall:  # fmt: skip
    _check_unsupported(body)
    if body.tools:
        raise bad("tools are not supported", "tools", "unsupported_parameter")
    if body.tool_choice not in (None, "none"):
        raise bad('tool_choice must be "none"', "tool_choice", "unsupported_parameter")
    kind = (body.response_format or {}).get("type", "text")
    if kind != "text":
        raise bad(f"response_format {kind!r} is not supported; only text",
                  "response_format", "unsupported_parameter")  # fmt: skip
    if body.top_logprobs is not None and body.top_logprobs > MAX_TOP_LOGPROBS:
        raise bad(
            f"top_logprobs is at most {MAX_TOP_LOGPROBS}, got {body.top_logprobs}", "top_logprobs"
        )
    if body.top_logprobs and not body.logprobs:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    if not body.messages:
        raise bad("messages is empty", "messages", "empty_input")
    messages = []
    for index, message in enumerate(body.messages):
        role = ROLES.get(message.role)
        if role is None:
            raise bad(
                f"messages[{index}].role is {message.role!r}; the roles are system, user "
                "and assistant", "messages",
            )  # fmt: skip
        content = message.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        messages.append(ChatMessage(role, content or ""))
    try:
        ids = prompts.encode_chat(messages)
    except NoChatTemplate as exc:
        raise bad(str(exc), "messages", "no_chat_template") from None
    except ChatTemplateError as exc:
        raise bad(str(exc), "messages") from None
    if body.max_completion_tokens is not None:
        max_tokens = (body.max_completion_tokens, "max_completion_tokens")
    else:
        max_tokens = (body.max_tokens, "max_tokens")
    return _call(
        body, name=name, info=prompts.info, prompts=[ids], defaults=defaults,
        max_tokens=max_tokens, timeout_s=timeout_s, prompt_param="messages",
        num_logprobs=(body.top_logprobs or 0) if body.logprobs else None,
    )  # fmt: skip


def _check_unsupported(body: _Sampling) -> None:
    for field in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, field)
        if value:
            raise bad(f"{field} is not supported (only 0), got {value}", field,
                      "unsupported_parameter")  # fmt: skip
    if body.logit_bias:
        raise bad("logit_bias is not supported", "logit_bias", "unsupported_parameter")
    if body.n > MAX_CHOICES:
        raise bad(f"n is at most {MAX_CHOICES}, got {body.n}", "n")
    stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    if len(stops) > MAX_STOPS:
        raise bad(f"stop holds at most {MAX_STOPS} strings, got {len(stops)}", "stop")


def _check_token_ids(tokens: Sequence[int], vocab_size: int) -> None:
    wrong = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if wrong is not None:
        raise bad(f"token id {wrong} is outside the vocabulary (0 to {vocab_size - 1})", "prompt")


def _call(
    body: _Sampling, *, name: str, info: ModelInfo, prompts: list[list[int]],
    defaults: GenerationDefaults, max_tokens: tuple[int | None, str], num_logprobs: int | None,
    timeout_s: float, prompt_param: str, echo_texts: list[str] | None = None,
) -> GenerationCall:  # fmt: skip
    """``max_tokens``: the value asked for (None: up to the context) and its field's name."""
    context = info.max_input_tokens
    longest = max(len(tokens) for tokens in prompts)
    if longest >= context:
        raise bad(
            f"the prompt has {longest} tokens; model {name!r}'s context is {context} tokens, "
            "and at least one must be left to generate", prompt_param, "context_length_exceeded",
        )  # fmt: skip
    asked, field = max_tokens
    if asked is None:
        most = context - longest
        if defaults.max_new_tokens:
            most = min(most, defaults.max_new_tokens)
    elif longest + asked > context:
        raise bad(
            f"{field} is {asked} and the prompt has {longest} tokens: {longest + asked} in all, "
            f"past model {name!r}'s context of {context} tokens", field, "context_length_exceeded",
        )  # fmt: skip
    else:
        most = asked
    stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    temperature = defaults.temperature if body.temperature is None else body.temperature
    top_p = defaults.top_p if body.top_p is None else body.top_p
    top_k = defaults.top_k if body.top_k is None else max(body.top_k, 0)
    specs = []
    for tokens in prompts:
        for choice in range(body.n):
            sampling = SamplingParams(
                temperature=temperature, top_p=top_p, top_k=top_k,
                seed=None if body.seed is None else body.seed + choice,
                num_logprobs=num_logprobs,
            )  # fmt: skip
            specs.append(SequenceSpec(tokens, most, sampling, stops, body.ignore_eos))
    options = body.stream_options
    return GenerationCall(
        model=name, prompts=prompts, specs=specs, n=body.n, stream=body.stream,
        include_usage=bool(body.stream and options and options.include_usage),
        priority=body.priority, timeout_s=timeout_s, echo_texts=echo_texts,
    )  # fmt: skip
