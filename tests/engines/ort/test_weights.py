"""One copy of the weights (issue 13): the engine's graphs share one external-data file, outputs
are bit-identical to graphs holding their own weights, and --no-prepack engines share one mapping."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import onnx
import torch

from medusa_trt.engine_dir import past_names, read_engine
from medusa_trt.engines.onnx.export import example_inputs, export_onnx, step_example_inputs
from medusa_trt.engines.ort.weights import ALIGNMENT, WEIGHTS_FILE, share_weights
from medusa_trt.modeling import MedusaModel
from medusa_trt.runtime.decoding import GenerationConfig, decode
from medusa_trt.runtime.ort.backend import OrtBackend
from medusa_trt.runtime.ort.session import OrtSessionOptions, make_session


def _feeds(inputs: dict, num_layers: int) -> dict:
    past = inputs.pop("past")
    feeds = {k: v.numpy() for k, v in inputs.items()}
    feeds.update({name: p.numpy() for name, p in zip(past_names(num_layers), past, strict=True)})
    return feeds


def _external(path) -> list[tuple[str, int, int]]:
    """(location, offset, length) of every external initializer of the graph at `path`."""
    out = []
    for t in onnx.load(str(path), load_external_data=False).graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            out.append((info["location"], int(info["offset"]), int(info["length"])))
    return out


def test_shared_graphs_are_bit_identical(tmp_path, tiny_merged):
    model = MedusaModel.from_checkpoint(tiny_merged("llama"))
    result = export_onnx(model, tmp_path / "model.onnx", fused_step=True)
    graphs = [result.path, result.heads_path, result.step_path]
    cfg = model.cfg
    feeds = [_feeds(example_inputs(model), cfg.num_layers), {"hidden": np.random.default_rng(0).standard_normal(
        (3, cfg.hidden_size)).astype(np.float32)}, _feeds(step_example_inputs(model), cfg.num_layers)]
    before = [make_session(g).run(None, f) for g, f in zip(graphs, feeds, strict=True)]
    graph_bytes = sum(g.stat().st_size for g in graphs)

    shared = share_weights(graphs)
    assert shared.file_bytes < 0.6 * shared.graph_bytes  # the step graph repeats the decoder's weights
    files = {p.name for p in tmp_path.iterdir()}
    assert files == {"model.onnx", "model_heads.onnx", "model_step.onnx", WEIGHTS_FILE}
    total = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert total < 0.6 * graph_bytes, (total, graph_bytes)  # tiny model: the decoder's weights once, not twice
    regions = set()
    for g in graphs:
        onnx.checker.check_model(str(g))  # the external-data entries are valid onnx
        for location, offset, length in _external(g):
            assert location == WEIGHTS_FILE and (length < ALIGNMENT or offset % ALIGNMENT == 0)
            regions.add((offset, length))
    data = (tmp_path / WEIGHTS_FILE).read_bytes()
    digests = [hashlib.sha256(data[o:o + n]).digest() for o, n in regions]
    assert len(set(digests)) == len(digests)  # no content written twice
    after = [make_session(g).run(None, f) for g, f in zip(graphs, feeds, strict=True)]
    for outs_before, outs_after in zip(before, after, strict=True):
        for a, b in zip(outs_before, outs_after, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b)  # same weights, same bits


def test_transposed_copy_becomes_a_transpose(tmp_path):
    """A graph holding another graph's tensor transposed (the exporter's pre-transposed lm_head)
    reads the stored one through a Transpose node: one copy on disk, the same output bits."""
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).standard_normal((300, 8)).astype(np.float32)  # [vocab, hidden]-like
    x = np.random.default_rng(1).standard_normal((2, 300)).astype(np.float32)
    x2 = np.random.default_rng(2).standard_normal((2, 8)).astype(np.float32)
    paths, outputs = [], []
    for name, weight, xin in (("a", w, x), ("b", np.ascontiguousarray(w.T), x2)):
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["y"])], name,
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(xin.shape))],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [numpy_helper.from_array(weight, "w")])
        path = tmp_path / f"{name}.onnx"
        onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), str(path))
        paths.append(path)
        outputs.append(make_session(path).run(None, {"x": xin})[0])
    shared = share_weights(paths)
    assert (shared.tensors, shared.transposed) == (1, 1) and shared.file_bytes == w.nbytes
    assert [n.op_type for n in onnx.load(str(paths[1]), load_external_data=False).graph.node] == ["Transpose", "MatMul"]
    for path, xin, want in zip(paths, (x, x2), outputs, strict=True):
        assert np.array_equal(make_session(path).run(None, {"x": xin})[0], want)


def test_engine_dir_holds_one_weights_file(ort_engine):
    engine_dir = ort_engine("llama")
    engine = read_engine(engine_dir)
    assert engine["onnx"]["weights_file"] == WEIGHTS_FILE and engine["onnx"]["prepack_weights"] is True
    assert WEIGHTS_FILE in engine["artifacts"]  # medusa-check's digests cover it
    assert not list(engine_dir.glob("*.data"))
    for key in ("file", "heads_file", "step_file"):
        assert {loc for loc, _, _ in _external(engine_dir / engine["onnx"][key])} == {WEIGHTS_FILE}


def test_no_prepack_engine_decodes_the_same(ort_engine, tmp_path):
    """--no-prepack: the sessions compute from one mapping of weights.bin. Unpacked MatMuls may sum
    in another order than packed ones, so logits agree to float32 rounding (1e-5) and greedy tokens
    exactly (the tiny model's top-2 margins are far wider)."""
    engine_dir = tmp_path / "engine"
    shutil.copytree(ort_engine("llama"), engine_dir)
    path = engine_dir / "engine.json"
    engine = json.loads(path.read_text())
    engine["onnx"]["prepack_weights"] = False
    path.write_text(json.dumps(engine))
    one = OrtSessionOptions(threads=1)
    packed, mapped = OrtBackend(ort_engine("llama"), options=one), OrtBackend(engine_dir, options=one)
    assert packed._weights is None and mapped._weights is not None
    prompts = [[1, 5, 9, 2, 7], [3, 4]]
    for use_medusa in (True, False):
        cfg = GenerationConfig(max_new_tokens=12, use_medusa=use_medusa)
        assert decode(mapped, prompts, cfg).tokens == decode(packed, prompts, cfg).tokens
    ids = torch.tensor([[1, 5, 9]])
    pos, mask = torch.arange(3)[None], torch.ones(1, 3, 3, dtype=torch.bool).tril()
    for b in (packed, mapped):
        b.start(1, 8)
    (lp, mp), (lm, mm) = packed.forward(ids, pos, mask), mapped.forward(ids, pos, mask)
    assert torch.allclose(lp, lm, atol=1e-5) and torch.allclose(mp, mm, atol=1e-5)
