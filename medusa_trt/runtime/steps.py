"""The steps a decode runs (runtime/decoding.py's loop calls them through a StepPlan): the prefills,
and the plain, two-call and fused steps, for static trees and for trees chosen per step.

step_plan is the one place that picks them for a backend and a config. Every step verifies a tree
(one forward over its slots with the tree mask), accepts (greedy, typical or sample), commits the
accepted slots' KV and hands the drafter the committed rows; a fused step does all of it, and the
next tree's drafting, in one backend call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from medusa_trt.acceptance import (
    greedy_accept,
    sample_accept,
    sample_tokens,
    sampling_probs,
    tree_candidates,
    typical_accept,
)
from medusa_trt.runtime.backend import Backend
from medusa_trt.runtime.config import GenerationConfig
from medusa_trt.runtime.dynamic import BatchTree, Context, DynamicTree, drafts_topk, step_trees
from medusa_trt.tree import StepTree


def _greedy(cfg: GenerationConfig) -> bool:
    return cfg.acceptance == "greedy" or (cfg.acceptance == "typical" and cfg.temperature == 0)


class Sampler:
    """Per-sequence random streams and the target distribution of `sample` acceptance. Each
    sequence owns a torch.Generator and draws one uniform per slot of its own tree a step, so its
    tokens depend on its seed and its trees, not on the backend, and, as a sampled sequence's trees
    are its own (step_trees' own_width), not on the batch or its row either (docs/sampling.md), save
    where an engine's key block cuts every row's tree to the batch's tightest room (within_block)."""

    def __init__(self, cfg: GenerationConfig, seeds: list[int]):
        self.cfg = cfg
        self.generators = [torch.Generator().manual_seed(s) for s in seeds]

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        # One NaN logit makes its row's distribution NaN, from which every draw would be token 0: a
        # model that computes NaN is said, not sampled from.
        if torch.isnan(logits).any():
            raise ValueError("the model's logits hold NaN, which sampling cannot draw from; the engine or "
                             "checkpoint computes NaN (medusa-check compares it with its reference)")
        return sampling_probs(logits, self.cfg.temperature, self.cfg.top_k, self.cfg.top_p)

    def uniforms(self, count: int, own: list[int] | None = None) -> torch.Tensor:
        """[B, count] in (0, 1]: 1 - U[0, 1) so a draw never lands on a zero-probability token.
        `own`: sequence b draws own[b] of them (its tree's slots; the rest are inert pads, 1)."""
        own = own or [count] * len(self.generators)
        return 1.0 - torch.stack([torch.cat([torch.rand(n, generator=g), torch.zeros(count - n)])
                                  for g, n in zip(self.generators, own, strict=True)])

    def draw(self, logits: torch.Tensor) -> torch.Tensor:
        """One token per sequence from logits [B, V]."""
        return sample_tokens(self.probs(logits), self.uniforms(1)[:, 0])

    def keep(self, rows: torch.Tensor) -> None:
        self.generators = [self.generators[i] for i in rows.tolist()]


@dataclass
class Carry:
    """What one step hands the next, a row per active sequence: the next root token [B] and the
    drafter's logits there [H, B, V] (two-call and plain steps), or the next tree's tokens [B, T]
    (fused steps, whose root is the next token); per-step trees: the root and the drafter's top-k
    ids and log-probs ([B, H, k] each; fused), and the context candidates' state."""

    root: torch.Tensor | None = None
    medusa: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    top: tuple[torch.Tensor, torch.Tensor] | None = None
    context: Context | None = None
    slots: int | None = None  # the slots the step just verified, where the tree was chosen per step
    # each sequence's own slots, where its tree is its own and padded inert to the widest (the pads
    # are never verified, so the statistics do not count them)
    row_slots: list[int] | None = None

    def slots_of(self, row: int) -> int | None:
        """The slots this step verified for the sequence in `row` (None: the step's static tree)."""
        return self.row_slots[row] if self.row_slots is not None else self.slots

    def keep(self, rows: torch.Tensor) -> Carry:
        """The carry of the sequences in `rows`. `slots`/`row_slots` are dropped: they describe the
        step just verified, and the statistics read them before the finished rows are let go."""
        return Carry(None if self.root is None else self.root[rows],
                     None if self.medusa is None else self.medusa[:, rows],
                     None if self.tokens is None else self.tokens[rows],
                     None if self.top is None else (self.top[0][rows], self.top[1][rows]),
                     None if self.context is None else self.context.keep(rows.tolist()))


@dataclass(frozen=True)
class StepPlan:
    """The step a decode runs, chosen once per request by step_plan, as plain callables over the
    backend. The loop runs prefill(prompts, sampler) -> Carry, then step(this step's tree, carry,
    sampler) -> (emitted tokens per sequence, accepted draft tokens [B] or None, carry). `compute`
    (tokens [B, T], positions [B, T], tree) is a step's backend work alone, the call the step
    makes before acceptance and commit: what tools/tree_measure times."""

    kind: str  # "fused" (verify, accept and draft in one backend call), "two_call" (forward, then draft) or "plain"
    prefill: Callable[..., Carry]
    step: Callable[..., tuple[list[list[int]], torch.Tensor | None, Carry]]
    compute: Callable[..., object]


def step_plan(backend: Backend, cfg: GenerationConfig, tree: StepTree | DynamicTree | None) -> StepPlan:
    """The one place that decides which step a decode of `tree` (None: plain decoding) runs on
    `backend`: the decoding loop, medusa-tune-tree's step timings and medusa-bench's timer all go
    through it. A backend with a fused greedy step verifies, accepts and drafts the next tree in
    one call; its graph has argmax acceptance and the top-k of its own `fused_step_topk` built in,
    so `sample` and typical acceptance, and trees that need another top-k, take the two-call path."""
    if isinstance(tree, DynamicTree):
        return _dynamic_plan(backend, cfg, tree)
    if tree is None:
        return StepPlan("plain", functools.partial(_prefill, backend, heads=False), functools.partial(_plain_step, backend),
                        functools.partial(_plain_compute, backend))
    if _greedy(cfg) and backend.fused_step_topk == tree.topk:
        # A drafter with its own cache reads every prompt row: the two-call prefill, then fused steps.
        prefill = _cached_fused_prefill if backend.info.drafter_cache else _fused_prefill
        return StepPlan("fused", functools.partial(prefill, backend, tree),
                        functools.partial(_fused_tree_step, backend), functools.partial(_fused_compute, backend))
    return StepPlan("two_call", functools.partial(_prefill, backend, heads=True),
                    functools.partial(_two_call_step, backend, cfg), functools.partial(_tree_compute, backend))


def _pad_prompts(prompts: list[list[int]]) -> tuple[torch.Tensor, ...]:
    """Prompts in one left-padded [B, S] batch: ids, positions, mask [B, S, S] (causal over the
    prompt's own tokens; a padding slot also sees itself, since a row without keys would be NaN),
    the slots to commit [B, S] (the first `lens` of each row are the prompt's) and lens [B]. Every
    prefill pads the same way: the fused step needs every last token in slot S-1, and a row's keys
    then sit at the same offsets whichever graph computes its prompt (an int4 engine's attention is
    exact only with keys at equal offsets; engines/onnx/attention.py: row_exact_f32_attention)."""
    lens = torch.tensor([len(p) for p in prompts])
    s = int(lens.max())
    first = s - lens  # [B] slot of each prompt's first token
    ids = torch.zeros(len(prompts), s, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, int(first[i]):int(first[i]) + len(p)] = torch.tensor(p)
    slot = torch.arange(s)[None]
    pos = (slot - first[:, None]).clamp(min=0)
    valid = (slot >= first[:, None]) & (slot < (first + lens)[:, None])  # [B, S] padding keys are never seen
    mask = (torch.ones(s, s, dtype=torch.bool).tril()[None] & valid[:, None, :]) | torch.eye(s, dtype=torch.bool)[None]
    return ids, pos, mask, (first[:, None] + slot).clamp(max=s - 1), lens


def prefill(backend: Backend, prompts: list[list[int]], heads: bool = True, pick: Callable | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """All prompts in one left-padded forward, committed to the cache; returns the logits [B, V] at
    each prompt's last token (slot S-1), the first root there (`pick` of the logits: argmax by
    default) and, with `heads`, the drafter's logits [H, B, V] for the first tree (None without).
    medusa-check drives it too."""
    ids, pos, mask, slots, lens = _pad_prompts(prompts)
    if heads and backend.info.drafter_cache:
        # The drafter's cache takes every prompt row: the forward keeps row j = the prompt's token j
        # (slots), and the token after each is the prompt's next, then the root. An engine that keeps
        # every row's hidden state computes the logits of the last row alone (left padding: slot S-1),
        # and the drafter reads the prompt's rows at their slots.
        if backend.info.hidden_all_rows:
            last = torch.full((len(prompts), 1), ids.shape[1] - 1, dtype=torch.long)
            logits = backend.forward(ids, pos, mask, last, with_heads=False)[0][:, 0]
            rows = slots
        else:
            logits, _ = backend.forward(ids, pos, mask, slots, with_heads=False)
            logits = logits[torch.arange(len(prompts)), lens - 1]
            rows = torch.arange(ids.shape[1]).expand(len(prompts), -1)
        backend.commit(slots, lens)
        root = (pick or argmax)(logits)
        after = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            after[i, : len(p)] = torch.tensor(list(p[1:]) + [int(root[i])])
        return logits, root, backend.draft(rows, lens, after)
    last = torch.full((len(prompts), 1), ids.shape[1] - 1, dtype=torch.long)
    logits, _ = backend.forward(ids, pos, mask, last, with_heads=False)
    backend.commit(slots, lens)
    logits = logits[:, 0]
    root = (pick or argmax)(logits)
    # The forward kept one row, the prompt's last; the token chosen after it is the root.
    medusa = backend.draft(torch.zeros(len(prompts), 1, dtype=torch.long), torch.ones(len(prompts), dtype=torch.long),
                           root[:, None]) if heads else None
    return logits, root, medusa


def drafts_at_every_row(backend: Backend, ids: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The base's logits [1, K, V] and the drafts [H, 1, K, V] at rows first..S-2 of one sequence ids
    [1, S], for a drafter with a cache of its own (medusa-tune-tree's head accuracy): the whole sequence through the decoder, every row up to `first`
    into the drafter, then one row at a time, each call drafting at its row (the decoding loop's
    calls, one token accepted per step)."""
    s = ids.shape[1]
    rows = torch.arange(s)[None]
    logits, _ = backend.forward(ids, rows, torch.ones(s, s, dtype=torch.bool).tril()[None], rows, with_heads=False)
    drafts = [backend.draft(rows[:, : first + 1], torch.tensor([first + 1]), ids[:, 1 : first + 2])]
    for t in range(first + 1, s - 1):
        drafts.append(backend.draft(rows[:, t : t + 1], torch.ones(1, dtype=torch.long), ids[:, t + 1 : t + 2]))
    return logits[:, first : s - 1], torch.stack(drafts, dim=2)  # [H, 1, K, V]


def _prefill(backend: Backend, prompts: list[list[int]], sampler: Sampler | None, heads: bool) -> Carry:
    """prefill, and the first root: the base model's pick at each prompt's last token."""
    _, root, medusa = prefill(backend, prompts, heads=heads, pick=sampler.draw if sampler else None)
    return Carry(root=root, medusa=medusa)


def _fused_prefill(backend: Backend, tree: StepTree, prompts: list[list[int]], sampler: None = None) -> Carry:
    """The prompts through the fused step graph, so a greedy Medusa decode never opens the decoder
    and heads graphs (one packed copy of the weights per process; docs/benchmarks/issue-13-int4.md,
    memory). The graph takes one `retrieve` for the batch, so prompts are left-padded: every last
    token sits in slot S-1, the root of a path without drafts, and the graph's argmax there and its
    heads' top-k there are the first tree's tokens [B, T]. The graph computes logits at its last
    1 + len(candidate_index) slots only (a tree's width), not over the whole prompt."""
    ids, pos, mask, slots, lens = _pad_prompts(prompts)
    retrieve = torch.full((1, tree.retrieve.shape[1]), -1, dtype=torch.long)
    retrieve[0, 0] = ids.shape[1] - 1
    tokens = backend.fused_step(ids, pos, mask, retrieve, tree.candidate_index)[2]
    backend.commit(slots, lens)
    return Carry(tokens=tokens)


def _cached_fused_prefill(backend: Backend, tree: StepTree, prompts: list[list[int]], sampler: None = None) -> Carry:
    """The prefill of a fused decode whose drafter keeps a cache of its own: the decoder and drafter
    graphs (every prompt row into the drafter's cache), then the first tree's tokens from its drafts."""
    _, root, medusa = prefill(backend, prompts)
    return Carry(tokens=tree_candidates(root, medusa, tree.candidate_index, tree.topk))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy picks over the last axis, the first maximum on ties (as torch.argmax). Host logits
    take numpy's argmax: torch's sets up a reduction per call, which costs a noticeable share of a
    small int4 engine's plain step; numpy's does not (docs/benchmarks/issue-13-int4.md)."""
    if not logits.is_cpu or logits.dtype == torch.bfloat16:  # numpy has no bfloat16
        return logits.argmax(-1)
    return torch.from_numpy(logits.detach().numpy().argmax(-1))


@functools.cache
def _plain_step_inputs(batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A plain step's constant mask [B, 1, 1], slot 0 [B, 1] (its logit position and its committed
    slot) and counts [B], made once per batch size and never written: each torch call right after
    an engine step costs tens of microseconds (cold caches)."""
    return (torch.ones(batch, 1, 1, dtype=torch.bool), torch.zeros(batch, 1, dtype=torch.long),
            torch.ones(batch, dtype=torch.long))


def _plain_compute(backend: Backend, tokens: torch.Tensor, positions: torch.Tensor, tree: None = None) -> torch.Tensor:
    """A plain step's backend work: logits [B, 1, V] of one new token per sequence."""
    mask, slots, _ = _plain_step_inputs(len(tokens))
    logits, _ = backend.forward(tokens, positions, mask, slots, with_heads=False)
    return logits


def _plain_step(backend: Backend, tree: None, carry: Carry, sampler: Sampler | None):
    root = carry.root
    emitted = [[t] for t in root.tolist()]
    _, slots, counts = _plain_step_inputs(len(root))
    logits = _plain_compute(backend, root[:, None], backend.lengths[:, None])
    backend.commit(slots, counts)
    return emitted, None, Carry(root=sampler.draw(logits[:, 0]) if sampler else argmax(logits[:, 0]))


def _tree_compute(backend: Backend, tokens: torch.Tensor, positions: torch.Tensor,
                  tree: StepTree | BatchTree) -> torch.Tensor:
    """A two-call tree step's verification: logits [B, T, V] over the tree's slots (the drafter comes
    after acceptance, at the committed slots). A StepTree's mask [T, T] serves every sequence; a
    BatchTree has one per sequence."""
    logits, _ = backend.forward(tokens, positions, tree.mask.expand(len(tokens), -1, -1), with_heads=False)
    return logits


def _two_call_step(backend: Backend, cfg: GenerationConfig, tree: StepTree, carry: Carry, sampler: Sampler | None):
    emitted, accepted, root, medusa = tree_step(backend, tree, carry.root, carry.medusa, cfg, sampler)
    return emitted, accepted, Carry(root=root, medusa=medusa)


def tree_step(backend: Backend, tree: StepTree, root: torch.Tensor, medusa: torch.Tensor, cfg: GenerationConfig,
              sampler: Sampler | None = None):
    """One step of the two-call path: the tree drafted from root [B] and the heads' logits medusa
    [H, B, V] is verified, accepted (cfg.acceptance) and its accepted path committed. Returns the
    emitted tokens per sequence, the accepted draft tokens [B], and the next root [B] and medusa
    logits [H, B, V]. medusa-check drives it too."""
    tokens = tree_candidates(root, medusa, tree.candidate_index, tree.topk)[:, : tree.num_slots]  # [B, T]
    return verify(backend, tree, tokens, cfg, sampler)


def verify(backend: Backend, tree: StepTree | BatchTree, tokens: torch.Tensor, cfg: GenerationConfig,
           sampler: Sampler | None = None):
    """The two-call path's verification of a tree's tokens [B, T]: forward, acceptance, commit of the
    accepted path, and the drafter at the committed rows. Returns tree_step's four values."""
    b = len(tokens)
    logits = _tree_compute(backend, tokens, backend.lengths[:, None] + tree.position_offsets, tree)  # [B, T, V]
    if sampler:
        best, accepted, picks = sample_accept(tree.retrieve, tokens, sampler.probs(logits),
                                             sampler.uniforms(tree.num_slots, tree.row_slots))
    else:
        picks = argmax(logits)  # [B, T] argmax per slot first: no [B, N, D, V] gather
        if _greedy(cfg):
            best, accepted = greedy_accept(tree.retrieve, tokens, picks)  # ties go to the first path
        else:
            best, accepted = typical_accept(tree.retrieve, tokens, logits, cfg.temperature,
                                            cfg.posterior_threshold, cfg.posterior_alpha)
    emitted, rows, last = commit_path(backend, tree, tokens, best, accepted)
    root = picks[torch.arange(b), last]
    # The drafter reads the committed rows and the token chosen after each: the next accepted one,
    # then the new root (lists: right after an engine step each torch call costs more than a list op).
    width = rows.shape[1]
    after = [e[1:] + [r] + [0] * (width - len(e)) for e, r in zip(emitted, root.tolist(), strict=True)]
    return emitted, accepted, root, backend.draft(rows, accepted + 1, torch.tensor(after))


def _fused_compute(backend: Backend, tokens: torch.Tensor, positions: torch.Tensor, tree: StepTree | BatchTree,
                   candidate_index: torch.Tensor | None = None):
    """A fused step's one backend call: best path [B], accepted [B] and the next tree's tokens (then,
    on engines whose step graph returns them, the drafter's top-k ids and log-probs [B, H, k])."""
    return backend.fused_step(tokens, positions, tree.mask.expand(len(tokens), -1, -1), tree.retrieve,
                              tree.candidate_index if candidate_index is None else candidate_index)


def _fused_tree_step(backend: Backend, tree: StepTree, carry: Carry, sampler: None = None):
    """One backend call verifies the carried tokens (the first tree.num_slots: a cut tree verifies
    fewer), accepts greedily and drafts the next tree's tokens; then the accepted path's commit."""
    tokens = carry.tokens[:, : tree.num_slots]
    best, accepted, next_tokens = _fused_compute(backend, tokens, backend.lengths[:, None] + tree.position_offsets[None],
                                                 tree)[:3]
    emitted, _, _ = commit_path(backend, tree, tokens, best, accepted)
    return emitted, accepted, Carry(tokens=next_tokens)


def _emitted(tree: StepTree | BatchTree, tokens, best, accepted) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Each sequence's emitted tokens (its accepted path's), the path's slots [B] (root..leaf, -1
    as 0) and its accepted count. In Python lists: right after an engine step each torch call costs
    tens of microseconds (cold caches), a list lookup well under one."""
    if isinstance(tree, BatchTree):  # a tree per sequence
        rows = [paths[p] for paths, p in zip(tree.paths, best.tolist(), strict=True)]
    else:
        rows = [tree.paths[p] for p in best.tolist()]
    kept = accepted.tolist()
    toks = tokens.tolist()
    return [[toks[i][s] for s in row[: a + 1]] for i, (row, a) in enumerate(zip(rows, kept, strict=True))], rows, kept


def commit_path(backend, tree: StepTree | BatchTree, tokens, best, accepted):
    """Commits each sequence's accepted path; returns the emitted tokens, the path's slots [B, D+1]
    (the rows committed, the first accepted + 1 of each) and the slot whose logits continue [B]."""
    emitted, rows, kept = _emitted(tree, tokens, best, accepted)
    slots = torch.tensor(rows)
    backend.commit(slots, accepted + 1)
    return emitted, slots, torch.tensor([row[a] for row, a in zip(rows, kept, strict=True)])


# -- trees chosen per step (runtime/dynamic.py) ----------------------------------------------------


def _dynamic_plan(backend: Backend, cfg: GenerationConfig, tree: DynamicTree) -> StepPlan:
    """Per-step trees: greedy decodes on an engine whose fused step graph returns the drafter's top-k
    log-probs verify, accept and draft in one call per step, the tree chosen on the host between
    calls; everything else takes the two-call path, choosing from the drafter's logits."""
    if _greedy(cfg) and backend.fused_step_dynamic and backend.fused_step_topk == tree.topk:
        prefill = _cached_dynamic_prefill if backend.info.drafter_cache else _dynamic_fused_prefill
        return StepPlan("fused", functools.partial(prefill, backend, tree), functools.partial(_dynamic_fused_step, backend),
                        functools.partial(_fused_compute, backend))
    return StepPlan("two_call", functools.partial(_prefill, backend, heads=True),
                    functools.partial(_dynamic_two_call_step, backend, cfg), functools.partial(_tree_compute, backend))


def _filler(slots: int) -> torch.Tensor:
    """A per-step tree's candidate_index for the fused step graph: its length sets how many of the
    last slots get logits (all T of the tree); the next_tokens it selects are not read."""
    return torch.zeros(max(slots - 1, 1), dtype=torch.long)


def _dynamic_fused_prefill(backend: Backend, tree: DynamicTree, prompts: list[list[int]], sampler: None = None) -> Carry:
    """_fused_prefill for per-step trees: the root and the drafter's top-k at each prompt's last token."""
    ids, pos, mask, slots, lens = _pad_prompts(prompts)
    retrieve = torch.full((len(prompts), 1, tree.heads + 1), -1, dtype=torch.long)  # all heads draft
    retrieve[:, 0, 0] = ids.shape[1] - 1
    _, _, tokens, top_ids, top_logp = backend.fused_step(ids, pos, mask, retrieve, _filler(1))[:5]
    backend.commit(slots, lens)
    return Carry(root=tokens[:, 0], top=(top_ids, top_logp))


def _cached_dynamic_prefill(backend: Backend, tree: DynamicTree, prompts: list[list[int]], sampler: None = None) -> Carry:
    """The drafter with a cache of its own reads every prompt row: prefill, then its top-k there."""
    _, root, medusa = prefill(backend, prompts)
    return Carry(root=root, top=drafts_topk(medusa, tree.topk))


def _dynamic_fused_step(backend: Backend, tree: DynamicTree, carry: Carry, sampler: None = None):
    """Chooses each sequence's tree from the carried top-k and context, then one backend call verifies
    it, accepts greedily and returns the drafter's next top-k; then the accepted path's commit."""
    bt = step_trees(tree, carry.root, *carry.top, carry.context, min_depth=tree.heads)
    best, accepted, next_tokens, top_ids, top_logp = _fused_compute(
        backend, bt.tokens, backend.lengths[:, None] + bt.position_offsets, bt, _filler(bt.num_slots))[:5]
    emitted, _, _ = commit_path(backend, bt, bt.tokens, best, accepted)
    root = next_tokens[:, 0]
    if carry.context is not None:
        carry.context.advance(emitted, root.tolist())
    return emitted, accepted, Carry(root=root, top=(top_ids, top_logp), context=carry.context, slots=bt.num_slots,
                                    row_slots=bt.row_slots)


def _dynamic_two_call_step(backend: Backend, cfg: GenerationConfig, tree: DynamicTree, carry: Carry,
                           sampler: Sampler | None):
    """Chooses each sequence's tree from the drafter's logits and context, then verifies it as
    tree_step does (any acceptance)."""
    # A sampled (or typical) sequence's tree is its own, not the batch's: its tokens depend on the tree.
    bt = step_trees(tree, carry.root, *drafts_topk(carry.medusa, tree.topk), carry.context, own_width=not _greedy(cfg))
    emitted, accepted, root, medusa = verify(backend, bt, bt.tokens, cfg, sampler)
    if carry.context is not None:
        carry.context.advance(emitted, root.tolist())
    return emitted, accepted, Carry(root=root, medusa=medusa, context=carry.context, slots=bt.num_slots,
                                    row_slots=bt.row_slots)
