"""ONNX Runtime contrib-op fusions of medusa-build's graphs (engines/ort/fusions.py, issue 13): every
pattern of every layer is rewritten, and a fused engine decodes as the plain one does (greedy tokens
equal; logits within float32 rounding); the in-place cache rewrite (write_cache_in_place)."""

from __future__ import annotations

import collections
import json

import onnx
import pytest
import torch

from medusa_trt.engines.build import build_engine
from medusa_trt.engines.options import BuildError, BuildOptions
from medusa_trt.engines.ort.build import OrtOptions
from medusa_trt.engines.ort.fusions import FUSIONS
from medusa_trt.modeling import MedusaModel
from medusa_trt.runtime.decoding import GenerationConfig, decode
from medusa_trt.runtime.ort.backend import OrtBackend
from medusa_trt.runtime.ort.session import OrtSessionOptions
from medusa_trt.runtime.steps import prefill
from tests.engines.onnx.test_attention import one_row_logits
from tests.engines.ort.test_ort_build import INT4, int4_engine


def _ops(path) -> collections.Counter:
    return collections.Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)


@pytest.mark.parametrize("weights", ["float", "int4", "int8"])
def test_fused_graphs(ort_engine, tiny_merged, weights):
    engine = ort_engine(backend_options=OrtOptions(weights=weights))
    layers = MedusaModel.from_checkpoint(tiny_merged("llama")).cfg.num_layers
    info = json.loads((engine / "engine.json").read_text())["onnx"]
    # Query and key rotated per layer; each layer's two norms and the final one follow a residual Add
    # (the first input norm reads the embedding). An int8 layer fuses its gate and up twice: the int8
    # products and those of the float channels.
    gate_up = 2 * layers if weights == "int8" else layers
    assert info["fusions"] == {"rotary": 2 * layers, "skip_norm": 2 * layers, "gate_up": gate_up}
    for name in (info["file"], info["step_file"]):
        ops = _ops(engine / name)
        assert ops["RotaryEmbedding"] == 2 * layers and ops["SkipSimplifiedLayerNormalization"] == 2 * layers
        assert ops["Neg"] == 0 and ops["Sin"] == 0 and ops["RMSNormalization"] == 1, (name, ops)
        matmuls = {"int4": ops["MatMulNBits"], "int8": ops["MatMulIntegerToFloat"]}.get(weights, ops["MatMul"])
        assert matmuls >= 4 * layers and ops["Split"] >= 2 * layers  # qkv, o, gate+up, down per layer
        if weights == "int8":  # the gate and up products are one, split once after their float channels are added
            assert ops["MatMulIntegerToFloat"] == 4 * layers + 1 and ops["MatMul"] == 3 * layers + 1, (name, ops)


@pytest.mark.parametrize("weights", ["float", "int4", "int8"])
def test_fused_engine_decodes_as_plain_graph(ort_engine, weights):
    fused = ort_engine(backend_options=OrtOptions(weights=weights))
    plain = ort_engine(backend_options=OrtOptions(weights=weights, fusions=()))
    assert json.loads((plain / "engine.json").read_text())["onnx"]["fusions"] == {}
    one = OrtSessionOptions(threads=1)
    a, b = OrtBackend(fused, options=one), OrtBackend(plain, options=one)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, a.vocab_size, (2, 9), generator=g)
    pos, mask = torch.arange(9).expand(2, 9), torch.ones(2, 9, 9, dtype=torch.bool).tril()
    for backend in (a, b):
        backend.start(2, 32)
    (la, ma), (lb, mb) = a.forward(ids, pos, mask), b.forward(ids, pos, mask)
    tol = 1e-4 if weights == "float" else 5e-2  # int4, int8: activations are rounded to int8
    torch.testing.assert_close(la, lb, rtol=0, atol=tol * lb.abs().max().item())
    torch.testing.assert_close(ma, mb, rtol=0, atol=tol * mb.abs().max().item())
    if weights == "float":
        cfg = GenerationConfig(max_new_tokens=12, medusa_choices=[[0], [0, 0], [1]])
        prompts = [ids[0, :5].tolist(), ids[1].tolist()]
        assert decode(a, prompts, cfg).tokens == decode(b, prompts, cfg).tokens


def test_unknown_fusion_is_refused(tiny_merged, tmp_path):
    with pytest.raises(BuildError, match="fusions"):
        build_engine(BuildOptions(checkpoint=tiny_merged("llama"), out=tmp_path / "e", progress=False,
                                  backend_options=OrtOptions(fusions=("rotary", "gelu"))))
    assert not (tmp_path / "e").exists()
    assert set(FUSIONS) == {"rotary", "skip_norm", "gate_up"}


def _two_splits_added(extra_reader: bool = False):
    """y_i = split(a)_i + split(b)_i for three parts of a [2, 9] row (an exact int4 engine's
    MatMulNBits and offset correction after the gate_up fusion); `extra_reader`: part 0 of a is also
    a graph output."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    sizes = numpy_helper.from_array(np.array([2, 3, 4], dtype=np.int64), "sizes")
    nodes = [helper.make_node("Split", ["a", "sizes"], ["a0", "a1", "a2"], axis=-1),
             helper.make_node("Split", ["b", "sizes"], ["b0", "b1", "b2"], axis=-1)]
    nodes += [helper.make_node("Add", [f"a{i}", f"b{i}"] if i != 1 else ["b1", "a1"], [f"y{i}"]) for i in range(3)]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y0", "y1", "y2")]
    if extra_reader:
        io.append(helper.make_tensor_value_info("a0", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 9]) for n in "ab"],
                              io, [sizes])
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("extra_reader", [False, True])
def test_add_before_split_is_bitwise_the_pairwise_adds(extra_reader):
    import numpy as np
    import onnxruntime as ort

    from medusa_trt.engines.ort.fusions import _add_before_split

    model = _two_splits_added(extra_reader)
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal((2, 9), dtype=np.float32), "b": rng.standard_normal((2, 9), dtype=np.float32)}

    def run(m):
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)

    before = run(model)
    assert _add_before_split(model) == (0 if extra_reader else 1)
    ops = collections.Counter(n.op_type for n in model.graph.node)
    assert (ops["Split"], ops["Add"]) == ((2, 3) if extra_reader else (1, 1))
    for x, y in zip(before, run(model), strict=True):
        assert np.array_equal(x, y)


def test_int4_cache_is_written_in_place(ort_engine):
    """int4 engines write each step's new K/V into the cache buffers the runtime binds (TensorScatter,
    engines/ort/fusions.py: write_cache_in_place), nothing scattered after the step: the same
    tokens and logit bits as the same engine built without it, on both greedy paths of a branching
    tree (whose accepted paths the commit moves into place) and a ragged batch."""
    import onnx

    inplace = int4_engine(ort_engine, 4)
    copied = ort_engine("llama", backend_options=OrtOptions(**INT4, int4_accuracy_level=4, cache_in_place=False))
    engine = json.loads((inplace / "engine.json").read_text())
    assert engine["onnx"]["cache_in_place"] is True and engine["onnx"]["opset"] >= 24
    assert json.loads((copied / "engine.json").read_text())["onnx"]["cache_in_place"] is False
    layers = engine["model"]["num_layers"]
    for name in ("model.onnx", "model_step.onnx"):
        graph = onnx.load(inplace / name, load_external_data=False).graph
        ops = [n.op_type for n in graph.node]
        assert ops.count("TensorScatter") == 2 * layers and "ScatterElements" not in ops
        assert [o.name for o in graph.output][-2 * layers:] == [
            f"present_{kind}_{i}" for i in range(layers) for kind in ("key", "value")]
    a, b = OrtBackend(inplace), OrtBackend(copied)
    assert a.in_place and not b.in_place
    ids = [7, 3, 19, 40, 2, 11, 5, 60, 33, 21, 9, 14]
    torch.testing.assert_close(one_row_logits(a, ids, 6), one_row_logits(b, ids, 6), rtol=0, atol=0)
    prompts = [[5, 9, 17, 33], [3, 4], list(range(20, 40))]
    tree = [[0], [1], [0, 0], [1, 0], [0, 1]]
    for use_medusa in (False, True):
        cfg = GenerationConfig(max_new_tokens=24, use_medusa=use_medusa, medusa_choices=tree)
        want = decode(b, prompts, cfg)
        assert decode(a, prompts, cfg).tokens == want.tokens
    a.step_session, a.fused_step_topk = None, None  # the two-call path: forward, then commit
    assert decode(a, prompts, cfg).tokens == want.tokens
    # Random heads are rarely right, so a commit that moves slots is made here: a tree of root, two
    # children and a grandchild under the second child, its path root -> 2 -> 3 kept, then a step.
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)[None]
    after = []
    for backend in (a, b):
        backend.start(1, 32)
        prefill(backend, [ids[:6]])
        backend.forward(torch.tensor([[4, 8, 9, 10]]), backend.lengths[:, None] + torch.tensor([[0, 1, 1, 2]]), mask,
                        with_heads=False)
        backend.commit(torch.tensor([[0, 2, 3]]), torch.tensor([3]))
        after.append(backend.forward(torch.tensor([[12]]), backend.lengths[:, None], torch.ones(1, 1, 1, dtype=torch.bool),
                                     with_heads=False)[0])
    assert a.lengths.tolist() == b.lengths.tolist() == [9]
    torch.testing.assert_close(after[0], after[1], rtol=0, atol=0)
