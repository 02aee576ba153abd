"""The adapter for Hugging Face text models: embedders (encoders and decoders), classifiers
and cross-encoders. What follows the forward pass is the model's postprocess."""

from __future__ import annotations

import copy
import inspect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tokenizers import Tokenizer

from .base import ArchitectureShape, Item, ModelInfo
from .description import ModelDescription, activation_name
from .errors import InputTooLong, translate_error
from .postprocess import Postprocess

TRUNCATION_SIDES = ("right", "left")


@dataclass(frozen=True, slots=True)
class Tokens:
    """One input's token ids; a pair's segment ids; how many leading tokens are its prompt
    (0 unless pooling leaves the prompt out)."""

    ids: list[int]
    type_ids: list[int] | None = None
    prompt_length: int = 0


class TextModel:
    """A transformers model behind the model contract.

    Three tokenizer copies are configured once at load (one truncating on each side, one
    not) and never mutated afterwards, so they can encode from any thread without the fast
    tokenizer's "Already borrowed" errors. Batches are padded on the right; the postprocess
    reads each row's real tokens from the attention mask.
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
        self._special_ids = special_ids
        self._prompt_lengths: dict[str, int] = {}
        # NOTE: the signature, not ``forward.__code__``: transformers wraps ``forward`` in
        # decorators whose code object takes only ``*args, **kwargs``, which silently dropped
        # the segment ids of every pair.
        parameters = inspect.signature(module.forward).parameters
        self._accepts_token_type_ids = "token_type_ids" in parameters
        # A decoder would otherwise build a key/value cache nobody reads.
        self._accepts_use_cache = "use_cache" in parameters
        pooling = description.pooling if description is not None else None
        self._exclude_prompt = pooling is not None and not pooling.include_prompt
        source = tokenizer.to_str()
        if description is not None and description.do_lower_case:
            source = _lowercased(source)
        self._full = Tokenizer.from_str(source)
        self._full.no_truncation()
        self._full.no_padding()
        self._truncating: dict[str, Tokenizer] = {}
        for side in TRUNCATION_SIDES:
            truncating = Tokenizer.from_str(source)
            truncating.enable_truncation(max_length=max_input_tokens, direction=side)
            truncating.no_padding()
            self._truncating[side] = truncating
        if truncation_side not in TRUNCATION_SIDES:
            truncation_side = "right"
        self._truncation_side = truncation_side
        # Any non-special id works for warm-up: 1000 where the vocabulary has it.
        vocab_size = self._full.get_vocab_size()
        self._filler_id = next(
            i for i in (1000, *range(vocab_size - 1, -1, -1))
            if i < vocab_size and i not in special_ids
        )  # fmt: skip
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
            pooling=pooling.name if pooling is not None else None,
            normalize=description.normalize if description and task == "embed" else None,
            prompts=dict(description.prompts) if description else {},
            default_prompt_name=description.default_prompt_name if description else None,
            activation=activation_name(description.head_activation) if description else None,
            truncation_side=truncation_side,
        )

    def preparer(self) -> TextModel:
        """This model without its weights: all that tokenizing (``prepare``,
        ``prepare_pairs``) needs. It pickles, so another process can tokenize for it."""
        bare = copy.copy(self)
        bare._module = None
        bare._postprocess = None
        bare._device = torch.device("cpu")
        return bare

    def prepare(
        self, inputs: Sequence[str], *, truncate: bool, prompt: str | None = None,
        truncation_direction: str | None = None,
    ) -> list[Item]:  # fmt: skip
        """One item per input; a prompt goes in front of each input's text, as
        sentence-transformers puts it, and its tokens count in the item's cost. Truncation
        cuts the prompted text, as sentence-transformers does: from the end
        ``truncation_direction`` names (default: the tokenizer's side), so ``left`` cuts a
        long input's prompt before its end."""
        texts = [prompt + text for text in inputs] if prompt else list(inputs)
        return self._items(
            texts, truncate=truncate, pairs=False, prompt=prompt, side=truncation_direction
        )

    def prepare_pairs(
        self, query: str, documents: Sequence[str], *, truncate: bool = True,
        prompt: str | None = None, truncation_direction: str | None = None,
    ) -> list[Item]:  # fmt: skip
        """One item per (query, document) pair, encoded as the tokenizer encodes a pair (with
        its separators and segment ids); truncation shortens the longer side first, from the
        end ``truncation_direction`` names. A prompt goes in front of the query."""
        query = prompt + query if prompt else query
        pairs = [(query, document) for document in documents]
        return self._items(
            pairs, truncate=truncate, pairs=True, prompt=None, side=truncation_direction
        )

    def _items(
        self, inputs: list[Any], *, truncate: bool, pairs: bool, prompt: str | None,
        side: str | None = None,
    ) -> list[Item]:  # fmt: skip
        side = side or self._truncation_side
        if side not in TRUNCATION_SIDES:
            raise ValueError(f"truncation_direction must be right or left, got {side!r}")
        tokenizer = self._truncating[side] if truncate else self._full
        limit = self.info.max_input_tokens
        prompt_length = self._prompt_length(prompt) if prompt and self._exclude_prompt else 0
        items = []
        for index, encoding in enumerate(tokenizer.encode_batch_fast(inputs)):
            ids = encoding.ids
            if len(ids) > limit:
                raise InputTooLong(index, len(ids), limit)
            data = Tokens(ids, encoding.type_ids if pairs else None, prompt_length)
            items.append(Item(data=data, cost=len(ids)))
        return items

    def _prompt_length(self, prompt: str) -> int:
        """The prompt's tokens as sentence-transformers counts them: the prompt encoded alone,
        less a trailing special token (an end-of-sequence or separator)."""
        found = self._prompt_lengths.get(prompt)
        if found is None:
            ids = self._truncating[self._truncation_side].encode(prompt).ids
            found = len(ids) - 1 if ids and ids[-1] in self._special_ids else len(ids)
            if len(self._prompt_lengths) < 256:  # literal prompts come from clients
                self._prompt_lengths[prompt] = found
        return found

    def synthetic_items(self, num_items: int, length: int) -> list[Item]:
        """``num_items`` inputs padded to ``length``. NOTE: in a batch of several the last
        is one token shorter, as in a served batch: a batch without padding needs no
        attention mask under sdpa, and would measure a peak smaller than served batches
        of its shape reach (an ``n x L x L`` mask; half the peak at 2 x 4096 tokens)."""
        length = max(2, min(length, self.info.max_input_tokens))
        tokens = Tokens([self._filler_id] * length)
        items = [Item(data=tokens, cost=length) for _ in range(num_items)]
        if num_items > 1:
            items[-1] = Item(data=Tokens([self._filler_id] * (length - 1)), cost=length - 1)
        return items

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
                results = self._postprocess(output, attention_mask, prompt_lengths)
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


def _lowercased(tokenizer_json: str) -> str:
    """The tokenizer with a Lowercase normalizer in front, unless it lowercases already
    (sentence-transformers' ``do_lower_case``)."""
    spec = json.loads(tokenizer_json)
    existing = spec.get("normalizer")
    if _lowercases(existing):
        return tokenizer_json
    if existing is None:
        rest = []
    elif existing.get("type") == "Sequence":
        rest = list(existing.get("normalizers", []))
    else:
        rest = [existing]
    spec["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "Lowercase"}, *rest]}
    return json.dumps(spec)


def _lowercases(spec: Any) -> bool:
    if not isinstance(spec, dict):
        return False
    kind = spec.get("type")
    if kind == "Lowercase" or (kind == "BertNormalizer" and spec.get("lowercase")):
        return True
    return kind == "Sequence" and any(_lowercases(n) for n in spec.get("normalizers", []))


def _num_parameters(module: torch.nn.Module) -> int:
    """Parameters, counting the packed weights of dynamically quantized linear layers."""
    total = sum(p.numel() for p in module.parameters())
    for sub in module.modules():
        packed = getattr(sub, "_packed_params", None)
        if packed is not None and hasattr(packed, "_weight_bias"):
            weight, bias = packed._weight_bias()
            total += weight.numel() + (bias.numel() if bias is not None else 0)
    return total
