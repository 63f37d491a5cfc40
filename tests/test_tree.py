"""Tests for medusa_trt.tree. Expected buffers are recomputed here from the definition in
docs/formats.md section 4 (prefix relations on raw paths), not from the implementation's
parent pointers."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from medusa_trt import tree
from medusa_trt.acceptance import tree_candidates
from medusa_trt.dynamic_spec import parse_dynamic, read_dynamic, spec_cost
from medusa_trt.tree import (
    CANDIDATE_TOPK,
    DEFAULT_TREE,
    StepTree,
    TreeError,
    build_tree,
    candidate_topk,
    parse_medusa_choices,
    read_tree,
    tree_for_engine,
    tree_to_brace,
    unpack_mask,
    validate_and_expand,
)

SMALL = [[0], [1], [0, 0], [0, 1]]


# ---- independent oracle -------------------------------------------------------------------------


def is_prefix(a: tuple, b: tuple) -> bool:
    return len(a) <= len(b) and b[: len(a)] == a


def expected_buffers(choices: list[list[int]], max_draft_len: int | None = None) -> dict:
    paths = sorted({tuple(p[:d]) for p in choices for d in range(1, len(p) + 1)}, key=lambda p: (len(p), p))
    slot = {p: i + 1 for i, p in enumerate(paths)}
    T = len(paths) + 1
    mask = [[j == 0 for j in range(T)] for _ in range(T)]
    for i, pi in enumerate(paths, start=1):
        for j, pj in enumerate(paths, start=1):
            mask[i][j] = is_prefix(pj, pi)
    words = math.ceil(((max_draft_len if max_draft_len is not None else T - 1) + 1) / 32)
    packed = []
    for row in mask:
        row_words = []
        for w in range(words):
            v = sum(1 << (j - 32 * w) for j in range(32 * w, min(32 * w + 32, T)) if row[j])
            row_words.append(v - (1 << 32) if v >= 1 << 31 else v)  # two's complement int32
        packed.append(row_words)
    leaves = [p for p in paths if not any(len(q) > len(p) and is_prefix(p, q) for q in paths)]
    max_depth = max(len(p) for p in paths)
    retrieve = [[0] + [slot[leaf[:d]] for d in range(1, len(leaf) + 1)] for leaf in leaves]
    retrieve = [r + [-1] * (max_depth + 1 - len(r)) for r in retrieve]
    return dict(
        nodes=tuple(paths),
        position_offsets=[0] + [len(p) for p in paths],
        attention_mask=mask,
        packed_mask=packed,
        retrieve_indices=retrieve,
        max_depth=max_depth,
        num_leaves=len(leaves),
        topk_per_depth=[1 + max(p[-1] for p in paths if len(p) == d) for d in range(1, max_depth + 1)],
    )


def assert_matches_oracle(buf: tree.TreeBuffers, choices: list[list[int]], max_draft_len: int | None = None):
    exp = expected_buffers(choices, max_draft_len)
    assert buf.nodes == exp["nodes"]
    assert buf.num_slots == len(exp["nodes"]) + 1
    for name in ("position_offsets", "topk_per_depth", "retrieve_indices"):
        np.testing.assert_array_equal(getattr(buf, name), np.array(exp[name]), err_msg=name)
    np.testing.assert_array_equal(buf.attention_mask, np.array(exp["attention_mask"], dtype=bool))
    assert buf.packed_mask.dtype == np.int32
    assert [[int(x) for x in row] for row in buf.packed_mask] == exp["packed_mask"]
    assert (buf.max_depth, buf.num_leaves) == (exp["max_depth"], exp["num_leaves"])
    np.testing.assert_array_equal(buf.depth, buf.position_offsets)


# ---- presets and the default tree -------------------------------------------------------------


def test_default_tree_shape_and_buffers():
    choices = tree.PRESETS[DEFAULT_TREE]
    buf = build_tree(DEFAULT_TREE, num_heads=4)
    assert len(buf.nodes) == 63 and buf.num_slots == 64
    assert np.bincount(buf.depth[1:]).tolist() == [0, 10, 28, 23, 2]
    assert buf.num_leaves == 42 and buf.retrieve_indices.shape == (42, 5)
    assert buf.topk_per_depth.tolist() == [10, 10, 10, 2]
    assert buf.packed_mask.shape == (64, 2)
    assert_matches_oracle(buf, choices)
    # TensorRT-LLM sizes the packed mask by max_draft_len, not by the tree.
    wide = build_tree(DEFAULT_TREE, num_heads=4, max_draft_len=100)
    assert wide.packed_mask.shape == (64, 4)
    assert_matches_oracle(wide, choices, max_draft_len=100)


def test_bit_31_is_sign_bit():
    # Slot 31 sets bit 31 of word 0 in its own row (and its descendants'): stored as a negative int32.
    buf = build_tree(DEFAULT_TREE, num_heads=4)
    assert int(buf.packed_mask[31, 0]) < 0
    assert int(buf.packed_mask[31, 0]) & 0xFFFFFFFF & (1 << 31)
    assert int(buf.packed_mask[63, 1]) & 0xFFFFFFFF & (1 << 31)


@pytest.mark.parametrize("name", ["mc_sim_7b_63", "vicuna_7b_stage2", "zephyr_stage2"])
def test_all_presets_build(name):
    choices = parse_medusa_choices(name)
    assert choices == tree.PRESETS[name] and choices is not tree.PRESETS[name]
    assert_matches_oracle(build_tree(name, num_heads=4, max_draft_len=63), choices, max_draft_len=63)


def test_small_tree_exact():
    buf = build_tree(SMALL, num_heads=2)
    assert buf.nodes == ((0,), (1,), (0, 0), (0, 1))
    assert buf.parent.tolist() == [-1, 0, 0, 1, 1]
    assert buf.head.tolist() == [-1, 0, 0, 1, 1]
    assert buf.rank.tolist() == [0, 0, 1, 0, 1]
    assert buf.position_offsets.tolist() == [0, 1, 1, 2, 2]
    assert buf.topk_per_depth.tolist() == [2, 2]
    assert buf.attention_mask.astype(int).tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 0, 0, 1],
    ]
    assert buf.packed_mask.tolist() == [[0b1], [0b11], [0b101], [0b1011], [0b10011]]
    assert buf.retrieve_indices.tolist() == [[0, 2, -1], [0, 1, 3], [0, 1, 4]]
    assert (buf.max_depth, buf.num_leaves) == (2, 3)
    step = StepTree.of(buf, vocab_size=100)
    assert step.topk == 10 and step.candidate_index.tolist() == [0, 1, 10, 11]  # head * k + rank


def test_large_rank_widens_the_top_k():
    buf = build_tree([[0], [12], [12, 3]], num_heads=2)
    assert buf.topk_per_depth.tolist() == [13, 4]
    step = StepTree.of(buf, vocab_size=100)
    assert step.topk == 13 and step.candidate_index.tolist() == [0, 12, 13 + 3]
    with pytest.raises(TreeError, match="rank 12 is beyond the vocabulary .12 tokens.*ranks < 12"):
        StepTree.of(buf, vocab_size=12)


def test_buffers_are_cached_and_read_only():
    a = build_tree(SMALL, num_heads=2)
    assert build_tree([list(p) for p in SMALL], num_heads=3) is a
    with pytest.raises(ValueError, match="read-only"):
        a.attention_mask[0, 1] = True


# ---- every input form --------------------------------------------------------------------------


def test_input_forms(tmp_path):
    want = [[0], [0, 1], [2]]
    (tmp_path / "t.json").write_text(json.dumps(want))
    (tmp_path / "d.json").write_text(json.dumps({"medusa_choices": want, "note": "x"}))
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(want))
    (tmp_path / "d.yml").write_text(yaml.safe_dump({"medusa_choices": want}))
    forms = [
        want,
        [tuple(p) for p in want],
        "[[0], [0, 1], [2]]",
        "[(0,), (0, 1), (2,),]",  # python literal: tuples and a trailing comma
        " [[0],[0,1],[2]] ",
        str(tmp_path / "t.json"),
        tmp_path / "d.json",
        str(tmp_path / "t.yaml"),
        tmp_path / "d.yml",
        "{0}, {0, 1}, {2}",
        "{{0},{0,1},{2}}",
        "{ {0}, {0, 1}, {2} }",
    ]
    for form in forms:
        assert parse_medusa_choices(form) == want, form


def test_preset_name_and_default():
    assert parse_medusa_choices(DEFAULT_TREE) == tree.PRESETS["mc_sim_7b_63"]
    assert set(tree.PRESETS) == {"mc_sim_7b_63", "vicuna_7b_stage2", "zephyr_stage2"}


def test_brace_round_trip_small():
    assert tree_to_brace(SMALL) == "{0}, {1}, {0, 0}, {0, 1}"
    assert parse_medusa_choices(tree_to_brace(tree.PRESETS[DEFAULT_TREE])) == tree.PRESETS[DEFAULT_TREE]


# ---- every error names what is wrong ------------------------------------------------------------


@pytest.mark.parametrize(
    "choices, num_heads, max_draft_len, needles",
    [
        ([], 4, None, ["[]", "non-empty"]),
        ([[0], []], 4, None, ["medusa_choices[1]", "[]", "non-empty"]),
        ([[0], [0, -1]], 4, None, ["[0, -1]", "rank -1", ">= 0"]),
        ([[0], [True]], 4, None, ["[True]", "rank True", "bool"]),
        ([[0], [0, 1.0]], 4, None, ["[0, 1.0]", "rank 1.0", "float"]),
        ([[0], [0, 0, 0]], 2, None, ["[0, 0, 0]", "depth 3", "num_heads=2"]),
        ([[0], [1], [0]], 4, None, ["medusa_choices[2]", "duplicate", "[0]"]),
        ([[0, 0, 0]], 4, 2, ["3 nodes", "max_draft_len=2"]),
        ("[[0], 1]", 4, None, ["path #1", "1"]),
        ([[0], "ab"], 4, None, ["path #1", "'ab'"]),
    ],
)
def test_validation_errors(choices, num_heads, max_draft_len, needles):
    with pytest.raises(TreeError) as err:
        build_tree(choices, num_heads, max_draft_len)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))
    assert isinstance(err.value, ValueError)


def test_max_draft_len_counts_expanded_nodes():
    assert len(validate_and_expand([[0, 0, 0]], 4, max_draft_len=3)) == 3
    with pytest.raises(TreeError, match="63 nodes.*max_draft_len=62"):
        build_tree(DEFAULT_TREE, num_heads=4, max_draft_len=62)


@pytest.mark.parametrize(
    "spec, needles",
    [
        ("mc_sim_7b_64", ["mc_sim_7b_64", "unknown preset", "mc_sim_7b_63"]),
        ("[[0], [0, 1]", ["[[0], [0, 1]", "malformed"]),
        ("[[0], [0, x]]", ["[[0], [0, x]]", "malformed"]),
        ("{0}, {0, 1", ["{0}, {0, 1", "malformed"]),
        ("{0}, {0; 1}", ["{0}, {0; 1}", "brace form"]),
        ("{0}, {a}", ["{0}, {a}", "brace form"]),
        ("[0, 1]", ["[0, 1]", "path #0", "0"]),
        ('{"medusa_choices": [[0]]}', ["medusa_choices", "brace form"]),
        (42, ["int", "42"]),
    ],
)
def test_parse_errors(spec, needles):
    with pytest.raises(TreeError) as err:
        parse_medusa_choices(spec)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


def test_long_inputs_are_shortened_in_messages():
    spec = "[[0], " + "[1], " * 200 + "oops]"
    with pytest.raises(TreeError) as err:
        parse_medusa_choices(spec)
    assert len(str(err.value)) < 300 and "[[0], [1]" in str(err.value)


def test_file_errors(tmp_path):
    missing = tmp_path / "missing.json"
    with pytest.raises(TreeError, match="missing.json.*cannot read"):
        parse_medusa_choices(str(missing))
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("[[0], [0,")
    with pytest.raises(TreeError, match="bad.json.*JSON"):
        parse_medusa_choices(bad_json)
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("medusa_choices: [[0], [0\n  - x: {")
    with pytest.raises(TreeError, match="bad.yaml.*YAML"):
        parse_medusa_choices(bad_yaml)
    no_key = tmp_path / "nokey.yml"
    no_key.write_text("choices: [[0]]\n")
    with pytest.raises(TreeError, match=r"nokey.yml.*\['choices'\].*medusa_choices"):
        parse_medusa_choices(no_key)
    scalar = tmp_path / "scalar.json"
    scalar.write_text("7")
    with pytest.raises(TreeError, match="scalar.json.*got 7"):
        parse_medusa_choices(scalar)
    wrong_suffix = tmp_path / "tree.txt"
    wrong_suffix.write_text("[[0]]")
    with pytest.raises(TreeError, match=r"tree.txt.*'\.txt'"):
        parse_medusa_choices(str(wrong_suffix))
    a_dir = tmp_path / "dir.json"
    a_dir.mkdir()
    with pytest.raises(TreeError, match="dir.json.*cannot read"):
        parse_medusa_choices(a_dir)


def test_values_found_bad_in_a_file_name_the_file(tmp_path):
    """A tree file's duplicate path, bad rank or too many nodes is reported with the file first,
    whoever reads it (build_tree, read_tree)."""
    for name, text, said in (("dup.json", "[[0], [0]]", r"medusa_choices\[1\] = \[0\]: duplicate path"),
                             ("neg.yaml", "- [0]\n- [-1]\n", "rank -1 is negative"),
                             ("big.yml", "medusa_choices: [[0, 0, 0]]\n", "3 nodes after adding prefixes"),
                             ("dyn.json", '{"medusa_choices": "dynamic:x"}', "budget 'x' is not an integer")):
        path = tmp_path / name
        path.write_text(text)
        for spec in (path, str(path)):
            with pytest.raises(TreeError, match=f"^tree file {str(path)!r}: .*{said}"):
                if name.startswith("dyn"):
                    read_dynamic(spec)
                else:
                    build_tree(spec, num_heads=4, max_draft_len=2)
        if not name.startswith("dyn"):
            with pytest.raises(TreeError, match=f"^tree file {str(path)!r}: "):
                read_tree(path, 4, 2)
    with pytest.raises(TreeError, match=r"^medusa_choices\[1\]"):  # no file: no file named
        build_tree([[0], [0]], num_heads=4)


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".yml", ".YAML"])
def test_a_tree_file_of_any_suffix_holds_a_dynamic_spec(tmp_path, suffix):
    """docs/formats.md section 4: a .json, .yaml or .yml file may hold {"medusa_choices": "dynamic:N"}."""
    path = tmp_path / f"t{suffix}"
    path.write_text(json.dumps({"medusa_choices": "dynamic:8,cost=0.05"}) if suffix == ".json" else
                    yaml.safe_dump({"medusa_choices": "dynamic:8,cost=0.05"}))
    for spec in (path, str(path)):
        assert parse_dynamic(spec) == 8 and spec_cost(spec) == 0.05


# ---- prefix expansion ---------------------------------------------------------------------------


def test_leaves_expand_to_all_prefixes(caplog):
    with caplog.at_level(logging.INFO, logger="medusa_trt.tree"):
        nodes = validate_and_expand([[1, 2, 0], [0, 3]], num_heads=3, max_draft_len=None)
    assert nodes == [[0], [1], [0, 3], [1, 2], [1, 2, 0]]
    assert any(r.levelno >= logging.INFO and "3 of the paths' parents were not given" in r.getMessage() for r in caplog.records)


def test_complete_tree_logs_nothing(caplog):
    with caplog.at_level(logging.INFO, logger="medusa_trt.tree"):
        validate_and_expand(SMALL, num_heads=2, max_draft_len=4)
    assert not caplog.records


def test_leaf_only_default_tree_gives_same_buffers():
    full = tree.PRESETS[DEFAULT_TREE]
    leaves = [p for p in full if not any(len(q) > len(p) and q[: len(p)] == p for q in full)]
    assert len(leaves) == 42
    a, b = build_tree(full, 4), build_tree(leaves, 4)
    np.testing.assert_array_equal(a.packed_mask, b.packed_mask)
    np.testing.assert_array_equal(a.retrieve_indices, b.retrieve_indices)


# ---- properties over random trees ---------------------------------------------------------------

random_paths = st.lists(
    st.lists(st.integers(min_value=0, max_value=11), min_size=1, max_size=4),
    min_size=1, max_size=40,
).map(lambda ps: sorted({tuple(p) for p in ps}))


def prefix_closed(paths: list[tuple]) -> list[list[int]]:
    return [list(p) for p in sorted({p[:d] for p in paths for d in range(1, len(p) + 1)})]


@settings(max_examples=100, deadline=None)
@given(random_paths, st.booleans(), st.randoms(use_true_random=False))
def test_random_trees(paths, closed, rnd):
    choices = prefix_closed(paths) if closed else [list(p) for p in paths]
    rnd.shuffle(choices)  # input order must not matter
    buf = build_tree(choices, num_heads=4)
    assert_matches_oracle(buf, choices)

    # Every node attends to exactly root, its ancestors and itself (by walking paths, not slots).
    slot_path = {0: ()} | {i + 1: p for i, p in enumerate(buf.nodes)}
    for i in range(buf.num_slots):
        attended = set(np.flatnonzero(buf.attention_mask[i]).tolist())
        assert attended == {j for j, p in slot_path.items() if is_prefix(p, slot_path[i])}

    # Every retrieve row is a root-to-leaf chain; every leaf appears once.
    for row in buf.retrieve_indices:
        chain = [int(s) for s in row if s >= 0]
        assert chain[0] == 0 and all(s == -1 for s in row[len(chain):])
        for prev, cur in zip(chain[:-1], chain[1:], strict=True):
            assert buf.parent[cur] == prev and slot_path[cur][:-1] == slot_path[prev]
    assert sorted(int(r[r >= 0][-1]) for r in buf.retrieve_indices) == [
        s for s in range(1, buf.num_slots) if s not in set(buf.parent.tolist())]

    # Packing round-trips, including a wider word count.
    np.testing.assert_array_equal(unpack_mask(buf.packed_mask, buf.num_slots), buf.attention_mask)
    wide = build_tree(choices, num_heads=4, max_draft_len=130)
    assert wide.packed_mask.shape == (buf.num_slots, 5)
    np.testing.assert_array_equal(unpack_mask(wide.packed_mask, buf.num_slots), buf.attention_mask)
    assert not unpack_mask(wide.packed_mask, 160)[:, buf.num_slots:].any()

    # The brace form round-trips.
    assert parse_medusa_choices(tree_to_brace(choices)) == choices


# ---- the candidates the decoding loop drafts ----------------------------------------------------


def brute_force_candidates(nodes: tuple, medusa: np.ndarray) -> np.ndarray:
    """[B, nodes]: node (r_1, ..., r_d) gets the token of rank r_d (0: the largest logit) of head
    d - 1, found by sorting that head's whole row."""
    order = np.argsort(-medusa, axis=-1, kind="stable")  # [H, B, V]
    return np.array([[order[len(p) - 1, b, p[-1]] for p in nodes] for b in range(medusa.shape[1])])


@settings(max_examples=100, deadline=None)
@given(random_paths, st.integers(min_value=1, max_value=40), st.integers(min_value=0, max_value=2**31))
def test_step_candidates_are_each_nodes_rank_in_its_head(paths, vocab, seed):
    """The buffers the loop uses (StepTree: the top-k and flat index from tree.py) put in every slot
    the rank-r token of head depth - 1, for any tree and vocabulary; the top-k is the one the fused
    step graph bakes (candidate_topk(vocab)) exactly when every rank is below CANDIDATE_TOPK."""
    buf = build_tree([list(p) for p in paths], num_heads=4)
    top_rank = max(p[-1] for p in buf.nodes)
    if top_rank >= vocab:
        with pytest.raises(TreeError, match=f"rank {top_rank} is beyond the vocabulary"):
            StepTree.of(buf, vocab)
        return
    step = StepTree.of(buf, vocab)
    assert step.topk == max(min(CANDIDATE_TOPK, vocab), top_rank + 1)
    assert (step.topk == candidate_topk(vocab)) == (top_rank < CANDIDATE_TOPK)
    gen = torch.Generator().manual_seed(seed)
    batch = 3
    medusa = torch.stack([torch.randperm(vocab, generator=gen) for _ in range(4 * batch)]).float().view(4, batch, vocab)
    root = torch.randint(vocab, (batch,), generator=gen)
    got = tree_candidates(root, medusa, step.candidate_index, step.topk)
    assert got[:, 0].tolist() == root.tolist()
    np.testing.assert_array_equal(got[:, 1:].numpy(), brute_force_candidates(buf.nodes, medusa.numpy()))


@pytest.mark.parametrize("num_heads, max_draft_len", [(4, 63), (4, 100), (3, 63), (2, 20), (1, 5), (5, 7)])
def test_tree_for_engine_is_the_default_tree_cut(num_heads, max_draft_len):
    full = [tuple(p) for p in tree.PRESETS[DEFAULT_TREE]]
    assert prefix_closed(full) == sorted(map(list, full))  # the preset lists every prefix
    want = sorted((p for p in full if len(p) <= num_heads), key=lambda p: (len(p), p))[:max_draft_len]
    buf = tree_for_engine(num_heads, max_draft_len)
    assert list(buf.nodes) == want
    assert all(p[:-1] in set(want) for p in want if len(p) > 1)  # every node's parent kept
    assert buf.packed_mask.shape[1] == math.ceil((max_draft_len + 1) / 32)


def test_main_chain():
    """What an engine exact for chains only verifies (engine.json onnx.chains_only)."""
    from medusa_trt.tree import main_chain

    assert main_chain([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]) == [[0], [0, 0], [0, 0, 0]]
    assert main_chain([[1], [2], [2, 0], [1, 3]]) == [[1], [1, 3]]  # the lowest rank at each depth
    assert main_chain([[0], [0, 0]]) == [[0], [0, 0]]
    chain = build_tree("mc_sim_7b_63", 4, 63, chains_only=True)
    assert chain.nodes == ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)) and chain.num_slots == 5
    assert build_tree([[0], [0, 0]], 4, chains_only=True).nodes == ((0,), (0, 0))
