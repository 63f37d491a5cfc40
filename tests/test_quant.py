"""The reference model's int4 numerics (modeling: quantize_int4, the offsets and int8 schemes,
quantize_model_int4), which MatMulNBits engines are checked against."""

from __future__ import annotations

import pytest
import torch

from medusa_trt.modeling import MedusaModel
from medusa_trt.quant import (
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int4_offsets,
    quantize_int8,
    quantize_model_int4,
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


def test_unfit_block_size_stays_float(tiny_merged):
    """hidden 64 is not a multiple of 128: those Linears stay float and are named; proj (K=128) is int4."""
    model = MedusaModel.from_checkpoint(tiny_merged("llama"))
    skipped = quantize_model_int4(model, 128, 4)
    assert "layers.0.qkv" in skipped and "lm_head" in skipped and "layers.0.proj" not in skipped
    with pytest.raises(ValueError, match="block size 48"):
        quantize_model_int4(MedusaModel.from_checkpoint(tiny_merged("llama")), 48, 4)
