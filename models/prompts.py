"""Which prompt a request's inputs get, as sentence-transformers resolves it."""

from __future__ import annotations

from .base import ModelInfo
from .errors import ModelError

STANDARD_PROMPT_NAMES = ("query", "document")
"""Names every model answers: where the model defines no such prompt, the name means no
prompt, as sentence-transformers 6 reads them (its ``prompts`` gains ``query: ""`` and
``document: ""``)."""


class UnknownPrompt(ModelError):
    """A request named a prompt the model does not have."""

    def __init__(self, model: str, name: str, known: list[str]) -> None:
        listed = ", ".join(map(repr, known)) if known else "none"
        super().__init__(f"model {model!r} has no prompt named {name!r}; its prompts: {listed}")
        self.name = name
        self.known = known


def resolve_prompt(
    info: ModelInfo, prompt_name: str | None, prompt: str | None, *, name: str | None = None
) -> str | None:
    """The text to put before each input: a literal ``prompt`` as given, else the named
    prompt (``query`` and ``document`` name none where the model lacks them), else the
    model's default prompt; None (or an empty prompt) puts nothing. ``name``: what an error
    calls the model (None: its own name)."""
    if prompt is None:
        if prompt_name is not None:
            if prompt_name in info.prompts:
                prompt = info.prompts[prompt_name]
            elif prompt_name in STANDARD_PROMPT_NAMES:
                prompt = ""
            else:
                raise UnknownPrompt(name or info.name, prompt_name, list(info.prompts))
        elif info.default_prompt_name is not None:
            prompt = info.prompts.get(info.default_prompt_name)
    return prompt or None
