"""The reference model's int4 numerics (modeling: quantize_int4, the offsets and int8 schemes,
quantize_model_int4), which MatMulNBits engines are checked against; and the int8 scheme's
(Int8Linear), which an exported MatMulInteger graph must equal bit for bit, and its float input
channels (calibration.activations.calibrate_float_channels); the calibrated int4 rounding
(quantize_int4 with importance, calibrate_input_power, choose_searched_rows, int4_grids)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from medusa_trt.modeling import MedusaModel
from medusa_trt.quant import (
    block_sums,
    dequantize_int4,
    dequantize_int8,
    fake_quant_int8_blocks,
    nbits_matmul,
    quantize_int4,
    quantize_int4_offsets,
    quantize_int8,
    quantize_model_int4,
    quantize_model_int8,
)


def test_quantize_int4_round_trip():
    """Within half a step of each block's scale, zero exact, block layout as MatMulNBits reads it."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 64, generator=g)
    w[0, :32] = 0.0  # an all-zero block
    packed, scales, zp = quantize_int4(w, 32)
    assert packed.shape == (6, 2, 16) and packed.dtype == torch.uint8 and zp.shape == (6, 1)
    back = dequantize_int4(packed, scales, zp)
    step = scales.repeat_interleave(32, dim=1)
    assert bool(((back - w).abs() <= step / 2 + 1e-6).all())
    assert bool((back[0, :32] == 0).all())


def test_calibrated_int4_rounding_never_loses_to_the_nearest_grid():
    """quantize_int4 with an importance per input channel: every block's importance-weighted squared
    error is at most the nearest grid's, the total well below it, and the bytes still dequantize as
    MatMulNBits reads them (a zero point per block, codes 0..15). A channel with all the importance
    is held closest. Bad importance names or shapes are refused."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=g) * (0.2 + 2 * torch.rand(128, generator=g))
    importance = torch.rand(128, generator=g) ** 4 + 1e-3
    importance[9] = 50.0

    def err(tensors):
        back = dequantize_int4(*tensors)
        return ((w - back) ** 2 * importance).reshape(48, 4, 32).sum(-1), (w - back)[:, 9].abs()

    (nearest, near9), (searched, srch9) = err(quantize_int4(w, 32)), err(quantize_int4(w, 32, importance))
    assert bool((searched <= nearest * (1 + 1e-5)).all())
    assert float(searched.sum()) < 0.7 * float(nearest.sum())
    assert float(srch9.mean()) < 0.5 * float(near9.mean())
    packed, scales, zp = quantize_int4(w, 32, importance)
    assert packed.shape == (48, 4, 16) and zp.shape == (48, 2) and bool((scales > 0).all())
    assert torch.equal(quantize_int4(w, 32, importance)[0], packed)  # deterministic


def test_calibrate_input_power_weighs_a_loud_channel(tiny_merged):
    """calibrate_input_power: every base Linear's inputs' mean squares, positive everywhere (a floor
    for silent channels); a norm weight 40x the others makes its channel the heaviest behind that
    norm. choose_searched_rows picks rows and hands back the grids, which equal what the reference
    searches again from the importances and rows (int4_grids); bad names and shapes are refused."""
    from medusa_trt.calibration.activations import (
        calibrate_input_power,
        choose_searched_rows,
        int4_grids,
        sample_own_text,
    )
    from medusa_trt.quant import Int4Linear, base_linear_names

    model = MedusaModel.from_checkpoint(tiny_merged("llama"))
    with torch.no_grad():
        model.layers[0].input_layernorm.weight[5] = 40.0
    power = calibrate_input_power(model, sample_own_text(model, 1, count=2, length=6))
    assert list(power) == base_linear_names(model)
    assert all(bool((p > 0).all()) and p.shape == (model.get_submodule(n).in_features,) for n, p in power.items())
    assert int(power["layers.0.qkv"].argmax()) == 5
    # choose_searched_rows: per output row, the grid with the smaller output error on the samples;
    # rows it leaves out keep the nearest grid's bytes exactly.
    rows, grids = choose_searched_rows(model, sample_own_text(model, 1, count=2, length=6), power, 32)
    assert set(rows) == set(grids) == set(power)
    assert all(r.dtype == torch.bool and r.shape == (model.get_submodule(n).out_features,) for n, r in rows.items())
    w = model.layers[0].qkv.weight.detach()
    near, srch = quantize_int4(w, 32), quantize_int4(w, 32, power["layers.0.qkv"])
    keep = rows["layers.0.qkv"]
    assert 0 < int(keep.sum()) and not torch.equal(near[0], srch[0])
    for chosen, n, s in zip(grids["layers.0.qkv"], near, srch, strict=True):
        assert torch.equal(chosen[keep], s[keep]) and torch.equal(chosen[~keep], n[~keep])
    # The reference's grids, searched again over the chosen rows only, are the same bytes.
    again = int4_grids(model, power, rows, 32)
    assert all(torch.equal(a, b) for n in grids for a, b in zip(grids[n], again[n], strict=True))
    searched = MedusaModel.from_checkpoint(tiny_merged("llama"))
    quantize_model_int4(searched, 32, 4, grids=grids)
    assert isinstance(searched.layers[0].qkv, Int4Linear)
    assert torch.equal(searched.layers[0].qkv.packed, grids["layers.0.qkv"][0])
    with pytest.raises(ValueError, match="expected base Linear names"):
        int4_grids(model, {"layers.99.qkv": power["layers.0.qkv"]}, {}, 32)
    with pytest.raises(ValueError, match=r"layers.0.qkv: shape \(3,\)"):
        int4_grids(model, {"layers.0.qkv": torch.ones(3)}, {}, 32)
    with pytest.raises(ValueError, match=r"searched rows for layers.0.qkv: shape \(2,\)"):
        int4_grids(model, {"layers.0.qkv": power["layers.0.qkv"]}, {"layers.0.qkv": torch.ones(2, dtype=torch.bool)}, 32)
    with pytest.raises(ValueError, match="int4 grids for layers.99.qkv"):
        quantize_model_int4(MedusaModel.from_checkpoint(tiny_merged("llama")), 32, 4,
                            grids={"layers.99.qkv": grids["layers.0.qkv"]})
    with pytest.raises(ValueError, match="int4 grid for layers.0.dense: packed shape"):
        quantize_model_int4(MedusaModel.from_checkpoint(tiny_merged("llama")), 32, 4,
                            grids={"layers.0.dense": grids["layers.0.qkv"]})


def test_offsets_and_int8_hold_gguf_blocks_exactly():
    """A Q4_1 block (d * q + m, q in 0..15 with both end codes, as llama.cpp writes them) comes back
    from the offsets scheme to float32 rounding, where the zero-point grid misses it by up to half a
    step; a Q8_0 block (d * q, |q| <= 127 with 127 used) comes back bit for bit from int8."""
    g = torch.Generator().manual_seed(0)
    n, k = 8, 128
    d = torch.rand(n, k // 32, 1, generator=g) * 0.02 + 1e-3
    m = torch.randn(n, k // 32, 1, generator=g) * 0.05
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    w = (d * q + m).reshape(n, k)
    packed, scales, offsets = quantize_int4_offsets(w, 32)
    back = (dequantize_int4(packed, scales, None).reshape(n, k // 32, 32) + offsets[..., None]).reshape(n, k)
    assert (back - w).abs().max() <= 1e-6 * w.abs().max()
    assert (dequantize_int4(*quantize_int4(w, 32)) - w).abs().max() > 100 * (back - w).abs().max()
    q8 = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
    q8[..., 0] = 127
    w8 = (d * q8).reshape(n, k)
    assert torch.equal(dequantize_int8(*quantize_int8(w8, 32)), w8)


def test_constant_and_huge_blocks():
    """A constant block in the offsets scheme holds code 8 and its value as the offset, so at accuracy
    level 4 its product is the float one (code 0 with offset lo + 8 left -8 * blocksum(x) to cancel
    between x rounded to int8 and x: an error of 2 on these rows); a block whose range passes float32's
    maximum keeps finite scales in both schemes."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(4, 2, 1, generator=g) * 0.1).expand(4, 2, 32).reshape(4, 64)  # constant blocks
    x = torch.randn(3, 64, generator=g) * 3
    packed, scales, offsets = quantize_int4_offsets(w, 32)
    assert (fake_quant_int8_blocks(x, 32) - x).abs().max() > 0.01  # level 4's rounding is not nothing
    y = nbits_matmul(x, packed, scales, None, 4, 4) + F.linear(block_sums(x, 32), offsets)
    assert (y - F.linear(x, w)).abs().max() < 1e-5
    huge = torch.tensor([[3e38, -3e38] + [0.0] * 30])
    for scale in (quantize_int4(huge, 32)[1], quantize_int4_offsets(huge, 32)[1]):
        assert torch.isfinite(scale).all()
    back = dequantize_int4(*quantize_int4(huge, 32))
    assert back[0, 0] / 3e38 == pytest.approx(1, rel=0.1) and back[0, 1] / -3e38 == pytest.approx(1, rel=0.1)


def test_unfit_block_size_stays_float(tiny_merged):
    """hidden 64 is not a multiple of 128: those Linears stay float and are named; proj (K=128) is int4."""
    model = MedusaModel.from_checkpoint(tiny_merged("llama"))
    skipped = quantize_model_int4(model, 128, 4)
    assert "layers.0.qkv" in skipped and "lm_head" in skipped and "layers.0.proj" not in skipped
    with pytest.raises(ValueError, match="block size 48"):
        quantize_model_int4(MedusaModel.from_checkpoint(tiny_merged("llama")), 48, 4)


def _int8_session(module, x: torch.Tensor, path, opened_as: str = "engine"):
    """Module's graph as the ONNX Runtime builder exports it (quant's ops through their ONNX
    translations), in a session: a function of the rows [b, s, K]. `opened_as`: "engine", as the
    engines open theirs (make_session); "int8", its int8 weights as built; "uint8", read as uint8
    (int8_weights_as_unsigned) whatever the CPU."""
    import onnx
    import onnxruntime as ort
    from torch import nn

    from medusa_trt.engines.onnx.ops import export_int8_matmul, int8_translations
    from medusa_trt.quant import int8_matmul
    from medusa_trt.runtime.ort.session import int8_weights_as_unsigned, make_session, session_options

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = module

        def forward(self, x):
            return self.m(x)

    module.matmul = export_int8_matmul
    try:
        program = torch.onnx.export(Wrap(), (x,), dynamo=True, opset_version=23, verbose=False,
                                    custom_translation_table=int8_translations(),
                                    dynamic_shapes=({0: "b", 1: "s"},))
    finally:
        module.matmul = int8_matmul
    program.save(path)
    if opened_as == "engine":
        session = make_session(path, "cpu", int8_weights=True)
    else:
        model = onnx.load(str(path))
        if opened_as == "uint8":
            assert int8_weights_as_unsigned(model) == 1
        session = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return lambda rows: session.run(None, {name: rows.numpy()})[0]


def test_int8_weights_read_as_uint8_give_the_same_bits_on_every_cpu(tmp_path):
    """ONNX Runtime's u8 x s8 GEMM without VNNI (AVX2) adds pairs of products in int16 and saturates:
    int8 engines there were wrong (and medusa-check failed them) until make_session read their weights
    as uint8 + 128 with zero point 128 on such CPUs. That form gives the reference's bits on any CPU;
    the probe that decides says the built int8 form is exact exactly where it is."""
    import numpy as np
    from torch import nn

    from medusa_trt.quant import Int8Linear
    from medusa_trt.runtime.ort.session import signed_int8_gemm_saturates

    torch.manual_seed(0)
    module = Int8Linear(nn.Linear(256, 64))
    x = torch.randn(4, 8, 256)  # each row reaches +-127, so 255 or 1 as uint8: pairs of 255 x 127 saturate int16
    want = module(x).detach().numpy()
    np.testing.assert_array_equal(_int8_session(module, x, tmp_path / "u8.onnx", "uint8")(x), want)
    np.testing.assert_array_equal(_int8_session(module, x, tmp_path / "engine.onnx")(x), want)
    built = _int8_session(module, x, tmp_path / "s8.onnx", "int8")(x)
    assert np.array_equal(built, want) == (not signed_int8_gemm_saturates())


def test_int8_rows_are_exact_independent_and_the_exported_graph_equals_them(tmp_path):
    """Int8Linear: each row rounded to int8 by its own scale, an exact integer product, then the
    scales. A row's output is the same bits alone or beside others (what keeps a verify step's rows
    equal to plain steps'), it is within int8 rounding of the float product, and ONNX Runtime's
    graph for it (rows rounded by QuantizeLinear, MatMulIntegerToFloat, the row scale) gives the same
    bits."""
    import numpy as np
    from torch import nn

    from medusa_trt.quant import Int8Linear

    torch.manual_seed(0)
    linear = nn.Linear(64, 96)
    module = Int8Linear(linear)
    x = torch.randn(3, 5, 64) * 3
    x[0, 1] = 0.0  # a zero row: rounds to zeros, output the bias
    x[2, 3] = 1e-39  # a denormal row: its scale is held at INT8_MIN_SCALE, so it rounds to zeros too
    y = module(x)
    assert torch.equal(module(x[1:2, 2:3]), y[1:2, 2:3])
    want = linear(x)
    assert ((y - want).abs().max() / want.abs().max()) < 0.03
    assert torch.equal(y[0, 1], linear.bias) and torch.equal(y[2, 3], linear.bias)
    run = _int8_session(module, x, tmp_path / "int8.onnx")
    for rows in (x, x[:1, :1], torch.randn(2, 7, 64)):
        np.testing.assert_array_equal(run(rows), module(rows).detach().numpy())


def test_int8_float_channels_take_the_outliers_out_of_the_row_scale(tmp_path):
    """Int8Linear with float channels: those inputs leave the row's int8 rounding (their int8 weight
    columns are zero) and go through a float product beside it. With two outlier channels 50x the
    others, the error to the float product drops several fold; the exported graph gives a row the
    same bits alone or beside other rows, and equals the reference up to the float product's
    summation order."""
    import numpy as np
    from torch import nn

    from medusa_trt.quant import Int8Linear

    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=False)
    x = torch.randn(3, 5, 64)
    x[..., [3, 40]] *= 50
    want = linear(x).detach()
    plain, split = Int8Linear(linear), Int8Linear(linear, [40, 3])
    assert split.float_channels.tolist() == [3, 40] and not split.qweight_t[[3, 40]].any()
    err = lambda m: ((m(x) - want).abs().max() / want.abs().max()).item()  # noqa: E731
    assert err(split) * 4 < err(plain), (err(split), err(plain))
    run = _int8_session(split, x, tmp_path / "int8_float.onnx")
    together = run(x)
    for b, s in ((0, 0), (1, 3), (2, 4)):
        np.testing.assert_array_equal(run(x[b:b + 1, s:s + 1])[0, 0], together[b, s])
    np.testing.assert_allclose(together, split(x).detach().numpy(), rtol=0, atol=1e-5 * want.abs().max().item())
    for bad in ([64], [3, 3], [-1]):
        with pytest.raises(ValueError, match="expected distinct input channels in \\[0, 64\\)"):
            Int8Linear(linear, bad)


def test_calibration_finds_a_planted_outlier_channel(tiny_merged):
    """calibrate_float_channels: the channels whose inputs peak highest, per Linear that takes them
    (the attention's output projection does not); a norm weight 40x the others puts its channel
    first for the Linear behind that norm. quantize_model_int8 keeps them float."""
    from medusa_trt.calibration.activations import calibrate_float_channels, sample_own_text
    from medusa_trt.quant import Int8Linear

    model = MedusaModel.from_checkpoint(tiny_merged("llama"))
    with torch.no_grad():
        model.layers[0].input_layernorm.weight[5] = 40.0
        model.layers[1].post_layernorm.weight[7] = 40.0
    samples = sample_own_text(model, 1, count=2, length=6)
    assert len(samples) == 2 and all(len(s) == 7 and s[0] == 1 for s in samples)
    channels = calibrate_float_channels(model, samples, 3)
    assert "layers.0.dense" not in channels and "lm_head" in channels
    assert all(len(c) == 3 and c == sorted(c) for c in channels.values())
    assert 5 in channels["layers.0.qkv"] and 7 in channels["layers.1.fc"] and 7 in channels["layers.1.gate"]
    quantize_model_int8(model, embedding=True, float_channels=channels)
    assert model.layers[0].qkv.float_channels.tolist() == channels["layers.0.qkv"]
    assert isinstance(model.layers[0].dense, Int8Linear) and "float_channels" not in model.layers[0].dense.kept
    with pytest.raises(ValueError, match="no such base Linear"):
        quantize_model_int8(MedusaModel.from_checkpoint(tiny_merged("llama")), float_channels={"layers.99.qkv": [0]})


def test_int8_embedding_rows_and_their_exported_lookup(tmp_path):
    """Int8Embedding: each token's row as int8 by its own scale, within int8 rounding of the float
    row; the exported lookup (Gather of the codes and scales, Cast, Mul) gives the same bits."""
    import numpy as np
    import onnxruntime as ort
    from torch import nn

    from medusa_trt.quant import Int8Embedding
    from medusa_trt.runtime.ort.session import session_options

    torch.manual_seed(0)
    table = nn.Embedding(50, 16)
    with torch.no_grad():
        table.weight[3] = 0.0  # a zero row stays zeros
    module = Int8Embedding(table)
    assert module.qweight.dtype == torch.int8 and module.qweight.shape == (50, 16)
    ids = torch.tensor([[3, 0, 49, 7], [1, 1, 2, 3]])
    got, want = module(ids), table(ids)
    assert torch.equal(got[0, 0], torch.zeros(16))
    assert ((got - want).abs().amax(-1) <= table.weight.abs().amax(-1)[ids] / 254 + 1e-7).all()

    program = torch.onnx.export(module, (ids,), dynamo=True, opset_version=23, verbose=False,
                                dynamic_shapes=({0: "b", 1: "s"},))
    program.save(tmp_path / "embed.onnx")
    session = ort.InferenceSession(str(tmp_path / "embed.onnx"), session_options(), providers=["CPUExecutionProvider"])
    for rows in (ids, ids[:1, :1], torch.tensor([[49, 48, 47]])):
        out = session.run(None, {session.get_inputs()[0].name: rows.numpy()})[0]
        np.testing.assert_array_equal(out, module(rows).numpy())


def test_int8_quantizes_every_matrix(tiny_merged):
    """No block constraint: the decoder's Linears and the lm_head all become Int8Linear; with
    `embedding` the input embedding becomes Int8Embedding, and the model keeps its dtype."""
    from medusa_trt.quant import Int8Embedding, Int8Linear

    model = MedusaModel.from_checkpoint(tiny_merged("llama"))
    dtype = model.dtype
    assert quantize_model_int8(model, embedding=True) == []
    assert isinstance(model.lm_head, Int8Linear) and isinstance(model.layers[0].qkv, Int8Linear)
    assert isinstance(model.vocab_embedding, Int8Embedding) and model.dtype == dtype
