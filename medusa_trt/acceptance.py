"""Greedy tree acceptance and next-step candidates, in tensor ops only.

One implementation serves the decoding loop (eager torch) and the ONNX Runtime engine's fused step
graph (engines/onnx_export.py traces these functions), so both accept exactly the same path.
Everything is gathers, compares and reductions with shapes fixed by the inputs: no data-dependent
shapes, no Python branching on values.
"""

from __future__ import annotations

import torch

CANDIDATE_TOPK = 10  # tokens kept per head; the fused step handles trees whose ranks are all below it


def greedy_accept(retrieve: torch.Tensor, tokens: torch.Tensor, argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Longest accepted path per sequence.

    retrieve [N, D+1] root..leaf slots of each path (-1 padded), tokens [B, T] the tree's tokens,
    argmax [B, T] the base model's greedy token after each slot. A path's draft token at depth d is
    accepted when it equals the argmax of the slot before it and every shallower one was accepted.
    Returns (best path [B], accepted draft tokens [B]); ties go to the first path (argmax returns
    the first maximum in torch and in ONNX)."""
    n, depth = retrieve.shape[0], retrieve.shape[1] - 1
    valid = retrieve[:, 1:] >= 0  # [N, D]
    # index_select on flat indices: one Gather each in the exported graph (2-D indexing is several ops)
    cand = tokens.index_select(1, retrieve[:, 1:].clamp(min=0).reshape(-1)).reshape(-1, n, depth)  # [B, N, D]
    prev = argmax.index_select(1, retrieve[:, :-1].clamp(min=0).reshape(-1)).reshape(-1, n, depth)
    miss = ((cand != prev) | ~valid).long()
    accepted = (miss.cumsum(-1) == 0).long().sum(-1)  # leading run of hits: [B, N]
    best = accepted.argmax(-1)
    return best, accepted.gather(1, best[:, None]).squeeze(1)


def candidate_index(head: torch.Tensor, rank: torch.Tensor, k: int = CANDIDATE_TOPK) -> torch.Tensor:
    """Flat index of each non-root slot's token in the heads' top-k laid out [H * k] per sequence."""
    return head * k + rank


def tree_candidates(root: torch.Tensor, medusa: torch.Tensor, index: torch.Tensor, k: int = CANDIDATE_TOPK) -> torch.Tensor:
    """The next tree's tokens [B, 1 + C]: the root (base greedy token [B]) then, for each slot, the
    rank-r token of head h at flat `index` [C] = h * k + r of the heads' top-k (medusa [H, B, V])."""
    return candidates_from_topk(root, medusa.topk(k, dim=-1).indices.permute(1, 0, 2), index)


def candidates_from_topk(root: torch.Tensor, top: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`tree_candidates` from the heads' top-k token ids already taken, top [B, H, k]."""
    return torch.cat([root[:, None], top.reshape(top.shape[0], -1).index_select(1, index)], dim=1)
