"""Long inputs on every route: a request's ``truncate`` (``end``, ``start``, ``none``,
``chunk``, or today's booleans) and its ``late_chunks``, checked once here; and the windows
of chunked inputs pooled back into one vector each once they are answered."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import PlainValidator, WithJsonSchema
from pydantic_core import PydanticCustomError

from models import Item, ModelInfo, Span, Windows, pool_windows, truncate_dimensions

from .errors import ApiError

TRUNCATE_MODES: tuple[str, ...] = ("end", "start", "none", "chunk")


def _truncate_value(value: Any) -> bool | str | None:
    if (
        value is None
        or isinstance(value, bool)
        or (isinstance(value, str) and value in TRUNCATE_MODES)
    ):
        return value
    raise PydanticCustomError(
        "truncate_mode", "Input should be true, false, 'end', 'start', 'none' or 'chunk'"
    )


Truncate = Annotated[
    bool | str | None,
    PlainValidator(_truncate_value),
    WithJsonSchema(
        {"anyOf": [{"type": "boolean"}, {"enum": list(TRUNCATE_MODES)}, {"type": "null"}]}
    ),
]
"""A request's ``truncate`` field, with one clear message for a wrong value."""
TRUNCATE_DESCRIPTION = (
    "What an input longer than the model's maximum becomes: end cuts its end, start its "
    "start, none refuses it (413 input_too_long, naming the model's limit), chunk cuts it "
    "into windows of the model's maximum length, each run as an ordinary input, and answers "
    "their token-weighted mean (normalised where the model normalises). true is the server's "
    "default (--truncate) or, where that is none, the model's own side; false is none. "
    "Default: the server's --truncate."
)
LATE_CHUNKS_DESCRIPTION = (
    "Embedding models: [[start_char, end_char], ...], character spans of the input (or one "
    "such list per input): each input then answers a list of vectors, one per span, pooled "
    "over the tokens the span overlaps from one pass over the whole input (late chunking), "
    "which must fit the model's maximum (else 413 input_too_long)."
)
# Sides as the tokenizer names them.
_SIDES = {"end": "right", "start": "left"}


@dataclass(frozen=True, slots=True)
class Truncation:
    """What a request's inputs get: cut (from ``direction``; None: the model's own side),
    refused when too long, or chunked."""

    truncate: bool
    direction: str | None
    chunk: bool = False


def resolve_truncation(
    truncate: bool | str | None, direction: str | None, default: str | None, *,
    schema_status: int = 422,
) -> Truncation:  # fmt: skip
    """A request's ``truncate`` and ``truncation_direction`` as one decision; ``default`` is
    the server's ``--truncate`` (None: cut from the model's own side)."""
    if isinstance(truncate, str) and truncate not in TRUNCATE_MODES:
        raise ApiError(
            schema_status, "invalid_request",
            f"truncate must be one of {', '.join(TRUNCATE_MODES)} (or true or false), got "
            f"{truncate!r}",
        )  # fmt: skip
    if truncate is None:
        truncate = default if default is not None else True
    if truncate is True:
        truncate = default if default not in (None, "none") else True
    if truncate is True:
        return Truncation(True, direction)
    if truncate is False or truncate == "none":
        return Truncation(False, direction)
    if truncate == "chunk":
        return Truncation(False, direction, chunk=True)
    side = _SIDES[str(truncate)]
    if direction is not None and direction != side:
        raise ApiError(
            400, "invalid_request",
            f"truncate {truncate!r} cuts from the {side}, but truncation_direction is "
            f"{direction!r}; give one of them",
        )  # fmt: skip
    return Truncation(True, side)


def late_chunks_of(
    late_chunks: Sequence[Any] | None, inputs: Sequence[str], info: ModelInfo, *, name: str,
    truncation: Truncation,
) -> list[list[Span]] | None:  # fmt: skip
    """A request's ``late_chunks`` as one list of character spans per input: a flat list of
    spans goes with a lone input, a list of lists with as many inputs. Checked against the
    texts; 400 where they do not fit them."""
    if late_chunks is None:
        return None
    if info.task != "embed":
        raise ApiError(
            400, "unsupported_parameter",
            f"late_chunks applies to embedding models; {name!r} does {info.task}",
        )  # fmt: skip
    if truncation.chunk:
        raise ApiError(
            400, "invalid_late_chunks",
            "late_chunks need the whole input in one pass; truncate chunk cuts it into windows",
        )  # fmt: skip
    nested = bool(late_chunks) and all(
        isinstance(span, list | tuple) and all(isinstance(s, list | tuple) for s in span)
        for span in late_chunks
    )
    per_input = [list(spans) for spans in late_chunks] if nested else [list(late_chunks)]
    if len(per_input) != len(inputs):
        raise ApiError(
            400, "invalid_late_chunks",
            f"late_chunks has {len(per_input)} list(s) of spans for {len(inputs)} inputs: give "
            "one list of [start_char, end_char] per input (a flat list for a lone input)",
        )  # fmt: skip
    checked: list[list[Span]] = []
    for index, (spans, text) in enumerate(zip(per_input, inputs, strict=True)):
        if not spans:
            raise ApiError(400, "invalid_late_chunks", f"late_chunks of input {index} is empty")
        if len(spans) > info.max_input_tokens:  # more spans than the input can have tokens
            raise ApiError(
                400, "invalid_late_chunks",
                f"input {index} has {len(spans)} late chunks, more than the model's maximum "
                f"of {info.max_input_tokens} tokens",
            )  # fmt: skip
        for span in spans:
            if not _is_span(span, len(text)):
                raise ApiError(
                    400, "invalid_late_chunks",
                    f"late chunk {list(span) if isinstance(span, list | tuple) else span!r} of "
                    f"input {index} is not [start_char, end_char] with 0 <= start < end <= "
                    f"{len(text)} (the input's length in characters)",
                )  # fmt: skip
        checked.append([(int(span[0]), int(span[1])) for span in spans])
    return checked


def _is_span(span: Any, length: int) -> bool:
    if not isinstance(span, list | tuple) or len(span) != 2:
        return False
    start, end = span
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end)):
        return False
    return 0 <= start < end <= length


def unwindow(prepared: list[Item] | Windows) -> tuple[list[Item], Windows | None]:
    """The items to queue, and the windows to pool their outputs by (None: not chunked)."""
    if isinstance(prepared, Windows):
        return prepared.items, prepared
    return prepared, None


def pool_answer(
    outputs: Sequence[Any], windows: Windows, info: ModelInfo, dimensions: int | None
) -> list[Any]:
    """Each chunked input's vector from its windows' full vectors, then cut to
    ``dimensions`` (renormalised where the model normalises)."""
    normalize = bool(info.normalize)
    pooled = pool_windows(outputs, windows, normalize=normalize)
    if dimensions is None or dimensions == info.output_dim:
        return pooled
    return [truncate_dimensions(vector, dimensions, normalize) for vector in pooled]
