"""medusa-build --backend tensorrt and the TensorRT runtime backend.

On a machine without TensorRT (or without a GPU) the builder must stop with one clear line naming
the extra to install and exit 2; that path and the option checks run everywhere. The real builds
(plugin and native attention) and the TensorRTBackend parity against the PyTorch reference run only
where `tensorrt` imports and CUDA is available.
"""

from __future__ import annotations

import json
import re
import sys
import types

import pytest
import torch

from medusa_trt.cli import build as build_cli
from medusa_trt.engines.options import BuildError, BuildOptions, Limits, limits_for
from medusa_trt.engines.trt.build import TrtOptions, check_attention_options, decoder_profile, heads_profile


def _main(ckpt, out, *args) -> int:
    return build_cli.main(["--checkpoint", str(ckpt), "--out", str(out), "--backend", "tensorrt", "--quiet", *args])


def test_missing_tensorrt_is_one_line_and_exit_2(tiny_merged, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # `import tensorrt` fails, even where it is installed
    out, ckpt = tmp_path / "engine", tiny_merged("llama")
    capsys.readouterr()  # the fixture's own output
    assert _main(ckpt, out) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("medusa-build: error: --backend tensorrt needs TensorRT")
    assert "pip install 'medusa-trt[tensorrt]'" in err
    assert not out.exists() and not list(tmp_path.glob(".engine.tmp-*"))


def test_missing_gpu_is_one_line_and_exit_2(tiny_merged, tmp_path, monkeypatch, capsys):
    """A supported TensorRT (a stand-in module: only the refusal before any TensorRT call runs) on a
    machine whose torch sees no GPU: one line, exit 2, nothing written. Without the stand-in this
    ran on no machine: CI has no TensorRT, and the GPU machine has a GPU."""
    ckpt = tiny_merged("llama")
    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="10.15.1"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    capsys.readouterr()
    assert _main(ckpt, tmp_path / "engine") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no CUDA device" in err and "medusa-trt[tensorrt]" in err, err
    assert not (tmp_path / "engine").exists() and not list(tmp_path.glob(".engine.tmp-*"))


def test_option_errors_come_before_tensorrt(tiny_merged, tmp_path, capsys):
    ckpt = tiny_merged("llama")
    assert _main(ckpt, tmp_path / "e", "--attention", "split") == 2
    assert "--attention split with --trt-attention plugin" in capsys.readouterr().err
    assert _main(ckpt, tmp_path / "e", "--opset", "21") == 2
    assert "--opset 21" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse refuses unknown modes
        _main(ckpt, tmp_path / "e", "--trt-attention", "flash")
    opts = BuildOptions(checkpoint=ckpt, out=tmp_path / "e", backend="tensorrt", backend_options=TrtOptions(trt_attention="x"))
    with pytest.raises(BuildError, match="--trt-attention 'x'"):
        check_attention_options(opts)
    native = BuildOptions(checkpoint=ckpt, out=tmp_path / "e", attention="split", backend_options=TrtOptions(trt_attention="native"))
    assert check_attention_options(native) == "native"


def test_profiles_cover_the_engine_interface(ort_engine, tiny_merged):
    """Every decoder input gets min <= opt <= max with the graph's static dims, the hot path (a whole
    tree at the largest batch) as opt, and a whole-context prefill within max."""
    import onnx

    engine = json.loads((ort_engine("llama") / "engine.json").read_text())
    model = engine["model"]
    graph = onnx.load(str(ort_engine("llama") / "model.onnx"), load_external_data=False).graph
    opts = BuildOptions(checkpoint=tiny_merged("llama"), out=ort_engine("llama"), max_batch_size=4, max_draft_len=20)
    limits = limits_for(opts, {"max_position_embeddings": 512, "max_draft_len": 63})
    assert limits == Limits(max_batch_size=4, max_seq_len=512, max_draft_len=20)
    profile = decoder_profile(limits, model["num_layers"], model["num_kv_heads"], model["head_dim"])
    assert list(profile) == [i.name for i in graph.input]
    for value in graph.input:
        lo, opt, hi = profile[value.name]
        dims = value.type.tensor_type.shape.dim
        assert len(lo) == len(opt) == len(hi) == len(dims), value.name
        for d, a, b, c in zip(dims, lo, opt, hi, strict=True):
            assert 1 <= a <= b <= c
            if d.HasField("dim_value"):
                assert a == b == c == d.dim_value, value.name
    assert profile["input_ids"] == ((1, 1), (4, 21), (4, 512))
    assert profile["new_mask"] == ((1, 1, 1), (4, 21, 21), (4, 512, 512))
    assert profile["past_key_0"][2] == (4, model["num_kv_heads"], 512 + 21, model["head_dim"])
    heads = heads_profile(limits, model["hidden_size"])
    assert heads == {"hidden": ((1, 64), (4, 64), (4 * 21, 64))}


@pytest.mark.parametrize(("mode", "dtype"), [("plugin", "float32"), ("plugin", "bfloat16"), ("native", "float16")])
def test_onnx_stage_of_the_build(tiny_merged, tmp_path, mode, dtype):
    """What the TensorRT build parses, made here without TensorRT: the plugin build's decoder graph has
    plugin nodes and no Attention, the native build's keeps the exporter's Attention; both keep the
    engine interface its profile describes, in the engine dtype."""
    import onnx

    from medusa_trt.engines.trt.build import export_for_tensorrt
    from medusa_trt.runtime.trt.tree_attention.plugin import PLUGIN_NAME

    opts = BuildOptions(checkpoint=tiny_merged("llama"), out=tmp_path / "e", backend="tensorrt",
                        backend_options=TrtOptions(trt_attention=mode))
    graphs = export_for_tensorrt(opts, check_attention_options(opts), dtype, tmp_path / "onnx")
    onnx.checker.check_model(str(graphs.decoder))
    decoder = onnx.load(str(graphs.decoder))
    ops = {n.op_type for n in decoder.graph.node}
    assert (PLUGIN_NAME in ops, "Attention" in ops) == ((True, False) if mode == "plugin" else (False, True))
    assert graphs.plugin_nodes == (graphs.num_layers if mode == "plugin" else 0)
    limits = Limits(max_batch_size=2, max_seq_len=128, max_draft_len=15)
    profile = decoder_profile(limits, graphs.num_layers, graphs.num_kv_heads, graphs.head_dim)
    assert list(profile) == [i.name for i in decoder.graph.input]
    elem = {"float32": onnx.TensorProto.FLOAT, "bfloat16": onnx.TensorProto.BFLOAT16,
            "float16": onnx.TensorProto.FLOAT16}[dtype]
    types = {i.name: i.type.tensor_type.elem_type for i in decoder.graph.input}
    assert types["past_key_0"] == elem and types["new_mask"] == onnx.TensorProto.BOOL
    heads = onnx.load(str(graphs.heads))
    assert [i.name for i in heads.graph.input] == list(heads_profile(limits, graphs.hidden_size))


def _amphista_checkpoint(tiny_base, root):
    from synthetic import make_amphista

    from medusa_trt.converter.merge import convert

    base = tiny_base("llama")
    convert(base, make_amphista(root / "drafter", base), root / "ckpt", progress=False)
    return root / "ckpt"


@pytest.fixture(scope="module")
def amphista_onnx(tiny_base, tmp_path_factory):
    """An Amphista checkpoint and the ONNX stage of its plugin build (the drafter graph is the same in
    both attention modes: the rewrite touches the decoder only)."""
    from medusa_trt.engines.trt.build import export_for_tensorrt

    root = tmp_path_factory.mktemp("trt-amphista")
    ckpt = _amphista_checkpoint(tiny_base, root)
    opts = BuildOptions(checkpoint=ckpt, out=root / "e", backend="tensorrt", backend_options=TrtOptions())
    return ckpt, export_for_tensorrt(opts, "plugin", "float32", root / "onnx")


def test_onnx_stage_of_an_amphista_build(amphista_onnx):
    """An Amphista checkpoint's TensorRT build parses the drafter graph in place of the heads graph,
    and a decoder, rewritten for the plugin, whose hidden output holds every new row (a prefill hands
    the drafter every prompt row). The drafter graph bound as the TensorRT backend binds it, its cache
    whole whatever lies past each committed length, gives what the torch module it was exported from
    gives on the committed rows alone."""
    import onnx
    import onnxruntime as ort

    from medusa_trt.engine_dir import required_features
    from medusa_trt.engines.onnx.export import _DrafterModule
    from medusa_trt.engines.trt.build import drafter_profile
    from medusa_trt.modeling import MedusaModel
    from medusa_trt.runtime.trt.tree_attention.plugin import PLUGIN_NAME

    ckpt, graphs = amphista_onnx
    assert graphs.heads is None and graphs.drafter is not None
    decoder = onnx.load(str(graphs.decoder), load_external_data=False).graph
    assert graphs.plugin_nodes == graphs.num_layers and PLUGIN_NAME in {n.op_type for n in decoder.node}

    def rows(values, name):  # the symbolic name of a tensor's dimension 1
        return next(v for v in values if v.name == name).type.tensor_type.shape.dim[1].dim_param

    assert rows(decoder.output, "hidden") == rows(decoder.input, "input_ids") != rows(decoder.output, "logits")
    drafter = onnx.load(str(graphs.drafter))
    limits = Limits(max_batch_size=2, max_seq_len=128, max_draft_len=15)
    profile = drafter_profile(limits, graphs.num_kv_heads, graphs.head_dim, graphs.hidden_size)
    assert list(profile) == [i.name for i in drafter.graph.input]
    for value in drafter.graph.input:
        dims = value.type.tensor_type.shape.dim
        for i, (d, a, b, c) in enumerate(zip(dims, *profile[value.name], strict=True)):
            assert 1 <= a <= b <= c, value.name
            if d.HasField("dim_value"):
                assert a == b == c == d.dim_value, (value.name, i)
    assert profile["hidden"][2] == (2, 128, graphs.hidden_size)
    assert profile["past_key_0"][2][2] == limits.max_past
    # engine.json's tensorrt part of such a build: a reader that knows neither refuses the engine
    assert required_features({"tensorrt": {"drafter_engine": "drafter.engine", "hidden_all_rows": True}}) == [
        "drafter_graph", "hidden_all_rows"]

    g = torch.Generator().manual_seed(0)
    lengths, counts, cap = torch.tensor([5, 2]), torch.tensor([3, 1]), 8
    feeds = {"hidden": torch.randn(2, 3, graphs.hidden_size, generator=g),
             "next_tokens": torch.randint(0, 256, (2, 3), generator=g),
             "position_ids": lengths[:, None] + torch.arange(3),
             "past_lengths": lengths,
             "new_mask": (torch.ones(3, 3, dtype=torch.bool).tril() & (torch.arange(3) < counts[:, None, None]))
             | torch.eye(3, dtype=torch.bool),
             "last": counts - 1}
    shape = (2, graphs.num_kv_heads, cap, graphs.head_dim)
    whole = [torch.randn(*shape, generator=g) * 3 for _ in range(4)]  # what lies past a length is never read
    committed = [torch.where(torch.arange(cap)[None, None, :, None] < lengths[:, None, None, None], t, 0)[:, :, :5]
                 for t in whole]
    session = ort.InferenceSession(str(graphs.drafter), providers=["CPUExecutionProvider"])
    names = [i.name for i in drafter.graph.input]
    got = session.run(None, {n: t.numpy() for n, t in zip(names, [*feeds.values(), *whole], strict=True)})
    with torch.no_grad():
        want = _DrafterModule(MedusaModel.from_checkpoint(ckpt, dtype="float32"))(**feeds, past=tuple(committed))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(torch.from_numpy(a), b, atol=1e-4, rtol=1e-4)


class _OnnxRuntimeAsEngine:
    """The drafter graph a TensorRT build parses, run by ONNX Runtime behind the runtime's engine
    interface (runtime/trt/backend.py, _Engine: dtypes, run by name), so the TensorRT backend's
    drafter code runs here on the same graph."""

    def __init__(self, path):
        import onnxruntime as ort

        self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        kinds = {"tensor(float)": torch.float32, "tensor(int64)": torch.int64, "tensor(bool)": torch.bool}
        self.dtypes = {v.name: kinds[v.type] for v in [*self.session.get_inputs(), *self.session.get_outputs()]}

    def run(self, feeds, device):
        names = [o.name for o in self.session.get_outputs()]
        out = self.session.run(names, {k: v.numpy() for k, v in feeds.items()})
        return {n: torch.from_numpy(a) for n, a in zip(names, out, strict=True)}


def test_the_tensorrt_backend_drafter_bookkeeping_drafts_as_the_reference(amphista_onnx):
    """TensorRTBackend's drafter calls (its cache bound whole, the committed rows scattered after each
    length, `keep` following the batch) on the exported drafter graph, against the PyTorch reference,
    over a ragged prefill of every prompt row and a step after it. ONNX Runtime runs the graph in
    the TensorRT engine's place: the backend's bookkeeping is what this tests; the real engine is
    test_amphista_engine_drafts_as_the_reference_and_keeps_greedy on a GPU."""
    from medusa_trt.modeling import MedusaModel
    from medusa_trt.runtime.backend import zero_cache
    from medusa_trt.runtime.torch_backend import TorchBackend
    from medusa_trt.runtime.trt.backend import TensorRTBackend

    ckpt, graphs = amphista_onnx
    ref = TorchBackend(MedusaModel.from_checkpoint(ckpt, dtype="float32"))
    trt = object.__new__(TensorRTBackend)  # no TensorRT here: the drafter engine is the same graph in ONNX Runtime
    trt.drafter_engine, trt.device = _OnnxRuntimeAsEngine(graphs.drafter), torch.device("cpu")
    trt.drafter_keys, trt.drafter_values = zero_cache(2, 3, graphs.num_kv_heads, 32, graphs.head_dim, torch.float32, "cpu")
    trt.drafter_lengths = torch.zeros(3, dtype=torch.long)
    trt.keys = trt.values = torch.zeros(1, 3, 1, 1, 1)
    trt.lengths, trt._hidden = torch.zeros(3, dtype=torch.long), None
    ref.start(3, 32)
    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([6, 2, 4])
    ids = torch.randint(0, 256, (3, 6), generator=g)
    mask = torch.ones(6, 6, dtype=torch.bool).tril()[None] & (torch.arange(6)[None, :] < lens[:, None])[:, None]
    rows, after = torch.arange(6).expand(3, 6), torch.randint(0, 256, (3, 6), generator=g)
    ref.forward(ids, torch.arange(6).expand(3, 6), mask, with_heads=False)
    ref.commit(rows, lens)
    trt._hidden = ref._hidden
    torch.testing.assert_close(trt.draft(rows, lens, after), ref.draft(rows, lens, after), atol=1e-4, rtol=1e-4)
    for b in (trt, ref):
        b.keep(torch.tensor([2, 0]))
    ids = torch.randint(0, 256, (2, 3), generator=g)
    ref.forward(ids, ref.lengths[:, None] + torch.arange(3), torch.ones(2, 3, 3, dtype=torch.bool).tril(),
                with_heads=False)
    rows, counts = torch.tensor([[0, 1, 2], [0, 1, 2]]), torch.tensor([3, 1])
    ref.commit(rows, counts)
    trt._hidden, after = ref._hidden, torch.randint(0, 256, (2, 3), generator=g)
    torch.testing.assert_close(trt.draft(rows, counts, after), ref.draft(rows, counts, after), atol=1e-4, rtol=1e-4)
    assert trt.drafter_lengths.tolist() == [7, 7]  # 4 + 3 and 6 + 1: committed rows only


# -- on a GPU with TensorRT ---------------------------------------------------------------------------

try:
    import tensorrt  # noqa: F401

    HAVE_TRT = True
except ImportError:
    HAVE_TRT = False
gpu = pytest.mark.skipif(not (HAVE_TRT and torch.cuda.is_available()), reason="needs TensorRT and a CUDA GPU")


@pytest.fixture(scope="module")
def trt_engine(tmp_path_factory, tiny_merged):
    from medusa_trt.engines.build import build_engine

    cache = {}

    def get(arch="llama", mode="plugin", dtype="float32"):
        key = (arch, mode, dtype)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"trt-{arch}-{mode}-{dtype}") / "engine"
            build_engine(BuildOptions(checkpoint=tiny_merged(arch), out=out, backend="tensorrt", dtype=dtype,
                                      max_batch_size=4, max_seq_len=256, max_draft_len=32, progress=False,
                                      backend_options=TrtOptions(trt_attention=mode)))
            cache[key] = out
        return cache[key]

    return get


@gpu
@pytest.mark.parametrize("mode", ["plugin", "native"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_matches_torch_backend(trt_engine, tiny_merged, mode, arch):
    from medusa_trt.modeling import MedusaModel
    from medusa_trt.runtime.loading import load_backend
    from medusa_trt.runtime.torch_backend import TorchBackend
    from medusa_trt.runtime.trt.backend import TensorRTBackend
    from medusa_trt.tree import build_tree

    engine_dir = trt_engine(arch, mode)
    engine = json.loads((engine_dir / "engine.json").read_text())
    assert engine["backend"] == "tensorrt" and engine["device"] == "cuda"
    assert engine["tensorrt"]["attention"] == mode and engine["tensorrt"]["strongly_typed"]
    assert (engine_dir / "rank0.engine").is_file() and (engine_dir / "heads.engine").is_file()
    trt = load_backend(engine_dir)
    assert isinstance(trt, TensorRTBackend)
    ref = TorchBackend(MedusaModel.from_checkpoint(tiny_merged(arch), dtype="float32"))
    g = torch.Generator().manual_seed(0)
    for b in (trt, ref):
        b.start(3, 64)
    lens = torch.tensor([6, 2, 5])
    ids = torch.randint(0, 256, (3, 6), generator=g)
    mask = torch.ones(6, 6, dtype=torch.bool).tril()[None] & (torch.arange(6)[None, :] < lens[:, None])[:, None]
    tree = build_tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]], num_heads=4)
    t = tree.num_slots
    tree_mask = torch.from_numpy(tree.attention_mask.copy())[None].expand(3, t, t)
    steps = [(ids, torch.arange(6).expand(3, 6), mask, (lens - 1)[:, None], torch.arange(6).expand(3, 6), lens)]
    for _ in range(3):
        counts = torch.randint(1, 4, (3,), generator=g)
        slots = torch.tensor([[0, 1, 3], [0, 2, 5], [0, 1, 4]])
        steps.append((torch.randint(0, 256, (3, t), generator=g), "tree", tree_mask, None, slots, counts))
    for ids, pos, new_mask, logit_positions, slots, counts in steps:
        if isinstance(pos, str):  # a tree step: committed length + depth
            pos = trt.lengths[:, None] + torch.from_numpy(tree.position_offsets)[None]
        got, want = trt.forward(ids, pos, new_mask, logit_positions), ref.forward(ids, pos, new_mask, logit_positions)
        torch.testing.assert_close(got[0], want[0], atol=2e-3, rtol=0)  # float32 without TF32
        torch.testing.assert_close(got[1], want[1], atol=2e-3, rtol=0)
        rows, counts, after = torch.tensor([[0, 1], [1, 0], [0, 0]]), torch.tensor([1, 1, 2]), torch.zeros(3, 2, dtype=torch.long)
        torch.testing.assert_close(trt.draft(rows, counts, after), ref.draft(rows, counts, after), atol=2e-3, rtol=0)
        for b in (trt, ref):
            b.commit(slots, counts)
    for b in (trt, ref):
        b.keep(torch.tensor([2, 0]))
    ids = torch.randint(0, 256, (2, 1), generator=g)
    got, want = (b.forward(ids, trt.lengths[:, None], torch.ones(2, 1, 1, dtype=torch.bool)) for b in (trt, ref))
    torch.testing.assert_close(got[0], want[0], atol=2e-3, rtol=0)


@gpu
def test_medusa_greedy_decode_equals_plain(trt_engine):
    from medusa_trt.runtime.decoding import GenerationConfig, decode
    from medusa_trt.runtime.trt.backend import TensorRTBackend

    backend = TensorRTBackend(trt_engine("llama", "plugin"))
    prompts = [[1, 5, 9, 14, 3], [1, 40], [1, 7, 7, 8, 30, 31, 2]]
    plain = decode(backend, prompts, GenerationConfig(max_new_tokens=32, use_medusa=False))
    medusa = decode(backend, prompts, GenerationConfig(max_new_tokens=32,
                                                       medusa_choices=[[0], [1], [0, 0], [0, 1], [0, 0, 0]]))
    assert medusa.tokens == plain.tokens


@gpu
@pytest.mark.parametrize("mode", ["plugin", "native"])
def test_amphista_engine_drafts_as_the_reference_and_keeps_greedy(tiny_base, tmp_path, mode):
    from medusa_trt.engines.build import build_engine
    from medusa_trt.modeling import MedusaModel
    from medusa_trt.runtime.decoding import GenerationConfig, decode
    from medusa_trt.runtime.steps import prefill
    from medusa_trt.runtime.torch_backend import TorchBackend
    from medusa_trt.runtime.trt.backend import TensorRTBackend
    from medusa_trt.tools.parity import run_check

    ckpt, out = _amphista_checkpoint(tiny_base, tmp_path), tmp_path / "engine"
    build_engine(BuildOptions(checkpoint=ckpt, out=out, backend="tensorrt", max_batch_size=4, max_seq_len=256,
                              max_draft_len=32, progress=False, backend_options=TrtOptions(trt_attention=mode)))
    section = json.loads((out / "engine.json").read_text())["tensorrt"]
    assert section["drafter_engine"] == "drafter.engine" and section["heads_engine"] is None
    trt = TensorRTBackend(out)
    ref = TorchBackend(MedusaModel.from_checkpoint(ckpt, dtype="float32"))
    prompts = [[1, 5, 9, 14, 3], [1, 40], [1, 7, 7, 8, 30, 31, 2]]
    for b in (trt, ref):
        b.start(3, 64)
    got, want = prefill(trt, prompts), prefill(ref, prompts)  # the drafter's cache takes every prompt row
    torch.testing.assert_close(got[0], want[0], atol=2e-3, rtol=0)
    torch.testing.assert_close(got[2], want[2], atol=2e-3, rtol=0)
    for b in (trt, ref):
        b.keep(torch.tensor([2, 0]))  # the drafter's cache follows the batch
    rows, counts, after = torch.tensor([[0, 0], [0, 0]]), torch.tensor([1, 1]), torch.tensor([[3, 0], [4, 0]])
    ids, mask = after[:, :1], torch.ones(2, 1, 1, dtype=torch.bool)
    for b in (trt, ref):
        b.forward(ids, b.lengths[:, None], mask, with_heads=False)
        b.commit(rows, counts)
    torch.testing.assert_close(trt.draft(rows, counts, after), ref.draft(rows, counts, after), atol=2e-3, rtol=0)
    tree = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]
    plain = decode(trt, prompts, GenerationConfig(max_new_tokens=32, use_medusa=False))
    assert decode(trt, prompts, GenerationConfig(max_new_tokens=32, medusa_choices=tree)).tokens == plain.tokens
    assert run_check(out, ckpt, ["a b c", "hello world again"]).passed  # medusa-check: drafts included


@gpu
def test_float16_engine(trt_engine, tiny_merged):
    from medusa_trt.modeling import MedusaModel
    from medusa_trt.runtime.torch_backend import TorchBackend
    from medusa_trt.runtime.trt.backend import TensorRTBackend

    backend = TensorRTBackend(trt_engine("llama", "plugin", "float16"))
    ref = TorchBackend(MedusaModel.from_checkpoint(tiny_merged("llama"), dtype="float32"))
    for b in (backend, ref):
        b.start(2, 32)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 8, 8, dtype=torch.bool).tril()
    got, want = (b.forward(ids, torch.arange(8).expand(2, 8), mask) for b in (backend, ref))
    torch.testing.assert_close(got[0], want[0], atol=5e-2, rtol=5e-2)


def test_tensorrt_version_range():
    """10.15 (RMSNormalization in the opset-23 graphs) to 11.x (the newest API checked): others refused."""
    from medusa_trt.engines.options import BuildError
    from medusa_trt.engines.trt.build import check_tensorrt_version

    for ok in ("10.15.1.29", "10.16.0", "11.0.0", "11.4.0.106"):
        check_tensorrt_version(ok)
    for old in ("10.9.0.34", "10.14.1", "8.6.1"):
        with pytest.raises(BuildError, match=rf"TensorRT {re.escape(old)} is not supported: .*10.15 to 11.x .*need 10.15"):
            check_tensorrt_version(old)
    with pytest.raises(BuildError, match=r"TensorRT 12.0.0 is not supported: medusa-trt works with TensorRT 10.15 to 11.x"):
        check_tensorrt_version("12.0.0")


@pytest.mark.parametrize("version", ["12.0.1", "10.13.0"])
def test_unsupported_tensorrt_is_one_line_and_exit_2(tiny_merged, ort_engine, tmp_path, monkeypatch, capsys, version):
    """An installed TensorRT outside 10.15 to 11.x (a stand-in module with that __version__): one line
    naming the version and the supported range, exit 2, nothing written; the runtime refuses it too."""
    from medusa_trt.engine_dir import EngineError
    from medusa_trt.runtime.trt.backend import TensorRTBackend

    out, ckpt, built = tmp_path / "engine", tiny_merged("llama"), ort_engine("llama")  # before the stand-in
    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__=version))
    capsys.readouterr()
    assert _main(ckpt, out) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"TensorRT {version} is not supported" in err and "10.15 to 11.x" in err
    assert not out.exists() and not list(tmp_path.glob(".engine.tmp-*"))
    from medusa_trt.engine_dir import artifact_checksums

    engine = tmp_path / "trt-engine"
    engine.mkdir()
    (engine / "rank0.engine").write_bytes(b"")  # listed in artifacts, as every file the engine reads
    built = json.loads((built / "engine.json").read_text())
    section = {"engine": "rank0.engine", "heads_engine": None, "attention": "plugin"}
    (engine / "engine.json").write_text(json.dumps(built | {"backend": "tensorrt", "device": "cuda",
                                                            "artifacts": artifact_checksums(engine), "tensorrt": section}))
    with pytest.raises(EngineError, match=f"TensorRT {version} is not supported"):
        TensorRTBackend(engine)
