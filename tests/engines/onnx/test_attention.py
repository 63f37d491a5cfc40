"""The attention forms (engines/onnx/attention.py): the kernel premises the int4 forms rest on, and
whole int4 engines whose rows are bitwise row-invariant.

If a future ONNX Runtime kernel breaks a premise, its test here fails first.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from medusa_trt.engines.onnx.attention import ATTENTION_FORMS, KEY_BLOCK, default_attention, engine_attention
from medusa_trt.runtime.ort.backend import OrtBackend
from medusa_trt.runtime.steps import prefill
from tests.engines.ort.test_ort_build import exact_engine, int4_engine


def one_row_logits(backend, ids: list[int], start: int) -> torch.Tensor:
    """Logits of ids[start:], each from its own one-row step after the prefix (plain decoding)."""
    backend.start(1, len(ids) + 8)
    prefill(backend, [ids[:start]])
    rows = []
    for t in ids[start:]:
        logits, _ = backend.forward(torch.tensor([[t]]), backend.lengths[:, None], torch.ones(1, 1, 1, dtype=torch.bool),
                                    with_heads=False)
        backend.commit(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long))
        rows.append(logits[0, 0])
    return torch.stack(rows)


def tree_logits(backend, ids: list[int], start: int, decoys: bool = True) -> torch.Tensor:
    """Logits of ids[start:] as one path of a tree step, each path node followed by a decoy sibling
    (so the path's keys sit at other offsets than in plain decoding), as Medusa verifies them;
    without decoys the path is a chain tree."""
    backend.start(1, len(ids) + 8)
    prefill(backend, [ids[:start]])
    path = ids[start:]
    tokens, parents, on_path = [], [], []  # slot layout: p0, d0, p1, d1, ... (d_i is p_i's sibling)
    width = 2 if decoys else 1
    for i, t in enumerate(path):
        parent = width * (i - 1) if i else -1
        tokens += [t, (t + 1) % 64][:width]
        parents += [parent] * width
        on_path.append(width * i)
    n = len(tokens)
    mask = torch.eye(n, dtype=torch.bool)
    depth = torch.zeros(n, dtype=torch.long)
    for j in range(n):
        a = parents[j]
        while a >= 0:
            mask[j, a] = True
            depth[j] += 1
            a = parents[a]
    logits, _ = backend.forward(torch.tensor([tokens]), (backend.lengths[0] + depth)[None], mask[None],
                                torch.tensor([on_path]), with_heads=False)
    return logits[0]


@pytest.mark.parametrize("attention", [None, "row_exact_f32", "row_exact", "exact weights"])
def test_int4_rows_are_bitwise_row_invariant(ort_engine, attention):
    """The attention forms of level-4 int4 engines (the default "chain_f32", "row_exact_f32" and
    "row_exact") make a position's logits the same bits in a one-row step, a many-row prefill and a
    chain tree step, and (all but chain_f32) a tree step whose path keys sit at other offsets:
    MatMulNBits' int8 activations would otherwise turn float32 rounding noise into different logits
    (the cause of Medusa != plain greedy on the real model; benchmarks/bench_row_invariance.py).
    "exact weights": chain_f32 with the offsets' ReduceSum and MatMul and the 8-bit lm_head."""
    engine = exact_engine(ort_engine) if attention == "exact weights" else int4_engine(ort_engine, 4, attention)
    attention = None if attention == "exact weights" else attention
    onnx_info = json.loads((engine / "engine.json").read_text())["onnx"]
    assert onnx_info["attention"] == (attention or "chain_f32")
    assert onnx_info.get("key_block") == (128 if attention == "row_exact_f32" else None)
    assert onnx_info.get("chains_only", False) == (attention is None)
    backend = OrtBackend(engine)
    # Bitwise on every CPU: where MatMulNBits has a one-row kernel of its own (ONNX Runtime's AVX2
    # build), one-token steps run as two rows and a lone logits row is computed twice
    # (OrtBackend.pad_one_row; docs/benchmarks/issue-13-int4.md (l)).
    tol = dict(rtol=0, atol=0)
    ids = [7, 3, 19, 40, 2, 11, 5, 60, 33, 21, 9, 14]
    one = one_row_logits(backend, ids, 6)
    many = []  # position k's logits from a prefill of ids[:k + 1] (one many-row forward)
    for k in range(6, len(ids)):
        backend.start(1, len(ids) + 8)
        many.append(prefill(backend, [ids[:k + 1]])[0][0])
    torch.testing.assert_close(torch.stack(many), one, **tol)
    torch.testing.assert_close(tree_logits(backend, ids, 6, decoys=False), one, **tol)
    if attention is not None:
        torch.testing.assert_close(tree_logits(backend, ids, 6), one, **tol)


@pytest.mark.parametrize("threads", [1, 2])
def test_float32_scores_are_row_invariant_in_onnx_runtime(threads):
    """row_exact keeps its scores in float32 on the premise that ONNX Runtime's MatMul gives a query
    row's dot products the same bits whatever the step's row count, key count and batch (the GQA
    grouped layout of a plain step vs a tree step). If a future kernel breaks that, this fails first."""
    from onnx import TensorProto, helper

    a = helper.make_tensor_value_info("q", TensorProto.FLOAT, ["B", "H", "M", 64])
    b = helper.make_tensor_value_info("k", TensorProto.FLOAT, ["B", "H", "N", 64])
    graph = helper.make_graph([helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
                               helper.make_node("Mul", ["q", "scale"], ["qs"]),
                               helper.make_node("MatMul", ["qs", "kt"], ["s"])], "scores", [a, b],
                              [helper.make_tensor_value_info("s", TensorProto.FLOAT, None)],
                              [helper.make_tensor("scale", TensorProto.FLOAT, [], [0.125])])
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21)])
    session = _session_from_bytes(model.SerializeToString(), threads)
    rng = np.random.default_rng(0)
    for _ in range(60):
        batch, past, n = int(rng.integers(1, 5)), int(rng.integers(5, 700)), int(rng.integers(2, 30))
        q = rng.standard_normal((batch, 3, 3 * n, 64), dtype=np.float32)
        k = rng.standard_normal((batch, 3, past + n, 64), dtype=np.float32)
        tree = session.run(None, {"q": q, "k": k})[0]
        i = int(rng.integers(0, n))
        rows = [g * n + i for g in range(3)]  # query heads of one KV head, node i
        keys = past + int(rng.integers(1, n + 1))
        one = session.run(None, {"q": q[:, :, rows], "k": k[:, :, :keys]})[0]
        np.testing.assert_array_equal(one, tree[:, :, rows, :keys])


@pytest.mark.parametrize("threads", [1, 2])
def test_float32_weighted_sum_is_row_invariant_within_a_key_block(threads):
    """row_exact_f32's premise: ONNX Runtime's float32 MatMul sums a row over the keys in key order
    within each KEY_BLOCK-aligned block, so masked keys (exact zeros) between the visible ones and the
    step's row count change no bit, as long as each visible key stays in its block. Here a tree
    step's node (its ancestors at slot offsets, decoys between them) against the one-row step of
    the same position (its keys contiguous), the tree inside the past's block. If a future kernel
    breaks that, this fails first."""
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("MatMul", ["p", "v"], ["y"])], "weighted_sum",
                              [helper.make_tensor_value_info("p", TensorProto.FLOAT, ["B", "H", "M", "K"]),
                               helper.make_tensor_value_info("v", TensorProto.FLOAT, ["B", "H", "K", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21)])
    session = _session_from_bytes(model.SerializeToString(), threads)
    rng = np.random.default_rng(0)
    for _ in range(60):
        past, n = int(rng.integers(5, 1500)), int(rng.integers(2, 30))
        n = max(2, min(n, KEY_BLOCK - past % KEY_BLOCK))  # the tree's slots in the past's block
        node = int(rng.integers(1, n))
        ancestors = sorted(rng.choice(node, size=int(rng.integers(0, node + 1)), replace=False).tolist())
        visible = np.zeros(past + n, bool)
        visible[:past] = True
        visible[[past + a for a in ancestors] + [past + node]] = True
        p = np.exp(rng.standard_normal((1, 3, 3 * n, past + n), dtype=np.float32))
        v = rng.standard_normal((1, 3, past + n, 64), dtype=np.float32)
        rows = [g * n + node for g in range(3)]  # query heads of one KV head, this node
        p[:, :, rows] *= visible
        tree = session.run(None, {"p": p, "v": v})[0][:, :, rows]
        keys = np.flatnonzero(visible)
        one = session.run(None, {"p": np.ascontiguousarray(p[:, :, rows][..., keys]),
                                 "v": np.ascontiguousarray(v[:, :, keys])})[0]
        np.testing.assert_array_equal(one, tree)


@pytest.mark.parametrize("threads", [1, 2])
def test_onnx_attention_is_row_invariant_for_chains(threads):
    """chain_f32's premise: ONNX Runtime's Attention op (opset 23), given a KV head's grouped query
    rows, gives a chain tree node's rows the same bits as the one-step rows of the same position:
    whatever the step's row count and the masked keys after the node's own (its descendants, or a
    shorter sequence's tail in a ragged batch). Keys moved by a gap (branching trees) are not
    covered: the softmax sums a row in vector lanes by key index. If a future kernel breaks the
    premise, this fails first."""
    from onnx import TensorProto, helper

    shape = {"q": ["B", 3, "M", 64], "k": ["B", 3, "P", 64], "v": ["B", 3, "P", 64]}
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, d) for n, d in shape.items()]
    inputs.append(helper.make_tensor_value_info("visible", TensorProto.BOOL, ["B", 1, "M", "P"]))
    graph = helper.make_graph([helper.make_node("Attention", ["q", "k", "v", "visible"], ["y"])], "attention",
                              inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 23)])
    session = _session_from_bytes(model.SerializeToString(), threads)
    rng = np.random.default_rng(0)
    for _ in range(100):
        past, n = int(rng.integers(1, 1500)), int(rng.integers(2, 30))
        q = rng.standard_normal((1, 3, 3 * n, 64), dtype=np.float32)
        k = rng.standard_normal((1, 3, past + n, 64), dtype=np.float32)
        v = rng.standard_normal((1, 3, past + n, 64), dtype=np.float32)
        causal = np.arange(past + n)[None, :] <= past + np.arange(n)[:, None]  # [n, P]: a chain
        chain = session.run(None, {"q": q, "k": k, "v": v, "visible": np.tile(causal, (3, 1))[None, None]})[0]
        i = int(rng.integers(0, n))
        rows = [g * n + i for g in range(3)]  # query heads of one KV head, node i
        keys = past + i + 1
        one = session.run(None, {"q": np.ascontiguousarray(q[:, :, rows]), "k": np.ascontiguousarray(k[:, :, :keys]),
                                 "v": np.ascontiguousarray(v[:, :, :keys]),
                                 "visible": np.ones((1, 1, 3, keys), bool)})[0]
        np.testing.assert_array_equal(one, chain[:, :, rows])


def _session_from_bytes(model: bytes, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def test_engine_attention_derives_what_a_form_means_for_the_engine():
    """One place says what each form implies: a key block, chains only, the cache written in place
    (placed forms on the CPU, unless turned off); and which form an engine gets by default."""
    assert list(ATTENTION_FORMS)[0] == "attention23"
    chain = engine_attention("chain_f32")
    assert (chain.key_block, chain.chains_only, chain.places_new_keys, chain.cache_in_place) == (None, True, True, True)
    row = engine_attention("row_exact_f32", "cpu")
    assert (row.key_block, row.chains_only, row.cache_in_place) == (KEY_BLOCK, False, True)
    assert not engine_attention("row_exact_f32", "cuda").cache_in_place
    assert not engine_attention("chain_f32", "cpu", cache_in_place=False).cache_in_place
    for form in ("attention23", "split", "concat", "mha", "row_exact"):
        e = engine_attention(form)
        assert (e.key_block, e.chains_only, e.places_new_keys, e.cache_in_place) == (None, False, False, False)
    assert default_attention(23, {"format": "int4", "accuracy_level": 4}) == "chain_f32"
    assert default_attention(23, {"format": "int4", "accuracy_level": 0}) == "attention23"
    assert default_attention(21, {"format": "float"}) == "split"
