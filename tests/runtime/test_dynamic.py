"""Trees chosen per step (dynamic:N) and context candidates: the selection, the context index, and
decoding that stays equal to plain greedy with them."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random

import pytest

from medusa_trt.dynamic_spec import parse_dynamic, spec_cost
from medusa_trt.runtime.decoding import GenerationConfig, decode
from medusa_trt.runtime.dynamic import (
    MAX_NGRAM,
    SLOT_COST,
    Context,
    ContextIndex,
    ContextStats,
    DynamicTree,
    best_paths,
    best_union_chain,
    build_batch,
    choose_nodes,
    dynamic_tree,
    step_trees,
    worth,
)
from medusa_trt.tree import TreeError
from tests.runtime.test_decoding import EOS, oracle, prompts


def _random_topk(rng: random.Random, heads: int, k: int) -> tuple[list[list[int]], list[list[float]]]:
    ids, logp = [], []
    for _ in range(heads):
        p = sorted((rng.random() for _ in range(k)), reverse=True)
        total = sum(p) / rng.uniform(0.5, 1.0)  # the top-k holds part of the mass
        logp.append([math.log(x / total) for x in p])
        ids.append(rng.sample(range(1000), k))
    return ids, logp


@pytest.mark.parametrize("seed", range(20))
def test_best_paths_are_the_most_probable_and_form_a_tree(seed):
    rng = random.Random(seed)
    heads, k, budget = rng.randint(1, 4), rng.randint(1, 6), rng.randint(1, 20)
    ids, logp = _random_topk(rng, heads, k)
    got = best_paths(ids, logp, budget)
    every = [sum(logp[d][r] for d, r in enumerate(ranks))
             for depth in range(1, heads + 1) for ranks in itertools.product(range(k), repeat=depth)]
    best = sorted(every, reverse=True)[: len(got)]
    assert len(got) == min(budget, len(every))
    assert [s for s, _ in got] == pytest.approx(best)  # best first, and no better path left out
    paths = {p for _, p in got}
    assert all(p[:-1] in paths for p in paths if len(p) > 1)  # every parent kept


def test_context_chain_and_drafter_share_a_budget():
    tree = DynamicTree(budget=6, heads=2, topk=3)
    ids = [[10, 11, 12], [20, 21, 22]]
    logp = [[math.log(0.5), math.log(0.2), math.log(0.1)], [math.log(0.4), math.log(0.3), math.log(0.1)]]
    # A confident chain that starts with the drafter's second choice: its nodes outrank the drafter's deeper ones.
    ranked = choose_nodes(tree, ids, logp, [([11, 30, 31, 32], [math.log(0.9)] * 2 + [math.log(0.8)] * 2)])
    assert [s for s, _ in ranked] == sorted((s for s, _ in ranked), reverse=True)
    nodes = [p for _, p in ranked]
    assert len(nodes) == 6
    assert {(11,), (11, 30), (11, 30, 31), (11, 30, 31, 32)} <= set(nodes)
    assert (10,) in nodes and (10, 20) in nodes  # the drafter's best two: 0.5 and 0.2 beat the rest
    assert all(p[:-1] in nodes for p in nodes if len(p) > 1)
    assert all(p[:-1] in nodes[:i] for i, p in enumerate(nodes) if len(p) > 1)  # every prefix of the ranking is a tree
    chain = choose_nodes(DynamicTree(6, 2, 3, chains_only=True), ids, logp, [([11, 30, 31, 32], [math.log(0.9)] * 4)])
    assert [p for _, p in chain] == [(11,), (11, 30), (11, 30, 31), (11, 30, 31, 32)]  # the chain expecting more


def test_a_chain_only_engine_gets_the_best_chain_through_every_source():
    """Where an offered chain starts on the drafter's path, the chain takes each node's better score:
    the drafter's 0.5 for the shared first token, the offered chain's tail where it expects more."""
    ids, logp = [[10, 11], [20, 21]], [[math.log(0.5), math.log(0.3)], [math.log(0.4), math.log(0.3)]]
    offered = ([10, 21, 22], [math.log(0.3), math.log(0.25), math.log(0.25)])
    chain = choose_nodes(DynamicTree(6, 2, 2, chains_only=True), ids, logp, [offered])
    assert [p for _, p in chain] == [(10,), (10, 21), (10, 21, 22)]
    assert [math.exp(s) for s, _ in chain] == pytest.approx([0.5, 0.25, 0.25])
    assert best_union_chain({(1,): math.log(0.9), (1, 2): math.log(0.8), (1, 2, 3): math.log(0.7)}, 2) == [
        (math.log(0.9), (1,)), (math.log(0.8), (1, 2))]  # never deeper than the budget


def test_a_step_keeps_the_nodes_that_pay_for_their_slots():
    sure, unsure = [(math.log(0.95), (1,) * (i + 1)) for i in range(8)], [(math.log(0.05), (i,)) for i in range(8)]
    assert worth([sure], 0.08) == 8  # each slot adds 0.95 tokens for 8% of a step
    assert worth([unsure], 0.08) == 0  # a 5% node never pays for its slot
    assert worth([unsure[:3]], 0.0) == 3  # no cost: the whole budget
    assert worth([sure[:2] + unsure], 0.08) == 2
    # A batch: one sure chain pays for slots that three unsure sequences also pay for, up to a point.
    assert worth([sure], 0.3) == 8 and worth([sure] + [unsure] * 3, 0.3) == 0  # slots 3 of 4 would waste
    assert worth([sure] * 4, 0.3) == 8


def test_batch_tree_buffers():
    bt = build_batch([[(5,), (6,), (5, 7)], [(8,), (8, 9), (8, 9, 4)]], [1, 2], min_depth=4)
    assert bt.tokens.tolist() == [[1, 5, 6, 7], [2, 8, 9, 4]]
    assert bt.position_offsets.tolist() == [[0, 1, 1, 2], [0, 1, 2, 3]]
    assert bt.mask[0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert bt.mask[1].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert bt.retrieve.shape == (2, 2, 5)  # widened to min_depth + 1; the batch's most leaves
    assert bt.retrieve[0].tolist() == [[0, 2, -1, -1, -1], [0, 1, 3, -1, -1]]
    assert bt.retrieve[1, 0].tolist() == [0, 1, 2, 3, -1]
    assert build_batch([[]], [3]).retrieve.tolist() == [[[0, -1]]]  # the root alone


def test_a_nan_or_infinite_draft_costs_its_slot_never_the_tree():
    """A drafter that computes NaN or -inf log-probabilities (an overflow) makes greedy output no
    different, so it may cost speed but not the step: every tree stays closed under prefixes (a NaN
    score used to order a child before its parent, and build_batch failed on the missing parent)."""
    import torch

    for seed in range(300):
        rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
        heads, k = 3, 4
        ids = torch.stack([torch.randperm(50, generator=g)[:k] for _ in range(heads)])[None]
        logp = torch.log_softmax(torch.randn(heads, 50, generator=g), -1).sort(descending=True).values[:, :k][None]
        logp[0, rng.randrange(heads), rng.randrange(k)] = math.nan
        logp[0, rng.randrange(heads), rng.randrange(1, k)] = -math.inf
        prompt = [rng.randrange(50) for _ in range(12)]
        tree = DynamicTree(rng.choice([4, 8, 12]), heads, k, context=True, slot_cost=0.0)
        bt = step_trees(tree, torch.tensor([prompt[6]]), ids, logp, Context.of([prompt + prompt[:6]]))
        assert bt.mask[0, :, 0].all() and 1 <= bt.num_slots <= 1 + tree.budget, seed  # every slot under the root


def test_context_index_finds_the_latest_longest_match_and_loops():
    index = ContextIndex([1, 2, 3, 4, 9, 2, 3, 5])
    index.tokens.append(2)
    index.tokens.append(3)  # ... 2 3: the latest earlier "2 3" was followed by 5
    assert index.lookup(3) == (2, [5, 2, 3])
    loop = ContextIndex([7, 8, 7, 8])
    assert loop.lookup(5) == (2, [7, 8, 7, 8, 7])  # a loop continues with its period
    assert ContextIndex([1, 2, 3]).lookup(4) == (0, [])
    long = ContextIndex(list(range(100)) * 3)
    n, chain = long.lookup(4)
    assert n == MAX_NGRAM and chain == [0, 1, 2, 3]


def test_context_stats_learn_from_what_was_right():
    stats = ContextStats()
    prior = stats.scores(2, 3)
    assert prior == sorted(prior, reverse=True)
    for _ in range(20):
        stats.record(2, [5, 6, 7], [5, 6, 7, 8])
    assert stats.scores(2, 3)[2] > math.log(0.85)
    for _ in range(40):
        stats.record(1, [5, 6], [4, 6])
    assert stats.scores(1, 1)[0] < math.log(0.1)


@pytest.mark.parametrize("spec, message", [
    ("dynamic:0", "budget 0; expected dynamic:N with N >= 1"),
    ("dynamic:-3", "budget -3; expected dynamic:N with N >= 1"),
    ("dynamic:abc", "budget 'abc' is not an integer"),
    ("dynamic:64", "budget 64 exceeds the engine's max_draft_len 63"),
    ("dynamic:41", "budget 41 exceeds the drafter's 4 heads x top-10 = 40"),
    ("dynamic:8,cost=x", "cost 'x' is not a number"),
    ("dynamic:8,cost=-0.1", "cost -0.1; expected dynamic:N or dynamic:N,cost=C with C >= 0"),
    ("dynamic:8,cost=nan", "cost nan"),
    ("dynamic:8,width=3", "unknown option 'width=3'"),
    ("dynamic:4/fill", "unknown option /fill; .* medusa-bench --also's"),
])
def test_bad_budgets_name_the_value_and_the_limit(spec, message):
    with pytest.raises(TreeError, match=message):
        dynamic_tree(spec, heads=4, topk=10, max_draft_len=63)
    assert parse_dynamic("mc_sim_7b_63") is None and parse_dynamic([[0]]) is None


def test_a_spec_records_its_engine_slot_cost(tmp_path):
    # medusa-tune-tree writes the engine's measured cost into the spec; a caller's own cost wins.
    assert dynamic_tree("dynamic:8", 4, 10, 63).slot_cost == SLOT_COST
    assert dynamic_tree("dynamic:8,cost=0.31", 4, 10, 63).slot_cost == 0.31
    assert dynamic_tree("dynamic:8, COST = 0.31", 4, 10, 63, slot_cost=0.0).slot_cost == 0.0
    tree_file = tmp_path / "tree.json"
    tree_file.write_text(json.dumps({"medusa_choices": "dynamic:8,cost=0.31"}))
    assert spec_cost(tree_file) == 0.31 and parse_dynamic(tree_file) == 8 and spec_cost("dynamic:8") is None


def _cfg(tree, **kw) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=48, medusa_choices=tree, stop_token_ids=(EOS,), **kw)


@pytest.mark.parametrize("context", [True, False])
@pytest.mark.parametrize("budget", [1, 8, 16])
def test_dynamic_trees_equal_transformers_greedy_batch4(distilled, budget, context):
    m = distilled("llama")
    ps = prompts(7)
    result = decode(m.backend, ps, _cfg(f"dynamic:{budget}", context_candidates=context, slot_cost=0.0))
    assert result.tokens == [oracle(m.hf, p) for p in ps]
    assert sum(s.accepted_draft_tokens for s in result.stats) > 0
    assert all(s.draft_tokens == budget * s.steps for s in result.stats)  # slot_cost 0: the whole budget
    paying = decode(m.backend, ps, _cfg(f"dynamic:{budget}", context_candidates=context))
    assert paying.tokens == result.tokens
    assert all(s.draft_tokens <= budget * s.steps for s in paying.stats)
    # Without context candidates no path is deeper than the heads (4); with them, a chain may reach the budget.
    assert all(len(s.accepted_per_depth) == min(max(4, budget if context else 0), budget) for s in result.stats)


def test_dynamic_trees_beat_a_static_tree_of_the_same_size(distilled):
    m = distilled("llama")
    ps = prompts(8, lengths=[6] * 8)
    static = decode(m.backend, ps, _cfg([[0], [0, 0], [1], [0, 0, 0], [2], [0, 1], [1, 0], [0, 0, 0, 0]],
                                        context_candidates=False))
    dynamic = decode(m.backend, ps, _cfg("dynamic:8", context_candidates=False, slot_cost=0.0))
    assert dynamic.tokens == static.tokens

    def per_step(r):
        return sum(s.new_tokens for s in r.stats) / sum(s.steps for s in r.stats)
    assert per_step(dynamic) > per_step(static)  # SmolLM2's figures: BENCHMARKS.md


def test_context_candidates_follow_a_repeating_prompt(distilled):
    """A prompt that repeats a phrase: the continuation the base model chooses is greedy either way,
    and context candidates may only add accepted tokens, never change them."""
    m = distilled("llama")
    phrase = [17, 42, 99, 23, 5, 61]
    ps = [phrase * 5, [3] + phrase * 4]
    with_ctx = decode(m.backend, ps, _cfg("dynamic:8"))
    assert with_ctx.tokens == [oracle(m.hf, p) for p in ps]
    heads_only = decode(m.backend, ps, _cfg("dynamic:8", context_candidates=False))
    assert heads_only.tokens == with_ctx.tokens
    accepted = [sum(s.accepted_draft_tokens for s in r.stats) for r in (with_ctx, heads_only)]
    assert accepted[0] > accepted[1], accepted  # the context's chains were verified and taken


@pytest.mark.parametrize("acceptance", ["typical", "sample"])
def test_typical_and_sample_acceptance_run_on_per_step_trees(distilled, acceptance):
    """Per-step trees verified by each row of a ragged batch (a per-sequence retrieve), with drafts
    accepted. Typical: at T = 0 it is greedy (steps.py routes it there) and equals transformers'; at
    T > 0 it draws nothing, so every row decodes as it does alone. Sample: a seed repeats the text
    (seeds per sequence), another seed changes it."""
    m = distilled("llama")
    ps = prompts(9)
    cfg = _cfg("dynamic:8", acceptance=acceptance, temperature=0.7, seed=3)
    batch = decode(m.backend, ps, cfg)
    assert sum(s.accepted_draft_tokens for s in batch.stats) > 0
    if acceptance == "typical":
        greedy = decode(m.backend, ps, dataclasses.replace(cfg, temperature=0.0))
        assert greedy.tokens == [oracle(m.hf, p) for p in ps]
        alone = [decode(m.backend, [p], cfg) for p in ps]
        assert batch.tokens == [a.tokens[0] for a in alone]
        # and counts as it does alone: the inert pads that make a row's tree as wide as the batch's
        # widest are not drafts it verified
        assert [(s.draft_tokens, s.accepted_draft_tokens) for s in batch.stats] == [
            (a.stats[0].draft_tokens, a.stats[0].accepted_draft_tokens) for a in alone]
    else:
        assert decode(m.backend, ps, cfg).tokens == batch.tokens
        assert decode(m.backend, ps, dataclasses.replace(cfg, seed=4)).tokens != batch.tokens
