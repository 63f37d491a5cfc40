"""Lossless sampling over a Medusa tree (`acceptance="sample"`, docs/sampling.md).

The claim under test: the tokens emitted under `sample` follow plain sampling from the base model's
processed distribution (temperature, top-k, top-p) exactly. The oracle is the exact law of the first
K tokens, enumerated from transformers' logits on a model with a 72-token vocabulary; thousands of
seeded runs (one batch, one torch.Generator per sequence) are compared with it by a chi-square test.

False-alarm rate: each test rejects at p < ALPHA = 1e-3, so a correct implementation fails one of
the 12 statistical checks below with probability < 1.2% for a random seed; the seeds are fixed, so
the outcome is reproducible. Power: the deliberately broken rules (accept a draft when it is the
argmax; SpecInfer's min(1, p/q) rule applied to deterministic top-k candidates) fail the same
tests with p-values far below ALPHA.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from medusa_trt.acceptance import (
    greedy_accept,
    sample_accept,
    sample_tokens,
    sampling_probs,
    typical_accept,
    typical_posterior,
)
from medusa_trt.cli.run import main as run_main
from medusa_trt.converter.merge import convert
from medusa_trt.modeling import MedusaModel
from medusa_trt.runtime import steps
from medusa_trt.runtime.decoding import GenerationConfig, decode
from medusa_trt.runtime.torch_backend import TorchBackend
from medusa_trt.tools.train_heads import greedy_continuations, save_heads, train_heads
from medusa_trt.tree import build_tree

ALPHA = 1e-3
PROMPT = [5, 17, 30, 41]
WIDE = [[0], [1], [2], [3], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]]
CHAIN = [[0], [0, 0], [0, 0, 0]]


@pytest.fixture(scope="module")
def small(tmp_path_factory, tiny_base):
    """A 72-token Llama (the synthetic tokenizer's minimum) with 3 heads distilled on its own greedy
    continuations (a few seconds), so drafts are accepted often (about 60% at depth 1 at T=0.3)."""
    base = tiny_base("llama", vocab=72, hidden_size=32, intermediate=64, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(base).eval()
    rng = random.Random(0)
    train = [[rng.randrange(3, 72) for _ in range(6)] for _ in range(64)]
    state = train_heads(hf, greedy_continuations(hf, train, 48), num_heads=3, steps=150, batch_tokens=2048,
                        progress=False)
    root = tmp_path_factory.mktemp("sampling")
    save_heads(state, root / "heads", base, num_heads=3, num_layers=1)
    convert(base, root / "heads", root / "ckpt", progress=False)
    return SimpleNamespace(hf=hf, ckpt=root / "ckpt", backend=TorchBackend(MedusaModel.from_checkpoint(root / "ckpt")))


@torch.no_grad()
def exact_law(hf, prompt: list[int], k_tokens: int, **processing) -> dict[tuple[int, ...], float]:
    """P(first k_tokens tokens) of plain sampling, enumerated level by level from transformers' logits
    processed by `sampling_probs` (itself checked against transformers' warpers below)."""
    law = {(): 1.0}
    for _ in range(k_tokens):
        prefixes = list(law)
        logits = hf(torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1]
        probs = sampling_probs(logits, **processing).double()
        law = {p + (t,): law[p] * float(probs[i, t])
               for i, p in enumerate(prefixes) for t in probs[i].nonzero().flatten().tolist()}
    return law


def chi_square_p(samples: list[tuple[int, ...]], law: dict[tuple[int, ...], float]) -> float:
    """Pearson chi-square goodness of fit; cells expected below 5 are pooled into one (with any
    sample outside the law's support) so the chi-square approximation holds."""
    n = len(samples)
    counts = Counter(samples)
    stat, cells, pooled_e, pooled_o = 0.0, 0, 0.0, n
    for cell, p in law.items():
        if n * p >= 5:
            o, e = counts.get(cell, 0), n * p
            stat += (o - e) ** 2 / e
            cells += 1
            pooled_o -= o
        else:
            pooled_e += n * p
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        cells += 1
    elif pooled_o:
        return 0.0  # samples where the law has no mass at all
    df = cells - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def sampled_prefixes(backend, tree, k_tokens: int, n: int, use_medusa: bool = True, prompt=PROMPT, **processing):
    cfg = GenerationConfig(max_new_tokens=k_tokens, medusa_choices=tree, use_medusa=use_medusa,
                           acceptance="sample", seed=12345, **processing)
    result = decode(backend, [prompt] * n, cfg)
    return [tuple(t) for t in result.tokens], result.stats


CASES = [  # tree, tokens compared, processing: several trees, temperatures, top-k and top-p
    (WIDE, 2, dict(temperature=0.3)),
    (WIDE, 3, dict(temperature=0.5, top_k=5)),
    (CHAIN, 3, dict(temperature=1.0, top_k=3)),
    (WIDE, 2, dict(temperature=0.8, top_p=0.6)),
    # Trees chosen per step, with context candidates: a prompt that repeats itself, so the context's
    # continuation joins the drafter's nodes in the tree.
    ("dynamic:6", 3, dict(temperature=0.5, top_k=5, prompt=[5, 17, 30, 41, 5, 17, 30, 41, 5, 17])),
    ("dynamic:4", 2, dict(temperature=0.8, top_p=0.6)),
]


def follows_the_law(model, tree, k_tokens: int, processing: dict, n: int = 8000) -> None:
    processing = dict(processing)
    prompt = processing.pop("prompt", PROMPT)
    law = exact_law(model.hf, prompt, k_tokens, **processing)
    samples, stats = sampled_prefixes(model.backend, tree, k_tokens, n, prompt=prompt, **processing)
    # The acceptance path carries weight: accepted drafts within the k compared tokens (statistics count
    # none past max_new_tokens) in over 10% of the sequences (the T=0.8, top-p case: 16%).
    assert sum(s.accepted_draft_tokens for s in stats) > 0.1 * len(stats)
    assert chi_square_p(samples, law) > ALPHA


@pytest.mark.parametrize("tree,k_tokens,processing", CASES)
def test_sample_acceptance_follows_plain_sampling(small, tree, k_tokens, processing):
    follows_the_law(small, tree, k_tokens, processing)


@pytest.mark.parametrize("tree,k_tokens,processing", [CASES[1], CASES[4]])
def test_sample_acceptance_with_an_amphista_drafter_follows_plain_sampling(small_amphista, tree, k_tokens,
                                                                          processing):
    # The drafter depends on the tokens drawn so far (its cache holds them), unlike Medusa heads: the
    # same law must hold, on a static tree and on per-step trees with context candidates. 4,000 runs:
    # the reference drafts one sequence at a time (torch_backend.py), ~4 ms a sequence and step here.
    follows_the_law(small_amphista, tree, k_tokens, processing, n=4000)


def test_plain_sampling_on_the_same_backend_follows_the_law(small):
    processing = dict(temperature=0.5, top_k=5)
    samples, _ = sampled_prefixes(small.backend, None, 3, 4000, use_medusa=False, **processing)
    assert chi_square_p(samples, exact_law(small.hf, PROMPT, 3, **processing)) > ALPHA


def _argmax_rule(retrieve, tokens, probs, uniforms):
    """Broken: accepts a draft whenever it is the argmax of its parent's distribution."""
    drawn = sample_tokens(probs, uniforms)
    best, accepted = greedy_accept(retrieve, tokens, probs.argmax(-1))
    return best, accepted, drawn


@pytest.mark.parametrize("tree,k_tokens,processing", [CASES[1], CASES[4]])
def test_a_broken_rule_fails_the_same_test(small, monkeypatch, tree, k_tokens, processing):
    # The negative control, on a static tree and on per-step trees with context candidates: the
    # test above would catch an acceptance rule that biases the output on either path.
    processing = dict(processing)
    prompt = processing.pop("prompt", PROMPT)
    law = exact_law(small.hf, prompt, k_tokens, **processing)
    monkeypatch.setattr(steps, "sample_accept", _argmax_rule)
    samples, _ = sampled_prefixes(small.backend, tree, k_tokens, 8000, prompt=prompt, **processing)
    assert chi_square_p(samples, law) < ALPHA


# --- the rule itself on enumerated distributions (no model): every node of a tree, 200k draws at once


def _tree_case(seed: int, vocab: int = 6):
    """A tree with its slot tokens (children of a node are distinct, as the heads' top-k ranks are),
    random target distributions per slot, and the exact law of the step's outcome: (end slot, bonus
    token) with P = P(path to the slot) * p_slot(bonus), bonus not among the slot's children."""
    g = torch.Generator().manual_seed(seed)
    buffers = build_tree(WIDE, 3, 63)
    t = buffers.num_slots
    retrieve = torch.tensor(buffers.retrieve_indices)
    parent = [-1] * t
    for row in buffers.retrieve_indices:
        for a, b in zip(row[:-1], row[1:], strict=True):
            if b >= 0:
                parent[b] = a
    perm = torch.randperm(vocab, generator=g)
    tokens = torch.tensor([int(perm[0])] + [int(perm[buffers.rank[i]]) for i in range(1, t)])
    probs = torch.softmax(1.5 * torch.randn(t, vocab, generator=g), -1).double()
    reach = [1.0] * t
    for s in range(1, t):  # slots are in breadth-first order: parents first
        reach[s] = reach[parent[s]] * float(probs[parent[s], tokens[s]])
    law = {}
    for s in range(t):
        children = {int(tokens[c]) for c in range(t) if parent[c] == s}
        for v in range(vocab):
            if v not in children:
                law[(s, v)] = reach[s] * float(probs[s, v])
    return retrieve, tokens, probs.float(), law, perm


def _outcomes(rule, retrieve, tokens, probs, n: int, seed: int) -> list[tuple[int, int]]:
    uniforms = 1.0 - torch.rand(n, probs.shape[0], generator=torch.Generator().manual_seed(seed))
    best, accepted, drawn = rule(retrieve, tokens[None].expand(n, -1), probs[None].expand(n, -1, -1), uniforms)
    last = retrieve[best, accepted]
    return list(zip(last.tolist(), drawn[torch.arange(n), last].tolist(), strict=True))


def _q_rule_on_top_k(q):
    """Broken: SpecInfer's rule for children *sampled* from q (accept x with min(1, p/q); residual
    norm(max(p - q, 0))) applied to the deterministic top-k children the tree holds."""
    def rule(retrieve, tokens, probs, uniforms):
        b, t, v = probs.shape
        g = torch.Generator().manual_seed(7)
        slot = torch.zeros(b, dtype=torch.long)
        done = torch.zeros(b, dtype=torch.bool)
        accepted = torch.zeros(b, dtype=torch.long)
        drawn = torch.zeros(b, t, dtype=torch.long)
        kids = {s: [c for c in range(t) if int((retrieve[:, :-1] == s).logical_and(retrieve[:, 1:] == c).any())]
                for s in range(t)}
        for _ in range(retrieve.shape[1]):
            res = probs[torch.arange(b), slot].clone()
            moved = torch.zeros(b, dtype=torch.bool)
            for rank in range(max(len(c) for c in kids.values())):
                child = torch.tensor([kids[s][rank] if rank < len(kids[s]) else -1 for s in slot.tolist()])
                has = (child >= 0) & ~moved & ~done
                x = tokens[torch.arange(b), child.clamp(min=0)]
                px, qx = res[torch.arange(b), x], q[x]
                take = has & (torch.rand(b, generator=g) < (px / qx).clamp(max=1))
                slot = torch.where(take, child, slot)
                accepted += take.long()
                moved |= take
                rej = has & ~take
                res[rej] = (res[rej] - q[None]).clamp(min=0)
                res[rej] /= res[rej].sum(-1, keepdim=True)
            stop = ~moved & ~done
            drawn[stop, slot[stop]] = sample_tokens(res[stop], uniforms[stop, 0])
            done |= stop
        best = torch.tensor([next(i for i, r in enumerate(retrieve.tolist()) if r[a] == s)
                             for s, a in zip(slot.tolist(), accepted.tolist(), strict=True)])
        return best, accepted, drawn
    return rule


@pytest.mark.parametrize("seed", range(3))
def test_sample_accept_law_on_enumerated_trees(seed):
    retrieve, tokens, probs, law, _ = _tree_case(seed)
    assert abs(sum(law.values()) - 1) < 1e-6  # the outcomes partition the probability space (float32 probs)
    assert chi_square_p(_outcomes(sample_accept, retrieve, tokens, probs, 200_000, seed), law) > ALPHA
    assert chi_square_p(_outcomes(_argmax_rule, retrieve, tokens, probs, 200_000, seed), law) < ALPHA


def test_q_based_rule_is_not_exact_for_deterministic_candidates():
    """docs/sampling.md: with the candidates fixed (the heads' top ranks), the min(1, p/q) rule
    over-emits them; the point-mass rule is the exact one."""
    retrieve, tokens, probs, law, perm = _tree_case(0)
    ranked = torch.softmax(torch.randn(probs.shape[1], generator=torch.Generator().manual_seed(1)), -1).sort(descending=True).values
    q = torch.empty_like(ranked).index_copy_(0, perm, ranked)  # the rank-r child is q's r-th most likely token
    outcomes = _outcomes(_q_rule_on_top_k(q), retrieve, tokens, probs, 50_000, 0)
    assert chi_square_p(outcomes, law) < ALPHA


def test_sampling_probs_equals_transformers_warpers():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = torch.Generator().manual_seed(0)
    # Real-valued logits, and integer ones: ties at the nucleus' edge (frequent in float16 logits),
    # where which of the tied tokens stays is the warpers' tie order.
    for logits in (2 * torch.randn(64, 50, generator=g), torch.randint(0, 6, (256, 12), generator=g).float()):
        for t, k, p in [(0.7, None, 0.9), (1.0, 5, 1.0), (0.5, 8, 0.8), (1.3, None, 0.3), (1.0, 1, 1.0),
                        (1.0, None, 0.6), (1.0, 6, 0.5)]:
            ref = TemperatureLogitsWarper(t)(None, logits.clone())
            ref = TopKLogitsWarper(k)(None, ref) if k else ref
            ref = TopPLogitsWarper(p)(None, ref) if p < 1 else ref
            ours = sampling_probs(logits, t, k, p)
            assert torch.equal(ours > 0, torch.softmax(ref, -1) > 0), (t, k, p)
            assert torch.allclose(ours, torch.softmax(ref, -1), atol=1e-6), (t, k, p)


def test_nan_logits_are_one_error_not_token_0():
    # One NaN logit makes its row's distribution NaN, where every inverse-CDF draw is token 0.
    sampler = steps.Sampler(GenerationConfig(acceptance="sample", temperature=0.8), [0])
    with pytest.raises(ValueError, match="logits hold NaN"):
        sampler.draw(torch.tensor([[1.0, math.nan, 3.0, 2.0]]))
    assert sampler.draw(torch.tensor([[1.0, -math.inf, 3.0, 2.0]])).item() in (0, 2, 3)


def test_sample_tokens_never_draws_a_zero_probability_token():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0])
    edges = torch.tensor([2.0**-24, 0.5, 0.5 + 2.0**-24, 1.0])  # the smallest, a boundary, the largest u
    assert sample_tokens(probs.expand(4, -1), edges).tolist() == [1, 1, 3, 3]


def test_typical_accept_on_hand_made_distributions():
    """The typical rule production calls (acceptance.typical_accept), on a 2-slot chain: threshold
    min(epsilon, delta * exp(-H))."""
    retrieve = torch.tensor([[0, 1]])
    # Peaked: p = [0.97, 0.01, 0.01, 0.01]; H ~ 0.168 -> threshold = min(0.09, 0.3 e^-H = 0.254) = 0.09.
    peaked = torch.log(torch.tensor([0.97, 0.01, 0.01, 0.01]))
    flat = torch.zeros(4)  # p = 0.25, H = ln 4 -> threshold = min(0.09, 0.075) = 0.075 < 0.25
    logits = torch.stack([torch.stack([peaked, flat]), torch.stack([peaked, flat]), torch.stack([flat, flat])])
    tokens = torch.tensor([[0, 0], [0, 1], [0, 3]])
    assert typical_accept(retrieve, tokens, logits, 1.0, 0.09, 0.3)[1].tolist() == [1, 0, 1]
    # Lower epsilon lets the 0.01 token through; temperature sharpens and rejects it again.
    assert typical_accept(retrieve, tokens[1:2], logits[1:2], 1.0, 0.005, 0.3)[1].tolist() == [1]
    assert typical_accept(retrieve, tokens[1:2], logits[1:2], 0.5, 0.005, 0.3)[1].tolist() == [0]
    # Two paths accepted equally far: the larger log-probability wins.
    two = torch.tensor([[0, 1], [0, 2]])
    probs = torch.log(torch.tensor([0.1, 0.4, 0.5, 0.0001]))
    best, accepted = typical_accept(two, torch.tensor([[0, 1, 2]]), torch.stack([probs, flat, flat])[None], 1.0, 0.09, 0.3)
    assert (best.item(), accepted.item()) == (1, 1)


# --- reproducibility, limits, bad input


def test_seeded_runs_repeat_and_rows_equal_single_runs(small):
    prompts = [PROMPT, [9, 3, 60], [44] * 7]
    cfg = GenerationConfig(max_new_tokens=20, medusa_choices=WIDE, acceptance="sample", temperature=0.8, seed=42)
    batch = decode(small.backend, prompts, cfg).tokens
    assert decode(small.backend, prompts, cfg).tokens == batch
    for i, p in enumerate(prompts):  # row i draws from seed + i, whatever the batch
        assert decode(small.backend, [p], GenerationConfig(**{**cfg.__dict__, "seed": 42 + i})).tokens == [batch[i]]
    other = decode(small.backend, prompts, GenerationConfig(**{**cfg.__dict__, "seed": 43})).tokens
    assert other != batch
    # Per-step trees: each sampled row keeps the nodes worth its own slots, and its context chains are
    # scored by its own history, so its tree, and so its tokens, are the ones it has alone. Slot
    # costs that keep different widths per row (a loop prompt, [44] * 7, offers long context chains).
    for spec in ("dynamic:8,cost=0", "dynamic:8", "dynamic:8,cost=0.3"):
        per_step = GenerationConfig(**{**cfg.__dict__, "medusa_choices": spec})
        result = decode(small.backend, prompts, per_step)
        for i, p in enumerate(prompts):
            alone = GenerationConfig(**{**per_step.__dict__, "seed": 42 + i})
            assert decode(small.backend, [p], alone).tokens == [result.tokens[i]], (spec, i)
        assert sum(s.accepted_draft_tokens for s in result.stats) > 0, spec


def test_temperature_to_zero_is_greedy(small):
    prompts = [PROMPT, [9, 3, 60]]
    greedy = decode(small.backend, prompts, GenerationConfig(max_new_tokens=24, medusa_choices=WIDE)).tokens
    cold = GenerationConfig(max_new_tokens=24, medusa_choices=WIDE, acceptance="sample", temperature=1e-4, seed=0)
    assert decode(small.backend, prompts, cold).tokens == greedy


def test_a_temperature_below_float32s_range_is_greedy_not_token_0(small):
    """logits / T overflowed float32 for a T such as 1e-40 (allowed: any T > 0), the probabilities came
    out NaN and every draw was token 0, silently. The tempered logits are shifted first (acceptance.tempered)."""
    prompts = [PROMPT, [9, 3, 60]]
    greedy = decode(small.backend, prompts, GenerationConfig(max_new_tokens=12, medusa_choices=WIDE)).tokens
    for t in (1e-40, 1e-300):
        for medusa in (True, False):
            tree = {"medusa_choices": WIDE} if medusa else {"use_medusa": False}
            cold = GenerationConfig(max_new_tokens=12, acceptance="sample", temperature=t, seed=0, **tree)
            assert decode(small.backend, prompts, cold).tokens == greedy, (t, medusa)
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0]])
    assert sampling_probs(logits, 1e-300).tolist() == [[0.0, 0.5, 0.5, 0.0]]  # ties share the point mass
    probs, threshold = typical_posterior(logits, 1e-40, 0.09, 0.3)
    assert probs.isfinite().all() and threshold.isfinite().all()
    assert sampling_probs(torch.tensor([[1.0, float("nan")]]), 1e-40).isnan().all()  # not hidden as a token


def test_same_seed_same_tokens_on_onnx_runtime(ort_engine, tiny_merged):
    """The reference and the ONNX Runtime engine of one checkpoint draw the same tokens from one seed
    (the engine has the fused greedy step; `sample` takes the two-call path on it)."""
    from medusa_trt.runtime.ort.backend import OrtBackend

    engine = OrtBackend(ort_engine("llama"))
    assert engine.fused_step_topk
    reference = TorchBackend(MedusaModel.from_checkpoint(tiny_merged("llama")))
    prompts = [PROMPT, [9, 3, 60], [44] * 7, [70, 71]]
    cfg = GenerationConfig(max_new_tokens=24, acceptance="sample", temperature=0.5, top_p=0.95, seed=5)
    ours = decode(engine, prompts, cfg)
    assert ours.tokens == decode(reference, prompts, cfg).tokens
    assert sum(s.accepted_draft_tokens for s in ours.stats) > 0


@pytest.mark.parametrize("kw,message", [
    (dict(temperature=0.0), "temperature 0.0 with acceptance 'sample'.*use acceptance 'greedy'"),
    (dict(temperature=-1.0), "temperature must be a finite number >= 0"),
    (dict(temperature=float("inf")), "temperature must be a finite number >= 0, got inf"),
    (dict(top_p=0.0), r"top_p 0.0: expected a value in \(0, 1\]"),
    (dict(top_p=1.5), "top_p 1.5"),
    (dict(top_k=0), "top_k 0: expected an integer >= 1"),
    (dict(seed=1.5), "seed 1.5: expected an integer"),
    (dict(seed="7"), "seed '7'"),
    (dict(acceptance="typical", posterior_threshold=0.0), r"posterior_threshold must be a finite number in \(0, 1\]"),
    (dict(acceptance="typical", posterior_threshold=9.0), "posterior_threshold .* got 9.0"),  # epsilon is a probability
    (dict(acceptance="typical", posterior_alpha=0.0), "posterior_alpha must be a finite number > 0"),  # accepts all
    (dict(use_medusa="no"), "use_medusa 'no': expected True or False"),  # a string would read as True
    (dict(context_candidates=0), "context_candidates 0: expected True or False"),
    (dict(datastore=None), "datastore None: expected True or False"),
])
def test_bad_sampling_settings(kw, message):
    with pytest.raises(ValueError, match=message):
        GenerationConfig(**{"acceptance": "sample", **kw})


def test_medusa_run_sample_flags(small, capsys):
    args = ["--checkpoint", str(small.ckpt), "--prompt", "abc", "--max-new-tokens", "12", "--json",
            "--medusa-choices", str(WIDE), "--acceptance", "sample", "--temperature", "0.8", "--top-p", "0.9",
            "--top-k", "20", "--seed", "3"]
    import json

    assert run_main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert run_main(args) == 0
    assert json.loads(capsys.readouterr().out)["output_ids"] == first["output_ids"]
    assert run_main(args + ["--temperature", "0"]) == 2  # a rule between two flags: GenerationConfig's
    err = capsys.readouterr().err
    assert "temperature 0.0" in err and len(err.strip().splitlines()) == 1, err
    for bad, said in ((["--top-p", "1.2"], "--top-p 1.2: expected a number in (0, 1]"),
                      (["--top-k", "0"], "--top-k 0: expected a positive integer"),
                      (["--seed", "1.5"], "--seed 1.5: expected an integer"),
                      (["--temperature", "inf"], "--temperature inf: expected a non-negative finite number")):
        with pytest.raises(SystemExit) as exit_info:  # the flag's own range: refused while parsing
            run_main(args + bad)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and said in err and len(err.strip().splitlines()) == 1, err

