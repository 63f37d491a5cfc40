"""The ONNX graph for TensorRT: attention nodes replaced by tree-attention plugin nodes.

The rewritten graph runs here in ONNX Runtime, the plugin op implemented through onnxruntime-extensions
by the PyTorch reference (and by the Triton kernel in its interpreter), and must match the unrewritten
ONNX Runtime engine: on prefill and tree-verify inputs, on whole Medusa decodes, and for FP8 graphs,
whose quantize/dequantize nodes must pass through untouched.
"""

from __future__ import annotations

import collections
import importlib.util
import os
import shutil
import sys

import numpy as np
import pytest
import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None
if HAVE_TRITON and not torch.cuda.is_available() and "triton" not in sys.modules:
    # As in test_tree_attention_kernel: triton picks interpreted mode at its first import.
    os.environ["TRITON_INTERPRET"] = "1"
    import triton  # noqa: F401

# Imported, not importorskip'd: `make test` installs them (the dev extra), so a broken install fails
# here rather than skipping the graph rewrite's tests without a word.
import onnx  # noqa: E402
import onnx_graphsurgeon  # noqa: E402, F401
import onnxruntime_extensions  # noqa: E402, F401

from medusa_trt.engines.onnx.export import export_onnx  # noqa: E402
from medusa_trt.engines.trt.rewrite import (  # noqa: E402
    PACKED_MASK,
    PAST_LENS,
    POSITIONS,
    RewriteError,
    reference_session,
    rewrite_attention,
    rewrite_onnx_file,
)
from medusa_trt.modeling import MedusaModel  # noqa: E402
from medusa_trt.runtime.decoding import GenerationConfig, decode  # noqa: E402
from medusa_trt.runtime.dynamic import build_batch  # noqa: E402
from medusa_trt.runtime.ort.backend import OrtBackend  # noqa: E402
from medusa_trt.runtime.ort.session import make_session  # noqa: E402
from medusa_trt.runtime.trt.tree_attention import kernel  # noqa: E402
from medusa_trt.runtime.trt.tree_attention.plugin import PLUGIN_NAME, PLUGIN_NAMESPACE  # noqa: E402
from medusa_trt.tree import build_tree, pack_mask  # noqa: E402

TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [2, 0, 0, 0]]  # 9 nodes, depth 4


@pytest.fixture(scope="module")
def rewritten(ort_engine, tmp_path_factory):
    """rewritten(arch) -> (unrewritten model.onnx, rewritten copy), from the session's ORT engine."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            src = ort_engine(arch) / "model.onnx"
            work = tmp_path_factory.mktemp(f"rewrite-{arch}")
            shutil.copy(src, work / "model.onnx")
            shutil.copy(src.with_name("weights.bin"), work / "weights.bin")  # its external data (shared weights)
            cache[arch] = (src, rewrite_onnx_file(work / "model.onnx"))
        return cache[arch]

    return get


def _attr(node, name):
    return next(onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_structure(rewritten, tiny_merged, arch):
    src, result = rewritten(arch)
    layers = MedusaModel.from_checkpoint(tiny_merged(arch)).cfg.num_layers
    before, after = onnx.load(str(src)), onnx.load(str(result.path))
    attention = [n for n in before.graph.node if n.op_type == "Attention"]
    plugins = [n for n in after.graph.node if n.op_type == PLUGIN_NAME]
    assert len(attention) == layers == len(plugins) == len(result.plugin_nodes)
    assert result.replaced == tuple(n.name for n in attention)
    assert not any(n.op_type == "Attention" for n in after.graph.node)

    producers = {o: n for n in after.graph.node for o in n.output}
    for old, new in zip(attention, plugins, strict=True):
        assert new.domain == PLUGIN_NAMESPACE
        assert _attr(new, "plugin_namespace") == PLUGIN_NAMESPACE.encode()
        assert _attr(new, "aot") == 1
        assert _attr(new, "scale") == 0.0  # the exporter's Attention has no scale: 1/sqrt(D)
        assert list(new.output) == [old.output[0]]  # downstream reads the same tensor
        assert _attr(new, "window") == 0
        assert list(new.input[:3]) == list(old.input[:3])
        assert list(new.input[3:]) == [PAST_LENS, PACKED_MASK, POSITIONS]
        for name, past in ((new.input[1], "past_key_"), (new.input[2], "past_value_")):
            concat = producers[name]
            first = concat.input[0]
            if first in producers and producers[first].op_type == "Slice":  # the committed prefix
                first = producers[first].input[0]
            assert concat.op_type == "Concat" and first.startswith(past)
    # The dense mask and its prefix subgraph are gone; new_mask's values only feed the packing.
    readers = [n.op_type for n in after.graph.node if "new_mask" in n.input and n.op_type != "Shape"]
    assert readers == ["Cast"]
    assert "Less" in {n.op_type for n in before.graph.node} and "Less" not in {n.op_type for n in after.graph.node}
    # Everything else is untouched.
    kept = ("MatMul", "RMSNormalization", "Gather", "GatherElements", "Sigmoid", "Cos", "Sin", "Transpose")
    count = lambda m: collections.Counter(n.op_type for n in m.graph.node if n.op_type in kept)  # noqa: E731
    assert count(before) == count(after)
    assert [i.name for i in after.graph.input] == [i.name for i in before.graph.input]
    assert [o.name for o in after.graph.output] == [o.name for o in before.graph.output]
    assert {o.domain: o.version for o in after.opset_import}[PLUGIN_NAMESPACE] == 1
    assert after.ir_version == before.ir_version

    onnx.checker.check_model(after)
    inferred = onnx.shape_inference.infer_shapes(after, strict_mode=True)
    logits = next(o for o in inferred.graph.output if o.name == "logits").type.tensor_type
    assert logits.elem_type == onnx.TensorProto.FLOAT and len(logits.shape.dim) == 3


def test_packed_mask_is_tree_pack_mask(rewritten, tmp_path):
    """The in-graph packing equals medusa_trt.tree.pack_mask, bit 31 and several words included."""
    _, result = rewritten("llama")
    model = onnx.load(str(result.path))
    model.graph.output.append(onnx.helper.make_tensor_value_info(PACKED_MASK, onnx.TensorProto.INT32, None))
    path = result.path.parent / "with_mask.onnx"
    onnx.save(model, str(path))
    session = reference_session(path)
    rng = np.random.default_rng(0)
    for s in (1, 5, 31, 32, 33, 64, 70):
        feeds = _feeds(rng, batch=2, new=s, past=3, lengths=[1, 3], mask=rng.random((2, s, s)) < 0.5)
        feeds["new_mask"][:, :, min(s - 1, 31)] = True  # bit 31 set in word 0 when it exists
        got = session.run([PACKED_MASK], feeds)[0]
        words = -(-s // 32)
        assert got.shape == (2, s, words) and got.dtype == np.int32
        for b in range(2):
            np.testing.assert_array_equal(got[b], pack_mask(feeds["new_mask"][b], words))


def _feeds(rng, *, batch, new, past, lengths, mask, layers=2, kv_heads=2, head_dim=16, vocab=256, positions=None):
    feeds = {
        "input_ids": rng.integers(0, vocab, (batch, new)).astype(np.int64),
        "position_ids": (np.asarray(lengths)[:, None] + (np.arange(new) if positions is None else positions)[None]
                         ).astype(np.int64),
        "past_lengths": np.asarray(lengths, dtype=np.int64),
        "new_mask": np.ascontiguousarray(mask, dtype=bool),
        "logit_positions": np.tile(np.arange(new), (batch, 1)).astype(np.int64),
    }
    for i in range(layers):
        for kind in ("key", "value"):
            # Holes past each length hold garbage: the plugin must not read them.
            feeds[f"past_{kind}_{i}"] = rng.standard_normal((batch, kv_heads, past, head_dim)).astype(np.float32)
    return feeds


def _run_both(src, dst, feeds, impl="reference"):
    expected = make_session(src).run(None, feeds)
    got = reference_session(dst, impl=impl).run(None, feeds)
    for name, e, g in zip(("logits", "hidden", "present_keys", "present_values"), expected, got, strict=True):
        assert e.shape == g.shape, name
        np.testing.assert_allclose(g, e, atol=1e-4, rtol=0, err_msg=name)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("batch", [1, 3])
def test_matches_unrewritten_engine(rewritten, tiny_merged, arch, batch):
    src, result = rewritten(arch)
    cfg = MedusaModel.from_checkpoint(tiny_merged(arch)).cfg
    dims = dict(layers=cfg.num_layers, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, vocab=cfg.vocab_size)
    rng = np.random.default_rng(batch)
    # Prefill: a causal mask over the prompt, an empty committed prefix in a cache of garbage.
    s = 7
    causal = np.tril(np.ones((s, s), dtype=bool))[None].repeat(batch, 0)
    _run_both(src, result.path, _feeds(rng, batch=batch, new=s, past=4, lengths=[0] * batch, mask=causal, **dims))
    # Tree verify: the tree's mask and depth offsets after per-sequence committed lengths.
    tree = build_tree(TREE, num_heads=cfg.num_medusa_heads)
    lengths = [9, 4, 11][:batch]
    mask = np.broadcast_to(tree.attention_mask, (batch, tree.num_slots, tree.num_slots))
    _run_both(src, result.path, _feeds(rng, batch=batch, new=tree.num_slots, past=12, lengths=lengths, mask=mask,
                                       positions=tree.position_offsets, **dims))


@pytest.mark.skipif(not (HAVE_TRITON and kernel.interpreter_active()),
                    reason="triton is not running interpreted in this process")
def test_matches_with_triton_kernel_in_interpreter(rewritten, tiny_merged, monkeypatch):
    calls = []
    triton_attention = kernel.triton_tree_attention
    monkeypatch.setattr(kernel, "triton_tree_attention", lambda *a, **k: calls.append(1) or triton_attention(*a, **k))
    src, result = rewritten("llama")
    cfg = MedusaModel.from_checkpoint(tiny_merged("llama")).cfg
    tree = build_tree(TREE, num_heads=cfg.num_medusa_heads)
    mask = np.broadcast_to(tree.attention_mask, (2, tree.num_slots, tree.num_slots))
    feeds = _feeds(np.random.default_rng(5), batch=2, new=tree.num_slots, past=6, lengths=[6, 2], mask=mask,
                   positions=tree.position_offsets, layers=cfg.num_layers, kv_heads=cfg.num_kv_heads,
                   head_dim=cfg.head_dim, vocab=cfg.vocab_size)
    _run_both(src, result.path, feeds, impl="kernel")
    assert len(calls) == cfg.num_layers  # the Triton kernel ran, once per plugin node
    # Trees chosen per step: each sequence of the batch has a tree of its own (mask and depths).
    per_step = build_batch([[(5,), (6,), (5, 7), (5, 7, 8)], [(9,), (9, 4), (9, 4, 3), (2,)]], [1, 1])
    feeds = _feeds(np.random.default_rng(6), batch=2, new=per_step.num_slots, past=6, lengths=[6, 2],
                   mask=per_step.mask.numpy(), positions=np.zeros(per_step.num_slots, dtype=np.int64), layers=cfg.num_layers, kv_heads=cfg.num_kv_heads,
                   head_dim=cfg.head_dim, vocab=cfg.vocab_size)
    feeds["position_ids"] = (np.array([6, 2])[:, None] + per_step.position_offsets.numpy()).astype(np.int64)
    _run_both(src, result.path, feeds, impl="kernel")
    assert len(calls) == 2 * cfg.num_layers


def test_medusa_decode_through_rewritten_graph(ort_engine, rewritten):
    """Whole greedy Medusa decodes (prefill, tree steps, ragged batch, commits) give the same tokens
    through the rewritten graph as through the ONNX Runtime engine."""
    engine = ort_engine("llama")
    _, result = rewritten("llama")
    prompts = [[1, 5, 9, 14, 3, 22], [1, 40], [1, 7, 7, 7, 8, 30, 31, 2, 50, 51, 52]]
    cfg = GenerationConfig(max_new_tokens=24, medusa_choices=TREE)
    expected = decode(OrtBackend(engine), prompts, cfg)
    backend = OrtBackend(engine)
    backend.session = reference_session(result.path)
    got = decode(backend, prompts, cfg)
    assert got.tokens == expected.tokens
    assert [s.steps for s in got.stats] == [s.steps for s in expected.stats]
    # Trees chosen per step, on the two-call path a TensorRT engine takes: a mask per sequence.
    backend.fused_step_topk = None
    dynamic = decode(backend, prompts, GenerationConfig(max_new_tokens=24, medusa_choices="dynamic:6"))
    assert dynamic.tokens == decode(OrtBackend(engine), prompts, GenerationConfig(max_new_tokens=24,
                                                                                  use_medusa=False)).tokens


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory, tiny_base, tiny_heads):
    from medusa_trt.converter.merge import convert
    from medusa_trt.converter.quantize import QuantOptions

    work = tmp_path_factory.mktemp("fp8-rewrite")
    calib = work / "calib.txt"
    calib.write_text("\n".join(["the quick brown fox jumps", "over a lazy dog while Medusa heads guess",
                                "what comes next, 42 times"]) + "\n")
    base = tiny_base()
    out = work / "ckpt"
    convert(base, tiny_heads("medusa_v1", base), out, progress=False,
            quant=QuantOptions(quantize="fp8", kv_cache_dtype="fp8", calib_data=calib))
    return out


def test_fp8_qdq_pass_through(fp8_checkpoint, tmp_path):
    model = MedusaModel.from_checkpoint(fp8_checkpoint, dtype="float32")
    exported = export_onnx(model, tmp_path / "model.onnx")
    result = rewrite_onnx_file(exported.path)
    before, after = onnx.load(str(exported.path)), onnx.load(str(result.path))

    def qdq(m):
        return [(n.name, n.op_type, list(n.input), list(n.output), [onnx.helper.printable_attribute(a) for a in n.attribute])
                for n in m.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]

    assert qdq(before) and sorted(qdq(after)) == sorted(qdq(before))
    fp8 = lambda m: sorted(i.name for i in m.graph.initializer if i.data_type == onnx.TensorProto.FLOAT8E4M3FN)  # noqa: E731
    assert fp8(before) and fp8(after) == fp8(before)
    # With an FP8 KV cache the new keys/values are quantized-dequantized before the concat the plugin reads.
    producers = {o: n for n in after.graph.node for o in n.output}
    plugin = next(n for n in after.graph.node if n.op_type == PLUGIN_NAME)
    concat = producers[plugin.input[1]]
    assert producers[concat.input[1]].op_type in ("DequantizeLinear", "CastLike", "Cast")
    onnx.checker.check_model(after)

    cfg = model.cfg
    tree = build_tree(TREE, num_heads=cfg.num_medusa_heads)
    mask = np.broadcast_to(tree.attention_mask, (2, tree.num_slots, tree.num_slots))
    _run_both(exported.path, result.path,
              _feeds(np.random.default_rng(7), batch=2, new=tree.num_slots, past=10, lengths=[8, 3], mask=mask,
                     positions=tree.position_offsets, layers=cfg.num_layers, kv_heads=cfg.num_kv_heads,
                     head_dim=cfg.head_dim, vocab=cfg.vocab_size))


def test_external_data_stays_external(tiny_merged, tmp_path):
    model = MedusaModel.from_checkpoint(tiny_merged("llama"), dtype="float32")
    exported = export_onnx(model, tmp_path / "model.onnx", external_data=True)
    data_files = {p.name for p in tmp_path.glob("*.data")}
    assert data_files
    result = rewrite_onnx_file(exported.path)
    assert {p.name for p in tmp_path.glob("*.data")} == data_files  # nothing copied or rewritten
    assert result.path.stat().st_size < 200_000  # the graph only; the weights stay in the data files
    after = onnx.load(str(result.path), load_external_data=False)
    locations = {e.value for i in after.graph.initializer for e in i.external_data if e.key == "location"}
    assert locations and locations <= data_files
    cfg = model.cfg
    causal = np.tril(np.ones((4, 4), dtype=bool))[None]
    _run_both(exported.path, result.path, _feeds(np.random.default_rng(1), batch=1, new=4, past=2, lengths=[2],
                                                 mask=causal, layers=cfg.num_layers, kv_heads=cfg.num_kv_heads,
                                                 head_dim=cfg.head_dim, vocab=cfg.vocab_size))


def test_errors(tiny_merged, rewritten, tmp_path):
    model = MedusaModel.from_checkpoint(tiny_merged("llama"), dtype="float32")
    split = export_onnx(model, tmp_path / "split.onnx", attention="split")
    with pytest.raises(RewriteError, match="no Attention node.*attention23"):
        rewrite_onnx_file(split.path)
    src, _ = rewritten("llama")
    with pytest.raises(RewriteError, match="must be in the directory"):
        rewrite_onnx_file(src, tmp_path / "elsewhere.onnx")
    with pytest.raises(RewriteError, match="not found"):
        rewrite_onnx_file(tmp_path / "missing.onnx")
    # An Attention whose mask is not the exporter's [prefix | new_mask] is refused, not rewritten.
    m = onnx.load(str(src))
    node = next(n for n in m.graph.node if n.op_type == "Attention")
    node.input[3] = "new_mask"
    with pytest.raises(RewriteError, match="attn_mask 'new_mask'"):
        rewrite_attention(m)
