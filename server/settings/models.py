"""What to serve and how to run it: the models, their tasks and prompts, the device and
dtype, and the generation engine's caps."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Self

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import NoDecode

from models import BUNDLED_MODEL, ModelSpec

from ..model_list import ModelEntry, model_specs, parse_models, split_list


class ModelSettings(BaseModel):
    """The models' group of ``Settings`` (flags of the same names)."""

    model: Annotated[tuple[str, ...], NoDecode] = Field(
        (BUNDLED_MODEL,),
        description="Model to serve, as [name=]source; repeat the flag (or separate with commas "
        "in BATCHFIT_MODEL) to serve several, the first being the default. A source is the "
        "bundled all-MiniLM-L6-v2, a local Hugging Face folder, a hub name (safetensors only) "
        "or python:package.module:factory (a custom model); without name= a model serves "
        "under its own name.",
    )
    task: Annotated[tuple[str, ...], NoDecode] = Field(
        ("auto",),
        description="[name=]task: embed (pooled as the model's configuration says), classify, "
        "rerank (a cross-encoder; for a causal LM, an LLM reranker with Qwen3-Reranker's "
        "prompt), generate (a causal LM behind /v1/completions and /v1/chat/completions), "
        "sparse (a sentence-transformers SparseEncoder: SPLADE vectors behind /embed_sparse) "
        "or auto, which reads the config (a one-label sequence classifier is a reranker; a "
        "Qwen3 causal LM whose folder or hub name says reranker is an LLM reranker; another "
        "causal LM without a sentence-transformers layout, or a .gguf file, generates; "
        "SpladePooling in modules.json makes sparse vectors). A bare task applies to every "
        "model without a name=task of its own.",
    )
    default_prompt_name: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        description="[name=]prompt_name: the prompt (from the model's "
        "config_sentence_transformers.json) put in front of inputs whose request names none, "
        "instead of the model's own default; an empty name means no prompt. A bare value "
        "applies to every model without a name=value of its own.",
    )
    device: str = Field("auto", description="cuda, cuda:N or cpu; auto picks CUDA if present.")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto",
        description="Weights and activations dtype; auto is float16 on CUDA and float32 on CPU. "
        "bfloat16 runs on either.",
    )
    quantize: Literal["none", "int8"] = Field(
        "none",
        description="int8: torch dynamic quantization of the linear layers (CPU, float32 only).",
    )
    max_input_tokens: int | None = Field(
        None,
        ge=2,
        description="Truncation length; defaults to the model's own maximum. For a generator: "
        "its context (prompt and generated tokens together).",
    )
    chat_template: Path | None = Field(
        None,
        description="A Jinja chat template file, for every generator, instead of its "
        "tokenizer's own (a generator without one answers chat requests with 400).",
    )
    num_threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads on CPU; default: OMP_NUM_THREADS where set (batchfit "
        "up sets it to share the cores among its replicas), else every CPU the process may "
        "use, at most its cgroup's CPU quota rounded up; that default drops to one thread "
        "while other work holds the host's CPUs and one thread runs faster. A number set here "
        "or in OMP_NUM_THREADS is kept as it is.",
    )
    max_running_seqs: int = Field(
        64,
        ge=1,
        description="Generation: most sequences decoding at once (each choice of each request "
        "is one). A cap: within it, the memory free at each step decides.",
    )
    max_step_tokens: int = Field(
        2048,
        ge=16,
        description="Generation: most tokens one step feeds (decode tokens and prompt chunks).",
    )
    prefill_time_factor: float = Field(
        1.8,
        gt=1,
        description="Generation: while sequences decode, prompts are prefilled in chunks that "
        "keep a step's predicted time within this many times a step without them, so that "
        "running streams wait at most one chunk for a new prompt. Where more sequences wait "
        "for their first token than decode, the room for prompt tokens grows by the waiting "
        "sequences per decoding one, as memory allows.",
    )

    @field_validator("model", "task", "default_prompt_name", mode="before")
    @classmethod
    def _split_list(cls, value: object) -> object:
        return split_list(value)

    @model_validator(mode="after")
    def _check_models(self) -> Self:
        parse_models(self.model, self.task, self.default_prompt_name)
        return self

    def model_entries(self) -> list[ModelEntry]:
        """The served models in order, the default first, each with its task."""
        return parse_models(self.model, self.task, self.default_prompt_name)

    def model_specs(self) -> list[tuple[str | None, ModelSpec]]:
        """Each model's name (None: its own) and what to load."""
        return model_specs(self.model_entries(), self.model_spec())

    def model_spec(self) -> ModelSpec:
        """The default model's spec (the others differ only in source and task)."""
        default = self.model_entries()[0]
        return ModelSpec(
            model=default.source,
            task=default.task,
            device=self.device,
            dtype=self.dtype,
            max_input_tokens=self.max_input_tokens,
            quantize=self.quantize,
            num_threads=self.num_threads,
            default_prompt_name=default.default_prompt_name,
            chat_template=str(self.chat_template) if self.chat_template else None,
        )
