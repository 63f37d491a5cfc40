"""medusa-convert --quantize fp8: TensorRT-LLM's FP8 conventions, checked against scales computed here
independently from the Hugging Face weights and from activations recorded on transformers' own model;
the reference model's fake quantization; bad input; tensor parallelism."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F
from synthetic import make_heads
from transformers import AutoModelForCausalLM, AutoTokenizer

from medusa_trt.checkpoint import load_checkpoint, rank_file, validate_checkpoint
from medusa_trt.cli.convert import main as convert_main
from medusa_trt.converter.hf_base import TensorSource, find_weight_files
from medusa_trt.converter.merge import convert
from medusa_trt.converter.quantize import QuantOptions
from medusa_trt.fp8 import FP8Linear
from medusa_trt.modeling import MedusaModel
from medusa_trt.safetensors_io import SafetensorsFile

E4M3_MAX = 448.0
LINEARS = {"attention.qkv": ("q_proj", "k_proj", "v_proj"), "attention.dense": ("o_proj",),
           "mlp.fc": ("gate_proj",), "mlp.gate": ("up_proj",), "mlp.proj": ("down_proj",)}
WORDS = ("the quick brown fox jumps over a lazy dog while Medusa heads guess what comes next and "
         "the base model checks them all at once, 42 times. Really? Yes! It's fast").split()


def sentences(n: int, seed: int, words: tuple[int, int] = (4, 14)) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(*words))) for _ in range(n)]


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text("\n".join(sentences(12, seed=0)) + "\n")
    return path


@pytest.fixture(scope="module")
def fp8(tmp_path_factory, tiny_base, tiny_heads, calib_file):
    """fp8(**QuantOptions fields, tp_size=1, dtype=None, fmt="medusa_v1") -> merged FP8 checkpoint."""
    cache = {}

    def make(*, tp_size: int = 1, dtype: str | None = None, fmt: str = "medusa_v1", heads_kwargs=None, **quant):
        quant = {"quantize": "fp8", "calib_data": calib_file, **quant}
        key = json.dumps([tp_size, dtype, fmt, heads_kwargs, quant], sort_keys=True, default=str)
        if key not in cache:
            base = tiny_base()
            heads = tiny_heads(fmt, base, **(heads_kwargs or {}))
            out = tmp_path_factory.mktemp("fp8") / "ckpt"
            convert(base, heads, out, dtype=dtype, tp_size=tp_size, progress=False, quant=QuantOptions(**quant))
            cache[key] = out
        return cache[key]

    return make


@pytest.fixture(scope="module")
def hf_ranges(tiny_base, calib_file):
    """The oracle's ranges: max |input| of every HF projection and max |K|, |V| of its cache (post-RoPE),
    recorded on transformers' LlamaForCausalLM over the calibration samples, one sample at a time."""
    base = tiny_base()
    hf = AutoModelForCausalLM.from_pretrained(base).eval()
    tok = AutoTokenizer.from_pretrained(base)
    amax: dict[str, float] = {}

    def hook(name):
        def record(_module, args):
            amax[name] = max(amax.get(name, 0.0), args[0].abs().max().item())
        return record

    hooks = [m.register_forward_pre_hook(hook(n)) for n, m in hf.named_modules() if n.endswith("_proj")]
    finals = []
    hooks.append(hf.model.norm.register_forward_hook(lambda _m, _a, out: finals.append(out)))
    with torch.no_grad():
        for text in calib_file.read_text().splitlines():
            out = hf(torch.tensor([tok(text)["input_ids"]]), use_cache=True)
            for i, layer in enumerate(out.past_key_values.layers):
                kv = max(layer.keys.abs().max().item(), layer.values.abs().max().item())
                amax[f"kv.{i}"] = max(amax.get(f"kv.{i}", 0.0), kv)
            amax["final_norm"] = max(amax.get("final_norm", 0.0), finals.pop().abs().max().item())
    for h in hooks:
        h.remove()
    return hf, amax


def hf_state(base) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(base).state_dict()


def test_scales_and_tensors_follow_trtllm_fp8_conventions(fp8, tiny_base, tiny_merged, hf_ranges):
    ckpt = fp8(kv_cache_dtype="fp8")
    config, w = load_checkpoint(ckpt)
    hf, ranges = hf_ranges
    src = hf.state_dict()
    assert config["quantization"] == {
        "quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
        "exclude_modules": ["*lm_head", "*vocab_embedding", "*ln_f", "*layernorm", "*medusa_heads*"]}
    with SafetensorsFile(rank_file(ckpt, 0)) as f:
        header = {n: (i.dtype, i.shape) for n, i in f.tensors.items()}
    for i in range(config["num_hidden_layers"]):
        p, hp = f"transformer.layers.{i}", f"model.layers.{i}"
        for name, projs in LINEARS.items():
            group = "self_attn" if name.startswith("attention") else "mlp"
            full = torch.cat([src[f"{hp}.{group}.{x}.weight"] for x in projs])
            # One weight scale per fused tensor: the max over q, k and v, computed here from the HF weights.
            w_scale = torch.tensor([max(src[f"{hp}.{group}.{x}.weight"].abs().max().item() for x in projs)])
            w_scale = (w_scale.float() / E4M3_MAX)
            assert header[f"{p}.{name}.weight"] == (torch.float8_e4m3fn, tuple(full.shape))
            for scale in ("weights_scaling_factor", "activation_scaling_factor"):
                assert header[f"{p}.{name}.{scale}"] == (torch.float32, (1,))
            assert torch.equal(w[f"{p}.{name}.weights_scaling_factor"], w_scale), (p, name)
            expected_q = (full / w_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            assert torch.equal(w[f"{p}.{name}.weight"].view(torch.uint8), expected_q.view(torch.uint8)), (p, name)
            # e4m3 keeps 3 mantissa bits: relative error <= 2^-4, plus the subnormal step near zero.
            err = (w[f"{p}.{name}.weight"].float() * w_scale - full).abs()
            assert (err <= full.abs() / 16 + w_scale * 2.0**-9).all()
            # Activation scale: the HF model's max |input| / 448. Our reference and transformers compute
            # the same float32 math in a different op order, so allow float32 rounding (1e-5 relative).
            act = max(ranges[f"{hp}.{group}.{x}"] for x in projs) / E4M3_MAX
            assert w[f"{p}.{name}.activation_scaling_factor"].item() == pytest.approx(act, rel=1e-5), (p, name)
        assert torch.equal(w[f"{p}.mlp.fc.activation_scaling_factor"], w[f"{p}.mlp.gate.activation_scaling_factor"])
        assert header[f"{p}.attention.kv_cache_scaling_factor"] == (torch.float32, (1,))
        kv = w[f"{p}.attention.kv_cache_scaling_factor"].item()
        assert kv == pytest.approx(ranges[f"kv.{i}"] / E4M3_MAX, rel=1e-5)
    # Everything else is the unquantized conversion, bit for bit, in the model dtype.
    _, plain = load_checkpoint(tiny_merged())
    kept = [n for n in plain if not any(f".{x}." in n for x in LINEARS)]
    assert any(n.startswith("medusa_heads") for n in kept) and "lm_head.weight" in kept
    for name in kept:
        assert w[name].dtype == torch.float32 and torch.equal(w[name], plain[name]), name
    assert set(w) == set(plain) | {n for n in w if n.endswith("scaling_factor")}
    meta = json.loads((ckpt / "config.json").read_text())["medusa_trt"]["calibration"]
    assert meta["samples"] == 12 and meta["tokens"] > 12 * 5


def test_quantized_linears_are_about_half_of_float16(fp8, tiny_merged):
    ckpt = fp8(dtype="float16")
    plain = tiny_merged(dtype="float16")

    def linear_bytes(path) -> int:
        with SafetensorsFile(rank_file(path, 0)) as f:
            return sum(i.nbytes for n, i in f.tensors.items() if any(f".{x}." in n for x in LINEARS))

    ratio = linear_bytes(ckpt) / linear_bytes(plain)
    assert 0.5 < ratio < 0.51  # 1 byte per weight instead of 2, plus two float32 scales per linear
    assert (rank_file(ckpt, 0).stat().st_size < rank_file(plain, 0).stat().st_size)


def test_quantize_heads(fp8, tiny_merged, hf_ranges):
    config, w = load_checkpoint(fp8(quantize_heads=True))
    _, plain = load_checkpoint(tiny_merged())
    _, ranges = hf_ranges
    assert "*medusa_heads*" not in config["quantization"]["exclude_modules"]
    for h in range(config["num_medusa_heads"]):
        p = f"medusa_heads.{h}.medusa_layers.0.linear"
        scale = plain[f"{p}.weight"].abs().max() / E4M3_MAX
        assert torch.equal(w[f"{p}.weights_scaling_factor"], scale.reshape(1))
        assert torch.equal(w[f"{p}.weight"].view(torch.uint8),
                           (plain[f"{p}.weight"] / scale).to(torch.float8_e4m3fn).view(torch.uint8))
        # Layer 0 of every head reads the base's final normed hidden state.
        assert w[f"{p}.activation_scaling_factor"].item() == pytest.approx(ranges["final_norm"] / E4M3_MAX, rel=1e-5)
        assert w[f"{p}.bias"].dtype == torch.float32
        assert w[f"medusa_heads.{h}.lm_head.weight"].dtype == torch.float32  # never quantized (*lm_head)


def test_modelopt_fp8_heads_requantize_to_their_own_bytes(fp8, tiny_base, tiny_heads):
    """ModelOpt FP8 heads (weight amax-scaled) dequantized and quantized again come back unchanged."""
    config, w = load_checkpoint(fp8(fmt="modelopt", heads_kwargs={"fp8": True}, quantize_heads=True))
    heads_dir = tiny_heads("modelopt", tiny_base(), fp8=True)
    source = TensorSource.open(find_weight_files(heads_dir))
    try:
        q = source.read("medusa_heads.2.0.linear.weight")
        s = source.read("medusa_heads.2.0.linear.weight_scale")
    finally:
        source.close()
    assert torch.equal(w["medusa_heads.2.medusa_layers.0.linear.weight"].view(torch.uint8), q.view(torch.uint8))
    assert w["medusa_heads.2.medusa_layers.0.linear.weights_scaling_factor"].item() == pytest.approx(s.item(), rel=1e-6)


def test_reference_fake_quantization(fp8, tiny_merged):
    ckpt = fp8(kv_cache_dtype="fp8", quantize_heads=True)
    model = MedusaModel.from_checkpoint(ckpt)
    plain = MedusaModel.from_checkpoint(tiny_merged())
    layer = model.layers[1]
    assert isinstance(layer.fc, FP8Linear) and layer.fc.weight.dtype == torch.float8_e4m3fn
    # FP8Linear against the GEMM written out here: saturate, round to e4m3, dequantize, multiply.
    x = 3 * torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    sx, sw = layer.fc.activation_scaling_factor, layer.fc.weights_scaling_factor
    xq = (x / sx).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * sx
    assert torch.equal(layer.fc(x), F.linear(xq, layer.fc.weight.float() * sw))
    assert (layer.fc(x) - plain.layers[1].fc(x)).abs().max() > 0

    ids = torch.randint(3, 72, (2, 30), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(30)[None].expand(2, -1)
    mask = torch.ones(30, 30, dtype=torch.bool).tril()[None].expand(2, -1, -1)
    with torch.no_grad():
        out, heads, k, v = model(ids, pos, mask, *model.empty_cache(2))
        ref, ref_heads, _, _ = plain(ids, pos, mask, *plain.empty_cache(2))
    # The FP8 KV cache: every key/value the model hands back is an e4m3 value times the layer's scale.
    for i in range(2):
        scale = model.layers[i].kv_cache.scale
        for t in (k[i], v[i]):
            assert torch.equal((t / scale).to(torch.float8_e4m3fn).float() * scale, t)
    # Quantization moves logits a little, heads included; it does not scramble them.
    for a, b in ((out, ref), (heads, ref_heads)):
        assert 0 < (a - b).abs().mean() < 0.1 * b.std()
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8
    # A dtype cast keeps FP8 weights and float32 scales as stored.
    half = model.to(torch.float16)
    assert half.layers[0].qkv.weight.dtype == torch.float8_e4m3fn
    assert half.layers[0].qkv.weights_scaling_factor.dtype == torch.float32
    assert half.drafter.fp8.weight.dtype == torch.float8_e4m3fn and half.lm_head.weight.dtype == torch.float16


def test_kv_cache_only(fp8, tiny_merged):
    config, w = load_checkpoint(fp8(quantize=None, kv_cache_dtype="fp8"))
    assert config["quantization"] == {"quant_algo": None, "kv_cache_quant_algo": "FP8", "exclude_modules": None}
    assert w["transformer.layers.0.attention.qkv.weight"].dtype == torch.float32
    assert w["transformer.layers.1.attention.kv_cache_scaling_factor"].shape == (1,)
    model = MedusaModel.from_weights(config, w)
    assert model.layers[0].kv_cache is not None and not isinstance(model.layers[0].qkv, FP8Linear)


def test_tp2_round_trip(fp8):
    one, two = fp8(kv_cache_dtype="fp8"), fp8(kv_cache_dtype="fp8", tp_size=2)
    validate_checkpoint(two)
    ranks = []
    for r in range(2):
        with SafetensorsFile(rank_file(two, r)) as f:
            ranks.append(f.read_all())
    for name in ranks[0]:
        if name.endswith("scaling_factor"):  # replicated per rank
            assert torch.equal(ranks[0][name], ranks[1][name]), name
    assert ranks[0]["transformer.layers.0.mlp.fc.weight"].shape == (64, 64)
    assert ranks[0]["transformer.layers.0.mlp.fc.weight"].dtype == torch.float8_e4m3fn
    _, w1 = load_checkpoint(one)
    _, w2 = load_checkpoint(two)
    assert w1.keys() == w2.keys()
    for name in w1:
        assert torch.equal(w1[name].view(torch.uint8), w2[name].view(torch.uint8)), name


# -- bad input: one line on stderr, exit 2, nothing written ------------------------------------


def bad(tmp_path, capsys, *args: str) -> str:
    out = tmp_path / "out"
    assert convert_main(["--out", str(out), "--quiet", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("medusa-convert: error: "), err
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))
    return err[0]


@pytest.fixture
def src(tiny_base, tiny_heads):
    base = tiny_base()
    return ["--base", str(base), "--heads", str(tiny_heads("medusa_v1", base))]


def test_bad_calibration_files(tmp_path, capsys, src, calib_file, tiny_base, tiny_heads):
    capsys.readouterr()  # the fixtures' own output
    missing = tmp_path / "nope.txt"
    assert "nope.txt: file not found" in bad(tmp_path, capsys, *src, "--quantize", "fp8", "--calib-data", str(missing))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert "no samples" in bad(tmp_path, capsys, *src, "--quantize", "fp8", "--calib-data", str(empty))
    msg = bad(tmp_path, capsys, *src, "--quantize", "fp8")
    assert "--quantize fp8 needs --calib-data" in msg
    msg = bad(tmp_path, capsys, *src, "--quantize-heads", "--calib-data", str(calib_file))
    assert "--quantize-heads needs --quantize fp8" in msg
    # A model with a 32-token context and a sample of ~60 tokens; --calib-seq-len past the context.
    short = tiny_base(max_position_embeddings=32)
    short_src = ["--base", str(short), "--heads", str(tiny_heads("medusa_v1", short))]
    capsys.readouterr()  # the fixtures' own output
    long = tmp_path / "long.txt"
    long.write_text("short one\n" + "a long sample that has many more characters than 32 tokens\n")
    msg = bad(tmp_path, capsys, *short_src, "--quantize", "fp8", "--calib-data", str(long))
    assert "sample 2 has" in msg and "max_position_embeddings 32" in msg and "--calib-seq-len" in msg
    msg = bad(tmp_path, capsys, *short_src, "--quantize", "fp8", "--calib-data", str(long), "--calib-seq-len", "64")
    assert "--calib-seq-len 64: expected 1..32" in msg


def test_calib_seq_len_cuts_samples(tmp_path, tiny_base, tiny_heads):
    short = tiny_base(max_position_embeddings=32)
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"text": "a long sample that has many more characters than 32 tokens"}) + "\n")
    summary = convert(short, tiny_heads("medusa_v1", short), tmp_path / "out", progress=False,
                      quant=QuantOptions(quantize="fp8", calib_data=data, calib_seq_len=16, calib_samples=3))
    assert summary.calib_samples == 1 and summary.calib_tokens == 16
    validate_checkpoint(tmp_path / "out")


def test_heads_from_every_format_quantize(tmp_path, tiny_base, calib_file):
    """--quantize-heads reads no scale from the head files (they are calibrated here), so every head
    format is accepted; multi-layer heads get one scale pair per layer."""
    base = tiny_base()
    heads = make_heads(tmp_path / "heads", "medusa_v2", base, num_layers=2)
    convert(base, heads, tmp_path / "out", progress=False,
            quant=QuantOptions(quantize="fp8", calib_data=calib_file, quantize_heads=True))
    config, w = load_checkpoint(tmp_path / "out")
    assert w["medusa_heads.3.medusa_layers.1.linear.weight"].dtype == torch.float8_e4m3fn
    model = MedusaModel.from_weights(config, w)
    assert model.drafter.fp8.weight.shape == (4, 2, 64, 64)


# -- engine: explicit float8 Q/DQ in ONNX, run by ONNX Runtime, against the FP8 reference ----------

# Engine vs FP8 reference (float32 engine). Both compute the same arithmetic: the weights are the same
# float8 values times the same float32 scales, and a Q/DQ round trip of the same float32 input gives
# the same output (test_onnx_qdq_is_the_reference_arithmetic checks that bit for bit). What remains is
# float32 summation order in matmuls and attention: ~1e-6 on these models (measured max 9.5e-7 on
# logits and Medusa logits, K/V bit-identical), hence ENGINE_ATOL = 1e-4, medusa-check's float32
# tolerance. One legitimate exception is inherent to quantization: an activation within a float32
# ulp of an e4m3 rounding boundary can round to the neighbouring FP8 value on one side (a 2^-3
# relative step of one element), which moves the rows that read it (that token, its tree
# descendants, later tokens attending to it) by up to ~1e-1. On 30 random inputs of this test's size
# 2 had such a flip (one row of 168 each, 1e-4 and 4e-4); medusa-check's larger inputs saw one row
# group at 6.5e-2. So: at least 90% of rows (token positions) within ENGINE_ATOL, every row within
# FLIP_BOUND. A missing Q/DQ, a wrong scale or unquantized weights move every row by >1e-2 (FP8 vs
# float: ~6e-2 mean here), which the 90% criterion catches.
ENGINE_ATOL = 1e-4
FLIP_BOUND = 0.25
ROWS_WITHIN = 0.9


@pytest.fixture(scope="module")
def fp8_engine(fp8, tmp_path_factory):
    from medusa_trt.engines.build import build_engine
    from medusa_trt.engines.options import BuildOptions

    ckpt = fp8(kv_cache_dtype="fp8", quantize_heads=True)
    out = tmp_path_factory.mktemp("fp8-engine") / "engine"
    build_engine(BuildOptions(checkpoint=ckpt, out=out, progress=False))
    return ckpt, out


def test_engine_graph_is_explicit_fp8(fp8_engine):
    import onnx

    ckpt, engine_dir = fp8_engine
    engine = json.loads((engine_dir / "engine.json").read_text())
    assert engine["dtype"] == "float32" and engine["onnx"]["opset"] >= 19
    assert engine["quantization"]["quant_algo"] == "FP8" and engine["quantization"]["kv_cache_quant_algo"] == "FP8"
    assert engine["quantization"]["session_config"] == {"session.disable_quant_qdq": "1"}
    # Decoder graph: 5 linears x 2 layers; heads graph: 4 heads x 1 ResBlock layer. Activation Q/DQ per
    # layer: qkv, dense, fc/gate, proj, K and V; in the heads graph every head's layer 0 reads the same
    # hidden state with the same calibrated scale. Identical Q/DQ (fc and gate, the heads) may be merged
    # by the exporter, so these are lower bounds.
    for file, linears, min_q in ((engine["onnx"]["file"], 10, 2 * 4 + 2 * 2), (engine["onnx"]["heads_file"], 4, 1)):
        graph = onnx.load(engine_dir / file).graph
        fp8_inits = [i for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT8E4M3FN and i.dims]
        assert len(fp8_inits) == linears, file  # every quantized weight stays float8 on disk ...
        readers = {i: n.op_type for n in graph.node for i in n.input}
        assert {readers[i.name] for i in fp8_inits} == {"DequantizeLinear"}, file  # ... behind DequantizeLinear
        quant = [n for n in graph.node if n.op_type == "QuantizeLinear"]
        assert len(quant) >= min_q, file
        assert {readers[n.output[0]] for n in quant} == {"DequantizeLinear"}, file


def test_engine_matches_fp8_reference(fp8_engine):
    """A prefill then a tree-verify step on its cache (default tree, 64 slots), ONNX Runtime vs the FP8
    reference on identical inputs: base logits, hidden state, new K/V, and the heads graph's logits."""
    import numpy as np

    from medusa_trt.runtime.ort.session import make_session
    from medusa_trt.tree import build_tree

    ckpt, engine_dir = fp8_engine
    engine = json.loads((engine_dir / "engine.json").read_text())
    model = MedusaModel.from_checkpoint(ckpt, dtype="float32")
    decoder = make_session(engine_dir / engine["onnx"]["file"])
    heads = make_session(engine_dir / engine["onnx"]["heads_file"])
    layers = model.cfg.num_layers
    g = torch.Generator().manual_seed(3)
    worst = {}

    def close(name, got, want):  # rows: every axis but the last (the vocab / hidden / head_dim axis)
        rows = np.abs(got - want.numpy()).reshape(-1, got.shape[-1]).max(-1)
        worst[name] = max(worst.get(name, 0.0), float(rows.max()))
        assert rows.max() <= FLIP_BOUND, (name, rows.max())
        assert (rows <= ENGINE_ATOL).mean() >= ROWS_WITHIN, (name, (rows > ENGINE_ATOL).sum(), rows.size)

    def run(ids, pos, new_mask, past_k, past_v):
        b, s = ids.shape
        p = past_k.shape[3]
        full = torch.cat([torch.ones(b, s, p, dtype=torch.bool), new_mask], dim=-1)
        with torch.no_grad():
            ref = model.forward_hidden(ids, pos, full, past_k, past_v)
            ref_heads = model.draft(ref[1])  # [H, B, S, V]
        feeds = {"input_ids": ids.numpy(), "position_ids": pos.numpy(), "past_lengths": np.full(b, p),
                 "new_mask": new_mask.numpy(), "logit_positions": torch.arange(s).repeat(b, 1).numpy()}
        for i in range(layers):
            feeds[f"past_key_{i}"], feeds[f"past_value_{i}"] = past_k[i].numpy(), past_v[i].numpy()
        got = decoder.run(None, feeds)
        for name, a, want in zip(("logits", "hidden", "present_keys", "present_values"), got, ref, strict=True):
            close(name, a, want)
        (medusa,) = heads.run(None, {"hidden": ref[1].reshape(b * s, -1).numpy()})
        close("medusa_logits", medusa, ref_heads.reshape(ref_heads.shape[0], b * s, -1))
        return ref

    prompt = torch.randint(3, 72, (2, 20), generator=g)
    causal = torch.ones(20, 20, dtype=torch.bool).tril()[None].expand(2, -1, -1)
    _, _, k, v = run(prompt, torch.arange(20)[None].expand(2, -1), causal, *model.empty_cache(2))
    tree = build_tree("mc_sim_7b_63", num_heads=4)
    ids = torch.randint(3, 72, (2, tree.num_slots), generator=g)
    pos = (20 + torch.tensor(tree.position_offsets, dtype=torch.long))[None].expand(2, -1)
    run(ids, pos, torch.tensor(tree.attention_mask)[None].expand(2, -1, -1), k, v)


def test_onnx_qdq_is_the_reference_arithmetic(tmp_path):
    """The exported Q/DQ ops, run by ONNX Runtime, equal the reference's fake quantization bit for bit
    on identical inputs: saturation past 448, round-to-nearest-even ties, subnormals, zero."""
    import numpy as np

    from medusa_trt.engines.onnx.ops import export_dequant, export_fake_quant, fp8_translations
    from medusa_trt.fp8 import fake_quant_fp8
    from medusa_trt.runtime.ort.session import make_session

    scale = torch.tensor([0.01])
    grid = torch.tensor([0.0, 1.0, 1.125, 1.0625, 1.1875, 448.0, 464.0, 480.0, 2.0**-9, 2.0**-10, 3 * 2.0**-10])
    x = torch.cat([grid, -grid, 600 * torch.randn(200, generator=torch.Generator().manual_seed(0))]) * scale
    q = (torch.randn(16, 8) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)

    class QDQ(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("q", q)
            self.register_buffer("scale", scale)

        def forward(self, x):
            return export_fake_quant(x, self.scale), export_dequant(self.q, self.scale, torch.float32)

    program = torch.onnx.export(QDQ(), (x,), dynamo=True, opset_version=23, custom_translation_table=fp8_translations(),
                                input_names=["x"], output_names=["y", "w"], verbose=False)
    program.save(tmp_path / "qdq.onnx")
    y, w = make_session(tmp_path / "qdq.onnx").run(None, {"x": x.numpy()})
    assert np.array_equal(y, fake_quant_fp8(x, scale).numpy())
    assert np.array_equal(w, (q.float() * scale).numpy())


def test_medusa_check_on_fp8_engine(fp8_engine, tiny_merged, tmp_path):
    """medusa-check holds an FP8 engine to its FP8 reference (90th percentile within 1e-4, every logit
    within the rounding-flip bound), fails it against the unquantized reference, and refuses to judge
    a float16 FP8 engine without --atol."""
    import shutil

    from medusa_trt.tools.parity import CheckInputError, run_check

    ckpt, engine_dir = fp8_engine
    report = run_check(engine_dir, max_new_tokens=8, tree_steps=2)
    assert report.passed, report.table()
    against_float = run_check(engine_dir, tiny_merged(), max_new_tokens=8, tree_steps=2)
    compared = ("logits", "medusa_logits", "draft log-probs")  # paths and ranks may agree across the two
    assert not any(r.passed for r in against_float.rows if r.output in compared), against_float.table()
    assert any(r.output == "draft log-probs" for r in against_float.rows)
    half = tmp_path / "engine"
    shutil.copytree(engine_dir, half)
    engine = json.loads((half / "engine.json").read_text())
    (half / "engine.json").write_text(json.dumps({**engine, "dtype": "float16"}))
    with pytest.raises(CheckInputError, match="FP8 engine in float16"):
        run_check(half)


def test_qwen2_bias_and_tp4_with_duplicated_kv_heads(tmp_path, tiny_base, tiny_heads, calib_file):
    """Qwen2's qkv bias stays in the model dtype next to FP8 weights; tp 4 over 2 KV heads duplicates
    float8 K/V rows per rank pair and merges back to the tp 1 bytes."""
    base = tiny_base("qwen2")
    heads = tiny_heads("medusa_v1", base)
    quant = QuantOptions(quantize="fp8", kv_cache_dtype="fp8", calib_data=calib_file)
    for tp in (1, 4):
        convert(base, heads, tmp_path / f"tp{tp}", tp_size=tp, progress=False, quant=quant)
    config, w1 = load_checkpoint(tmp_path / "tp1")
    _, w4 = load_checkpoint(tmp_path / "tp4")
    assert w1["transformer.layers.0.attention.qkv.bias"].dtype == torch.float32
    for name in w1:
        assert torch.equal(w1[name].view(torch.uint8), w4[name].view(torch.uint8)), name
    model = MedusaModel.from_weights(config, w4)
    assert isinstance(model.layers[0].qkv, FP8Linear) and model.layers[0].qkv.bias is not None
    ids = torch.randint(3, 72, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, _, _, _ = model(ids, torch.arange(9)[None], torch.ones(9, 9, dtype=torch.bool).tril()[None],
                                *model.empty_cache(1))
    assert torch.isfinite(logits).all()


def test_an_fp8_checkpoint_is_refused_below_opset_19(fp8, tmp_path):
    """float8 QuantizeLinear/DequantizeLinear are opset 19: refused before the export, not inside it."""
    from medusa_trt.engines.build import BuildError, BuildOptions, build_engine

    with pytest.raises(BuildError, match=r"--opset 18: an FP8 checkpoint \(.*ckpt/config\.json\) needs opset >= 19"):
        build_engine(BuildOptions(checkpoint=fp8(), out=tmp_path / "e", progress=False, opset=18))
    assert not (tmp_path / "e").exists()
