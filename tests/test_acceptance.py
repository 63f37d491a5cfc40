"""medusa_trt/acceptance.py against brute force: every function on small tensors, compared with a
plain-Python walk over the tree written here from the definitions (no tensor tricks, nothing from
medusa_trt.tree), plus the edge cases by hand: no acceptance, a full path, ties, padded paths,
temperature towards 0.

The statistical law of `sample_accept` is tested in test_sampling.py; here its walk is checked draw
for draw.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from medusa_trt.acceptance import (
    candidates_from_topk,
    greedy_accept,
    sample_accept,
    sample_tokens,
    sampling_probs,
    tree_candidates,
    typical_accept,
)
from medusa_trt.tree import CANDIDATE_TOPK, build_tree, candidate_index

# --- trees, built from their definition: a prefix-closed set of rank paths, the root () = slot 0


def random_paths(rng: random.Random, max_depth: int = 4, max_children: int = 3) -> list[tuple[int, ...]]:
    """Slots in (depth, path) order, as the runtime numbers them (parents before children)."""
    paths = {()}
    for _ in range(rng.randrange(1, 25)):
        parent = rng.choice(sorted(paths))
        children = sum(1 for p in paths if len(p) == len(parent) + 1 and p[:-1] == parent)
        if len(parent) < max_depth and children < max_children:
            paths.add(parent + (children,))
    if len(paths) == 1:
        paths.add((0,))
    return sorted(paths, key=lambda p: (len(p), p))


def retrieve_of(paths: list[tuple[int, ...]], rng: random.Random | None = None) -> torch.Tensor:
    """[N, D+1]: one row per leaf, root..leaf slots, -1 padded; rows shuffled when rng is given
    (acceptance must not assume an order of the paths)."""
    slot = {p: i for i, p in enumerate(paths)}
    leaves = [p for p in paths if not any(len(q) > len(p) and q[: len(p)] == p for q in paths)]
    if rng is not None:
        rng.shuffle(leaves)
    depth = max(len(p) for p in paths)
    return torch.tensor([[slot[p[:i]] for i in range(len(p) + 1)] + [-1] * (depth - len(p)) for p in leaves])


def rows(retrieve: torch.Tensor) -> list[list[int]]:
    return [[s for s in r if s >= 0] for r in retrieve.tolist()]


def children(retrieve: torch.Tensor, slot: int) -> list[int]:
    return sorted({r[i + 1] for r in rows(retrieve) for i in range(len(r) - 1) if r[i] == slot})


# --- brute-force references


def ref_greedy(retrieve, tokens: list[int], argmax: list[int]) -> tuple[int, int]:
    """First path with the longest run of draft tokens equal to the argmax of the slot before them."""
    best, best_len = 0, -1
    for i, path in enumerate(rows(retrieve)):
        n = 0
        while n + 1 < len(path) and tokens[path[n + 1]] == argmax[path[n]]:
            n += 1
        if n > best_len:
            best, best_len = i, n
    return best, best_len


def ref_typical(retrieve, tokens: list[int], logits: torch.Tensor, temperature, epsilon, delta):
    """Medusa's typical rule in float64: accept the draft token when p(token | slot before) under
    softmax(logits / T) exceeds min(epsilon, delta * exp(-entropy)); longest run wins, then the larger
    sum of log p. Also returns the smallest |p - threshold| met, so callers can avoid float knife-edges."""
    probs = torch.softmax(logits.double() / temperature, -1)
    entropy = -(probs * probs.clamp(min=1e-300).log()).sum(-1)
    threshold = torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))
    best, key, margin = 0, None, math.inf
    for i, path in enumerate(rows(retrieve)):
        n, score = 0, 0.0
        for a, b in itertools.pairwise(path):
            p, t = float(probs[a, tokens[b]]), float(threshold[a])
            margin = min(margin, abs(p - t))
            if p <= t:
                break
            n, score = n + 1, score + math.log(p)
        if key is None or (n, score) > key:
            best, key = i, (n, score)
    return best, key[0], margin


def ref_draw(probs: list[float], u: float) -> int:
    """Inverse CDF: the first token whose cumulative probability reaches u * total."""
    total, acc = sum(probs), 0.0
    for i, p in enumerate(probs):
        acc += p
        if acc >= u * total:
            return i
    return len(probs) - 1


def ref_walk(retrieve, tokens: list[int], draws: list[int]) -> list[int]:
    """The sample walk: from the root, move to the child whose token is the draw at the current
    slot; stop where none is. Returns the visited slots."""
    walk = [0]
    while True:
        nxt = [c for c in children(retrieve, walk[-1]) if tokens[c] == draws[walk[-1]]]
        if not nxt:
            return walk
        walk.append(nxt[0])


def logits_following(retrieve, tokens: torch.Tensor, seed: int) -> torch.Tensor:
    """[B, T, V] distinct integer logits per slot (a gap of at least 1: softmax at T = 0.001 is
    one-hot), whose argmax is one of the slot's children's tokens 70% of the time."""
    g, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    b, t = tokens.shape
    vocab = int(tokens.max()) + 2
    logits = torch.stack([torch.randperm(vocab, generator=g).float() for _ in range(b * t)]).view(b, t, vocab)
    for row in range(b):
        for s in range(t):
            kids = children(retrieve, s)
            if kids and rng.random() < 0.7:
                logits[row, s, tokens[row, rng.choice(kids)]] = vocab
    return logits


def random_case(seed: int, vocab: int = 4, batch: int = 6, distinct_siblings: bool = False):
    """A random tree with tokens per slot and an argmax per slot that follows one of the slot's
    children 70% of the time (so runs of every length occur), `batch` rows."""
    rng = random.Random(seed)
    paths = random_paths(rng)
    retrieve = retrieve_of(paths, rng)
    t = len(paths)
    tokens, argmax = [], []
    for _ in range(batch):
        row = [rng.randrange(vocab) for _ in range(t)]
        if distinct_siblings:  # as the heads' top-k ranks give: rank r = r-th token of a permutation
            perms = {p: rng.sample(range(vocab), vocab) for p in paths}
            row = [row[0]] + [perms[p[:-1]][p[-1]] for p in paths[1:]]
        kids = {s: children(retrieve, s) for s in range(t)}
        am = [row[rng.choice(kids[s])] if kids[s] and rng.random() < 0.7 else rng.randrange(vocab) for s in range(t)]
        tokens.append(row)
        argmax.append(am)
    return retrieve, torch.tensor(tokens), torch.tensor(argmax)


# --- greedy_accept


@pytest.mark.parametrize("seed", range(40))
def test_greedy_accept_equals_brute_force(seed):
    retrieve, tokens, argmax = random_case(seed)
    best, accepted = greedy_accept(retrieve, tokens, argmax)
    assert best.dtype == accepted.dtype == torch.long
    for b in range(len(tokens)):
        assert (int(best[b]), int(accepted[b])) == ref_greedy(retrieve, tokens[b].tolist(), argmax[b].tolist())


def test_greedy_accept_edge_cases():
    # Slots: 0 root; 1, 2 children of the root; 3 child of 1; 4 child of 3. Paths [0,1,3,4] and [0,2,-1,-1].
    retrieve = torch.tensor([[0, 1, 3, 4], [0, 2, -1, -1]])
    tokens = torch.tensor([[9, 5, 6, 7, 8]])
    # No acceptance: no child's token is the root's argmax -> 0 accepted, the first path.
    assert [t.tolist() for t in greedy_accept(retrieve, tokens, torch.tensor([[4, 0, 0, 0, 0]]))] == [[0], [0]]
    # The full path: every draft token is the argmax of its parent.
    assert [t.tolist() for t in greedy_accept(retrieve, tokens, torch.tensor([[5, 7, 0, 8, 0]]))] == [[0], [3]]
    # A later break does not undo the run before it; a hit after a miss does not count.
    assert greedy_accept(retrieve, tokens, torch.tensor([[5, 7, 0, 1, 0]]))[1].tolist() == [2]
    assert greedy_accept(retrieve, tokens, torch.tensor([[5, 0, 0, 8, 0]]))[1].tolist() == [1]
    # The short path, fully accepted: its -1 padding (clamped to slot 0 in the gathers) never counts,
    # even when the padded slot's token would match.
    padded = torch.tensor([[6, 5, 6, 7, 8]])  # tokens[0] == 6 == argmax of slot 2
    assert [t.tolist() for t in greedy_accept(retrieve, padded, torch.tensor([[6, 0, 6, 0, 0]]))] == [[1], [1]]
    # Ties go to the first path, in either row order.
    tie = torch.tensor([[9, 5, 5, 7, 8]])  # both children of the root carry the root's argmax
    assert greedy_accept(retrieve, tie, torch.tensor([[5, 0, 0, 0, 0]]))[0].tolist() == [0]
    assert greedy_accept(retrieve.flip(0), tie, torch.tensor([[5, 0, 0, 0, 0]]))[0].tolist() == [0]
    # ... but a longer run later wins.
    assert greedy_accept(retrieve.flip(0), tie, torch.tensor([[5, 7, 0, 0, 0]]))[0].tolist() == [1]


def test_greedy_accept_rows_are_independent():
    retrieve, tokens, argmax = random_case(3, batch=8)
    best, accepted = greedy_accept(retrieve, tokens, argmax)
    for b in range(8):
        one = greedy_accept(retrieve, tokens[b : b + 1], argmax[b : b + 1])
        assert (int(one[0]), int(one[1])) == (int(best[b]), int(accepted[b]))


# --- typical_accept


@pytest.mark.parametrize("seed", range(30))
def test_typical_accept_equals_brute_force(seed):
    retrieve, tokens, _ = random_case(seed, vocab=5)
    g = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(tokens.shape[0], tokens.shape[1], 5, generator=g)
    rng = random.Random(seed)
    temperature, epsilon, delta = rng.choice([0.5, 0.7, 1.0, 1.5]), rng.choice([0.05, 0.09, 0.3]), rng.choice([0.1, 0.3])
    best, accepted = typical_accept(retrieve, tokens, logits, temperature, epsilon, delta)
    for b in range(len(tokens)):
        want_best, want_acc, margin = ref_typical(retrieve, tokens[b].tolist(), logits[b], temperature, epsilon, delta)
        assert margin > 1e-4, "a knife-edge case: pick another seed"
        assert (int(best[b]), int(accepted[b])) == (want_best, want_acc), b


def test_typical_accept_edge_cases():
    retrieve = torch.tensor([[0, 1, 3], [0, 2, -1]])
    tokens = torch.tensor([[0, 1, 2, 3]])
    sure = torch.full((4,), -20.0)
    # Every slot certain of token 3: nothing in the tree is token 3 below the root -> none accepted.
    logits = sure.index_fill(0, torch.tensor([3]), 20.0).expand(1, 4, 4)
    assert [t.tolist() for t in typical_accept(retrieve, tokens, logits, 1.0, 0.09, 0.3)] == [[0], [0]]
    # Root certain of 1, slot 1 certain of 3: the full first path.
    logits = torch.stack([sure.index_fill(0, torch.tensor([1]), 20.0), sure.index_fill(0, torch.tensor([3]), 20.0),
                          sure, sure])[None]
    assert [t.tolist() for t in typical_accept(retrieve, tokens, logits, 1.0, 0.09, 0.3)] == [[0], [2]]
    # Root splits 0.3 / 0.7 between slot 1's and slot 2's tokens (both above the threshold 0.09);
    # slot 1 is certain of token 0, so slot 3 (token 3) is rejected: equal runs of 1, the larger
    # probability wins, whichever row comes first.
    split = torch.log(torch.tensor([1e-9, 0.3, 0.7, 1e-9]))
    logits = torch.stack([split, sure.index_fill(0, torch.tensor([0]), 20.0), sure, sure])[None]
    assert [t.tolist() for t in typical_accept(retrieve, tokens, logits, 1.0, 0.09, 0.3)] == [[1], [1]]
    assert [t.tolist() for t in typical_accept(retrieve.flip(0), tokens, logits, 1.0, 0.09, 0.3)] == [[0], [1]]
    # Equal runs of 2: the larger product of probabilities wins (0.3 * 0.5 > 0.6 * 0.22), not the
    # larger sum (0.8 < 0.82).
    retrieve = torch.tensor([[0, 1, 3], [0, 2, 4]])
    probs = torch.tensor([[0.05, 0.3, 0.6, 0.025, 0.025], [0.2, 0.1, 0.1, 0.5, 0.1], [0.2, 0.2, 0.2, 0.18, 0.22],
                          [0.2] * 5, [0.2] * 5])
    tokens = torch.tensor([[0, 1, 2, 3, 4]])
    assert [t.tolist() for t in typical_accept(retrieve, tokens, probs.log()[None], 1.0, 0.09, 0.3)] == [[0], [2]]
    assert [t.tolist() for t in typical_accept(retrieve.flip(0), tokens, probs.log()[None], 1.0, 0.09, 0.3)] == [[1], [2]]


@pytest.mark.parametrize("seed", range(10))
def test_typical_accept_towards_temperature_zero_accepts_what_greedy_does(seed):
    """decoding routes temperature 0 to greedy_accept; the typical rule must agree in the limit."""
    retrieve, tokens, _ = random_case(seed, vocab=6)
    logits = logits_following(retrieve, tokens, seed)
    best, accepted = typical_accept(retrieve, tokens, logits, 0.001, 0.09, 0.3)
    g_best, g_accepted = greedy_accept(retrieve, tokens, logits.argmax(-1))
    assert torch.equal(accepted, g_accepted) and torch.equal(best, g_best)
    assert accepted.max() >= 1  # the comparison has teeth: something is accepted


# --- candidates


def test_candidate_index_is_the_flat_position_in_heads_top_k():
    """tree.candidate_index, the index the loop and the fused graph gather with: each non-root slot's
    (head, rank) found in the head-major [H * k] layout by search."""
    tree = build_tree([[0], [1], [0, 0], [2, 1], [0, 0, 3], [1, 0, 0, 1]], num_heads=4)
    for k in (CANDIDATE_TOPK, 4, 17):
        flat = [(h, r) for h in range(4) for r in range(k)]
        want = [flat.index((int(h), int(r))) for h, r in zip(tree.head[1:], tree.rank[1:], strict=True)]
        assert candidate_index(tree, k).tolist() == want


@pytest.mark.parametrize("k", [CANDIDATE_TOPK, 4, 12])
def test_tree_candidates_equal_ranked_tokens_by_hand(k):
    """Slot i's token is the rank[i]-th most likely token of head[i] (0-based), sorted in Python."""
    g = torch.Generator().manual_seed(k)
    heads, batch, vocab = 4, 3, 40
    medusa = torch.randn(heads, batch, vocab, generator=g)  # continuous: no ties in the ranking
    root = torch.randint(0, vocab, (batch,), generator=g)
    rng = random.Random(k)
    head = [rng.randrange(heads) for _ in range(15)]
    rank = [rng.randrange(k) for _ in range(15)]
    index = torch.tensor([h * k + r for h, r in zip(head, rank, strict=True)])  # head-major flat top-k
    got = tree_candidates(root, medusa, index, k)
    for b in range(batch):
        ranked = [[v for _, v in sorted((-float(medusa[h, b, v]), v) for v in range(vocab))] for h in range(heads)]
        assert got[b].tolist() == [int(root[b])] + [ranked[h][r] for h, r in zip(head, rank, strict=True)]
    top = medusa.topk(k, -1).indices.permute(1, 0, 2)  # [B, H, k], as the fused graph takes them
    assert torch.equal(candidates_from_topk(root, top, index), got)


# --- sampling


def test_sample_tokens_is_the_inverse_cdf():
    # u exactly on a CDF step belongs to the token that ends there (dyadic values: exact in float).
    probs = torch.tensor([0.25, 0.25, 0.5])
    u = torch.tensor([0.25, 0.5, 0.5 + 2.0**-20, 1.0, 2.0**-24])
    assert sample_tokens(probs.expand(5, -1), u).tolist() == [ref_draw([0.25, 0.25, 0.5], x) for x in u.tolist()] == [0, 1, 2, 2, 0]
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(200, 7, generator=g) * (torch.rand(200, 7, generator=g) > 0.3)
    probs[:, 0] += 1e-3  # no all-zero row
    u = 1 - torch.rand(200, generator=g)
    got = sample_tokens(probs, u).tolist()
    for i in range(200):
        p = probs[i].double().tolist()
        cdf = [sum(p[: j + 1]) / sum(p) for j in range(7)]
        if min(abs(c - float(u[i])) for c in cdf) > 1e-6:  # off the float knife-edges
            assert got[i] == ref_draw(p, float(u[i])), i
            assert p[got[i]] > 0


def test_sampling_probs_edges():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, -2.0]])
    # top_k keeps the ties at the k-th value; top_k >= vocab keeps all.
    assert (sampling_probs(logits, 1.0, top_k=2) > 0).tolist() == [[False, True, True, False, False]]
    assert (sampling_probs(logits, 1.0, top_k=1) > 0).tolist() == [[False, True, True, False, False]]
    assert torch.allclose(sampling_probs(logits, 1.0, top_k=9), torch.softmax(logits, -1))
    # top_p: the most likely token is never dropped, however small top_p.
    assert (sampling_probs(torch.tensor([[0.0, 2.0, 1.0]]), 1.0, top_p=1e-6) > 0).tolist() == [[False, True, False]]
    # Towards temperature 0: one-hot at the argmax. Rows sum to 1 always.
    g = torch.Generator().manual_seed(1)
    x = torch.stack([torch.randperm(9, generator=g).float() for _ in range(5)])
    assert torch.equal(sampling_probs(x, 0.001), torch.nn.functional.one_hot(x.argmax(-1), 9).float())
    for t, k, p in [(0.7, None, 0.9), (1.0, 3, 1.0), (2.0, 4, 0.5)]:
        assert torch.allclose(sampling_probs(x, t, k, p).sum(-1), torch.ones(5))


@pytest.mark.parametrize("seed", range(20))
def test_sample_accept_walks_the_tree_draw_by_draw(seed):
    retrieve, tokens, _ = random_case(seed, vocab=4, batch=8, distinct_siblings=True)
    g = torch.Generator().manual_seed(seed)
    b, t = tokens.shape
    probs = torch.softmax(2 * torch.randn(b, t, 4, generator=g), -1)
    uniforms = 1 - torch.rand(b, t, generator=g)
    best, accepted, drawn = sample_accept(retrieve, tokens, probs, uniforms)
    assert drawn.shape == (b, t)
    for i in range(b):
        draws = [ref_draw(probs[i, s].double().tolist(), float(uniforms[i, s])) for s in range(t)]
        assert drawn[i].tolist() == draws
        walk = ref_walk(retrieve, tokens[i].tolist(), draws)
        assert int(accepted[i]) == len(walk) - 1
        assert retrieve[best[i], : len(walk)].tolist() == walk


def test_sample_accept_with_one_hot_targets_is_greedy_accept():
    """Temperature towards 0: the draws are the argmax whatever the uniforms, and the walk accepts
    exactly what greedy acceptance does."""
    for seed in range(5):
        retrieve, tokens, _ = random_case(seed, vocab=6, batch=8, distinct_siblings=True)
        logits = logits_following(retrieve, tokens, seed)
        probs = sampling_probs(logits, 0.001)
        uniforms = 1 - torch.rand(tokens.shape, generator=torch.Generator().manual_seed(seed))
        best, accepted, drawn = sample_accept(retrieve, tokens, probs, uniforms)
        assert torch.equal(drawn, logits.argmax(-1))
        g_best, g_accepted = greedy_accept(retrieve, tokens, logits.argmax(-1))
        assert torch.equal(accepted, g_accepted) and torch.equal(best, g_best)
        assert accepted.max() >= 1
