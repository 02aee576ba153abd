"""A causal LM behind the generation contract: one forward pass per step over every
sequence's new tokens, packed into one row, then the sampler on the rows that sample."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..base import ModelInfo
from ..chat import PromptTokenizer
from ..errors import translate_error
from ..generative import GenerationDefaults, SamplingParams, StepRequest, StepResult
from .attention import IMPLEMENTATION
from .head import head_rows, padded_rows, padding_threshold
from .kv import KVStore, SeqBuffers, StepCache
from .sampling import Sampler


class CausalLM:
    """``step`` runs on the model thread only (as every forward pass does)."""

    def __init__(
        self,
        *,
        module: torch.nn.Module,
        info: ModelInfo,
        prompts: PromptTokenizer,
        device: torch.device,
    ) -> None:
        self._module = module
        self.info = info
        self.defaults: GenerationDefaults = prompts.defaults
        self._prompts = prompts
        self._device = device
        config = module.config
        module.set_attn_implementation(IMPLEMENTATION)
        # NOTE: models whose forward takes no ``logits_to_keep`` run the LM head on every
        # row of the step and the rows that sample are picked after it.
        self._keeps_logits = bool(getattr(module, "_supports_logits_to_keep", lambda: False)())
        shape = info.shape
        self.store = KVStore(
            num_layers=int(config.num_hidden_layers),
            num_kv_heads=shape.num_kv_heads or shape.num_heads,
            head_dim=shape.head_dim or shape.hidden_size // shape.num_heads,
            dtype=next(module.parameters()).dtype,
            device=device,
            windows=layer_windows(module, int(config.num_hidden_layers)),
        )
        self.cache_bytes_per_token = self.store.bytes_per_token
        self.cache_window_bytes_per_token = self.store.window_bytes_per_token
        self.cache_window_tokens = self.store.window_tokens
        self._sampler = Sampler(device)
        self._vocab_size = int(config.vocab_size)
        # The LM head's row of logits for each sampled row (a second where the model caps
        # them, Gemma 2's tanh, as a new tensor), and a float copy where it computes in
        # another type.
        element = info.shape.element_bytes
        capped = 2 if getattr(config, "final_logit_softcapping", None) else 1
        self._row_bytes = self._vocab_size * (element * capped + (4 if element != 4 else 0))
        head = module.get_output_embeddings() if self._keeps_logits else None
        self._pad_from = padding_threshold(head, device)

    def preparer(self) -> PromptTokenizer:
        return self._prompts

    def free(self, seq_ids: Sequence[int], *, forget: bool = False) -> int:
        self.store.free(seq_ids)
        if forget:
            self._sampler.forget(seq_ids)
        return self.store.bytes_held

    def step_bytes(self, num_tokens: int, attended: int, num_sampled: int) -> int:
        """Activations of one step: the widest per-token tensors (hidden states, the
        feed-forward's intermediate ones, queries, keys and values, and the keys and values
        stacked to be written) for every token, every head's scores for every query-key pair,
        the logits of the rows the LM head computes (those that sample, padded), and the
        working rows of the one row the sampler is on (a softmax, a sort's values and
        indices: three rows of float32)."""
        shape = self.info.shape
        element = shape.element_bytes
        heads = shape.num_heads + (shape.num_kv_heads or shape.num_heads)
        per_token = element * (
            4 * shape.hidden_size
            + (3 if shape.gated_mlp else 2) * shape.intermediate_size
            + 2 * heads * (shape.head_dim or 0)
        )
        scores = 4 * shape.num_heads * attended
        head = head_rows(num_sampled, self._pad_from)
        logits = self._row_bytes * head + (3 * 4 * self._vocab_size if num_sampled else 0)
        return num_tokens * per_token + scores + logits

    def step(self, request: StepRequest) -> StepResult:
        error: BaseException | None = None
        try:
            with torch.inference_mode():
                if request.free or request.forget:
                    self.store.free(request.free)
                    self._sampler.forget(request.forget)
                tokens = self._step(request) if request.chunks else []
        except Exception as exc:
            error = translate_error(exc)
            if error is exc:
                raise
        if error is not None:
            # NOTE: raised outside the except block so that no traceback (and none of the
            # frames holding the failed step's tensors) stays reachable from our error.
            raise error
        store = self.store
        return StepResult(tokens, store.bytes_held, store.slack_bytes(), store.growth_bytes())

    def _step(self, request: StepRequest) -> list:
        ids: list[int] = []
        positions: list[int] = []
        spans: list[tuple[int, int]] = []
        starts: list[int] = []
        seqs: list[SeqBuffers] = []
        rows: list[int] = []
        seq_ids: list[int] = []
        params: list[SamplingParams] = []
        for chunk in request.chunks:
            first = len(ids)
            count = len(chunk.token_ids)
            ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start, chunk.start + count))
            spans.append((first, first + count))
            starts.append(chunk.start)
            seqs.append(self.store.reserve(chunk.seq_id, chunk.start + count, keep=chunk.start,
                                           expect=chunk.prefill_to))  # fmt: skip
            if chunk.sampling is not None:
                rows.append(first + count - 1)
                seq_ids.append(chunk.seq_id)
                params.append(chunk.sampling)
        device = self._device
        cache = StepCache(spans, starts, seqs, self.store)
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        position_ids = torch.tensor([positions], dtype=torch.long, device=device)
        if self._keeps_logits:
            keep = torch.tensor(padded_rows(rows, self._pad_from), dtype=torch.long, device=device)
            logits = self._module(
                input_ids=input_ids, position_ids=position_ids, cache=cache, use_cache=True,
                logits_to_keep=keep,
            ).logits[0, : len(rows)]  # fmt: skip
        else:
            keep = torch.tensor(rows, dtype=torch.long, device=device)
            logits = self._module(
                input_ids=input_ids, position_ids=position_ids, cache=cache, use_cache=True
            ).logits[0, keep]
        if not rows:
            return []
        return self._sampler.sample(logits, seq_ids, params)


def layer_windows(module: torch.nn.Module, num_layers: int) -> list[int | None]:
    """Each decoder layer's sliding window, as its attention module holds it (what the
    attention function reads); None for full attention."""
    windows: list[int | None] = [None] * num_layers
    for sub in module.modules():
        index = getattr(sub, "layer_idx", None)
        window = getattr(sub, "sliding_window", None)
        attention = hasattr(sub, "k_proj") and isinstance(index, int) and 0 <= index < num_layers
        if attention and isinstance(window, int) and window > 0:
            windows[index] = window
    return windows
