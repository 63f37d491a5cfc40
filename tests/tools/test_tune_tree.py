"""medusa-tune-tree: the greedy construction on hand-made accuracy tables, the hardware-aware choice
and its guard, and the CLI end to end on a tiny checkpoint."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from medusa_trt.cli import tune_tree as tune_cli
from medusa_trt.dynamic_spec import parse_dynamic, spec_cost
from medusa_trt.tools import tree_choice as tc
from medusa_trt.tools import tune_tree as ts
from medusa_trt.tools.train_heads import rank_hits
from medusa_trt.tools.tree_measure import StepTimes, non_decreasing
from medusa_trt.tools.tune_tree import (
    choose_tree,
    expected_tokens_per_step,
    greedy_tree,
    joint_tree,
    simulate,
)
from medusa_trt.tree import build_tree, parse_medusa_choices

# Head k (row) rank r (column): P(rank-r token of head k is the greedy token). Chosen without ties.
ACC = [[0.6, 0.2, 0.1],
       [0.5, 0.3, 0.05],
       [0.4, 0.15, 0.01]]


def test_greedy_construction_on_a_hand_made_table():
    # Values: (0)=.6 (0,0)=.3 (1)=.2 (0,1)=.18 (0,0,0)=.12 (1,0)=.1 (2)=.1 -> tie, smaller path first
    nodes = greedy_tree(ACC, 7)
    assert [p for p, _ in nodes] == [(0,), (0, 0), (1,), (0, 1), (0, 0, 0), (1, 0), (2,)]
    assert [round(v, 6) for _, v in nodes] == [0.6, 0.3, 0.2, 0.18, 0.12, 0.1, 0.1]
    # Next: (0,1,0)=.072 beats (1,1)=.06 and (0,0,1)=.045
    assert greedy_tree(ACC, 8)[-1][0] == (0, 1, 0)


def test_depth_is_bounded_by_the_heads():
    nodes = greedy_tree([[1.0], [1.0]], 10)
    assert [p for p, _ in nodes] == [(0,), (0, 0)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.floats(0, 1), min_size=1, max_size=5), min_size=1, max_size=4), st.integers(1, 40))
def test_every_prefix_is_a_tree_and_values_never_increase(acc, n):
    nodes = greedy_tree(acc, n)
    seen = set()
    for i, (path, value) in enumerate(nodes):
        assert len(path) == 1 or path[:-1] in seen  # parent already in: the prefix is a tree
        seen.add(path)
        assert math.isclose(value, math.prod(acc[d][r] for d, r in enumerate(path)))
        if i:
            assert value <= nodes[i - 1][1] + 1e-12
    assert len(nodes) == min(n, len(seen))


def test_expected_tokens_per_step():
    assert expected_tokens_per_step(ACC, [[0], [0, 0], [1]]) == pytest.approx(1 + 0.6 + 0.3 + 0.2)
    # Ranks beyond the measured table never count; a deeper path than the table counts 0.
    assert expected_tokens_per_step(ACC, [[0], [7]]) == pytest.approx(1.6)
    assert expected_tokens_per_step(ACC, [[0, 0, 0, 0]]) == pytest.approx(1.0)


# Rank of the true token in head 1, head 2's top-k at each row of two continuations (-1: missed).
ROWS = [[(0, 0), (1, -1), (0, 1), (-1, -1)],
        [(0, 0), (0, 0), (0, 0), (2, 0), (0, -1)]]


def test_replay_walks_the_continuation_like_decoding():
    # Sequence 1, tree {0, 00}: row 0 accepts 2 drafts (3 tokens), row 3 none (1 token): 2 steps.
    # Sequence 2: row 0 -> 3 tokens, row 3 (rank 2 missing from the tree) -> 1, row 4 -> the last 1.
    tokens_per_step, starts = simulate(ROWS, [[0], [0, 0]])
    assert starts == [[0, 3], [0, 3, 4]]
    assert tokens_per_step == pytest.approx((4 + 5) / 5)
    # The root alone emits one token per step; a wider tree accepts row 3 of sequence 2.
    assert simulate(ROWS, [[7]])[0] == 1.0
    assert simulate(ROWS, [[0], [0, 0], [2], [2, 0]])[1][1] == [0, 3]


def test_joint_tree_counts_whole_paths():
    nodes = joint_tree(ROWS, 10)
    # 9 rows: rank 0 at depth 1 in 6, path (0, 0) in 4, (0, 1) in 1, (1,) in 1, (2,) and (2, 0) in 1.
    assert nodes[:2] == [((0,), pytest.approx(6 / 9)), ((0, 0), pytest.approx(4 / 9))]
    assert {p for p, _ in nodes} == {(0,), (0, 0), (0, 1), (1,), (2,), (2, 0)}
    seen = set()
    for path, _ in nodes:  # every prefix is a tree
        assert len(path) == 1 or path[:-1] in seen
        seen.add(path)
    weighted = joint_tree(ROWS, 10, weights=[[0, 0, 0, 1], [0, 0, 0, 1, 0]])  # only rows 3 count
    assert weighted == [((2,), 0.5), ((2, 0), 0.5)]


def test_replay_estimator_is_used_when_rows_are_given():
    choice = choose_tree(ACC, steps([1.0] * 10), 6, rank_paths=ROWS)
    assert choice.estimator == "replay"
    assert choice.tokens_per_step == pytest.approx(simulate(ROWS, choice.medusa_choices)[0], abs=1e-4)
    assert choice.tokens_per_step == pytest.approx(9 / 4)  # (0, 0) and (2, 0) accept all there is to accept
    assert choice.construction.startswith("joint")
    assert choose_tree(ACC, steps([1.0] * 10), 6).estimator == "product"


@pytest.mark.parametrize("chains_only", [False, True])
def test_calibration_without_a_usable_step_is_one_clear_error(chains_only):
    """No head ever ranked a calibration token in its top-k (every row missed): no order has a
    node to offer, and the tuner says so instead of failing inside max()."""
    misses = [[(-1, -1)] * 4, [(-1, -1)] * 5]
    zero = [[0.0] * 3 for _ in range(2)]
    with pytest.raises(ValueError, match="calibration gave no usable step"):
        choose_tree(zero, steps([1.0] * 10), 6, rank_paths=misses, chains_only=chains_only)
    # A chains-only engine whose heads ranked the right token second, never first: no chain to draft.
    second = [[(1, -1)] * 4]
    if chains_only:
        with pytest.raises(ValueError, match="calibration gave no usable step"):
            choose_tree([[0.0, 0.5], [0.0, 0.0]], steps([1.0] * 10), 1, rank_paths=second, chains_only=True)


def steps(forward: list[float], host_plain=0.0, host_tree=(0.0, 0.0)) -> StepTimes:
    return StepTimes(forward, forward, forward[0], host_plain, host_tree)


def test_flat_step_time_takes_every_useful_node():
    choice = choose_tree(ACC, steps([1.0] * 30), max_nodes=20)
    assert choice.recommendation == "medusa"
    # Step time never grows and every node has a positive value: the largest tree allowed wins.
    assert choice.nodes == 20
    assert choice.speedup_vs_plain == pytest.approx(expected_tokens_per_step(ACC, choice.medusa_choices), abs=1e-3)


def test_the_size_balances_tokens_per_step_and_step_time():
    # Each extra tree token costs 10% of a plain step. Expected tokens/ms by size: 1.6/1.1, 1.9/1.2,
    # 2.1/1.3, 2.28/1.4 (best, 1.629x), 2.40/1.5 (1.600x): the fifth node no longer pays for itself.
    forward = [1.0 + 0.1 * t for t in range(30)]
    choice = choose_tree(ACC, steps(forward), max_nodes=20)
    speedups = [row["speedup_vs_plain"] for row in choice.by_size]
    assert choice.nodes == 1 + speedups.index(max(speedups))
    assert choice.medusa_choices == [[0], [0, 0], [1], [0, 1]]
    assert choice.speedup_vs_plain == pytest.approx(2.28 / 1.4, abs=1e-3)


def test_chains_only_chooses_a_chain():
    """An engine exact for chains only (engine.json onnx.chains_only) gets a chain, with either estimator."""
    for rows in (None, ROWS):
        choice = choose_tree(ACC, steps([1.0] * 30), max_nodes=20, rank_paths=rows, chains_only=True)
        assert choice.medusa_choices == [[0] * d for d in range(1, len(choice.medusa_choices) + 1)]
        assert [row["nodes"] for row in choice.by_size] == list(range(1, len(ACC) + 1))  # a chain per depth


def test_chains_only_weighs_every_depth_of_the_chain():
    """max_nodes is the heads on a chains-only engine: the candidates are the chains up to that depth,
    not a full greedy order of that many nodes cut to its chain (here (0,), (0, 0), (1,): two deep)."""
    choice = choose_tree(ACC, steps([1.0] * 30), max_nodes=3, chains_only=True)
    assert choice.medusa_choices == [[0], [0, 0], [0, 0, 0]] and choice.construction == "chain"
    assert choice.tokens_per_step == pytest.approx(1 + 0.6 + 0.3 + 0.12, abs=1e-4)
    # Replayed: ranks 1 and 2 are the most frequent, so every full order of 3 nodes is all branches.
    rows = [[(0, 0, 0), (1, 1, 1), (1, 1, 1), (2, 2, 2), (2, 2, 2)] * 20]
    acc = [[sum(r[d] == k for r in rows[0]) / len(rows[0]) for k in range(3)] for d in range(3)]
    choice = choose_tree(acc, steps([1.0] * 30), max_nodes=3, rank_paths=rows, chains_only=True)
    assert choice.medusa_choices == [[0], [0, 0], [0, 0, 0]]
    assert choice.tokens_per_step == pytest.approx(simulate(rows, choice.medusa_choices)[0], abs=1e-4)
    assert choice.tokens_per_step > simulate(rows, [[0]])[0]


def test_default_budgets_never_exceed_max_nodes():
    info = SimpleNamespace(max_draft_len=63, num_medusa_heads=4, vocab_size=1000)
    assert tc.budgets_for(8, info) == [4, 8, 16]
    assert tc.budgets_for(8, info, max_nodes=8) == [4, 8]  # not twice the tuned tree: dynamic:16
    assert tc.budgets_for(3, info, max_nodes=5) == [1, 3]
    assert tc.budgets_for(8, info, [8, 16], max_nodes=12) == [8, 16]  # asked for: the user's own budgets


def test_guard_recommends_plain_when_step_time_grows_fast():
    forward = [1.0] + [2.5 + t for t in range(30)]  # any tree step costs 2.5x a plain one or more
    choice = choose_tree(ACC, steps(forward), max_nodes=20)
    assert choice.recommendation == "plain"
    assert choice.speedup_vs_plain < 1


def test_host_time_counts_in_the_step():
    fast = choose_tree(ACC, steps([1.0] * 10, host_plain=0.0, host_tree=(0.0, 0.0)), 9)
    slow = choose_tree(ACC, steps([1.0] * 10, host_plain=0.0, host_tree=(0.5, 0.2)), 9)
    assert slow.speedup_vs_plain < fast.speedup_vs_plain
    assert slow.nodes < fast.nodes


def test_non_decreasing_pools_dips():
    assert non_decreasing([1, 3, 2, 4]) == [1, 2.5, 2.5, 4]
    assert non_decreasing([2, 1, 1, 5]) == pytest.approx([4 / 3] * 3 + [5])
    assert non_decreasing([1, 2, 3]) == [1, 2, 3]


def test_rank_hits_counts_each_rank():
    import torch

    logits = torch.tensor([[[0.0, 3.0, 2.0, 1.0], [5.0, 0.0, 1.0, 0.0]]])  # [H=1, N=2, V=4]
    # position 0 ranks: 1, 2, 3, 0; position 1 ranks: 0, 2, ...
    assert rank_hits(logits, torch.tensor([[2, 0]]), 3).tolist() == [[1, 1, 0]]
    assert rank_hits(logits, torch.tensor([[-1, 2]]), 3).tolist() == [[0, 1, 0]]
    assert rank_hits(logits, torch.tensor([[0, 3]]), 6).shape == (1, 6)  # more ranks than the vocab


def test_cli_writes_a_loadable_tree_and_warns_for_random_heads(tiny_merged, tmp_path, capsys):
    data = tmp_path / "calib.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("def add(a, b):", "import os", "Hello there")))
    out = tmp_path / "tree.json"
    ckpt = tiny_merged("llama")  # random heads: they rarely predict anything
    rc = tune_cli.main(["--engine", str(ckpt), "--calib-data", str(data), "--out", str(out), "--max-nodes", "12",
                  "--max-new-tokens", "16", "--reps", "2", "--eval-limit", "1", "--budgets", "3", "--quiet"])
    assert rc == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    # The faster of the static tree and dynamic:3 (measured) is written; the static one is kept beside it.
    # Measured with the engine's own slot cost, which a chosen spec records.
    spec = f"dynamic:3,cost={result['slot_cost']:g}"
    assert result["choice"]["chosen"] in ("static", spec) and "measured on 1 prompts" in result["choice"]["why"]
    assert spec in result["measured"] and f"chosen: {result['choice']['chosen']}" in printed
    if result["choice"]["chosen"] == spec:
        assert result["medusa_choices"] == spec and parse_dynamic(out) == 3 and spec_cost(out) == result["slot_cost"]
    tree = parse_medusa_choices(json.dumps(result["static_tree"]))
    assert (result["medusa_choices"] == spec or tree == result["medusa_choices"]) and 1 <= len(tree) <= 12
    build_tree(tree, num_heads=4)  # valid: prefix-closed, depth <= heads
    assert len(result["head_accuracy"]["rank_accuracy"]) == 4
    assert len(result["step_time_ms"]["forward"]) >= 13
    assert result["head_accuracy"]["base_agreement"] > 0.9
    for key in ("tuned", "plain", "mc_sim_7b_63", "tuned_vs_mc_sim_7b_63"):
        assert key in result["predicted"]
    assert {"tuned", "mc_sim_7b_63", "plain_tokens_per_s"} <= set(result["measured"])
    assert result["measured"]["tuned"]["equal_to_plain"]
    # Random heads predict nothing: no head's draft at any rank is right in 10% of steps, whatever
    # tree the tuner picks (its predicted speedup also divides by measured step times, which a
    # loaded machine makes noisy: 1.72 was seen). The recommendation follows the measurement (a
    # per-step tree's context chains may still pay on a repetitive output).
    assert max(max(row) for row in result["head_accuracy"]["rank_accuracy"]) < 0.1
    m = result["measured"]
    faster = m["tuned" if result["choice"]["chosen"] == "static" else spec]["tokens_per_s"] > m["plain_tokens_per_s"]
    assert result["recommendation"] == ("medusa" if faster else "plain")
    assert ("warning: the chosen tree measured no faster than plain decoding" in printed) is not faster
    assert "tuned tree:" in printed


def test_cli_measures_budgets_when_the_reference_tree_does_not_fit(tiny_merged, tmp_path):
    # Two heads: mc_sim_7b_63 (depth 4) is neither predicted nor measured, the budgets still are.
    data = tmp_path / "calib.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("def add(a, b):", "Hello there")))
    out = tmp_path / "tree.json"
    ckpt = tiny_merged("llama", heads_kwargs={"num_heads": 2})
    rc = tune_cli.main(["--engine", str(ckpt), "--calib-data", str(data), "--out", str(out), "--max-nodes", "4",
                        "--max-new-tokens", "8", "--reps", "1", "--eval-limit", "1", "--budgets", "2", "--quiet"])
    assert rc == 0
    result = json.loads(out.read_text())
    assert "mc_sim_7b_63" not in result["predicted"] and "mc_sim_7b_63" not in result["measured"]
    assert f"dynamic:2,cost={result['slot_cost']:g}" in result["measured"]


def measured_result(static, dynamic, equal=True, plain=5.0):
    return {"medusa_choices": [[0], [1]], "recommendation": "medusa", "measured": {
        "num_prompts": 4, "plain_tokens_per_s": plain, "tuned": {"tokens_per_s": static, "tokens_per_step": 1.5},
        "dynamic:2,cost=0.3": {"tokens_per_s": dynamic, "tokens_per_step": 2.0, "equal_to_plain": equal},
        "dynamic:4,cost=0.3": {"tokens_per_s": dynamic - 1, "tokens_per_step": 2.2, "equal_to_plain": equal}}}


def test_the_faster_measured_of_static_and_per_step_trees_is_chosen():
    result = measured_result
    specs = tc.dynamic_specs([2, 4], 0.3)
    won = result(10.0, 12.0)
    tc.choose_static_or_dynamic(won, specs)
    assert won["medusa_choices"] == "dynamic:2,cost=0.3" and won["static_tree"] == [[0], [1]]
    assert won["choice"]["why"].startswith("faster: dynamic:2,cost=0.3 12.0 tokens/s")
    for lost in (result(12.0, 10.0), result(10.0, 12.0, equal=False)):
        tc.choose_static_or_dynamic(lost, specs)
        assert lost["medusa_choices"] == [[0], [1]] and lost["choice"]["chosen"] == "static"


def test_the_recommendation_follows_the_measurement():
    """Predicted or not, a tree measured slower than plain is not recommended, and one measured
    faster is (the prediction is only a prediction)."""
    specs = tc.dynamic_specs([2, 4], 0.3)
    slower = measured_result(10.0, 9.6, plain=10.0)  # the static tree at plain's speed, dynamic:4 at 0.96x
    tc.choose_static_or_dynamic(slower, specs)
    assert slower["choice"]["chosen"] == "static" and slower["recommendation"] == "plain"
    assert slower["choice"]["speedup_vs_plain"] == 1.0
    dynamic_slower = measured_result(9.0, 9.6, plain=10.0)  # the chosen dynamic:2 at 0.96x
    tc.choose_static_or_dynamic(dynamic_slower, specs)
    assert dynamic_slower["medusa_choices"] == "dynamic:2,cost=0.3" and dynamic_slower["recommendation"] == "plain"
    faster = measured_result(10.94, 9.0, plain=10.0)
    faster["recommendation"] = "plain"  # predicted slower
    tc.choose_static_or_dynamic(faster, specs)
    assert faster["recommendation"] == "medusa" and faster["choice"]["speedup_vs_plain"] == 1.094
    report = {"recommendation": "plain", "choice": {"chosen": "static", "why": "x", "speedup_vs_plain": 0.96},
              "predicted": {"tuned": {"nodes": 2, "tokens_per_step": 1.5, "step_ms": 1.0, "speedup_vs_plain": 1.2},
                            "plain": {"step_ms": 1.0}},
              "head_accuracy": {"top1": [0.5], "positions": [10]}, "step_time_ms": {"forward": [1.0, 1.1]}}
    assert "warning: the chosen tree measured no faster than plain decoding on this engine and machine (0.96x)" \
        in ts.format_report(report)


def test_slot_cost_is_the_measured_slope_over_a_plain_step():
    # 10 ms plain compute + 2 ms host; each slot adds 3 ms up to 4 slots, then 1 ms (beyond the fit).
    result = {"step_time_ms": {"forward": [10.0, 13.0, 16.0, 19.0, 20.0, 21.0], "plain_forward": 10.0,
                               "rest_plain": 2.0}}
    assert tc.slot_cost(result, 4) == 0.25 and tc.slot_cost(result, 1) == 0.0
    assert tc.dynamic_specs([4, 8], 0.25) == ["dynamic:4,cost=0.25", "dynamic:8,cost=0.25"]


def test_cli_bad_input_exits_2(tiny_merged, tmp_path, capsys):
    ckpt = tiny_merged("llama")
    out = tmp_path / "tree.json"
    assert tune_cli.main(["--engine", str(ckpt), "--calib-data", str(tmp_path / "missing.jsonl"), "--out", str(out)]) == 2
    assert "missing.jsonl: file not found" in capsys.readouterr().err
    assert tune_cli.main(["--engine", str(tmp_path / "nope"), "--calib-data", "x.txt", "--out", str(out)]) == 2
    assert "--engine directory not found" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    assert tune_cli.main(["--engine", str(ckpt), "--calib-data", str(empty), "--out", str(out)]) == 2
    assert "no prompts" in capsys.readouterr().err
    assert not out.exists()


def test_cli_refuses_an_out_it_cannot_read_back(tmp_path, capsys):
    out = tmp_path / "tree.txt"
    assert tune_cli.main(["--engine", str(tmp_path / "nope"), "--prompts", "p.txt", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"medusa-tune-tree: error: {out}: --out has suffix '.txt'; expected one of .json, .yaml, .yml "
                   "(a tree file --medusa-choices reads)"]
    assert not out.exists()


def test_cli_checks_every_prompt_file_before_tuning(tiny_merged, tmp_path, capsys, monkeypatch):
    """--eval-prompts, and each prompt's room for its new tokens (the decoder's rule: prompt + new
    tokens <= max_seq_len), are checked before the minutes of tuning, by file and prompt."""
    from medusa_trt.runtime.loading import load_backend, load_tokenizer

    monkeypatch.setattr(ts, "tune", lambda *a, **k: pytest.fail("tuned before the prompts were checked"))
    ckpt = tiny_merged("llama")
    most = load_backend(ckpt).info.max_seq_len
    text = "hello " * 50
    n = len(load_tokenizer(ckpt).encode(text))
    short, long = tmp_path / "short.txt", tmp_path / "long.txt"
    short.write_text("a b c\n")
    long.write_text(f"a b c\n{text}\n")
    out = tmp_path / "t.json"
    base = ["--engine", str(ckpt), "--out", str(out), "--quiet"]
    assert tune_cli.main([*base, "--prompts", str(short), "--eval-prompts", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl: file not found" in capsys.readouterr().err
    # Calibration, and the measured comparison: one position more than the prompt and its new tokens.
    new = most - n + 1
    assert tune_cli.main([*base, "--prompts", str(long), "--max-new-tokens", str(new), "--no-measure"]) == 2
    assert f"{long}: prompt 2 has {n} tokens; with --max-new-tokens {new} it needs {most + 1} positions" \
        in capsys.readouterr().err
    assert tune_cli.main([*base, "--prompts", str(short), "--eval-prompts", str(long), "--max-new-tokens",
                          str(new), "--budgets", "32"]) == 2
    assert f"{long}: prompt 2 has {n} tokens; with --max-new-tokens {new} it needs {most + 1} positions" \
        in capsys.readouterr().err
    # Held-out ShareGPT conversations (the rule) never tune or pick a tree, in either file.
    rows = [{"text": "a b c", "kind": "chat", "source": "I7GJBvO_0"}, {"text": "d e", "kind": "code", "source": "x.py"},
            {"text": "f g", "kind": "chat", "source": "gt6zkh9_0"}]  # the last hashes to 0 mod 10
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for flags in (["--prompts", str(mixed), "--no-measure"], ["--prompts", str(short), "--eval-prompts", str(mixed)]):
        assert tune_cli.main([*base, *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{mixed}:3:" in err[0] and "'gt6zkh9_0' is a held-out ShareGPT conversation" in err[0]
    assert not out.exists()


def test_importing_the_tuner_loads_no_engine_stack():
    """The tree math (and medusa-tune-tree --help) works without the engine stack: a fresh
    interpreter that imports the module has loaded none of it."""
    heavy = ("onnxruntime", "onnx", "tensorrt", "polygraphy", "transformers")
    code = f"import sys, medusa_trt.tools.tune_tree; print([m for m in {heavy!r} if m in sys.modules])"
    package_root = str(Path(ts.__file__).resolve().parents[2])  # the tested copy of medusa_trt
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]", out.stdout
