"""The adapter for Hugging Face text models: embedders (encoders and decoders), classifiers
and cross-encoders. What follows the forward pass is the model's postprocess."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from tokenizers import Tokenizer

from .base import ArchitectureShape, Item, ModelInfo
from .chunking import Span, Windows
from .description import ModelDescription, activation_name
from .errors import translate_error
from .late_chunks import SpanRows
from .postprocess import Postprocess
from .tokenizing import TRUNCATION_SIDES, TextTokenizer, Tokens


class TextModel:
    """A transformers model behind the model contract.

    Inputs are tokenized by a ``TextTokenizer`` (``models/tokenizing.py``), which holds no
    weights. Batches are padded on the right; the postprocess reads each row's real tokens
    from the attention mask.
    """

    def __init__(
        self,
        *,
        name: str,
        task: str,
        module: torch.nn.Module,
        tokenizer: Tokenizer,
        pad_token_id: int,
        max_input_tokens: int,
        postprocess: Postprocess,
        output_dim: int | None,
        shape: ArchitectureShape,
        device: torch.device,
        quantize: str = "none",
        description: ModelDescription | None = None,
        special_ids: frozenset[int] = frozenset(),
        truncation_side: str = "right",
    ) -> None:
        self._module = module
        self._device = device
        # NOTE: on CUDA, batches are collated into page-locked (pinned) host memory, so the
        # copies to the device are DMA transfers queued without blocking this thread.
        # torch's pinned-memory cache records each copy's stream, so a pinned block freed
        # here is not reused before its copy has finished.
        self._pin_memory = device.type == "cuda"
        self._pad_token_id = pad_token_id
        self._postprocess = postprocess
        # NOTE: the signature, not ``forward.__code__``: transformers wraps ``forward`` in
        # decorators whose code object takes only ``*args, **kwargs``, which silently dropped
        # the segment ids of every pair.
        parameters = inspect.signature(module.forward).parameters
        self._accepts_token_type_ids = "token_type_ids" in parameters
        # A decoder would otherwise build a key/value cache nobody reads.
        self._accepts_use_cache = "use_cache" in parameters
        pooling = description.pooling if description is not None else None
        splade = description.splade if description is not None else None
        pooling_name = pooling.name if pooling is not None else None
        if splade is not None:
            pooling_name = f"splade_{splade.strategy}"
        self._exclude_prompt = pooling is not None and not pooling.include_prompt
        if truncation_side not in TRUNCATION_SIDES:
            truncation_side = "right"
        dtype = next(module.parameters()).dtype
        self.info = ModelInfo(
            name=name,
            task=task,
            device=str(device),
            dtype=str(dtype).removeprefix("torch."),
            max_input_tokens=max_input_tokens,
            num_parameters=_num_parameters(module),
            output_dim=output_dim,
            shape=shape,
            quantize=quantize,
            pooling=pooling_name,
            normalize=description.normalize if description and task == "embed" else None,
            prompts=dict(description.prompts) if description else {},
            default_prompt_name=description.default_prompt_name if description else None,
            activation=activation_name(description.head_activation) if description else None,
            truncation_side=truncation_side,
        )
        self._tokenizer = TextTokenizer(
            tokenizer, info=self.info, special_ids=special_ids,
            lowercase=description is not None and description.do_lower_case,
            exclude_prompt=self._exclude_prompt,
        )  # fmt: skip

    def preparer(self) -> TextTokenizer:
        """All that tokenizing (``prepare``, ``prepare_pairs``) needs, without the weights or
        torch. It pickles, so another process can tokenize for this model."""
        return self._tokenizer

    def prepare(
        self, inputs: Sequence[str], *, truncate: bool, prompt: str | None = None,
        truncation_direction: str | None = None,
        late_chunks: Sequence[Sequence[Span]] | None = None,
    ) -> list[Item]:  # fmt: skip
        """As ``TextTokenizer.prepare``."""
        return self._tokenizer.prepare(
            inputs, truncate=truncate, prompt=prompt, truncation_direction=truncation_direction,
            late_chunks=late_chunks,
        )  # fmt: skip

    def prepare_windows(self, inputs: Sequence[str], *, prompt: str | None = None) -> Windows:
        """As ``TextTokenizer.prepare_windows``."""
        return self._tokenizer.prepare_windows(inputs, prompt=prompt)

    def prepare_pairs(
        self, query: str, documents: Sequence[str], *, truncate: bool = True,
        prompt: str | None = None, truncation_direction: str | None = None,
        max_tokens_per_doc: int | None = None,
    ) -> list[Item]:  # fmt: skip
        """As ``TextTokenizer.prepare_pairs``."""
        return self._tokenizer.prepare_pairs(
            query, documents, truncate=truncate, prompt=prompt,
            truncation_direction=truncation_direction, max_tokens_per_doc=max_tokens_per_doc,
        )  # fmt: skip

    def synthetic_items(self, num_items: int, length: int) -> list[Item]:
        """As ``TextTokenizer.synthetic_items``."""
        return self._tokenizer.synthetic_items(num_items, length)

    def collate(
        self, items: Sequence[Item], *, pin_memory: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Padded ids, attention mask, segment ids (non-zero only for pairs) and each row's
        prompt length to leave out of pooling, on the host."""
        max_len = max(item.cost for item in items)
        shape = (len(items), max_len)
        input_ids = torch.full(shape, self._pad_token_id, dtype=torch.long, pin_memory=pin_memory)
        attention_mask = torch.zeros(shape, dtype=torch.long, pin_memory=pin_memory)
        token_type_ids = torch.zeros(shape, dtype=torch.long, pin_memory=pin_memory)
        prompt_lengths = torch.zeros(len(items), dtype=torch.long, pin_memory=pin_memory)
        for row, item in enumerate(items):
            tokens: Tokens = item.data
            input_ids[row, : item.cost] = torch.tensor(tokens.ids, dtype=torch.long)
            attention_mask[row, : item.cost] = 1
            if tokens.type_ids is not None:
                token_type_ids[row, : item.cost] = torch.tensor(tokens.type_ids, dtype=torch.long)
            prompt_lengths[row] = tokens.prompt_length
        return input_ids, attention_mask, token_type_ids, prompt_lengths

    def forward(self, items: Sequence[Item]) -> list[Any]:
        input_ids, attention_mask, token_type_ids, prompt_lengths = self.collate(
            items, pin_memory=self._pin_memory
        )
        error: BaseException | None = None
        try:
            with torch.inference_mode():
                input_ids = input_ids.to(self._device, non_blocking=self._pin_memory)
                attention_mask = attention_mask.to(self._device, non_blocking=self._pin_memory)
                kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
                if self._accepts_token_type_ids:
                    kwargs["token_type_ids"] = token_type_ids.to(
                        self._device, non_blocking=self._pin_memory
                    )
                if self._accepts_use_cache:
                    kwargs["use_cache"] = False
                output = self._module(**kwargs)
                if self._exclude_prompt:  # else every row's is 0 and pooling never reads them
                    prompt_lengths = prompt_lengths.to(self._device, non_blocking=self._pin_memory)
                spans = SpanRows.of(items)
                if spans is None:
                    results = self._postprocess(output, attention_mask, prompt_lengths)
                else:  # late chunks: one row per span, pooled over the span's tokens
                    results = spans.pool(
                        self._postprocess, output.last_hidden_state, attention_mask,
                        prompt_lengths,
                    )  # fmt: skip
                del output
        except Exception as exc:
            error = translate_error(exc)
            if error is exc:
                raise
        if error is not None:
            # NOTE: raised outside the except block so that no traceback (and none of the
            # frames holding the failed batch's tensors) stays reachable from our error.
            raise error
        return results


def _num_parameters(module: torch.nn.Module) -> int:
    """Parameters, counting the packed weights of dynamically quantized linear layers."""
    total = sum(p.numel() for p in module.parameters())
    for sub in module.modules():
        packed = getattr(sub, "_packed_params", None)
        if packed is not None and hasattr(packed, "_weight_bias"):
            weight, bias = packed._weight_bias()
            total += weight.numel() + (bias.numel() if bias is not None else 0)
    return total
