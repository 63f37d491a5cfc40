"""Quantized weights in the exported graphs: FP8 as QuantizeLinear/DequantizeLinear, int4 as MatMulNBits,
int8 as MatMulInteger over each row rounded to int8.

While export.export_onnx traces, FP8Module and Int4Linear call the custom ops here instead of
their eager arithmetic (export_fake_quant, export_dequant, export_int4_matmul; Int8Linear calls
export_int8_matmul), and the exporter's translation table (fp8_translations, int4_translations,
int8_translations) turns each op into the ONNX nodes a
backend reads as quantized; traced as plain ops they would be Div/Clip/Cast or unpack-and-
dequantize chains and a float MatMul.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

from medusa_trt.fp8 import FP8Module, dequantize_fp8, fake_quant_fp8
from medusa_trt.modeling import MedusaModel
from medusa_trt.quant import INT8_MIN_SCALE, Int4Linear, Int8Linear, int8_matmul, nbits_matmul

# -- FP8 as explicit QuantizeLinear/DequantizeLinear ------------------------------------------------


@functools.cache
def _fp8_ops() -> tuple[Callable, Callable]:
    """Custom ops standing for FP8 quantize-dequantize and weight dequantization, translated to ONNX
    Q/DQ (traced as plain ops they would become Div/Clip/Cast chains no backend reads as FP8).
    Scales are scalars: per-tensor quantization in ONNX."""

    @torch.library.custom_op("medusa_trt::fp8_quantize_dequantize", mutates_args=())
    def qdq(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return fake_quant_fp8(x, scale)

    @qdq.register_fake
    def _(x, scale):
        return torch.empty_like(x)

    @torch.library.custom_op("medusa_trt::fp8_dequantize", mutates_args=())
    def dq(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return dequantize_fp8(q, scale)

    @dq.register_fake
    def _(q, scale):
        return torch.empty(q.shape, dtype=torch.float32, device=q.device)

    return qdq, dq


def export_fake_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return _fp8_ops()[0](x, scale.reshape(()))


def export_dequant(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _fp8_ops()[1](q, scale.reshape(())).to(dtype)


def _fp8_zero_point():
    from onnxscript import ir
    from onnxscript import opset19 as op

    # The zero point's type selects the quantized type: float8e4m3fn, value 0 (symmetric).
    return op.Constant(value=ir.tensor(np.zeros((), dtype=np.uint8), dtype=ir.DataType.FLOAT8E4M3FN))


def _qdq_translation(x, scale):
    from onnxscript import ir
    from onnxscript import opset19 as op

    zp = _fp8_zero_point()
    xf = x if x.dtype == ir.DataType.FLOAT else op.Cast(x, to=ir.DataType.FLOAT)
    y = op.DequantizeLinear(op.QuantizeLinear(xf, scale, zp, saturate=1), scale, zp)
    return y if x.dtype == ir.DataType.FLOAT else op.CastLike(y, x)


def _dequantize_translation(q, scale):
    from onnxscript import opset19 as op

    return op.DequantizeLinear(q, scale, _fp8_zero_point())


def fp8_translations() -> dict:
    _fp8_ops()  # registers torch.ops.medusa_trt.fp8_*
    return {torch.ops.medusa_trt.fp8_quantize_dequantize.default: _qdq_translation,
            torch.ops.medusa_trt.fp8_dequantize.default: _dequantize_translation}


# -- int4 weights as com.microsoft MatMulNBits ------------------------------------------------------


@functools.cache
def _int4_op() -> Callable:
    """A custom op standing for Int4Linear's matmul, translated to one MatMulNBits node (traced as
    plain ops it would be an unpack-and-dequantize chain and a float MatMul)."""

    @torch.library.custom_op("medusa_trt::matmul_nbits", mutates_args=())
    def op(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None,
           accuracy_level: int, bits: int) -> torch.Tensor:
        return nbits_matmul(x, packed, scales, zero_points, accuracy_level, bits)

    @op.register_fake
    def _(x, packed, scales, zero_points, accuracy_level, bits):
        return x.new_empty((*x.shape[:-1], packed.shape[0]))

    return op


def export_int4_matmul(x, packed, scales, zero_points, accuracy_level, bits):
    return _int4_op()(x, packed, scales, zero_points, accuracy_level, bits)


@functools.cache
def _matmul_nbits_schema():
    """The inputs of ONNX Runtime's contrib MatMulNBits this exporter writes (onnx has no schema)."""
    import onnx

    p = onnx.defs.OpSchema.FormalParameter
    optional = onnx.defs.OpSchema.FormalParameterOption.Optional
    attr = onnx.defs.OpSchema.Attribute
    return onnx.defs.OpSchema(
        "MatMulNBits", "com.microsoft", 1,
        inputs=[p("A", "T1"), p("B", "T2"), p("scales", "T1"), p("zero_points", "T2", param_option=optional)],
        outputs=[p("Y", "T1")],
        type_constraints=[("T1", ["tensor(float)", "tensor(float16)"], ""), ("T2", ["tensor(uint8)"], "")],
        attributes=[attr(name, onnx.defs.OpSchema.AttrType.INT, "", required=True)
                    for name in ("K", "N", "bits", "block_size", "accuracy_level")],
    )


def _matmul_nbits_translation(x, packed, scales, zero_points, accuracy_level, bits):
    from onnxscript import opset23 as op
    from onnxscript.values import Op, Opset

    n, blocks, blob = (int(d) for d in packed.shape)
    block_size = blob * 8 // int(bits)
    mm = Op(Opset("com.microsoft", 1), "MatMulNBits", _matmul_nbits_schema())
    # scales [N, blocks] -> [N * blocks], the layout the kernel reads (folded at load: an initializer).
    # Without zero points the node has three inputs: the kernel's implicit 2^(bits - 1).
    args = [x, packed, op.Reshape(scales, op.Constant(value_ints=[-1]))] + ([] if zero_points is None else [zero_points])
    return mm(*args, K=blocks * block_size, N=n, bits=int(bits), block_size=block_size,
              accuracy_level=int(accuracy_level))


def int4_translations() -> dict:
    _int4_op()  # registers torch.ops.medusa_trt.matmul_nbits
    return {torch.ops.medusa_trt.matmul_nbits.default: _matmul_nbits_translation}


# -- int8 weights and activations as MatMulInteger -------------------------------------------------


@functools.cache
def _int8_op() -> Callable:
    """A custom op standing for Int8Linear's matmul, translated to the row rounding, one
    MatMulInteger and the float scaling (quant.int8_matmul's arithmetic, op for op)."""

    @torch.library.custom_op("medusa_trt::matmul_int8", mutates_args=())
    def op(x: torch.Tensor, qweight_t: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return int8_matmul(x, qweight_t, scales)

    @op.register_fake
    def _(x, qweight_t, scales):
        return x.new_empty((*x.shape[:-1], qweight_t.shape[1]))

    return op


def export_int8_matmul(x, qweight_t, scales):
    return _int8_op()(x, qweight_t, scales)


@functools.cache
def _matmul_integer_to_float_schema():
    """The inputs of ONNX Runtime's contrib MatMulIntegerToFloat this exporter writes: A, B, their
    scales and A's zero point (onnx has no schema)."""
    import onnx

    p = onnx.defs.OpSchema.FormalParameter
    optional = onnx.defs.OpSchema.FormalParameterOption.Optional
    return onnx.defs.OpSchema(
        "MatMulIntegerToFloat", "com.microsoft", 1,
        inputs=[p("A", "T1"), p("B", "T2"), p("a_scale", "T3"), p("b_scale", "T3"),
                p("a_zero_point", "T1", param_option=optional)],
        outputs=[p("Y", "T3")],
        type_constraints=[("T1", ["tensor(uint8)"], ""), ("T2", ["tensor(int8)"], ""), ("T3", ["tensor(float)"], "")],
    )


def _matmul_int8_translation(x, qweight_t, scales):
    from onnxscript import ir
    from onnxscript import opset23 as op
    from onnxscript.values import Op, Opset

    mm = Op(Opset("com.microsoft", 1), "MatMulIntegerToFloat", _matmul_integer_to_float_schema())

    def const(value, dtype=np.float32):
        return op.Constant(value=ir.tensor(np.array(value, dtype=dtype)))

    # Each row's scale max|x| / 127 (at least float32's smallest normal, so a zero row divides by
    # something and rounds to 0s), the row rounded half to even and offset by 128 into uint8 by one
    # QuantizeLinear whose block is the whole row (one scale per row), then ONNX Runtime's
    # MatMulIntegerToFloat: the u8 x s8 GEMM subtracting zero point 128 again, its int32 sums
    # converted and scaled by the column scales in the GEMM's own output stage, and last the row
    # scale (rows offset into uint8 because ONNX Runtime 1.31's s8 x s8 GEMM ran ~25x slower on an
    # AVX-512 VNNI CPU). Five passes over a row fewer than rounding op by op (Div, Round, Add, Cast,
    # and Cast, Mul after the product), which a verify step paid for every row (docs/benchmarks/issue-35-
    # amphista.md, section y); quant.int8_matmul computes the same bits.
    k = qweight_t.shape[0]
    s = op.Div(op.ReduceMax(op.Abs(x), op.Constant(value_ints=[-1]), keepdims=1), const(127.0))
    s = op.Max(s, const(INT8_MIN_SCALE))
    # The zero points, 128 in the scales' shape (blocked QuantizeLinear wants one per scale), in one
    # node where Shape and ConstantOfShape took two: each scale (> 0, finite for a finite row) divided
    # by float32's largest value rounds to 0, plus the per-tensor zero point 128.
    zero = op.QuantizeLinear(s, const(np.finfo(np.float32).max), const(128, np.uint8))
    q = op.QuantizeLinear(x, s, zero, axis=-1, block_size=int(k))
    y = mm(q, qweight_t, const(1.0), scales, const(128, np.uint8))
    return op.Mul(y, s)


def int8_translations() -> dict:
    _int8_op()  # registers torch.ops.medusa_trt.matmul_int8
    return {torch.ops.medusa_trt.matmul_int8.default: _matmul_int8_translation}


def has_int8(model: MedusaModel) -> bool:
    return any(isinstance(m, Int8Linear) for m in model.modules())


def has_int4(model: MedusaModel) -> bool:
    return any(isinstance(m, Int4Linear) for m in model.modules())


def has_fp8(model: MedusaModel) -> bool:
    return any(isinstance(m, FP8Module) for m in model.modules())
