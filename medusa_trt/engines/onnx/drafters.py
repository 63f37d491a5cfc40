"""The drafters' exported forms: what the heads graph and the fused step graph run for each
drafter kind (medusa_trt/drafters/), with the same math as the reference in the forms ONNX Runtime
runs fast. `graph_form` is the one place export.py asks for a drafter's form; a new drafter kind
adds its form to GRAPH_FORMS.

A form is an nn.Module with `rows(hidden [N, d]) -> [N, H, V]` float32 logits (the heads graph) and
`topk(hidden [N, d], k, used) -> [N, used, k]` token ids and log-probs of the first `used` heads (the fused step),
and `shared_lm_head` (engine.json records whether the heads' logits go through the base lm_head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from medusa_trt.drafters.base import Drafter, topk_logp
from medusa_trt.drafters.medusa import MedusaHeads, resblocks
from medusa_trt.fp8 import FP8Linear


def _head_branch(x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
    """One head's rows inside the fused step's If (MedusaGraphHeads._head_rows): ResBlocks from (W,
    b) pairs, then, when the count is odd, float32 logits through the last [W, d] matrix. Its tensors
    are operands, not closure cells: torch.cond traces pure functions."""
    layers = len(params) // 2
    z = resblocks(x, lambda h, layer: F.linear(h, params[2 * layer], params[2 * layer + 1]), range(layers))
    return F.linear(z, params[-1]).float() if len(params) % 2 else z


def _skipped_head(x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
    """The If's other branch: zeros of _head_branch's shape (rows past the tree's depth, never read)."""
    return x.new_zeros(x.shape[0], params[-1].shape[0], dtype=torch.float32) if len(params) % 2 else torch.zeros_like(x)


class MedusaGraphHeads(nn.Module):
    """The exported form of MedusaHeads (Drafter.graph_form): the same math with 2-D MatMuls per
    head, which ONNX Runtime prepacks, and head h > 0 behind an If on the tree's depth in the fused
    step, so a head the tree does not draft with reads none of its weights."""

    def __init__(self, heads: MedusaHeads, lm_head: nn.Module):
        super().__init__()
        self.heads, self.lm_head = heads, lm_head
        h, layers, d = heads.num_heads, heads.num_layers, heads.b.shape[-1]
        pairs = [(k, i) for k in range(h) for i in range(layers)]
        # Per-head 2-D weights, copies of the stacked parameters: torch.cond (the fused step's If per
        # head) rejects operands that share storage. FP8 heads as one FP8Linear per head and layer,
        # aliasing the stacked float8 weights and their scales (their step computes every head).
        self.head_fp8 = None
        if heads.fp8 is not None:
            fp8 = heads.fp8
            self.head_fp8 = nn.ModuleList(FP8Linear(d, d, bias=False) for _ in pairs)
            for lin, (k, i) in zip(self.head_fp8, pairs, strict=True):
                lin.weight = fp8.weight[k, i]
                lin.weights_scaling_factor = fp8.weights_scaling_factor[k, i].reshape(1)
                lin.activation_scaling_factor = fp8.activation_scaling_factor[k, i].reshape(1)
        self.head_w = nn.ParameterList(
            nn.Parameter(heads.w[k, i].clone(), requires_grad=False) for k, i in pairs
        ) if self.head_fp8 is None else None
        self.head_b = nn.ParameterList(nn.Parameter(heads.b[k, i].clone(), requires_grad=False) for k, i in pairs)
        # Heads that use the base lm_head (FasterDecoding v2 heads; the merged checkpoint holds a copy
        # per head) share one MatMul: [heads * rows, d] against one matrix instead of one per head.
        base_lm = getattr(lm_head, "weight", None)  # None: an int4 lm_head
        self.shared_lm_head = h > 0 and (heads.uses_base_lm_head or base_lm is not None and all(
            torch.equal(heads.lm_heads[k], base_lm) for k in range(h)))
        self.head_lm = nn.ParameterList(
            nn.Parameter(heads.lm_heads[k], requires_grad=False) for k in range(h)
        ) if not self.shared_lm_head else None
        # A draft vocabulary: the heads' logits are computed over its V' rows only, one [V', d] matrix
        # when the heads share the lm_head. int4 engines hold it as MatMulNBits.
        self.draft_lm, self.draft_int4 = None, None
        self.draft_matrices = 0  # distinct draft matrices: 1 when the heads share one, else H; 0: none
        if heads.draft_ids is not None and h:
            lm = heads.draft_lm_heads
            shared = all(torch.equal(lm[k], lm[0]) for k in range(h))
            self.draft_matrices = 1 if shared else h
            if heads.draft_int4 is not None:
                self.draft_int4 = heads.draft_int4[:1] if shared else heads.draft_int4
            else:
                self.draft_lm = nn.Parameter(lm[:1] if shared else lm, requires_grad=False)  # [1 or H, V', d]

    def rows(self, x0: torch.Tensor) -> torch.Tensor:
        """Medusa logits [N, H, V] (row-major: the fused step takes its top-k without a transpose) of
        hidden rows x0 [N, d]: ResBlocks per head, logits per head or through the shared lm_head."""
        if self.draft_matrices:
            return self.heads.full_vocab(self._draft_rows(x0))
        return self._rows(x0)

    def topk(self, x0: torch.Tensor, k: int, used: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [N, H, k] of each head's k most likely drafts at hidden rows x0 [N, d], and their
        log-probabilities [N, H, k], of the first `used` heads only when given (H = used)."""
        if not self.draft_matrices:
            return topk_logp(self._rows(x0, used=used), k)
        ids, logp = topk_logp(self._draft_rows(x0, used), k)
        return self.heads.draft_ids[ids], logp

    def _draft_matmul(self, z: torch.Tensor, head: int) -> torch.Tensor:
        """z [..., d] -> head `head`'s draft logits [..., V'] (head 0 when the heads share one matrix)."""
        if self.draft_int4 is not None:
            return self.draft_int4[head](z)
        return F.linear(z, self.draft_lm[head])

    def _draft_rows(self, x0: torch.Tensor, used: int | None = None) -> torch.Tensor:
        """Head logits over the draft vocabulary only, [N, H, V'] (H = `used` when given)."""
        if self.draft_matrices == 1:
            z = self._rows(x0, logits=False, used=used)  # [N, H, d]
            n, heads, d = z.shape
            return self._draft_matmul(z.reshape(n * heads, d), 0).float().reshape(n, heads, -1)
        if self.draft_int4 is None:  # a float matrix per head, computed with its head
            return self._head_rows(x0, list(self.draft_lm), used)
        # An int4 matrix per head: every head computed, then cut.
        z = self._head_rows(x0)
        out = torch.stack([self._draft_matmul(z[:, h], h) for h in range(z.shape[1])], dim=1).float()
        return out if used is None else out.narrow(1, 0, used)

    def _rows(self, x0: torch.Tensor, logits: bool = True, used: int | None = None) -> torch.Tensor:
        """Heads' logits [N, H, V] (hidden [N, H, d] when not `logits`); H = `used` when given."""
        n, d = x0.shape
        if not self.heads.num_heads:  # a model without heads still has the output, with zero heads
            return x0.new_zeros(n, 0, self.heads.vocab_size, dtype=torch.float32)
        if logits and not self.shared_lm_head:  # each head's own [V, d] lm_head, computed with its head
            return self._head_rows(x0, list(self.head_lm), used)
        x = self._head_rows(x0, used=used)
        return self.lm_head(x.reshape(-1, d)).float().reshape(n, x.shape[1], -1) if logits else x

    def _head_rows(self, x0: torch.Tensor, tails: list[torch.Tensor] | None = None,
                   used: int | None = None) -> torch.Tensor:
        """Each head's ResBlock output [N, H, d] for hidden rows x0 [N, d], or with `tails` (a [W, d]
        matrix per head) its float32 logits [N, H, W]. `used` (the fused step's tree depth) keeps the
        first heads only, and head h > 0 then runs behind an If on `used > h`: a tree [[0]] on a
        4-head model reads one head's weights, not four (docs/benchmarks/issue-13-int4.md)."""
        heads, layers = self.heads.num_heads, self.heads.num_layers
        if self.head_fp8 is not None:  # FP8Linear modules cannot be If operands: every head computed, then cut
            x = torch.stack([self._fp8_head_rows(head, x0, tails) for head in range(heads)], dim=1)
            return x if used is None else x.narrow(1, 0, used)
        out = []
        for head in range(heads):
            params = [t for i in range(head * layers, (head + 1) * layers) for t in (self.head_w[i], self.head_b[i])]
            operands = (x0, *params, *([] if tails is None else [tails[head]]))
            gated = used is not None and head > 0  # a tree drafts with head 0 at least
            out.append(torch.cond(used > head, _head_branch, _skipped_head, operands) if gated else _head_branch(*operands))
        x = torch.stack(out, dim=1)
        return x if used is None else x.narrow(1, 0, used)

    def _fp8_head_rows(self, head: int, x: torch.Tensor, tails: list[torch.Tensor] | None) -> torch.Tensor:
        """_head_branch for FP8 heads: an FP8Linear per head and layer."""
        layers = self.heads.num_layers
        z = resblocks(x, lambda h, layer: self.head_fp8[head * layers + layer](h) + self.head_b[head * layers + layer],
                      range(layers))
        return z if tails is None else F.linear(z, tails[head]).float()


GRAPH_FORMS: dict[type[Drafter], type[nn.Module]] = {MedusaHeads: MedusaGraphHeads}


def graph_form(drafter: Drafter, lm_head: nn.Module) -> nn.Module:
    """The exported form of `drafter` (its kind's entry in GRAPH_FORMS), reading the base `lm_head`."""
    form = GRAPH_FORMS.get(type(drafter))
    if form is None:
        raise ValueError(f"drafter {drafter.kind!r} has no ONNX form; expected one of "
                         f"{', '.join(d.kind for d in GRAPH_FORMS)}")
    return form(drafter, lm_head)
