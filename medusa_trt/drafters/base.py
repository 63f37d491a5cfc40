"""The drafter interface (see the package docstring for the seam it is)."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn


class Drafter(nn.Module):
    """Proposes the next tree's tokens from what the base model committed.

    Subclasses set `kind` (the checkpoint's `medusa_trt.drafter`) and `num_heads` (how deep a tree
    it drafts), and implement `forward`, the reference math; the engines' exported form of a kind
    is registered next to the exporter (engines/onnx/drafters.py: GRAPH_FORMS; a drafter with a cache
    of its own: export.py's _DrafterModule).
    `reads_tokens`: whether drafts depend on the token chosen after each row (Amphista, Hydra,
    EAGLE), not on the hidden state alone (Medusa). `has_cache`: whether the drafter keeps a cache
    over committed rows of its own, appended with every committed row and never rolled back.
    """

    kind: ClassVar[str]
    reads_tokens: ClassVar[bool] = False
    has_cache: ClassVar[bool] = False
    num_heads: int
    # What an int4 build records of a drafter (medusa_trt.quant sets it on Medusa heads): whether it
    # reads the base lm_head module. Every drafter also has the instance attributes `draft_int4` (int4
    # draft matrices of its own) and `fp8` (FP8 forms of its weights), None when it has none: set in
    # __init__, as a module assigned later must not be shadowed by a class attribute.
    uses_base_lm_head = False

    def forward(self, hidden: torch.Tensor, next_tokens: torch.Tensor | None, lm_head: nn.Module,
                embed: nn.Module | None = None) -> torch.Tensor:
        """hidden [B, S, d] (the base model's final normed hidden states of whole sequences, rows
        0..S-1), next_tokens [B, S] (the token chosen after each row; None for a drafter that does
        not read them), the base model's lm_head and input embedding (drafters may share them) ->
        float32 logits [H, B, S, V]: head k at row t scores the token t + 2 + k."""
        raise NotImplementedError

    def append(self, hidden: torch.Tensor, next_tokens: torch.Tensor, lm_head: nn.Module, embed: nn.Module,
               past: tuple[torch.Tensor, ...] | None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """A drafter with a cache (`has_cache`), one sequence: appends its newly committed rows
        (hidden [1, c, d], the tokens after them [1, c]) to `past` (None: empty) and returns the
        drafts at the last row, logits [H, V], with the grown cache."""
        raise NotImplementedError(f"{type(self).__name__} keeps no cache")

    def quantize_weights(self, make: QuantizedLinear) -> list[str]:
        """Swaps the drafter's own matrices for the quantized modules `make` gives (medusa-build
        --weights int4 or int8; medusa_trt.quant calls it), in place; returns the names `make` left
        float (it returns None for a matrix whose input size is not a multiple of its block). The default
        keeps every weight float."""
        return []


# (Linear) -> its quantized module computing the same product, or None where it cannot (quant.py).
QuantizedLinear = Callable[[nn.Linear], "nn.Module | None"]


def linear_of(w: torch.Tensor) -> nn.Linear:
    """A bias-free Linear holding the matrix w [out, in] (a drafter's stacked weights, one slice at a
    time, handed to a QuantizedLinear)."""
    linear = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device)
    linear.weight.data = w.detach().float()
    return linear


# Head logit of a token outside the draft vocabulary: far below any real logit (they stay within
# +-100), and small enough that statistics over whole logit tensors (medusa-check's comparator
# squares them) do not overflow float32.
OUTSIDE_DRAFT_LOGIT = -1e4


def scatter_full_vocab(sub: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits over a draft vocabulary [..., V'] (token ids `ids`) -> [..., V], OUTSIDE_DRAFT_LOGIT
    elsewhere (top-k then never picks a token outside it)."""
    out = torch.full((*sub.shape[:-1], vocab_size), OUTSIDE_DRAFT_LOGIT, dtype=sub.dtype, device=sub.device)
    return out.scatter(-1, ids.expand(*sub.shape[:-1], -1), sub)


def topk_logp(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely token indices [..., k] of logits [..., V] and their log-probabilities (a tree
    chosen per step ranks paths by them; runtime/dynamic.py). Over a draft vocabulary the
    normalizer is the draft vocabulary's, as the drafter was trained."""
    logits = logits.float()
    top = logits.topk(k, dim=-1)
    return top.indices, top.values - logits.logsumexp(-1, keepdim=True)
