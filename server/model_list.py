"""The served models as ``--model``/``--task``/``--default-prompt-name`` (and their
``BATCHFIT_*`` variables) give them: ``[name=]source``, ``[name=]task`` and
``[name=]prompt_name``, one per flag or comma-separated in the variable."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from models import ModelSpec
from models.spec import TASKS

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_NAMED = re.compile(rf"({NAME.pattern})=(.+)")
_NAMED_PROMPT = re.compile(rf"({NAME.pattern})=(.*)")  # name= clears that model's default


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One ``--model`` value. Without an explicit ``name`` the model serves under its own
    (the bundled name, a folder's name, a hub name or what a custom factory says)."""

    name: str | None
    source: str
    task: str = "auto"
    default_prompt_name: str | None = None
    """None: the model's own default prompt; "": none."""


def split_list(value: object) -> object:
    """A variable's text as a list: a JSON list, or comma-separated values. Lists (repeated
    flags) pass through."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("["):
        return json.loads(text)
    return [part.strip() for part in text.split(",") if part.strip()]


def split_named(value: str) -> tuple[str | None, str]:
    """``name=rest`` -> (name, rest); anything else is all ``rest``."""
    match = _NAMED.fullmatch(value.strip())
    if match is None:
        return None, value.strip()
    return match.group(1), match.group(2).strip()


def parse_models(
    models: Sequence[str], tasks: Sequence[str], prompts: Sequence[str] = ()
) -> list[ModelEntry]:
    """The models in order (the first is the default), each with its task and default prompt.
    A bare task (prompt name) applies to every model without a ``name=task`` of its own.
    Raises ValueError showing the bad value."""
    if not models:
        raise ValueError("model: at least one model is needed")
    entries = []
    names: set[str] = set()
    for value in models:
        name, source = split_named(value)
        if not source:
            raise ValueError(f"model {value!r}: no source after the name")
        if name is not None:
            if name in names:
                raise ValueError(f"model {value!r}: the name {name!r} is given twice")
            names.add(name)
        entries.append(ModelEntry(name, source))
    default_task, named_tasks = "auto", {}
    for value in tasks:
        name, task = split_named(value)
        if task not in TASKS:
            raise ValueError(f"task {value!r}: expected [name=]{'|'.join(TASKS)}")
        if name is None:
            default_task = task
        else:
            named_tasks[name] = task
    default_prompt, named_prompts = None, {}
    for value in prompts:
        match = _NAMED_PROMPT.fullmatch(value.strip())
        if match is None:
            default_prompt = value.strip()
        else:
            named_prompts[match.group(1)] = match.group(2).strip()
    known = {entry.name or entry.source for entry in entries}
    for flag, named in (("task", named_tasks), ("default_prompt_name", named_prompts)):
        unknown = sorted(set(named) - known)
        if unknown:
            raise ValueError(
                f"{flag} for {unknown}, which no --model names (served: {sorted(known)})"
            )
    return [
        ModelEntry(
            e.name, e.source, named_tasks.get(e.name or e.source, default_task),
            named_prompts.get(e.name or e.source, default_prompt),
        )
        for e in entries
    ]  # fmt: skip


def model_specs(
    entries: Sequence[ModelEntry], template: ModelSpec
) -> list[tuple[str | None, ModelSpec]]:
    """Each entry's name and what to load: its source and task, the rest from ``template``."""
    return [
        (
            entry.name,
            dataclasses.replace(
                template, model=entry.source, task=entry.task,
                default_prompt_name=entry.default_prompt_name,
            ),
        )
        for entry in entries
    ]  # fmt: skip
