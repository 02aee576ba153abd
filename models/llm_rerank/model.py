"""Load and run an LLM reranker: the causal LM's decoder, and of its language-model head only
the rows of the two answer tokens."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig
from transformers.modeling_outputs import SequenceClassifierOutput

from ..base import Item
from ..description import SIGMOID, describe
from ..errors import ModelLoadError
from ..postprocess import make_postprocess
from ..quantization import quantize_int8
from ..spec import ModelSpec
from ..text import TextModel
from .template import QWEN3_RERANKER, RelevanceTemplate, RelevanceTokenizer

log = logging.getLogger(__name__)


class YesNoHead(torch.nn.Module):
    """A causal LM as a one-logit relevance head: at each row's last real token (either
    padding side), the "yes" logit less the "no" one. Its sigmoid is the softmax over
    ("no", "yes") taken at "yes", the model card's score.

    Only the two rows of the language-model head are kept (in float32): the full head would
    compute a vocabulary of logits at every position of every row. A final soft cap (Gemma 2
    and 3) is applied as the causal LM applies it; ``from_causal_lm`` checks the two logits
    against the causal LM's own on a probe, so a head that does more is refused, not guessed."""

    def __init__(
        self, decoder: torch.nn.Module, rows: torch.Tensor, bias: torch.Tensor | None = None,
        *, softcap: float | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.decoder = decoder
        # What the sizer reads (its attention implementation) is the decoder's config.
        self.config = decoder.config
        self.softcap = softcap
        self.register_buffer("rows", rows.detach().float().clone())
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @classmethod
    def from_causal_lm(
        cls, causal: Any, false_id: int, true_id: int, *, probe_ids: Sequence[int], name: str
    ) -> YesNoHead:
        """The decoder and the two rows of ``causal``'s head, checked on ``probe_ids``."""
        head = causal.get_output_embeddings()
        ids = torch.tensor([false_id, true_id], device=head.weight.device)
        bias = getattr(head, "bias", None)
        softcap = getattr(causal.config, "final_logit_softcapping", None)
        module = cls(
            causal.base_model, head.weight[ids], None if bias is None else bias[ids],
            softcap=float(softcap) if softcap else None,
        ).eval()  # fmt: skip
        with torch.inference_mode():
            probe = torch.tensor([list(probe_ids)], device=head.weight.device)
            mask = torch.ones_like(probe)
            expected = causal(input_ids=probe, attention_mask=mask, use_cache=False).logits
            expected = expected[0, -1, ids].float()
            found = module.answer_logits(probe, mask)[0]
        # Loose enough for half precision, where the head is computed in float32 here.
        if not torch.allclose(found, expected, rtol=1e-2, atol=1e-2 * (1 + expected.abs().max())):
            raise ModelLoadError(
                f"model {name!r}: its causal LM's logits are not its head's rows applied to its "
                f"last hidden state ({expected.tolist()} against {found.tolist()} for 'no' and "
                "'yes'), so Batchfit cannot score it as an LLM reranker"
            )
        return module

    def answer_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The ("no", "yes") logits at each row's last real token, in float32."""
        hidden = self.decoder(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).last_hidden_state
        _, from_end = attention_mask.flip(1).max(dim=1)
        last = hidden.size(1) - 1 - from_end
        states = hidden[torch.arange(hidden.size(0), device=hidden.device), last].float()
        logits = states @ self.rows.T
        if self.bias is not None:
            logits = logits + self.bias
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> SequenceClassifierOutput:
        logits = self.answer_logits(input_ids, attention_mask)
        return SequenceClassifierOutput(logits=(logits[:, 1] - logits[:, 0]).unsqueeze(1))


class LLMReranker(TextModel):
    """A ``TextModel`` whose pairs are written into the reranking prompt
    (``RelevanceTokenizer``); batches are padded on the right like every text model's."""

    def __init__(self, *, template: RelevanceTemplate, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._tokenizer = RelevanceTokenizer(  # type: ignore[assignment]
            self._tokenizer, kwargs["tokenizer"], template=template
        )

    def prepare_pairs(  # type: ignore[override]
        self, query: str, documents: Sequence[str], *, truncate: bool = True,
        prompt: str | None = None,
    ) -> list[Item]:  # fmt: skip
        """As ``RelevanceTokenizer.prepare_pairs``. The document's end is cut, as the model
        card cuts it: a request cannot choose the side."""
        return self._tokenizer.prepare_pairs(  # type: ignore[call-arg]
            query, documents, truncate=truncate, prompt=prompt
        )


def load_llm_reranker(
    path: str, config: PretrainedConfig, spec: ModelSpec, *, name: str, dtype: torch.dtype,
    device: torch.device, template: RelevanceTemplate = QWEN3_RERANKER,
) -> LLMReranker:  # fmt: skip
    """The causal LM in the folder ``path`` (``config`` already read) as a reranker."""
    from ..loading import architecture_shape, model_max_tokens

    description = describe(
        Path(path), config, "rerank", name=name, default_prompt_name=spec.default_prompt_name
    )
    # The model card's score, whatever a cross-encoder's configuration would name.
    description = replace(description, head_activation=SIGMOID)
    try:
        causal = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, use_safetensors=True, trust_remote_code=False
        )
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load reranker {spec.model!r}: {exc}") from exc
    if not getattr(tokenizer, "is_fast", False):
        raise ModelLoadError(f"model {spec.model!r} has no fast tokenizer (tokenizer.json)")
    backend = tokenizer.backend_tokenizer
    answer_ids = {token: backend.token_to_id(token)
                  for token in (template.false_token, template.true_token)}  # fmt: skip
    missing = [token for token, token_id in answer_ids.items() if token_id is None]
    if missing:
        raise ModelLoadError(
            f"model {spec.model!r} is read as an LLM reranker, but its vocabulary has no "
            f"{' or '.join(map(repr, missing))} token to score with"
        )
    causal.eval().to(device)
    module: torch.nn.Module = YesNoHead.from_causal_lm(
        causal, answer_ids[template.false_token], answer_ids[template.true_token],
        probe_ids=backend.encode(template.suffix, add_special_tokens=False).ids, name=name,
    )  # fmt: skip
    del causal  # an untied language-model head goes with it
    if spec.quantize == "int8":
        module = quantize_int8(module)
    model_limit = model_max_tokens(config, tokenizer.model_max_length, description.max_seq_length)
    max_input_tokens = min(spec.max_input_tokens or model_limit, model_limit)
    pad_token_id = tokenizer.pad_token_id
    if pad_token_id is None:
        pad_token_id = tokenizer.eos_token_id
    log.info(
        "model %s: LLM reranker, P(%r) against %r at the last token after Qwen3-Reranker's "
        "prompt; default instruction %r",
        name, template.true_token, template.false_token,
        (description.prompts.get(description.default_prompt_name or "")
         or template.default_instruction),
    )  # fmt: skip
    return LLMReranker(
        template=template,
        name=name,
        task="rerank",
        module=module,
        tokenizer=backend,
        pad_token_id=int(pad_token_id or 0),
        max_input_tokens=max_input_tokens,
        postprocess=make_postprocess(description, name=name, id2label={}, device=device),
        output_dim=None,
        shape=architecture_shape(config, module, description),
        device=device,
        quantize=spec.quantize,
        description=description,
        special_ids=frozenset(int(i) for i in tokenizer.all_special_ids),
        truncation_side=str(getattr(tokenizer, "truncation_side", "right") or "right"),
    )
