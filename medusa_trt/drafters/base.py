"""The drafter interface (see the package docstring for the seam it is)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn


class Drafter(nn.Module):
    """Proposes the next tree's tokens from what the base model committed.

    Subclasses set `kind` (the checkpoint's `medusa_trt.drafter`) and `num_heads` (how deep a tree
    it drafts), and implement `forward`, the reference math; the engines' exported form of a kind
    is registered next to the exporter (engines/onnx/drafters.py).
    `reads_tokens`: whether drafts depend on the token chosen after each row (Amphista, Hydra,
    EAGLE), not on the hidden state alone (Medusa). `has_cache`: whether the drafter keeps a cache
    over committed rows of its own, appended with every committed row and never rolled back.
    """

    kind: ClassVar[str]
    reads_tokens: ClassVar[bool] = False
    has_cache: ClassVar[bool] = False
    num_heads: int

    def forward(self, hidden: torch.Tensor, next_tokens: torch.Tensor | None, lm_head: nn.Module) -> torch.Tensor:
        """hidden [B, S, d] (the base model's final normed hidden states), next_tokens [B, S] (the
        token chosen after each row; None for a drafter that does not read them), the base model's
        lm_head (drafters may share it) -> float32 logits [H, B, S, V]: head k at row t scores the
        token t + 2 + k."""
        raise NotImplementedError
