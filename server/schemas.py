"""Request and response bodies of the HTTP API."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from .long_inputs import LATE_CHUNKS_DESCRIPTION, TRUNCATE_DESCRIPTION, Truncate

MIN_PRIORITY, MAX_PRIORITY = -10, 10
EmbeddingTypeName = Literal["float", "int8", "uint8", "binary", "ubinary"]
# What the route accepts, stricter than the Python type says: empty strings and an empty list
# are refused by the route itself (400 empty_input), so the schema documents them as invalid.
_TEXT = {"type": "string", "minLength": 1}
INPUTS_SCHEMA = {"anyOf": [_TEXT, {"type": "array", "items": _TEXT, "minItems": 1}]}
LateChunks = list[list[int]] | list[list[list[int]]]
"""[[start_char, end_char], ...] for a lone input, or one such list per input."""


class InferRequest(BaseModel):
    # Unknown fields are refused (422) so that a typo such as "input" is not silently ignored;
    # strict types, so "1" is not a number and "yes" not a boolean.
    model_config = ConfigDict(extra="forbid", strict=True)

    inputs: Annotated[str | list[str], WithJsonSchema(INPUTS_SCHEMA)] = Field(
        description="One text or a list of texts; no empty ones (400 empty_input)."
    )
    truncate: Truncate = Field(None, description=TRUNCATE_DESCRIPTION)
    late_chunks: LateChunks | None = Field(None, description=LATE_CHUNKS_DESCRIPTION)
    truncation_direction: Literal["right", "left"] | None = Field(
        None,
        description="Which end truncation cuts an over-long input from: right keeps the "
        "start, left keeps the end (for models where the end matters, such as last-token "
        "pooled decoders). It cuts the text with its prompt in front, as sentence-transformers "
        "does. Default: the model's own (GET /v1/models: truncation_direction).",
    )
    timeout_s: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Deadline in seconds from arrival; capped by the server's max_timeout_s. "
        "The X-Timeout-S header does the same; given both, the smaller wins.",
    )
    priority: int = Field(
        0,
        ge=MIN_PRIORITY,
        le=MAX_PRIORITY,
        description="Higher runs first; FIFO within a priority. A waiting item gains one level "
        "every priority_aging_s seconds (server setting), so work arriving more than "
        "d x priority_aging_s later never overtakes an item d levels below: no starvation.",
    )
    model: str | None = Field(
        None,
        description="Which served model runs the inputs, by name as GET /v1/models lists it; "
        "default: the first model the server was started with. Unknown: 404 model_not_found.",
    )
    prompt_name: str | None = Field(
        None,
        description="One of the model's prompts (GET /v1/models lists them), put in front of "
        "every input; an unknown name gets 400 unknown_prompt. Default: the model's default "
        "prompt, if it has one.",
    )
    prompt: str | None = Field(
        None,
        description="A literal prompt put in front of every input, instead of a named one; "
        '"" for none. Its tokens count in usage.',
    )
    dimensions: int | None = Field(
        None,
        description="Embedding models: keep the first dimensions values of each embedding "
        "(Matryoshka), renormalised when the model normalises; from 1 to the model's "
        "output_dim (else 400 invalid_dimensions).",
    )
    top_k: int | None = Field(
        None,
        description="Classifiers: each output becomes a list of the top_k best "
        "{label, score}, best first (at most the number of labels); without it, the best one.",
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float",
        description="Embedding models: float, lists of numbers; base64, each embedding's "
        "little-endian bytes (float32 unless embed_dtype says otherwise; a quantized type's "
        "own bytes).",
    )
    embed_dtype: Literal["float32", "float16", "bfloat16"] | None = Field(
        None, description="With base64: the bytes' type, float32 (default), float16 or bfloat16."
    )
    embedding_types: EmbeddingTypeName | list[EmbeddingTypeName] | None = Field(
        None,
        description="Embedding models: float (default); binary or ubinary, the sign bits "
        "packed 8 to a byte (as int8 or uint8 numbers), as sentence-transformers' "
        "quantize_embeddings packs them; int8 or uint8 over the range -1 to 1 (models that "
        "normalise). A string or a list of one.",
    )


class Usage(BaseModel):
    input_tokens: int


class ClassificationOutput(BaseModel):
    label: str
    score: float


class SparseOutput(BaseModel):
    indices: list[int] = Field(description="Vocabulary positions of the non-zero values.")
    values: list[float] = Field(description="The non-zero values, one per index.")


class InferResponse(BaseModel):
    model: str
    outputs: (
        list[list[float]] | list[list[int]] | list[str] | list[ClassificationOutput]
        | list[list[ClassificationOutput]] | list[SparseOutput] | list[list[list[float]]]
    ) = Field(
        description="One per input, in order: a vector (or its compact encoding), a "
        "classifier's label (or top_k labels), a sparse vector, or with late_chunks a list of "
        "vectors, one per span."
    )  # fmt: skip
    usage: Usage
    request_id: str


class ModelCard(BaseModel):
    name: str
    task: str
    device: str
    dtype: str
    max_input_tokens: int
    output_dim: int | None
    architecture: str = Field(description="encoder or decoder.")
    pooling: str | None = Field(
        description="Embedding models: cls, mean, max, mean_sqrt_len_tokens, weightedmean or "
        "lasttoken (several joined by +); sparse embedders: splade_max or splade_sum."
    )
    normalize: bool | None = Field(description="Embedding models: outputs have unit length.")
    prompts: dict[str, str] = Field(description="The model's named prompts and their text.")
    default_prompt_name: str | None = Field(
        description="The prompt inputs get when a request names none."
    )
    activation: str | None = Field(
        description="Classifiers and rerankers: the score function (softmax, sigmoid, identity...)."
    )
    truncation_direction: str = Field(
        "right", description="The end over-long inputs are cut from by default: right or left."
    )
    context_length: int | None = Field(
        None,
        description="Generators: the most tokens a prompt and its completion hold together.",
    )


class ModelList(BaseModel):
    models: list[ModelCard]


class Status(BaseModel):
    status: str


class ErrorBody(BaseModel):
    error: str
    error_type: str
    request_id: str
