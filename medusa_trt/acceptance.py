"""Tree acceptance (greedy, typical, sample) and next-step candidates, in tensor ops only.

One implementation serves the decoding loop (eager torch) and the ONNX Runtime engine's fused step
graph (engines/onnx/step.py traces the greedy functions), so both accept exactly the same path.
Everything is gathers, compares and reductions with shapes fixed by the inputs: no data-dependent
shapes, no Python branching on values. The sampling rule and its proof: docs/sampling.md.
"""

from __future__ import annotations

import torch


def greedy_accept(retrieve: torch.Tensor, tokens: torch.Tensor, argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Longest accepted path per sequence.

    retrieve [N, D+1] root..leaf slots of each path (-1 padded), or [B, N, D+1] per sequence (trees
    chosen per step, runtime/dynamic.py), tokens [B, T] the tree's tokens,
    argmax [B, T] the base model's greedy token after each slot. A path's draft token at depth d is
    accepted when it equals the argmax of the slot before it and every shallower one was accepted.
    Returns (best path [B], accepted draft tokens [B]); ties go to the first path (argmax returns
    the first maximum in torch and in ONNX)."""
    valid = retrieve[..., 1:] >= 0  # [N, D] or [B, N, D]
    cand, prev = path_tokens(retrieve, tokens), path_tokens(retrieve, argmax, parents=True)  # [B, N, D]
    miss = ((cand != prev) | ~valid).long()
    accepted = (miss.cumsum(-1) == 0).long().sum(-1)  # leading run of hits: [B, N]
    best = accepted.argmax(-1)
    return best, accepted.gather(1, best[:, None]).squeeze(1)


def path_tokens(retrieve: torch.Tensor, values: torch.Tensor, parents: bool = False) -> torch.Tensor:
    """values [B, T] at each path's slots of depth 1..D ([B, N, D]), or at their parents' slots with
    `parents`, for retrieve [N, D+1] shared by the batch or [B, N, D+1] per sequence; padding (-1)
    reads slot 0. Flat gathers: one Gather each in the exported graph (2-D indexing is several ops)."""
    slots = (retrieve[..., :-1] if parents else retrieve[..., 1:]).clamp(min=0)
    n, depth = slots.shape[-2], slots.shape[-1]
    if slots.dim() == 2:
        return values.index_select(1, slots.reshape(-1)).reshape(-1, n, depth)
    return values.gather(1, slots.reshape(slots.shape[0], -1)).reshape(-1, n, depth)


def path_of(retrieve: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    """Each sequence's best path's slots [B, D+1] (retrieve [N, D+1] or [B, N, D+1], best [B])."""
    if retrieve.dim() == 2:
        return retrieve[best]
    return retrieve.gather(1, best[:, None, None].expand(-1, 1, retrieve.shape[-1]))[:, 0]


def tree_candidates(root: torch.Tensor, medusa: torch.Tensor, index: torch.Tensor, k: int) -> torch.Tensor:
    """The next tree's tokens [B, 1 + C]: the root (base greedy token [B]) then, for each slot, the
    rank-r token of head h at flat `index` [C] = h * k + r of the heads' top-k (medusa [H, B, V];
    k and index from tree.candidate_topk and tree.candidate_index)."""
    return candidates_from_topk(root, medusa.topk(k, dim=-1).indices.permute(1, 0, 2), index)


def candidates_from_topk(root: torch.Tensor, top: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`tree_candidates` from the heads' top-k token ids already taken, top [B, H, k]."""
    return torch.cat([root[:, None], top.reshape(top.shape[0], -1).index_select(1, index)], dim=1)


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature in float32, shifted so that the largest is 0: the same softmax, without
    the overflow to inf (and NaN probabilities) that a small temperature > 0 gives logits / T. As T
    shrinks the softmax tends to the argmax's point mass, and reaches it: the largest logits stay 0
    even where T rounds to 0 in float32 (not 0 / 0), the others go to -inf. A NaN logit makes its
    whole row NaN (the row's max is NaN); the sampler refuses such logits (runtime/steps.py)."""
    x = logits.float()
    x = x - x.amax(-1, keepdim=True)
    return torch.where(x == 0, x, x / temperature)


def typical_posterior(logits: torch.Tensor, temperature: float, epsilon: float, delta: float):
    """p = softmax(logits / T) [..., V] and the acceptance threshold min(epsilon, delta * exp(-H(p)))
    [...] of the Medusa reference's typical acceptance."""
    probs = torch.softmax(tempered(logits, temperature), dim=-1)
    entropy = -(probs * torch.log(probs + 1e-5)).sum(-1)
    return probs, torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))


def typical_accept(retrieve: torch.Tensor, tokens: torch.Tensor, logits: torch.Tensor, temperature: float,
                   epsilon: float, delta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Typical acceptance (Medusa paper): a draft token is accepted when its probability under the
    tempered distribution of the slot before it exceeds the entropy-dependent threshold. Not exact:
    the output does not follow the base model's sampling distribution (use `sample_accept`).

    retrieve [N, D+1] or [B, N, D+1] (per sequence), tokens [B, T], logits [B, T, V]. Returns (best
    path [B], accepted [B]): the longest accepted run, ties to the larger sum of log-probabilities."""
    valid = retrieve[..., 1:] >= 0
    cand = path_tokens(retrieve, tokens)  # [B, N, D] candidate at each depth
    prev = retrieve[..., :-1].clamp(min=0).expand(cand.shape)  # [B, N, D] slot whose logits judge it
    # Posterior per slot, then one flat gather of p(candidate | previous slot): [B, N, D].
    probs, threshold = typical_posterior(logits, temperature, epsilon, delta)
    v = probs.shape[-1]
    p = probs.flatten(1).gather(1, (prev * v + cand).flatten(1)).view(cand.shape)
    ok, logp = p > threshold.gather(1, prev.flatten(1)).view(cand.shape), torch.log(p + 1e-10)
    keep = (ok & valid).long().cumprod(-1)
    accepted = keep.sum(-1)
    score = (logp * keep).sum(-1).masked_fill(accepted < accepted.max(-1, keepdim=True).values, -torch.inf)
    return score.argmax(-1), accepted.max(-1).values


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int | None = None,
                   top_p: float = 1.0) -> torch.Tensor:
    """The distribution sampling draws from [..., V]: softmax(logits / temperature) restricted to the
    top_k most likely tokens (ties at the k-th value kept), then to the nucleus, renormalized. Same
    order and rules as transformers' TopK/TopP warpers, ties included: the nucleus drops, from the
    least likely token up (equal logits in token order), every token whose running mass is at most
    1 - top_p, and never the most likely one."""
    x = tempered(logits, temperature)
    if top_k is not None and top_k < x.shape[-1]:
        x = x.masked_fill(x < x.topk(top_k, dim=-1).values[..., -1:], -torch.inf)
    if top_p < 1.0:
        ranked, order = x.sort(dim=-1, stable=True)
        drop = torch.softmax(ranked, dim=-1).cumsum(-1) <= 1 - top_p
        drop[..., -1] = False
        x = x.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), -torch.inf)
    return torch.softmax(x, dim=-1)


def sample_tokens(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws: the token whose CDF interval holds u (probs [..., V], uniforms [...] in
    (0, 1]). Explicit uniforms instead of torch.multinomial, so a seed gives the same tokens on every
    backend and batch size. u > 0 never lands on a zero-probability token."""
    cdf = probs.cumsum(-1)  # non-decreasing in floating point too (non-negative addends)
    return (cdf < (uniforms * cdf[..., -1])[..., None]).sum(-1).clamp(max=probs.shape[-1] - 1)


def sample_accept(retrieve: torch.Tensor, tokens: torch.Tensor, probs: torch.Tensor,
                  uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless sampling over the tree (docs/sampling.md).

    At every slot one token is drawn from the target distribution of that slot (probs [B, T, V],
    from `sampling_probs`; uniforms [B, T]). The walk starts at the root, moves to the child whose
    token equals the draw at the current node (siblings are distinct tokens, so at most one does)
    and stops at a node where no child matches: its draw is the next token (the bonus). Per node this
    is the recursive rejection rule with point-mass proposals (try child x_i with probability
    p_i(x_i), on rejection zero it and renormalize, finally sample the residual), whose output law is
    exactly p, and which accepts with probability p(children), the most any exact rule can for a
    deterministic candidate set. Draws are independent across slots, so each emitted token follows
    the target given the tokens before it.

    Returns (best path [B], accepted draft tokens [B], draws [B, T]); the next root is the draw at
    the last accepted slot."""
    drawn = sample_tokens(probs, uniforms)
    best, accepted = greedy_accept(retrieve, tokens, drawn)
    return best, accepted, drawn
