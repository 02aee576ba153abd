"""Adapters for Hugging Face text encoders: sentence embedding and sequence classification."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tokenizers import Tokenizer

from .base import ArchitectureShape, Item, ModelInfo
from .errors import InputTooLong, translate_error

Postprocess = Callable[[Any, torch.Tensor], list[Any]]


def mean_pool_normalize(output: Any, attention_mask: torch.Tensor) -> list[Any]:
    """Attention-masked mean pooling then L2 normalisation, as sentence-transformers does."""
    hidden = output.last_hidden_state
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    summed = (hidden * mask).sum(dim=1)
    counts = mask.sum(dim=1).clamp(min=1e-9)
    pooled = torch.nn.functional.normalize(summed / counts, p=2, dim=1)
    return list(pooled.float().cpu().numpy())


def make_classifier_postprocess(id2label: dict[int, str]) -> Postprocess:
    def postprocess(output: Any, attention_mask: torch.Tensor) -> list[Any]:
        probs = torch.softmax(output.logits.float(), dim=-1)
        scores, labels = probs.max(dim=-1)
        return [
            {"label": id2label.get(int(label), str(int(label))), "score": float(score)}
            for label, score in zip(labels.tolist(), scores.tolist(), strict=True)
        ]

    return postprocess


def relevance_scores(output: Any, attention_mask: torch.Tensor) -> list[Any]:
    """A cross-encoder's one logit through a sigmoid, as sentence-transformers' CrossEncoder
    scores a model with one label."""
    return torch.sigmoid(output.logits.float()[:, 0]).tolist()


class TextModel:
    """A transformers encoder behind the model contract.

    Two tokenizer copies are configured once at load (one truncating, one not) and never
    mutated afterwards, so they can encode from any thread without the fast tokenizer's
    "Already borrowed" errors.
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
        self._accepts_token_type_ids = (
            "token_type_ids" in inspect.signature(module.forward).parameters
        )
        self._full = Tokenizer.from_str(tokenizer.to_str())
        self._full.no_truncation()
        self._full.no_padding()
        self._truncating = Tokenizer.from_str(tokenizer.to_str())
        self._truncating.enable_truncation(max_length=max_input_tokens)
        self._truncating.no_padding()
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
        )

    def prepare(self, inputs: Sequence[str], *, truncate: bool) -> list[Item]:
        return self._items(list(inputs), truncate=truncate, pairs=False)

    def prepare_pairs(
        self, query: str, documents: Sequence[str], *, truncate: bool = True
    ) -> list[Item]:
        """One item per (query, document) pair, encoded as the tokenizer encodes a pair (with
        its separators and segment ids); truncation shortens the longer side first."""
        pairs = [(query, document) for document in documents]
        return self._items(pairs, truncate=truncate, pairs=True)

    def _items(self, inputs: list[Any], *, truncate: bool, pairs: bool) -> list[Item]:
        tokenizer = self._truncating if truncate else self._full
        limit = self.info.max_input_tokens
        items = []
        for index, encoding in enumerate(tokenizer.encode_batch_fast(inputs)):
            ids = encoding.ids
            if len(ids) > limit:
                raise InputTooLong(index, len(ids), limit)
            data = (ids, encoding.type_ids) if pairs else ids
            items.append(Item(data=data, cost=len(ids)))
        return items

    def synthetic_items(self, num_items: int, length: int) -> list[Item]:
        length = max(2, min(length, self.info.max_input_tokens))
        # Any non-special id works; 1000 exists in every vocabulary we load.
        ids = [1000] * length
        return [Item(data=ids, cost=length) for _ in range(num_items)]

    def collate(
        self, items: Sequence[Item], *, pin_memory: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Padded ids, attention mask and segment ids (non-zero only for pairs), on the host."""
        max_len = max(item.cost for item in items)
        shape = (len(items), max_len)
        input_ids = torch.full(shape, self._pad_token_id, dtype=torch.long, pin_memory=pin_memory)
        attention_mask = torch.zeros(shape, dtype=torch.long, pin_memory=pin_memory)
        token_type_ids = torch.zeros(shape, dtype=torch.long, pin_memory=pin_memory)
        for row, item in enumerate(items):
            if isinstance(item.data, tuple):  # a pair: (ids, segment ids)
                ids, type_ids = item.data
                token_type_ids[row, : item.cost] = torch.tensor(type_ids, dtype=torch.long)
            else:
                ids = item.data
            input_ids[row, : item.cost] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, : item.cost] = 1
        return input_ids, attention_mask, token_type_ids

    def forward(self, items: Sequence[Item]) -> list[Any]:
        input_ids, attention_mask, token_type_ids = self.collate(items, pin_memory=self._pin_memory)
        error: BaseException | None = None
        try:
            with torch.inference_mode():
                input_ids = input_ids.to(self._device, non_blocking=self._pin_memory)
                attention_mask = attention_mask.to(self._device, non_blocking=self._pin_memory)
                kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
                if self._accepts_token_type_ids:
                    kwargs["token_type_ids"] = token_type_ids.to(
                        self._device, non_blocking=self._pin_memory
                    )
                output = self._module(**kwargs)
                results = self._postprocess(output, attention_mask)
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
