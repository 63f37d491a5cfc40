"""Medusa decoding against the transformers oracle: greedy Medusa == plain greedy, token for token."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import onnx
import pytest
import torch
from synthetic import EOS
from transformers import AutoModelForCausalLM

from medusa_trt.cli.run import main as run_main
from medusa_trt.converter.merge import convert
from medusa_trt.drafters.base import OUTSIDE_DRAFT_LOGIT
from medusa_trt.modeling import MedusaModel
from medusa_trt.quant import quantize_model_int4
from medusa_trt.runtime.decoding import GenerationConfig, decode, generate, step_tree
from medusa_trt.runtime.steps import step_plan
from medusa_trt.runtime.torch_backend import TorchBackend
from medusa_trt.tree import PRESETS

NEW = 48


def oracle(hf, prompt: list[int], n: int = NEW) -> list[int]:
    """transformers' plain greedy decoding, cut after the first EOS (generate pads after it)."""
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=n, do_sample=False, eos_token_id=EOS, pad_token_id=EOS)[0, len(prompt):].tolist()
    return out[: out.index(EOS) + 1] if EOS in out else out


def prompts(seed: int, lengths=(5, 11, 3, 8)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]


def greedy(tree="mc_sim_7b_63", **kw) -> GenerationConfig:
    kw.setdefault("stop_token_ids", (EOS,))
    return GenerationConfig(max_new_tokens=NEW, medusa_choices=tree, **kw)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("tree", list(PRESETS))
def test_greedy_medusa_equals_transformers_batch4(arch, tree, distilled):
    m = distilled(arch)
    ps = prompts(1)
    result = decode(m.backend, ps, greedy(tree))
    assert result.tokens == [oracle(m.hf, p) for p in ps]
    assert sum(s.accepted_draft_tokens for s in result.stats) > 0  # the acceptance path ran, not only the bonus


def random_tree(rng: random.Random, num_heads: int = 4) -> list[list[int]]:
    nodes = set()
    for _ in range(rng.randrange(1, 40)):
        path = tuple(rng.randrange(0, 6) for _ in range(rng.randrange(1, num_heads + 1)))
        nodes.update(path[:i] for i in range(1, len(path) + 1))
    return [list(n) for n in sorted(nodes)]


@pytest.mark.parametrize("seed", range(4))
def test_greedy_medusa_equals_transformers_random_trees_batch1(seed, distilled):
    m = distilled("llama")
    rng = random.Random(seed)
    tree = random_tree(rng)
    for p in prompts(seed + 10, lengths=(rng.randrange(2, 20),)):
        assert decode(m.backend, [p], greedy(tree)).tokens == [oracle(m.hf, p)], tree


@pytest.mark.parametrize("fmt", ["medusa_v2", "modelopt"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_with_heads_without_own_lm_head_and_random_heads(fmt, arch, tiny_base, tiny_merged):
    """v2 heads use the base lm_head; random heads mostly miss, so this is the bonus-token path."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_base(arch)).eval()
    backend = TorchBackend(MedusaModel.from_checkpoint(tiny_merged(arch, fmt)))
    ps = prompts(2)
    assert decode(backend, ps, greedy()).tokens == [oracle(hf, p) for p in ps]


def test_trivial_heads_predict_like_the_base(tiny_base, tiny_merged):
    """Untrained upstream-style heads (zero ResBlock, lm_head = base lm_head) still decode exactly."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_base("llama")).eval()
    backend = TorchBackend(MedusaModel.from_checkpoint(tiny_merged("llama", heads_kwargs={"trivial": True})))
    ps = prompts(3)
    assert decode(backend, ps, greedy()).tokens == [oracle(hf, p) for p in ps]


def test_acceptance_path_is_exercised(distilled):
    m = distilled("llama")
    ps = prompts(4, lengths=(6, 6, 9, 4))
    result = decode(m.backend, ps, greedy())
    assert result.tokens == [oracle(m.hf, p) for p in ps]
    steps = sum(s.steps for s in result.stats)
    tokens = sum(s.new_tokens for s in result.stats)
    assert all(s.accepted_draft_tokens > 0 for s in result.stats)
    assert tokens / steps > 1.3, [s.as_dict() for s in result.stats]
    for s in result.stats:
        assert s.accepted_per_depth[0] >= s.accepted_per_depth[-1]  # deeper nodes are reached less
        assert s.draft_tokens == 63 * s.steps
        assert s.accepted_draft_tokens == sum(s.accepted_per_depth)


def test_plain_mode_equals_transformers(distilled):
    m = distilled("qwen2")
    ps = prompts(5)
    result = decode(m.backend, ps, greedy(use_medusa=False))
    assert result.tokens == [oracle(m.hf, p) for p in ps]
    assert all(s.steps == s.new_tokens for s in result.stats)


def test_stop_token_ends_only_its_sequence(distilled):
    """A stop id taken from inside one greedy continuation: that sequence ends on it (inclusive),
    the others run on, and every output stays equal to the oracle cut at the same id."""
    m = distilled("llama")
    ps = prompts(6)
    full = [oracle(m.hf, p) for p in ps]
    stop = full[0][7]
    result = decode(m.backend, ps, greedy(stop_token_ids=(EOS, stop)))
    for toks, ref in zip(result.tokens, full, strict=True):
        cut = next((i for i, t in enumerate(ref) if t == stop), None)
        assert toks == (ref[: cut + 1] if cut is not None else ref)
    assert len(result.tokens[0]) <= 8


def test_streaming_yields_the_same_tokens(distilled):
    m = distilled("llama")
    ps = prompts(7)
    streamed = [[] for _ in ps]
    steps = 0
    for step in generate(m.backend, ps, greedy()):
        steps += 1
        for i, t in enumerate(step.new_tokens):
            streamed[i].extend(t)
    assert streamed == decode(m.backend, ps, greedy()).tokens
    assert steps < NEW  # several tokens per step on the distilled heads


def test_typical_acceptance_is_deterministic_and_temperature_zero_is_greedy(distilled):
    m = distilled("llama")
    ps = prompts(8)
    typical = GenerationConfig(max_new_tokens=NEW, acceptance="typical", temperature=0.7, stop_token_ids=(EOS,))
    first, second = decode(m.backend, ps, typical), decode(m.backend, ps, typical)
    assert first.tokens == second.tokens
    assert all(len(t) == NEW or t[-1] == EOS for t in first.tokens)
    zero = GenerationConfig(max_new_tokens=NEW, acceptance="typical", temperature=0.0, stop_token_ids=(EOS,))
    assert decode(m.backend, ps, zero).tokens == [oracle(m.hf, p) for p in ps]


def test_too_long_request_is_a_clear_error(distilled):
    m = distilled("llama")
    with pytest.raises(ValueError, match="maximum sequence length 512"):
        next(generate(m.backend, [[5] * 500], greedy()))
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        GenerationConfig(max_new_tokens=0)


@pytest.mark.parametrize("prompts, config, message", [
    ([[-1, 5]], {}, "prompt 0: token -1 at position 0; expected integer ids in 0..255"),  # an engine wraps it
    ([[5], [256]], {}, "prompt 1: token 256"),
    ([[1.5, 2]], {}, "token 1.5"),
    ([[True, 5]], {}, "token True"),
    ([[]], {}, "every prompt needs at least one token"),
    ("abc", {}, "expected a non-empty list of token id lists"),
    ([[5]], {"stop_token_ids": (999,)}, "stop_token_ids [999]: token id 999 is beyond the vocabulary"),
    ([[5]], {"medusa_choices": 5}, "medusa_choices: got int 5"),
])
def test_bad_prompts_and_values_are_one_clear_error(distilled, prompts, config, message):
    from medusa_trt.tree import TreeError

    with pytest.raises((ValueError, TreeError), match=re.escape(message)):
        next(generate(distilled("llama").backend, prompts, GenerationConfig(max_new_tokens=4, **config)))


@pytest.mark.parametrize("config, message", [
    ({"max_new_tokens": 3.5}, "max_new_tokens must be an integer >= 1, got 3.5"),
    ({"max_new_tokens": True}, "max_new_tokens must be an integer >= 1, got True"),
    ({"temperature": "0.5"}, "temperature '0.5': expected a number"),
    ({"acceptance": "sample", "top_p": None}, "top_p None: expected a number"),
    ({"stop_token_ids": 5}, "stop_token_ids 5: expected a list of token ids"),
    ({"stop_token_ids": (-1,)}, "stop_token_ids (-1,)"),
])
def test_generation_config_types(config, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        GenerationConfig(**config)


def test_numpy_integers_are_integers():
    cfg = GenerationConfig(acceptance="sample", temperature=1.0, top_k=np.int64(5), seed=np.uint64(3))
    assert (cfg.top_k, cfg.seed) == (5, 3) and type(cfg.top_k) is int


def test_seeds_are_checked_like_the_config_seed(distilled):
    cfg = GenerationConfig(max_new_tokens=2, acceptance="sample", temperature=1.0)
    for seeds in ([-1], [2**64], [1, 2]):
        with pytest.raises(ValueError, match=r"expected 1 integers in \[0, 2\*\*63\)"):
            next(generate(distilled("llama").backend, [[5, 6]], cfg, None, seeds))


def test_medusa_run_cli(distilled, capsys):
    ckpt = distilled("llama").ckpt
    assert run_main(["--checkpoint", str(ckpt), "--prompt", "def fib(n):", "--max-new-tokens", "24", "--json"]) == 0
    medusa = json.loads(capsys.readouterr().out)
    assert run_main(["--checkpoint", str(ckpt), "--prompt", "def fib(n):", "--max-new-tokens", "24",
                     "--json", "--no-medusa"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert medusa["output_ids"] == plain["output_ids"] and medusa["steps"] < plain["steps"]
    assert run_main(["--checkpoint", str(ckpt), "--prompt", "x", "--medusa-choices", "[[0], [0, 0, 0, 0, 0]]"]) == 2
    assert "depth 5 exceeds" in capsys.readouterr().err
    assert run_main(["--checkpoint", str(ckpt / "missing"), "--prompt", "x"]) == 2


@pytest.fixture(scope="module")
def distilled_engine(distilled, tmp_path_factory):
    """The ONNX Runtime engine of distilled("llama"), built once for this file's engine tests."""
    from medusa_trt.engines.build import build_engine
    from medusa_trt.engines.options import BuildOptions

    out = tmp_path_factory.mktemp("distilled") / "engine"
    build_engine(BuildOptions(checkpoint=distilled("llama").ckpt, out=out, progress=False))
    return out


def test_fused_greedy_step_equals_the_unfused_loop(distilled, distilled_engine):
    """The ONNX Runtime engine's fused step (verify + accept + heads + next tree in one call) takes
    the same path as the loop's own acceptance: same tokens and statistics, batch 4, ragged prompts,
    one sequence ending early on a stop id; a tree shallower than the heads (the graph drafts with as
    many heads as the tree is deep); a tree with a rank beyond the graph's top-k falls back; trees
    chosen per step from the graph's top-k log-probs, with context candidates."""
    from medusa_trt.runtime.ort.backend import OrtBackend

    m = distilled("llama")
    backend = OrtBackend(distilled_engine)
    assert backend.fused_step_topk == 10
    ps = prompts(12)
    full = [oracle(m.hf, p) for p in ps]
    stop = full[1][9]
    expected = []
    for ref in full:
        cut = next((i for i, t in enumerate(ref) if t == stop), None)
        expected.append(ref[: cut + 1] if cut is not None else ref)
    for tree in ("mc_sim_7b_63", [[0], [0, 0], [1], [0, 0, 0]], [[0], [1]], [[0], [10]], "dynamic:8", "dynamic:3"):
        cfg = greedy(tree, stop_token_ids=(EOS, stop))
        assert step_plan(backend, cfg, step_tree(backend.info, tree)).kind == ("two_call" if tree == [[0], [10]]
                                                                            else "fused")
        fused = decode(backend, ps, cfg)
        backend.fused_step_topk = None  # the loop's own acceptance and top-k, two engine calls a step
        unfused = decode(backend, ps, cfg)
        backend.fused_step_topk = 10
        assert fused.tokens == unfused.tokens == expected, tree
        if not isinstance(tree, str) or not tree.startswith("dynamic"):  # per-step trees: log-probs from
            # the graph or the host may round apart and pick other trees of equal worth
            assert [s.as_dict() | {"prefill_s": 0, "decode_s": 0} for s in fused.stats] == \
                [s.as_dict() | {"prefill_s": 0, "decode_s": 0} for s in unfused.stats], tree
        assert sum(s.accepted_draft_tokens for s in fused.stats) > 0
    # Heads past a tree's depth are skipped at run time: head h > 0 sits behind an If on depth > h.
    step = onnx.load(str(distilled_engine / "model_step.onnx"), load_external_data=False)
    assert sum(n.op_type == "If" for n in step.graph.node) == backend.num_medusa_heads - 1 >= 2


@pytest.mark.parametrize("kind", ["reference", "engine"])
def test_medusa_decodes_what_plain_decoding_fits(kind, distilled, distilled_engine, monkeypatch):
    """A decode needs room for its prompt and new tokens only, as plain decoding does: near
    max_seq_len the loop cuts each step's tree to the slots below it (StepTree.within_room,
    DynamicTree.within_room), and the tokens stay transformers' greedy ones. Here the limit is
    lowered to the longest prompt + its new tokens exactly, so the last steps of every tree are cut,
    down to the root alone; no position fed reaches the limit (the engine's forward would refuse it
    too). Batched, ragged, fused and two-call steps, static and per-step trees, and a sampled decode
    (any tree keeps sampling lossless)."""
    import dataclasses

    from medusa_trt.runtime.ort.backend import OrtBackend

    m = distilled("llama")
    backend = m.backend if kind == "reference" else OrtBackend(distilled_engine)
    new = 24
    ps = prompts(21, lengths=(30, 7, 19))
    limit = max(map(len, ps)) + new
    monkeypatch.setattr(backend, "info", dataclasses.replace(backend.info, max_seq_len=limit))
    positions: dict[str, list[int]] = {"forward": [], "fused_step": []}  # the largest position of each call

    def spy(call, run):
        def seen(tokens, pos, *a, **k):
            positions[call].append(int(pos.max()))
            return run(tokens, pos, *a, **k)
        return seen

    for call in positions:
        monkeypatch.setattr(backend, call, spy(call, getattr(backend, call)))
    expected = [oracle(m.hf, p, new) for p in ps]
    for tree in ("mc_sim_7b_63", [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]], "dynamic:8"):
        cfg = GenerationConfig(max_new_tokens=new, medusa_choices=tree, stop_token_ids=(EOS,))
        assert step_tree(backend.info, tree).max_depth >= 3  # the old rule (+ depth) refused these prompts
        for topk in (10, None) if kind == "engine" else (None,):  # the engine: fused, then two-call steps
            monkeypatch.setattr(backend, "fused_step_topk", topk)
            result = decode(backend, ps, cfg)
            assert result.tokens == expected, (tree, topk)
            assert sum(s.accepted_draft_tokens for s in result.stats) > 0
    sampled = decode(backend, ps, GenerationConfig(max_new_tokens=new, acceptance="sample", temperature=0.8, seed=3,
                                                   stop_token_ids=()))
    assert [len(t) for t in sampled.tokens] == [new] * len(ps)
    with pytest.raises(ValueError, match=f"max_new_tokens \\({new + 1}\\) exceeds"):
        decode(backend, ps, GenerationConfig(max_new_tokens=new + 1))
    assert max(positions["forward"] + positions["fused_step"]) == limit - 1
    assert (max(positions["fused_step"]) == limit - 1) if kind == "engine" else not positions["fused_step"]


def test_tree_cut_near_max_seq_len():
    """within_room: the slots whose positions stay below max_seq_len after every sequence's prefix;
    a per-step tree gets the budget of the positions left after the root."""
    from medusa_trt.runtime.dynamic import DynamicTree
    from medusa_trt.tree import StepTree, build_tree

    tree = StepTree.of(build_tree([[0], [1], [0, 0], [1, 0], [0, 0, 0]], 3, 8), 1000)
    assert tree.within_room(torch.tensor([16]), 20) is tree  # positions 16..19
    assert tree.within_room(torch.tensor([17]), 20).num_slots == 5  # depth 2 at most: root, [0], [1], [0,0], [1,0]
    assert tree.within_room(torch.tensor([18, 3]), 20).num_slots == 3  # the longest prefix counts
    assert tree.within_room(torch.tensor([19]), 20).num_slots == 1  # the root alone
    assert tree.within_room(torch.tensor([18]), 20) is tree.within_room(torch.tensor([18]), 20)  # cut once
    dyn = DynamicTree(budget=8, heads=3, topk=10, context=False)
    assert dyn.within_room(torch.tensor([10]), 20) is dyn
    assert dyn.within_room(torch.tensor([17]), 20).budget == 2
    assert dyn.within_room(torch.tensor([19]), 20).budget == 0


def test_draft_vocabulary_heads(distilled, tmp_path):
    """Heads with a draft vocabulary (config.json `draft_vocab`, as medusa-train-heads writes for
    heads trained over a vocabulary subset): their logits are the full heads' logits on those ids and
    OUTSIDE_DRAFT_LOGIT elsewhere, in the reference and the engine alike (medusa-check passes); the
    engine's fused step drafts from the subset; greedy output still equals transformers'."""
    import shutil

    from medusa_trt.cli.check import main as check_main
    from medusa_trt.engines.build import build_engine
    from medusa_trt.engines.options import BuildOptions
    from medusa_trt.engines.ort.build import OrtOptions
    from medusa_trt.runtime.ort.backend import OrtBackend

    m = distilled("llama")
    heads = tmp_path / "heads"
    shutil.copytree(m.ckpt.parent / "heads", heads)
    ps = prompts(6)
    full = [oracle(m.hf, p) for p in ps]
    counts = torch.bincount(torch.tensor([t for r in full for t in r]), minlength=m.hf.config.vocab_size)
    vocab = sorted(counts.argsort(descending=True)[:48].tolist())
    config = json.loads((heads / "config.json").read_text())
    (heads / "config.json").write_text(json.dumps(config | {"draft_vocab": vocab}))
    convert(m.hf.name_or_path, heads, tmp_path / "ckpt", progress=False)
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["medusa_trt"]["draft_vocab"] == vocab

    sub, ref = MedusaModel.from_checkpoint(tmp_path / "ckpt"), MedusaModel.from_checkpoint(m.ckpt)
    h = torch.randn(2, 3, sub.cfg.hidden_size)
    got, want = sub.draft(h), ref.draft(h)
    outside = torch.ones(sub.cfg.vocab_size, dtype=torch.bool)
    outside[vocab] = False
    assert torch.equal(got[..., vocab], want[..., vocab])
    assert (got[..., outside] == OUTSIDE_DRAFT_LOGIT).all()

    build_engine(BuildOptions(checkpoint=tmp_path / "ckpt", out=tmp_path / "engine", progress=False))
    backend = OrtBackend(tmp_path / "engine")
    for tree in ("mc_sim_7b_63", [[0], [0, 0], [1], [0, 0, 0]], [[0], [1]]):
        cfg = greedy(tree)
        fused = decode(backend, ps, cfg)
        backend.fused_step_topk = None
        unfused = decode(backend, ps, cfg)
        backend.fused_step_topk = 10
        torch_run = decode(TorchBackend(sub), ps, cfg)
        assert fused.tokens == unfused.tokens == torch_run.tokens == full, tree
        assert sum(s.accepted_draft_tokens for s in fused.stats) > 0
    assert check_main(["--engine", str(tmp_path / "engine"), "--checkpoint", str(tmp_path / "ckpt"),
                       "--max-new-tokens", "12", "--tree-steps", "2"]) == 0

    # int4 engines hold the draft matrix as MatMulNBits too; the reference mirrors it (medusa-check).
    build_engine(BuildOptions(checkpoint=tmp_path / "ckpt", out=tmp_path / "engine_int4", progress=False,
                              backend_options=OrtOptions(weights="int4", int4_block_size=32)))
    info = json.loads((tmp_path / "engine_int4" / "engine.json").read_text())
    assert info["weights"]["draft_int4"]
    int4 = OrtBackend(tmp_path / "engine_int4")
    h = torch.randn(5, sub.cfg.hidden_size)
    for mirrored in (True, False):  # the engine's heads against the reference with and without it
        ref = MedusaModel.from_checkpoint(tmp_path / "ckpt")
        quantize_model_int4(ref, 32, 4, draft=mirrored)
        with torch.no_grad():
            want = ref.draft(h[None])[:, 0]
        diff = (int4.heads_session.run(None, {"hidden": h.numpy()})[0] - want.numpy())[..., vocab]
        # level 4's criterion (tests/runtime/test_int4_decoding.py): p90 within 1e-4; unmirrored it is ~0.05
        assert (np.quantile(np.abs(diff), 0.9) <= 1e-4) == mirrored
    plain = decode(int4, ps, GenerationConfig(max_new_tokens=NEW, use_medusa=False, stop_token_ids=(EOS,)))
    assert decode(int4, ps, greedy([[0], [0, 0], [1]])).tokens == plain.tokens
    assert check_main(["--engine", str(tmp_path / "engine_int4"), "--checkpoint", str(tmp_path / "ckpt"),
                       "--max-new-tokens", "12", "--tree-steps", "2"]) == 0

    # int8 engines hold the heads' draft matrices as int8 too (Int8Linear), and each base Linear's
    # float channels, picked here on a text file; Medusa still equals plain.
    (tmp_path / "calib.txt").write_text("a b c d e f\nhello world again and again\n")
    build_engine(BuildOptions(checkpoint=tmp_path / "ckpt", out=tmp_path / "engine_int8", progress=False,
                              backend_options=OrtOptions(weights="int8", int8_float_channels=4,
                                                         calibration=tmp_path / "calib.txt")))
    info = json.loads((tmp_path / "engine_int8" / "engine.json").read_text())
    assert info["weights"]["draft_int8"] and "int8_float_channels" in info["requires"]
    floats = info["weights"]["float_channels"]
    assert floats["count"] == 4 and floats["calibration"].endswith("calib.txt: 2 texts")
    assert len(floats["channels"]) == 4 * sub.cfg.num_layers + 1  # qkv, fc, gate, proj per layer; lm_head
    int8 = OrtBackend(tmp_path / "engine_int8")
    plain = decode(int8, ps, GenerationConfig(max_new_tokens=NEW, use_medusa=False, stop_token_ids=(EOS,)))
    assert decode(int8, ps, greedy([[0], [0, 0], [1]])).tokens == plain.tokens
    assert check_main(["--engine", str(tmp_path / "engine_int8"), "--checkpoint", str(tmp_path / "ckpt"),
                       "--max-new-tokens", "12", "--tree-steps", "2"]) == 0

    # Heads sharing one lm_head share one draft matrix: the step graph drafts with as many heads as
    # the tree is deep, and medusa-tune-tree times steps of more slots than that through it.
    from medusa_trt.tools.tree_measure import measure_forward_ms

    state = torch.load(heads / "medusa_lm_head.pt")
    for h in range(1, config["medusa_num_heads"]):
        state[f"{h}.{config['medusa_num_layers']}.weight"] = state[f"0.{config['medusa_num_layers']}.weight"]
    torch.save(state, heads / "medusa_lm_head.pt")
    convert(m.hf.name_or_path, heads, tmp_path / "shared", progress=False)
    build_engine(BuildOptions(checkpoint=tmp_path / "shared", out=tmp_path / "engine_shared", progress=False))
    shared = OrtBackend(tmp_path / "engine_shared")
    forward, _ = measure_forward_ms(shared, full[0][:8], max_tokens=config["medusa_num_heads"] + 3, reps=1,
                                    progress=False)
    assert len(forward) == config["medusa_num_heads"] + 3


def test_tree_cut_and_key_block():
    """StepTree.cut keeps the first slots as a tree (paths to its leaves, full depth); within_block
    cuts a branching tree where its slots would cross a block edge after some sequence's prefix,
    and never a chain."""
    from medusa_trt.tree import StepTree, build_tree

    tree = StepTree.of(build_tree([[0], [1], [0, 0], [1, 0]], 2, 8), 1000)
    cut = tree.cut(3)  # root, [0], [1]
    assert cut.num_slots == 3 and cut.max_depth == 1
    assert cut.retrieve.tolist() == [[0, 1, -1], [0, 2, -1]]
    assert torch.equal(cut.mask, tree.mask[:3, :3]) and torch.equal(cut.candidate_index, tree.candidate_index)
    assert tree.cut(1).retrieve.tolist() == [[0, -1, -1]]
    assert tree.within_block(torch.tensor([3]), 8) is tree  # slots at 3..7: inside [0, 8)
    assert tree.within_block(torch.tensor([5]), 8).num_slots == 3  # slots 5, 6, 7 before 8
    assert tree.within_block(torch.tensor([5]), 8) is tree.within_block(torch.tensor([13]), 8)  # cut once
    assert tree.within_block(torch.tensor([7, 2]), 8).num_slots == 1  # every sequence's edge counts
    assert tree.within_block(torch.tensor([7]), None) is tree  # engines without a key block
    chain = StepTree.of(build_tree([[0], [0, 0]], 2, 8), 1000)
    assert chain.is_chain and not tree.is_chain
    assert chain.within_block(torch.tensor([7]), 8) is chain
