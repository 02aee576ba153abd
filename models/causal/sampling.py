"""Picking each sequence's next token from its logits: greedy, or temperature, top-k and
top-p sampling with a generator of the sequence's own; and log probabilities.

Gemma's vocabulary has 262,144 words: a full sort per sampled row costs milliseconds, so
top-p looks first among the likeliest ``NUCLEUS_GUESS`` words and sorts everything only
where they do not reach ``top_p``.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence

import torch

from ..generative import SampledToken, SamplingParams

NUCLEUS_GUESS = 1024
ARGMAX_BLOCK = 4096
"""Greedy rows are searched a block of this many words at a time: torch's ``argmax`` along a
row runs on one element at a time (3.9 ms for 16 rows of Gemma's vocabulary here), while
the maximum of each block is a vectorised reduction (0.3 ms)."""


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._generators: dict[int, torch.Generator] = {}

    def forget(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self._generators.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._generators)

    def sample(
        self, logits: torch.Tensor, seq_ids: Sequence[int], params: Sequence[SamplingParams]
    ) -> list[SampledToken]:
        """One token per row of ``logits`` (``[rows, vocab]``, float), for ``seq_ids``."""
        logits = logits.float()
        chosen: list[int] = [0] * len(seq_ids)
        greedy = [row for row, p in enumerate(params) if p.greedy]
        if greedy:
            picked = first_argmax(logits if len(greedy) == len(params) else logits[greedy])
            for row, token in zip(greedy, picked, strict=True):
                chosen[row] = token
        for row, p in enumerate(params):
            if not p.greedy:
                chosen[row] = self._draw(logits[row], seq_ids[row], p)
        tokens = []
        for row, (seq_id, p) in enumerate(zip(seq_ids, params, strict=True)):
            if p.num_logprobs is None:
                tokens.append(SampledToken(seq_id, chosen[row]))
                continue
            logprobs = torch.log_softmax(logits[row], dim=-1)
            top: tuple[tuple[int, float], ...] = ()
            if p.num_logprobs:
                values, indices = logprobs.topk(p.num_logprobs)
                top = tuple(zip(indices.tolist(), values.tolist(), strict=True))
            tokens.append(SampledToken(seq_id, chosen[row], float(logprobs[chosen[row]]), top))
        return tokens

    def _generator(self, seq_id: int, seed: int | None) -> torch.Generator:
        generator = self._generators.get(seq_id)
        if generator is None:
            generator = torch.Generator(device=self._device)
            generator.manual_seed(seed if seed is not None else secrets.randbits(63))
            self._generators[seq_id] = generator
        return generator

    def _draw(self, row: torch.Tensor, seq_id: int, p: SamplingParams) -> int:
        generator = self._generator(seq_id, p.seed)
        scaled = row / p.temperature
        if p.top_k > 0:
            values, indices = scaled.topk(min(p.top_k, scaled.shape[-1]))
            probs = torch.softmax(values, dim=-1)
        else:
            probs = torch.softmax(scaled, dim=-1)
            indices = None
            if p.top_p < 1.0:
                probs, indices = probs.topk(min(NUCLEUS_GUESS, probs.shape[-1]))
                if float(probs.sum()) < p.top_p:
                    probs, indices = torch.softmax(scaled, dim=-1).sort(descending=True)
        if p.top_p < 1.0:
            # Keep the likeliest words until their mass reaches top_p (the one that crosses it
            # included), as transformers' TopPLogitsWarper keeps them.
            mass = probs.cumsum(dim=-1)
            keep = int((mass < p.top_p).sum()) + 1
            probs = probs[:keep]
            indices = indices[:keep] if indices is not None else None
        pick = int(torch.multinomial(probs, 1, generator=generator))
        return int(indices[pick]) if indices is not None else pick


def first_argmax(logits: torch.Tensor) -> list[int]:
    """Each row's first index of its largest value, as ``argmax`` gives it (``[rows,
    vocab]``): the maximum of every block of ``ARGMAX_BLOCK`` words, the first block that
    holds the row's maximum, then ``argmax`` inside that block. Comparisons only, so the
    index is ``argmax``'s exactly."""
    rows, width = logits.shape
    if width < 4 * ARGMAX_BLOCK or logits.stride(-1) != 1:
        return logits.argmax(dim=-1).tolist()
    whole = width // ARGMAX_BLOCK
    blocks = logits.as_strided((rows, whole, ARGMAX_BLOCK), (logits.stride(0), ARGMAX_BLOCK, 1))
    maxima = blocks.amax(dim=-1)
    if width > whole * ARGMAX_BLOCK:  # the words past the last whole block, as one more
        maxima = torch.cat([maxima, logits[:, whole * ARGMAX_BLOCK :].amax(-1, keepdim=True)], 1)
    if bool(maxima.isnan().any()):
        return logits.argmax(dim=-1).tolist()  # NaN is argmax's maximum, not amax's
    holding = (maxima == maxima.amax(dim=-1, keepdim=True)).to(torch.uint8).argmax(dim=-1)
    picked = []
    for row, block in enumerate(holding.tolist()):
        first = block * ARGMAX_BLOCK
        picked.append(first + int(logits[row, first : first + ARGMAX_BLOCK].argmax()))
    return picked
