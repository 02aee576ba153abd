"""Everything after the forward pass, built once from a model's description.

Embedders run their steps in order (pooling, Dense layers, normalisation, truncation) with
sentence-transformers' own formulas; heads apply their activation. Per request, Matryoshka
``dimensions`` and a classifier's ``top_k`` shape the answer (``models/answers.py``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from safetensors.torch import load_file

from .answers import SparseVector
from .description import Dense, ModelDescription, Normalize, Pooling, Step, Truncate
from .errors import ModelLoadError
from .splade import Splade

Postprocess = Callable[[Any, torch.Tensor, torch.Tensor], list[Any]]
"""(model output, attention mask, prompt lengths to leave out of pooling) -> one per row."""


def exclude_prompt(attention_mask: torch.Tensor, prompt_lengths: torch.Tensor) -> torch.Tensor:
    """The mask without each row's first ``prompt_lengths`` real tokens (after any left
    padding), as sentence-transformers excludes a prompt when ``include_prompt`` is false."""
    pad = attention_mask.to(torch.int32).argmax(dim=1)
    positions = torch.arange(attention_mask.size(1), device=attention_mask.device).unsqueeze(0)
    keep = positions >= (pad + prompt_lengths.to(pad.device)).unsqueeze(1)
    return attention_mask * keep.to(attention_mask.dtype)


def pool(
    hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: Pooling,
    prompt_lengths: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """One float32 vector per row: each mode's, concatenated. Any padding side; every mode
    reads only the rows' real tokens."""
    original = attention_mask
    mask = attention_mask
    if not pooling.include_prompt and prompt_lengths is not None and bool(prompt_lengths.any()):
        mask = exclude_prompt(attention_mask, prompt_lengths)
    vectors = []
    for mode in pooling.modes:
        vectors.append(_pool_one(mode, hidden, mask, original).float())
    return torch.cat(vectors, dim=-1)


def _pool_one(
    mode: str, hidden: torch.Tensor, mask: torch.Tensor, original: torch.Tensor
) -> torch.Tensor:
    batch, length = hidden.shape[:2]
    if mode == "cls":  # the first token pooling sees
        first = mask.to(torch.int32).argmax(dim=1)
        return hidden[torch.arange(batch, device=hidden.device), first]
    if mode == "lasttoken":  # each row's last real token, whatever the padding side
        values, from_end = mask.flip(1).max(dim=1)
        from_end = torch.where(values == 0, length - 1, from_end)
        last = length - 1 - from_end
        rows = hidden[torch.arange(batch, device=hidden.device), last]
        return rows * values.unsqueeze(-1).to(rows.dtype)  # a row with no token reads zeros
    if mode == "max":
        masked = hidden.masked_fill(mask.unsqueeze(-1) == 0, float("-inf"))
        return masked.max(dim=1).values
    if mode in ("mean", "mean_sqrt_len_tokens"):
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        summed = (hidden * weights).sum(dim=1, dtype=torch.float32)
        counts = weights.sum(dim=1, dtype=torch.float32).clamp(min=1e-9)
        return summed / (counts if mode == "mean" else counts.sqrt())
    if mode == "weightedmean":  # weights 1, 2, 3... from the first real token
        pad = original.to(torch.int32).argmax(dim=1)
        positions = torch.arange(1, length + 1, device=hidden.device, dtype=torch.float32)
        weights = mask.unsqueeze(-1).float() * (positions.view(1, -1) - pad.view(-1, 1)).unsqueeze(
            -1
        )
        summed = (hidden.float() * weights).sum(dim=1)
        return summed / weights.sum(dim=1).clamp(min=1e-9)
    raise ValueError(f"unknown pooling mode {mode!r}")


def torch_activation(path: str, what: str) -> torch.nn.Module:
    """An activation named by its ``torch`` class path, as sentence-transformers stores them;
    anything outside ``torch`` would be remote code and is refused."""
    module_name, _, class_name = path.rpartition(".")
    if not module_name.startswith("torch."):
        raise ModelLoadError(
            f"{what} names the activation {path!r}; only torch's own (torch.nn...) are run"
        )
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ModelLoadError(f"{what} names the activation {path!r}, which torch lacks") from exc
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise ModelLoadError(f"{what} names {path!r}, which is not a torch.nn module")
    return cls()


class DenseLayer(torch.nn.Module):
    """sentence-transformers' Dense: ``activation(linear(x))`` (+ the input, or its
    projection, with a residual)."""

    def __init__(self, step: Dense, name: str) -> None:
        super().__init__()
        what = f"model {name!r}: Dense {step.weights.parent.name!r}"
        self.linear = torch.nn.Linear(step.in_features, step.out_features, bias=step.bias)
        self.residual = (
            torch.nn.Linear(step.in_features, step.out_features, bias=False)
            if step.use_residual and step.in_features != step.out_features
            else None
        )
        self.use_residual = step.use_residual
        self.activation = torch_activation(step.activation, what)
        try:
            self.load_state_dict(load_file(step.weights), strict=True)
        except (OSError, RuntimeError, ValueError) as exc:
            raise ModelLoadError(f"{what}: cannot load {step.weights.name}: {exc}") from exc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.activation(self.linear(x))
        if self.use_residual:
            out = out + (x if self.residual is None else self.residual(x))
        return out


def _run_steps(
    steps: Sequence[Step | torch.nn.Module],
    output: Any, attention_mask: torch.Tensor, prompt_lengths: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    x = output.last_hidden_state
    for step in steps:
        if isinstance(step, Pooling):
            x = pool(x, attention_mask, step, prompt_lengths)
        elif isinstance(step, Normalize):
            x = torch.nn.functional.normalize(x, p=2, dim=-1)
        elif isinstance(step, Truncate):
            x = x[..., : step.dimensions]
        else:
            x = step(x)
    return x


def splade_pool(logits: torch.Tensor, attention_mask: torch.Tensor, step: Splade) -> torch.Tensor:
    """sentence-transformers' SpladePooling: ``log1p(relu(logits))`` (``log1p`` twice for
    ``log1p_relu``) over each row's real tokens, then their max or sum: [batch, vocab].

    NOTE: in place, on the logits the model just returned (nothing else reads them): a
    [batch, length, vocab] copy would double the forward pass's largest tensor. Padding is
    zeroed after the activation, which gives the same values as sentence-transformers'
    zeroing before it (relu and log1p keep 0 at 0)."""
    x = logits.relu_().log1p_()
    if step.activation == "log1p_relu":
        x = x.log1p_()
    x = x.mul_(attention_mask.unsqueeze(-1).to(x.dtype))
    pooled = x.amax(dim=1) if step.strategy == "max" else x.sum(dim=1)
    if step.max_active_dims is not None and step.max_active_dims < pooled.size(-1):
        # sentence-transformers' select_max_active_dims: the largest values, the rest zero.
        top = pooled.abs().topk(step.max_active_dims, dim=-1).indices
        pooled = torch.zeros_like(pooled).scatter_(-1, top, pooled.gather(-1, top))
    return pooled.float()


def sparse_vectors(pooled: torch.Tensor) -> list[SparseVector]:
    """Each row's non-zero entries, by ascending index."""
    rows = pooled.cpu().numpy()
    vectors = []
    for row in rows:
        (indices,) = row.nonzero()
        vectors.append(SparseVector(indices.astype("int32"), row[indices].astype("float32")))
    return vectors


def make_postprocess(
    description: ModelDescription, *, name: str, id2label: dict[int, str], device: torch.device
) -> Postprocess:
    """The one postprocess of a model, from its description. Dense layers run in float32 on
    the pooled float32 vectors (they are small; the pooled values are summed in float32 too)."""
    splade = description.splade
    if description.task == "sparse" and splade is not None:

        def sparse(output: Any, attention_mask: torch.Tensor, prompt_lengths: torch.Tensor):
            return sparse_vectors(splade_pool(output.logits, attention_mask, splade))

        return sparse
    if description.task == "embed":
        steps: list[Step | torch.nn.Module] = []
        for step in description.steps:
            if isinstance(step, Dense):
                steps.append(DenseLayer(step, name).eval().to(device))
            else:
                steps.append(step)

        def embed(output: Any, attention_mask: torch.Tensor, prompt_lengths: torch.Tensor):
            vectors = _run_steps(steps, output, attention_mask, prompt_lengths)
            return list(vectors.float().cpu().numpy())

        return embed
    activation = description.head_activation or "identity"
    if description.task == "rerank":
        head = _named_activation(activation, f"model {name!r}")

        def score(output: Any, attention_mask: torch.Tensor, prompt_lengths: torch.Tensor):
            # In float64: a sigmoid's score keeps the logit it came from (raw scores).
            return head(output.logits.double()[:, 0]).tolist()

        return score
    labels = [id2label.get(i, str(i)) for i in range(max(id2label, default=-1) + 1)]
    classify_head = _named_activation(activation, f"model {name!r}")

    def classify(output: Any, attention_mask: torch.Tensor, prompt_lengths: torch.Tensor):
        scores = classify_head(output.logits.float())
        return [_ranked(row, labels) for row in scores.tolist()]

    return classify


def _named_activation(activation: str, what: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if activation == "softmax":
        return lambda logits: torch.softmax(logits, dim=-1)
    if activation == "sigmoid":
        return torch.sigmoid
    if activation == "identity":
        return lambda logits: logits
    return torch_activation(activation, what)


def _ranked(scores: Sequence[float], labels: Sequence[str]) -> list[dict[str, Any]]:
    """Every label with its score, best first (ties in label order)."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return [
        {"label": labels[i] if i < len(labels) else str(i), "score": float(scores[i])}
        for i in order
    ]
