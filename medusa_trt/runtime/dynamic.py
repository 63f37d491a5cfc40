"""Trees chosen per step (`medusa_choices="dynamic:N"`) and context candidates.

Each step keeps the N nodes of highest path probability (the product of the drafter's probabilities
along the path, EAGLE-2's rule) out of every path the drafter's top-k allows, then verifies that
tree. A path's probability never exceeds its parent's, so the best N always form a tree (ties go to
the shallower node). Medusa heads and the Amphista drafter both give one distribution per depth,
independent of the path above it, so a node is a token path whose depth-d token is one of head d's
top-k.

Context candidates (prompt lookup) join the same budget: the runtime keeps each sequence's tokens,
finds the longest recent n-gram match of its last tokens (n = MAX_NGRAM..1) in the prompt and the
generated text, and offers what followed it as a chain. A chain node's score is the measured
probability that a chain of that match length is right that deep, counted per request (a prior
until measured). Where a chain node and a drafter node are the same token path they are one node,
with the higher score. A loop (what followed the match is the suffix itself) continues
periodically, so a two-token loop offers a chain as deep as the budget allows. An engine with a
datastore (medusa_trt/datastore.py: the base model's own text) offers a second chain per sequence, the
continuation of the longest suffix the datastore holds, scored by the datastore's calibration.

N is a budget: since a node's probability is its chance of being accepted, a step keeps only the
best nodes that pay for the step time their slots add (`worth`, SLOT_COST). Everything here is host
work on a few dozen numbers per sequence; the engine call is the same one a static tree makes
(docs/design.md, per-step trees).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from medusa_trt.datastore import Chain, Datastore
from medusa_trt.drafters.base import topk_logp
from medusa_trt.dynamic_spec import read_dynamic

MAX_NGRAM = 4  # longest n-gram looked up
MAX_CONTEXT_DEPTH = 16  # deepest context chain offered (a loop continues periodically up to it)
LOGP_FLOOR = -1e4  # a NaN or -inf draft log-probability is scored this: its worth, exp() of it, is 0 all the same
# Prior for a chain node at depth j of an n-gram match: q_n^j, worth PRIOR_WEIGHT observations, until
# the sequence has measured it (ContextStats).
PRIOR_WEIGHT = 2.0
# What one more tree slot adds to a step's time, as a share of a plain step: measured on SmolLM2-135M
# float32 engines on a 2-core CPU, 0.07-0.09 per slot from 4 to 12 slots (BENCHMARKS.md, per-step
# trees). A step keeps the n best nodes that maximize (1 + expected accepted tokens) / (1 + cost n),
# summed over the batch's sequences.
SLOT_COST = 0.08


def _prior(n: int) -> float:
    return min(0.3 + 0.1 * n, 0.7)


@dataclass(frozen=True)
class DynamicTree:
    """A per-step tree spec: `budget` nodes (root excluded) each step, from a drafter of `heads`
    heads and top-`topk` each; `context`: whether context candidates compete for the budget;
    `chains_only`: an engine that verifies chains only gets the best single chain."""

    budget: int
    heads: int
    topk: int
    context: bool = True
    chains_only: bool = False
    # Step time per slot over a plain step's (SLOT_COST): each step keeps as many of the budget's best
    # nodes as pay for their slots; 0 fills the budget every step.
    slot_cost: float = SLOT_COST

    @property
    def num_slots(self) -> int:
        return self.budget + 1

    @property
    def max_depth(self) -> int:
        """The deepest path a step can verify: a drafter path, or a context chain."""
        deepest = max(self.heads, min(self.budget, MAX_CONTEXT_DEPTH) if self.context else 0)
        return min(deepest, self.budget)

    def within_block(self, lengths: torch.Tensor, block: int | None) -> DynamicTree:
        """This step's spec on an engine whose tree must stay in one key block (StepTree.within_block):
        near a block edge, a smaller budget (the root at least). Chains need no cut."""
        if block is None or self.chains_only:
            return self
        room = min(block - n % block for n in lengths.tolist())
        if room >= self.num_slots:
            return self
        return replace(self, budget=max(room - 1, 0))

    def within_room(self, lengths: torch.Tensor, max_seq_len: int) -> DynamicTree:
        """This step's spec near the engine's last position (StepTree.within_room): a budget of the
        positions left after the root, since a tree of n nodes is at most n deep."""
        room = max_seq_len - int(lengths.max())
        if room > self.max_depth:
            return self
        return replace(self, budget=max(room - 1, 0))


def dynamic_tree(spec: object, heads: int, topk: int, max_draft_len: int, chains_only: bool = False,
                 context: bool = True, slot_cost: float | None = None) -> DynamicTree | None:
    """The DynamicTree of a "dynamic:N" spec checked against the engine (None: not a dynamic spec).
    Its slot cost: `slot_cost` when given, else the spec's own (",cost=C"), else SLOT_COST."""
    parsed = read_dynamic(spec)
    if parsed is None:
        return None
    parsed.check_fits(heads, topk, max_draft_len)
    if slot_cost is None:
        slot_cost = parsed.cost
    slot_cost = SLOT_COST if slot_cost is None else slot_cost
    return DynamicTree(parsed.budget, heads, topk, context, chains_only, slot_cost)


# -- context candidates -------------------------------------------------------------------------


class ContextIndex:
    """One sequence's tokens and, for each n <= MAX_NGRAM, where every n-gram last ended. An n-gram
    is indexed once, when the token after it arrives, so a lookup of the current suffix finds its
    latest earlier occurrence: O(MAX_NGRAM) dictionary work per token, amortized."""

    def __init__(self, tokens: list[int]):
        self.tokens: list[int] = []
        self.ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(MAX_NGRAM + 1)]
        self.indexed = 0  # n-grams ending before this position are in `ends`
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def _index(self) -> None:
        toks, last = self.tokens, len(self.tokens) - 1
        for end in range(self.indexed, last):  # every end but the current one
            for n in range(1, min(MAX_NGRAM, end + 1) + 1):
                self.ends[n][tuple(toks[end - n + 1 : end + 1])] = end
        self.indexed = max(self.indexed, last)

    def lookup(self, depth: int) -> tuple[int, list[int]]:
        """(n, up to `depth` tokens that followed the latest earlier occurrence of the last n tokens),
        longest n first; (0, []) without a match. A match whose continuation reaches the current end
        repeats with its period (a loop)."""
        if depth < 1 or len(self.tokens) < 2:
            return 0, []
        self._index()
        toks, last = self.tokens, len(self.tokens) - 1
        for n in range(min(MAX_NGRAM, last), 0, -1):
            end = self.ends[n].get(tuple(toks[last - n + 1 :]))
            if end is not None:
                period = last - end
                return n, [toks[end + 1 + j % period] for j in range(depth)]
        return 0, []


@dataclass
class ContextStats:
    """Per sequence: how often a context chain of match length n was right at depth j (its first j
    tokens all the base model's own), which scores the chains of the next steps. Not shared across
    a batch: a served batch holds other users' requests, and a sequence's trees, so its sampled
    tokens, would depend on them (docs/sampling.md)."""

    proposed: np.ndarray = field(default_factory=lambda: np.zeros((MAX_NGRAM + 1, MAX_CONTEXT_DEPTH + 1)))
    right: np.ndarray = field(default_factory=lambda: np.zeros((MAX_NGRAM + 1, MAX_CONTEXT_DEPTH + 1)))

    def scores(self, n: int, depth: int) -> list[float]:
        """Log-probabilities that a chain of an n-gram match is right through depth 1..depth,
        non-increasing (a deeper node is never likelier than its parent)."""
        out, best = [], 0.0
        q = _prior(n)
        for j in range(1, depth + 1):
            p = (self.right[n, j] + PRIOR_WEIGHT * q**j) / (self.proposed[n, j] + PRIOR_WEIGHT)
            best = min(best, math.log(max(p, 1e-9)))
            out.append(best)
        return out

    def record(self, n: int, chain: list[int], truth: list[int]) -> None:
        """A chain offered after an n-gram match against what the base model chose after the root
        (the accepted drafts and the next root): the depths it can be judged at are counted."""
        run = 0
        while run < min(len(chain), len(truth)) and chain[run] == truth[run]:
            run += 1
        judged = min(len(chain), len(truth))
        self.proposed[n, 1 : judged + 1] += 1
        self.right[n, 1 : run + 1] += 1


@dataclass(frozen=True)
class Offer:
    """A chain offered to one sequence's tree: from its own text (`n`: the n-gram match length) or
    from the datastore (`found`)."""

    tokens: list[int]
    n: int = 0
    found: Chain | None = None


@dataclass
class Context:
    """The context candidates' state of a batch: an index and statistics per sequence (its row in
    the batch), and the datastore when the engine has one."""

    indexes: list[ContextIndex]
    stats: list[ContextStats]
    datastore: Datastore | None = None
    offered: list[list[Offer]] = field(default_factory=list)  # last step's offers per row

    @classmethod
    def of(cls, prompts: list[list[int]], datastore: Datastore | None = None) -> Context:
        return cls([ContextIndex(list(p)) for p in prompts], [ContextStats() for _ in prompts], datastore=datastore)

    def keep(self, rows: list[int]) -> Context:
        return Context([self.indexes[i] for i in rows], [self.stats[i] for i in rows], self.datastore,
                       [self.offered[i] for i in rows] if self.offered else [])

    def chains(self, roots: list[int], depth: int) -> list[list[Offer]]:
        """Each sequence's chains after its root (the root is the next token, not yet emitted)."""
        out = []
        for index, root in zip(self.indexes, roots, strict=True):
            index.tokens.append(root)  # looked up with the root as the last token, then taken back
            n, chain = index.lookup(depth)
            row = [Offer(chain, n=n)] if n else []
            if self.datastore is not None:
                found = self.datastore.chain(index.tokens, depth)
                if found.tokens:
                    row.append(Offer(found.tokens, found=found))
            index.tokens.pop()
            out.append(row)
        self.offered = out
        return out

    def scores(self, row: int, offer: Offer) -> list[float]:
        """A chain offered to row `row`: its log-probability of being right through each depth."""
        if offer.n:
            return self.stats[row].scores(offer.n, len(offer.tokens))
        return self.datastore.scores(offer.found)

    def advance(self, emitted: list[list[int]], roots: list[int]) -> None:
        """After a step: each sequence's emitted tokens join its history, and the chains it was
        offered are judged against them (emitted[1:] then the next root: the tokens after the root)."""
        for row, (toks, root) in enumerate(zip(emitted, roots, strict=True)):
            truth = toks[1:] + [root]
            for offer in self.offered[row] if self.offered else []:
                if offer.n:  # datastore chains are scored by the datastore's calibration alone
                    self.stats[row].record(offer.n, offer.tokens, truth)
            self.indexes[row].extend(toks)


# -- selection ----------------------------------------------------------------------------------


def best_paths(ids: list[list[int]], logp: list[list[float]], budget: int) -> list[tuple[float, tuple[int, ...]]]:
    """The `budget` token paths of highest path log-probability from per-depth top-k lists (ids and
    logp [H][k], each sorted by probability), best first, parents before children: a best-first
    walk whose frontier holds each popped node's first child and next sibling."""
    heads, k = len(ids), len(ids[0]) if ids else 0
    if not heads or not k:
        return []
    out: list[tuple[float, tuple[int, ...]]] = []
    frontier = [(-logp[0][0], (0,))]
    while frontier and len(out) < budget:
        neg, ranks = heapq.heappop(frontier)
        d = len(ranks) - 1
        out.append((-neg, tuple(ids[i][r] for i, r in enumerate(ranks))))
        if d + 1 < heads:
            heapq.heappush(frontier, (neg - logp[d + 1][0], ranks + (0,)))
        if ranks[-1] + 1 < k:
            heapq.heappush(frontier, (neg + logp[d][ranks[-1]] - logp[d][ranks[-1] + 1], ranks[:-1] + (ranks[-1] + 1,)))
    return out


def choose_nodes(tree: DynamicTree, ids: list[list[int]], logp: list[list[float]],
                 chains: list[tuple[list[int], list[float]]]) -> list[tuple[float, tuple[int, ...]]]:
    """One sequence's candidate nodes for this step, (log-probability, token path) best first (ties
    to the shallower node, so every prefix of the list is a tree): the budget's best of the
    drafter's paths and the offered chains (tokens, log-probability per depth), a node offered
    twice scored by the higher. A node's probability is the chance that it is accepted, so a
    prefix's expected accepted tokens is the sum."""
    if tree.budget == 0:
        return []
    score: dict[tuple[int, ...], float] = {}
    for s, path in best_paths(ids, logp, tree.budget):
        score[path] = s
    for chain, scores in chains:
        for j, s in enumerate(scores[: tree.budget]):
            path = tuple(chain[: j + 1])
            score[path] = max(s, score.get(path, -math.inf))
    if tree.chains_only:
        return best_union_chain(score, tree.budget)
    return sorted(((v, p) for p, v in score.items()), key=lambda n: (-n[0], len(n[1])))[: tree.budget]


def best_union_chain(score: dict[tuple[int, ...], float], budget: int) -> list[tuple[float, tuple[int, ...]]]:
    """The chain (at most `budget` deep) of the most expected accepted tokens through the union of
    candidate nodes (every prefix of a node is a node): it may follow the drafter's path, then an
    offered chain's tail where the two agree. A node's probability is its chance of acceptance, so a
    chain's expected accepted tokens is the sum along it."""
    children: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for path in sorted(score, key=len):
        children.setdefault(path[:-1], []).append(path)
    value: dict[tuple[int, ...], float] = {}
    for path in sorted(score, key=len, reverse=True):  # children before parents
        below = [value[c] for c in children.get(path, [])]
        value[path] = math.exp(score[path]) + max(below, default=0.0)
    out, at = [], ()
    while len(at) < budget and children.get(at):
        at = max(children[at], key=lambda c: (value[c], score[c]))
        out.append((score[at], at))
    return out


def worth(ranked: list[list[tuple[float, tuple[int, ...]]]], slot_cost: float) -> int:
    """How many nodes a step verifies per sequence, given each sequence's best-first nodes: the n
    that maximizes the batch's tokens per unit of time, sum over sequences of (1 + expected accepted
    tokens of its first n) / (1 + slot_cost n), the slots costing every sequence alike; the most any
    sequence has when slot_cost is 0."""
    longest = max((len(nodes) for nodes in ranked), default=0)
    if slot_cost <= 0:
        return longest
    gains = [1.0] * len(ranked)
    best, best_n = float(len(ranked)), 0
    for n in range(1, longest + 1):
        for b, nodes in enumerate(ranked):
            if n <= len(nodes):
                gains[b] += math.exp(nodes[n - 1][0])
        value = sum(gains) / (1 + slot_cost * n)
        if value > best:
            best, best_n = value, n
    return best_n


@dataclass(frozen=True)
class BatchTree:
    """One step's trees, one per sequence, all of T slots: what the engine verifies and the loop
    commits. Slot 0 of each is its root."""

    tokens: torch.Tensor  # [B, T]
    position_offsets: torch.Tensor  # [B, T] each slot's depth
    mask: torch.Tensor  # [B, T, T] root, ancestors and self
    retrieve: torch.Tensor  # [B, N, D+1] root..leaf slots of each path, -1 padded
    paths: list[list[list[int]]]  # [B][N] retrieve's rows as lists, -1 padding as slot 0
    num_slots: int
    row_slots: list[int] | None = None  # each tree's own slots when the rows differ; the rest are inert pads


def _inert_pad(tokens, depth, mask, i: int, s: int) -> None:
    """Slot s of row i as a pad: token 0 under the root, on no path, so never accepted, drawn for
    or committed; it only makes the row as wide as the batch's widest tree."""
    tokens[i, s] = 0
    depth[i, s] = 1
    mask[i, s, 0] = mask[i, s, s] = True


def build_batch(trees: list[list[tuple[int, ...]]], roots: list[int], min_depth: int = 0) -> BatchTree:
    """The BatchTree of each sequence's nodes (choose_nodes) under its root. retrieve is at least
    `min_depth` + 1 wide: the fused step drafts with as many heads as retrieve is deep. Trees of
    fewer nodes than the widest are padded with inert slots (_inert_pad)."""
    own = [1 + len(nodes) for nodes in trees]  # each tree's slots, root included
    t = max(own)
    b = len(trees)
    tokens = np.zeros((b, t), dtype=np.int64)
    depth = np.zeros((b, t), dtype=np.int64)
    mask = np.zeros((b, t, t), dtype=bool)
    seqs = []
    for i, (nodes, root) in enumerate(zip(trees, roots, strict=True)):
        slot = {(): 0}
        parent = [0] * t
        tokens[i, 0] = root
        mask[i, 0, 0] = True
        for s, path in enumerate(nodes, start=1):
            slot[path] = s
            parent[s] = slot[path[:-1]]
            tokens[i, s] = path[-1]
            depth[i, s] = len(path)
            mask[i, s] = mask[i, parent[s]]
            mask[i, s, s] = True
        for s in range(own[i], t):
            _inert_pad(tokens, depth, mask, i, s)
        inner = set(parent[1 : own[i]])
        seq = []
        for leaf in (s for s in range(own[i]) if s not in inner):  # slot 0 alone is a leaf of a root-only tree
            chain = [leaf]
            while chain[-1]:
                chain.append(parent[chain[-1]])
            seq.append(chain[::-1])
        seqs.append(seq)
    width = max(min_depth, int(depth.max()), 1) + 1  # a root-only tree keeps one -1 column: no empty gathers
    n = max(len(s) for s in seqs)
    retrieve = np.full((b, n, width), -1, dtype=np.int64)
    for i, seq in enumerate(seqs):
        for j, chain in enumerate(seq):
            retrieve[i, j, : len(chain)] = chain
    paths = [[[max(x, 0) for x in row] for row in rows] for rows in retrieve.tolist()]
    return BatchTree(torch.from_numpy(tokens), torch.from_numpy(depth), torch.from_numpy(mask),
                     torch.from_numpy(retrieve), paths, t, own if min(own) < t else None)


def step_trees(tree: DynamicTree, roots: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor,
               context: Context | None, min_depth: int = 0, own_width: bool = False) -> BatchTree:
    """This step's BatchTree: per sequence, the budget's best nodes from the drafter's top-k (ids and
    log-probs [B, H, k], sorted) and its context chain. `own_width`: each sequence keeps the nodes
    worth its own slots, padded inert to the widest, so its tree is the one it would have alone
    (sampling: its tokens then depend on its seed, not on the batch; docs/sampling.md)."""
    roots_l = roots.tolist()
    # A NaN or -inf draft (a drafter glitch, an overflow) is never worth a slot, and is scored by a
    # finite floor: NaN, or -inf - -inf in best_paths, would break the order that keeps every prefix
    # of choose_nodes' list a tree.
    top_logp = top_logp[:, : tree.heads, : tree.topk].nan_to_num(nan=LOGP_FLOOR, posinf=0.0, neginf=LOGP_FLOOR)
    ids, logp = top_ids[:, : tree.heads, : tree.topk].tolist(), top_logp.tolist()
    depth = min(tree.budget, MAX_CONTEXT_DEPTH)
    offers = context.chains(roots_l, depth) if context is not None and tree.context else [[] for _ in roots_l]
    ranked = [choose_nodes(tree, ids[i], logp[i], [(o.tokens, context.scores(i, o)) for o in row])
              for i, row in enumerate(offers)]
    if own_width:
        return build_batch([sorted((p for _, p in nodes[: worth([nodes], tree.slot_cost)]), key=len)
                            for nodes in ranked], roots_l, min_depth)
    # The batch verifies one width, chosen for the batch's tokens per unit of time: a slot costs every
    # sequence, so one sequence's long chain is not worth it when the others have nothing to verify.
    width = worth(ranked, tree.slot_cost)
    trees = [sorted((p for _, p in nodes[:width]), key=len) for nodes in ranked]
    for nodes in trees:  # a sequence with fewer candidates (a short chain) runs on with token 0 (rejected or right)
        while len(nodes) < width:
            nodes.append(nodes[-1] + (0,) if nodes else (0,))
    return build_batch(trees, roots_l, min_depth)


def drafts_topk(medusa: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each head's k most likely tokens and their log-probabilities, [B, H, k] each, from the
    drafter's logits [H, B, V] (the two-call path; the fused step graph returns them itself)."""
    ids, logp = topk_logp(medusa, k)
    return ids.permute(1, 0, 2), logp.permute(1, 0, 2)
