"""ONNX export (engines/onnx/export.py): the engine's graphs against the PyTorch reference, every
attention form, and the exporter's option errors."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from synthetic import SLIDING_WINDOW_CONFIGS

from medusa_trt.engine_dir import past_names
from medusa_trt.engines.onnx.attention import ATTENTION_FORMS, DEFAULT_ATTENTION
from medusa_trt.engines.onnx.export import export_onnx
from medusa_trt.modeling import MedusaModel
from medusa_trt.runtime.backend import full_attention_mask
from medusa_trt.runtime.ort.session import make_session
from medusa_trt.tree import DEFAULT_TREE, build_tree

ARCHS = ("llama", "mistral", "qwen2")
ATOL = 1e-4  # float32 parity, as medusa-check states it


@pytest.fixture(scope="session")
def reference(tiny_merged):
    cache = {}

    def get(arch: str) -> MedusaModel:
        if arch not in cache:
            cache[arch] = MedusaModel.from_checkpoint(tiny_merged(arch))
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def session(ort_engine):
    cache = {}

    def get(arch: str, graph: str = "model.onnx"):
        if (arch, graph) not in cache:
            cache[arch, graph] = make_session(ort_engine(arch) / graph)
        return cache[arch, graph]

    return get


def make_inputs(model: MedusaModel, batch: int, past: int, mask_kind: str, seed: int = 0):
    """Random committed lengths (<= past, one sequence with none when batch > 1), random cache,
    and S new tokens under a causal or Medusa tree mask, plus the reference's full mask."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    if mask_kind == "tree":
        tree = build_tree(DEFAULT_TREE, cfg.num_medusa_heads, 63)
        new_mask = torch.tensor(tree.attention_mask)[None].expand(batch, -1, -1).contiguous()
        offsets = torch.tensor(tree.position_offsets)
    else:
        s = 7
        new_mask = torch.ones(s, s, dtype=torch.bool).tril()[None].expand(batch, -1, -1).contiguous()
        offsets = torch.arange(s)
    s = new_mask.shape[1]
    lengths = torch.randint(0, past + 1, (batch,), generator=g)
    if batch > 1:
        lengths[0], lengths[-1] = past, 0
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, past, cfg.head_dim)
    keys, values = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (batch, s), generator=g)
    pos = lengths[:, None] + offsets[None]
    logit_positions = torch.arange(s).repeat(batch, 1)
    feeds = {"input_ids": ids.numpy(), "position_ids": pos.numpy(), "past_lengths": lengths.numpy(),
             "new_mask": new_mask.numpy(), "logit_positions": logit_positions.numpy()}
    # The runtime's buffers have room for the new tokens after the longest prefix; the row_exact_f32
    # attention writes them there (engines/onnx/attention.py: PlacedMask), the other forms ignore it.
    room = torch.zeros(batch, cfg.num_kv_heads, s, cfg.head_dim)
    for i, name in enumerate(past_names(cfg.num_layers)):
        feeds[name] = torch.cat([(keys if i % 2 == 0 else values)[i // 2], room], dim=2).numpy()
    ref_args = (ids, pos, full_attention_mask(lengths, past, new_mask), keys, values, logit_positions)
    return feeds, ref_args


def run_decoder(sess, feeds: dict) -> list[np.ndarray]:
    """A decoder graph's logits, hidden and new K/V [L, B, Hkv, S, D]. An in-place graph (engine.json
    onnx.cache_in_place) returns each layer's cache buffer with the new K/V written in; they are read
    back at each sequence's past_lengths[b] + slot."""
    names = [o.name for o in sess.get_outputs()]
    out = dict(zip(names, sess.run(None, feeds), strict=True))
    if "present_keys" in out:
        return [out[n] for n in ("logits", "hidden", "present_keys", "present_values")]
    slots = feeds["past_lengths"][:, None] + np.arange(feeds["input_ids"].shape[1])  # [B, S]

    def new(kind: str) -> np.ndarray:
        layers = sorted((n for n in names if n.startswith(f"present_{kind}_")), key=lambda n: int(n.rsplit("_", 1)[1]))
        return np.stack([np.stack([out[n][b][:, row] for b, row in enumerate(slots)]) for n in layers])
    return [out["logits"], out["hidden"], new("key"), new("value")]


def assert_parity(sess, model: MedusaModel, feeds, ref_args, heads_sess=None):
    """The decoder graph against forward_hidden; with `heads_sess`, the heads graph on the engine's
    own hidden states against the reference heads."""
    got = run_decoder(sess, feeds)
    with torch.no_grad():
        want = model.forward_hidden(*ref_args)
        ref_medusa = model.draft(want[1])
    for name, a, b in zip(("logits", "hidden", "present_keys", "present_values"), got, want, strict=True):
        assert a.shape == tuple(b.shape), name
        diff = float(np.abs(a - b.numpy()).max())
        assert diff <= ATOL, f"{name}: max abs diff {diff:.3e} > {ATOL}"
    if heads_sess is not None:
        hidden = got[1]
        (medusa,) = heads_sess.run(None, {"hidden": hidden.reshape(-1, hidden.shape[-1])})
        medusa = medusa.reshape(ref_medusa.shape)
        diff = float(np.abs(medusa - ref_medusa.numpy()).max())
        assert diff <= ATOL, f"medusa_logits: max abs diff {diff:.3e} > {ATOL}"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("past", [0, 11])
@pytest.mark.parametrize("mask_kind", ["causal", "tree"])
def test_export_parity(session, reference, arch, batch, past, mask_kind):
    model = reference(arch)
    feeds, ref_args = make_inputs(model, batch, past, mask_kind)
    assert_parity(session(arch), model, feeds, ref_args, session(arch, "model_heads.onnx"))


def test_prefill_last_position_only(session, reference):
    """logit_positions picks rows: the prompt path asks for one position per sequence."""
    model = reference("llama")
    feeds, ref_args = make_inputs(model, 3, 5, "causal")
    last = np.array([[6], [2], [4]])
    feeds["logit_positions"] = last
    assert_parity(session("llama"), model, feeds, (*ref_args[:5], torch.from_numpy(last)))


def test_padding_capacity_is_ignored(session, reference):
    """The past input may be the whole cache buffer: entries past each committed length are never
    read, whatever they hold."""
    model = reference("llama")
    feeds, _ = make_inputs(model, 2, 9, "tree")
    sess = session("llama")
    base = sess.run(None, feeds)
    lengths = feeds["past_lengths"]
    for name in past_names(model.cfg.num_layers):
        garbage = feeds[name].copy()
        for b, n in enumerate(lengths):
            garbage[b, :, n:] = 1e4
        feeds[name] = garbage
    for a, b in zip(sess.run(None, feeds), base, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("form", sorted(set(ATTENTION_FORMS) - {DEFAULT_ATTENTION}))
def test_other_attention_forms(tmp_path, tiny_merged, form):
    """Every other attention form on a Qwen2 with a window of 8 keys in its second layer (the first
    attends to all; the default form's window is checked by whole engines, tests/runtime/
    test_ort_backend.py): a tree step and prefills past the window equal the reference, which cuts
    the keys (tests/test_modeling.py checks it against transformers), and differ from the same step
    without the window, so a form that ignored it would fail here."""
    model = MedusaModel.from_checkpoint(tiny_merged("qwen2", base_kwargs={"extra_config": SLIDING_WINDOW_CONFIGS["qwen2"]}))
    result = export_onnx(model, tmp_path / "model.onnx", attention=form)
    sess = make_session(result.path)
    for batch, past, kind in [(3, 11, "tree"), (1, 0, "causal"), (2, 13, "causal")]:
        feeds, ref_args = make_inputs(model, batch, past, kind)
        assert_parity(sess, model, feeds, ref_args)
    with torch.no_grad():  # the windowed layer given the full mask
        full = model.forward_hidden(*ref_args, window_mask=ref_args[2])[0]
    assert float(np.abs(run_decoder(sess, feeds)[0] - full.numpy()).max()) > 1e-2


def test_external_data(tmp_path, reference):
    """Over 2 GB the weights go to a side file; forced here on a tiny model."""
    model = reference("qwen2")
    result = export_onnx(model, tmp_path / "model.onnx", external_data=True)
    assert result.external_data and len(result.files) == 4  # decoder + heads graphs, each with its data file
    graph = onnx.load(result.path, load_external_data=False)
    big = [t for t in graph.graph.initializer if np.prod(t.dims) * 4 >= 4096]
    assert big and all(t.data_location == onnx.TensorProto.EXTERNAL for t in big)
    sess = make_session(result.path)
    assert_parity(sess, model, *make_inputs(model, 3, 11, "tree"))


def test_export_rejects_bad_options(tmp_path, reference):
    model = reference("llama")
    with pytest.raises(ValueError, match="attention form 'flash'"):
        export_onnx(model, tmp_path / "m.onnx", attention="flash")
    with pytest.raises(ValueError, match="attention23.*opset >= 23"):
        export_onnx(model, tmp_path / "m.onnx", attention="attention23", opset=20)
    with pytest.raises(ValueError, match="opset 12"):
        export_onnx(model, tmp_path / "m.onnx", opset=12)


def test_step_is_capacity_independent(ort_engine, tiny_merged):
    """Attention reads only the committed prefix: the same step with the cache in a buffer 5x larger
    (tail filled with garbage) gives bit-identical outputs."""
    model = MedusaModel.from_checkpoint(tiny_merged("llama"))
    feeds, _ = make_inputs(model, 3, 9, "tree")
    sess = make_session(ort_engine("llama") / "model.onnx")
    small = sess.run(None, feeds)
    for name in past_names(model.cfg.num_layers):
        cache = feeds[name]
        big = np.full((*cache.shape[:2], cache.shape[2] + 45, cache.shape[3]), 1e4, dtype=cache.dtype)
        big[:, :, :9] = cache[:, :, :9]
        for b, n in enumerate(feeds["past_lengths"]):
            big[b, :, n:9] = 1e4
        feeds[name] = big
    for a, b in zip(sess.run(None, feeds), small, strict=True):
        np.testing.assert_array_equal(a, b)


def test_exports_share_one_torchlib_registry_and_each_gets_its_own_copy():
    """A build's exports take copies of one registry of aten -> ONNX functions (tracing.py:
    one_torchlib_registry): the same functions as the registry torch.onnx builds itself, and a
    custom op one export registers stays out of the next export's copy."""
    from torch.onnx._internal.exporter._registration import ONNXRegistry

    from medusa_trt.engines.onnx.ops import int4_translations
    from medusa_trt.engines.onnx.tracing import one_torchlib_registry

    original = ONNXRegistry.__dict__["from_torchlib"].__func__
    fresh = ONNXRegistry.from_torchlib(23)
    with one_torchlib_registry():
        first = ONNXRegistry().from_torchlib(opset_version=23)
        for op, fn in int4_translations().items():
            first.register_op(op, fn)
        second = ONNXRegistry().from_torchlib(opset_version=23)
    assert ONNXRegistry.__dict__["from_torchlib"].__func__ is original  # restored on exit
    assert second.functions.keys() == fresh.functions.keys() and second.opset_version == fresh.opset_version
    assert all([d.onnx_function for d in second.functions[k]] == [d.onnx_function for d in fresh.functions[k]]
               for k in fresh.functions)
    assert len(first.functions) > len(second.functions)
