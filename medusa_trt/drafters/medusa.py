"""Medusa heads as a drafter: H heads of L ResBlocks (x <- x + silu(W x + b)) and an lm_head each;
head k reads the final normed hidden state at t and predicts token t + 2 + k.

The ResBlock math is here once: the reference (`MedusaHeads.forward`), the exported graphs
(engines/onnx/drafters.py), head training and FP8 calibration all run `resblocks`, each with the
linear form it needs (all heads stacked in one batched matmul in the reference and in training, 2-D
matrices per head in the export, whose constant 2-D weights ONNX Runtime prepacks). Quantized forms
are medusa_trt.fp8's and medusa_trt.quant's: they fill `MedusaHeads.fp8` (FP8 ResBlock weights) and
`draft_int4` (int4 draft-vocabulary matrices); the heads only call them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from medusa_trt.config import ModelConfig
from medusa_trt.drafters.base import Drafter, QuantizedLinear, linear_of, scatter_full_vocab

HeadLinear = Callable[[torch.Tensor, int], torch.Tensor]  # (x, layer) -> W_layer x + b_layer


def resblocks(x: torch.Tensor, linear: HeadLinear, layers: Iterable[int]) -> torch.Tensor:
    """x after the Medusa ResBlocks `layers` (in order): x <- x + silu(linear(x, layer)).

    `linear(x, layer)` is the layer's W x + b in whatever layout the caller holds x in: every head
    at once (`stacked_linear`, x [H, ..., d]) or one head's 2-D weights (x [..., d])."""
    for layer in layers:
        x = x + F.silu(linear(x, layer))
    return x


class StackedWeights(Protocol):
    """Every head's ResBlock weights held in another form than a float tensor (fp8.FP8HeadLinears)."""

    def layer(self, x: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [H, ..., d] -> (the input the layer's matmul reads, its weights [H, d, d] in x's dtype)."""
        ...


def stacked_linear(w: torch.Tensor | None, b: torch.Tensor, weights: StackedWeights | None = None) -> HeadLinear:
    """The ResBlock linear of every head as one batched matmul: x [H, ..., d] -> W_h x_h + b_h, from
    weights w [H, L, d, d] (out, in) and biases b [H, L, d], or from `weights` (w None), which give
    each layer's matmul input and weights (FP8: the input quantized-dequantized, as an FP8 GEMM's is)."""

    def linear(x: torch.Tensor, layer: int) -> torch.Tensor:
        xin, wl = (x, w[:, layer]) if weights is None else weights.layer(x, layer)  # wl [H, d, d]
        bias = b[:, layer].reshape(b.shape[0], *(1,) * (x.dim() - 2), b.shape[-1])  # [H, 1.., d]
        return torch.einsum("h...i,hoi->h...o", xin, wl) + bias

    return linear


class MedusaHeads(Drafter):
    """FasterDecoding's Medusa heads (v1: an lm_head per head; v2: the base lm_head, stored as a copy
    per head in the merged checkpoint), optionally over a draft vocabulary (docs/formats.md section 1)."""

    kind = "medusa"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, h, layers, v = cfg.hidden_size, cfg.num_medusa_heads, cfg.num_medusa_layers, cfg.vocab_size
        self.num_heads, self.num_layers, self.vocab_size = h, layers, v
        # Heads stacked so all of them run as one batched matmul per ResBlock layer.
        self.w = nn.Parameter(torch.zeros(h, layers, d, d))  # [H, L, out, in]
        self.b = nn.Parameter(torch.zeros(h, layers, d))
        self.lm_heads = nn.Parameter(torch.zeros(h, v, d))  # [H, V, d]
        # The draft vocabulary [V'] and each head's lm_head rows for it [H, V', d] (set_draft_vocab).
        self.register_buffer("draft_ids", None, persistent=False)
        self.register_buffer("draft_lm_heads", None, persistent=False)
        # Slots medusa_trt.fp8 and medusa_trt.quant fill when they swap quantized forms in (instance
        # attributes: nn.Module keeps an assigned module in _modules, which a class attribute would
        # shadow). fp8: every head's ResBlock weights in another form (StackedWeights; w is then
        # None). draft_int4: a module per head giving its draft-vocabulary logits, in place of the
        # draft_lm_heads product.
        self.fp8: nn.Module | None = None
        self.draft_int4: nn.ModuleList | None = None

    # v2 heads (their lm_head a copy of the base one) read the base lm_head module, whatever form
    # quant gave it (quant.quantize_model_int4 sets this).
    uses_base_lm_head = False

    def set_draft_vocab(self, ids: list[int] | tuple[int, ...], base_lm_head: torch.Tensor | None = None) -> None:
        """Heads that compute their logits over the token ids `ids` alone (config draft_vocab)."""
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.lm_heads.device)
        self.register_buffer("draft_ids", ids_t, persistent=False)
        self.register_buffer("draft_lm_heads", self.lm_heads.detach()[:, ids_t].clone(), persistent=False)

    def quantize_weights(self, make: QuantizedLinear) -> list[str]:
        """The draft-vocabulary matrices, one quantized module per head: they are the heads' largest
        float32 read per step ([V', d] a head; docs/benchmarks/issue-13-int4.md). The ResBlocks stay
        float (a [d, d] matrix per head and layer)."""
        if self.draft_lm_heads is None or not self.num_heads:
            return []
        heads = [make(linear_of(w)) for w in self.draft_lm_heads]
        if any(m is None for m in heads):
            return ["draft_lm_head"]
        self.draft_int4 = nn.ModuleList(heads)
        return []

    def forward(self, hidden: torch.Tensor, next_tokens: torch.Tensor | None, lm_head: nn.Module,
                embed: nn.Module | None = None) -> torch.Tensor:
        x = hidden.unsqueeze(0).expand(self.num_heads, *hidden.shape)  # [H, B, S, d]
        x = resblocks(x, stacked_linear(self.w, self.b, self.fp8), range(self.num_layers))
        if self.draft_int4 is not None:
            return self.full_vocab(torch.stack([m(x[h]) for h, m in enumerate(self.draft_int4)]).float())
        if self.draft_ids is not None:
            return self.full_vocab(torch.einsum("hbsi,hvi->hbsv", x, self.draft_lm_heads).float())
        if self.uses_base_lm_head:
            return lm_head(x).float()
        return torch.einsum("hbsi,hvi->hbsv", x, self.lm_heads).float()

    def full_vocab(self, sub: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary [..., V'] -> [..., V], OUTSIDE_DRAFT_LOGIT elsewhere
        (top-k then never picks a token outside it)."""
        return scatter_full_vocab(sub, self.draft_ids, self.vocab_size)
