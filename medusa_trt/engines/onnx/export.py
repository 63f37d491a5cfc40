"""ONNX export of the reference model (base decoder + Medusa heads) for ONNX Runtime.

The graph is `MedusaModel.forward` itself, traced by torch.onnx's dynamo exporter, so the engine
and the reference share one implementation. What differs from eager was chosen by measurement on
a 2-core CPU with 10M and 100M-parameter models (benchmarks/bench_onnx.py):

- one past input per layer and per K/V: a stacked [L, ...] input costs ONNX Runtime a Gather copy
  of every layer's cache per step (BENCHMARKS.md, issue 4);
- the past may be the runtime's whole cache buffer (capacity T >= every committed length): the
  graph slices it to max(past_lengths) and builds the prefix mask from `past_lengths`, so a step
  costs the committed length, not the capacity (BENCHMARKS.md, issue 13). The runtime passes the
  buffer as it is; in the graph, that Slice and the default attention form's Concat of past and new
  K/V each copy the committed prefix once per layer and step;
- attention as the opset-23 `Attention` op by default (ATTENTION_FORMS lists the alternatives);
- Medusa heads as one 2-D MatMul per head: ONNX Runtime prepacks 2-D constant weights, and the
  reference's batched einsum runs several times slower there.

FP8 checkpoints export as explicit quantization (opset >= 19), the form TensorRT builds FP8 engines
from: each quantized Linear's weight is a float8e4m3fn initializer behind DequantizeLinear with its
per-tensor scale, its input goes through QuantizeLinear -> DequantizeLinear with the calibrated
activation scale, and with an FP8 KV cache the new keys/values do too. Q/DQ run in float32, where the
checkpoint's scales live (`x` is cast to float32 first in a float16 graph): that is the reference's
arithmetic, and ONNX Runtime's CPU kernels do not take a float16 input with a float32 scale.

int4 models (modeling.quantize_model_int4, medusa-build --weights int4) export each Int4Linear as one
com.microsoft MatMulNBits node over its packed bytes, scales and zero points (none with per-block
offsets, whose blocksum(x) @ offsets^T traces as Reshape, ReduceSum, MatMul and Add; bits=8 for an
8-bit lm_head).

Graph interface (names are the contract with `medusa_trt.runtime.ort_backend`):

  inputs   input_ids        [batch, new] int64
           position_ids     [batch, new] int64   absolute positions (tree nodes: length + depth)
           past_lengths     [batch] int64        committed cache entries [0, n) of each sequence
           new_mask         [batch, new, new] bool  which new tokens each new token sees
           logit_positions  [batch, logits] int64   rows of `new` to produce logits for
           past_key_{i}, past_value_{i}  [batch, kv_heads, past, head_dim]  for each layer i
  outputs  logits           [batch, logits, vocab] float32
           hidden           [batch, logits, hidden_size]  final normed hidden state at those rows
           present_keys, present_values  [layers, batch, kv_heads, new, head_dim]  new tokens only

The heads graph (`model_heads.onnx`) maps hidden [rows, hidden_size] -> medusa_logits [heads, rows,
vocab]. The fused step graph (`model_step.onnx`, models with heads) is one greedy decoding step:
the decoder over a tree's tokens, greedy acceptance, the heads at the last accepted node and the
next tree's tokens (medusa_trt/acceptance.py, the functions the decoding loop runs eagerly):

  inputs   input_ids, position_ids, past_lengths, new_mask, past_*   as above (new = tree slots)
           retrieve         [paths, depth + 1] int64  root..leaf slots of each path, -1 padded;
                            heads 0..depth-1 draft the next tree, the others are not computed
           candidate_index  [slots - 1] int64  next tree's slots in the heads' flat top-k
  outputs  best_path, accepted  [batch] int64
           next_tokens      [batch, slots] int64  the next step's input_ids
           present_keys, present_values  as above
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from medusa_trt.acceptance import candidates_from_topk, greedy_accept
from medusa_trt.checkpoint import dequantize_fp8
from medusa_trt.engine_dir import (  # noqa: F401 (re-exported for the TensorRT builder and tests)
    HEADS_INPUT,
    HEADS_OUTPUT,
    INPUT_NAMES,
    OUTPUT_NAMES,
    STEP_INPUT_NAMES,
    STEP_OUTPUT_NAMES,
    past_names,
)
from medusa_trt.modeling import (
    FP8Linear,
    FP8Module,
    Int4Linear,
    MedusaModel,
    attention_with_past,
    fake_quant_fp8,
    nbits_matmul,
    resblocks,
)
from medusa_trt.tree import candidate_topk

log = logging.getLogger(__name__)

DEFAULT_OPSET = 23  # RMSNormalization and Attention became standard ops in opset 23
MIN_OPSET = 18  # the dynamo exporter's floor
MIN_FP8_OPSET = 19  # float8 types in QuantizeLinear/DequantizeLinear
MAX_PROTOBUF_BYTES = 2**31 - 1  # one protobuf message; larger models must use external data
# The graph interface (names, past_names) is part of the engine-dir contract: medusa_trt/engine_dir.py.


# -- attention forms ---------------------------------------------------------------------------
# Each has the signature of modeling.attention_with_past: q [B, Hq, S, D], k/v [B, Hkv, S, D],
# past_k/past_v [B, Hkv, T, D], mask [B, S, T+S] bool -> [B, Hq, S, D].


def split_attention(q, k, v, past_k, past_v, mask):
    """Plain ops that never copy the cache: scores against the past and the new keys are computed
    separately and joined (the join is [.., S, T+S], D times smaller than the cache), and GQA groups
    the queries of each KV head instead of repeating the keys."""
    b, hq, s, d = q.shape
    hkv, t = past_k.shape[1], past_k.shape[2]
    g = hq // hkv
    # repeat_interleave order: query head h reads KV head h // g, so heads of one KV head are adjacent.
    qg = q.float().reshape(b, hkv, g * s, d)
    scores = torch.cat(
        [torch.matmul(qg, past_k.float().transpose(-1, -2)), torch.matmul(qg, k.float().transpose(-1, -2))], dim=-1
    ) / math.sqrt(d)  # [B, Hkv, G*S, T+S]
    scores = scores.reshape(b, hkv, g, s, t + s).masked_fill(~mask[:, None, None], torch.finfo(torch.float32).min)
    probs = torch.softmax(scores, dim=-1).reshape(b, hkv, g * s, t + s).to(v.dtype)
    out = torch.matmul(probs[..., :t], past_v) + torch.matmul(probs[..., t:], v)
    return out.reshape(b, hq, s, d)


def row_exact_attention(q, k, v, past_k, past_v, mask):
    """Attention whose output for a row does not depend on the step's other rows or on where its
    visible keys sit: the softmax and the weighted sum in float64, rounded back to the model dtype
    once.

    A row's float32 softmax and weighted sum depend on how many rows the step has and on the key
    positions (kernels pick other blockings and reduction orders), so a one-row plain step and the
    tree row of the same position differ in the last bits. Float32 engines absorb that (Medusa greedy
    still equals plain greedy), but MatMulNBits at accuracy level 4 rounds its input to int8 per
    block: one bit of noise at a rounding boundary moves a whole quantum, and over 30 layers the
    logits of the two paths differ by ~0.6 and greedy tokens part at near-ties. In float64 the
    differences stay ~1e-16 relative, far below float32's rounding step, so the rounded output is
    the same bits whatever the row count or tree (BENCHMARKS.md, issue 13: int4 row invariance).

    The scores stay in the model dtype: each is one dot product over head_dim, which ONNX Runtime's
    MatMul accumulates in the same order whatever the row and key counts (test_int4.py:
    test_float32_scores_are_row_invariant_in_onnx_runtime; test_int4_rows_are_bitwise_row_invariant
    checks a whole engine). That spares casting the keys, half of the cache prefix, to float64 in
    every layer. The weighted sum over keys is not invariant in float32 (its reduction blocks move
    with the key count), so it stays in float64."""
    b, hq, s, d = q.shape
    keys = torch.cat([past_k, k], dim=2)  # the past is copied once either way (see "concat")
    values = torch.cat([past_v, v], dim=2).double()
    hkv = keys.shape[1]
    g = hq // hkv
    # GQA by query grouping, as in split_attention: query head h reads KV head h // g. The mask is
    # tiled to the grouped rows [B, 1, G*S, T+S] (once per step: every layer reads the same one), so
    # scores and probabilities stay 4-D, without a reshape each way per layer.
    # The scale right before the MatMul, where ONNX Runtime folds it into the kernel's alpha.
    qg = q.reshape(b, hkv, g * s, d) * (1.0 / math.sqrt(d))
    scores = torch.matmul(qg, keys.transpose(-1, -2)).double()
    scores = scores.masked_fill(~mask[:, None].repeat(1, 1, g, 1), torch.finfo(torch.float64).min)
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, values).reshape(b, hq, s, d).to(q.dtype)


class PlacedMask(NamedTuple):
    """The `mask` argument of a form that writes each new token's K/V at its own sequence's position
    in the cache buffer (AttentionForm.places_new_keys), built by _ExportModule.forward."""

    mask: torch.Tensor  # [B, S, P] bool over the buffer's first P = max(past_lengths) + S keys
    slots: torch.Tensor  # [B, 1, S, 1] int64: new token i's key index, past_lengths[b] + i


def row_exact_f32_attention(q, k, v, past_k, past_v, mask: PlacedMask):
    """row_exact's guarantee at float32 cost, where ONNX Runtime's kernels allow it: a row's output
    is the same bits whatever the step's other rows and the gaps between its visible keys, as long as
    each visible key sits in the same KEY_BLOCK-aligned block of the key axis as in a plain step.

    - Scores: float32, invariant (see row_exact_attention).
    - Softmax without ONNX Runtime's Softmax, whose sum runs in vector lanes by key index (a key moved
      by a gap lands in another lane): the row max is exact, exp is elementwise, and the sum runs in
      float64 over the [rows, keys] exponentials (small: no cast of the cache), rounded once.
    - The weighted sum: a float32 MatMul of the unnormalized exponentials and the values. ONNX
      Runtime's MatMul sums each KEY_BLOCK of keys in key order and adds the blocks' sums; zeros in
      between (masked keys) change nothing, so a row agrees with the one-row step of the same
      position unless a key falls in another block there.
    - So keys sit where a plain step has them: the past in place, and each new token at its own
      sequence's length + slot (past_k/past_v span max(past_lengths) + S keys; a shorter sequence's
      new keys overwrite its masked tail), not after the longest prefix of a ragged batch. A plain
      step, a prefill and a chain tree then put every key at its position; a branching tree puts a
      deep node's ancestors at slot offsets instead, within the block as long as the tree does not
      cross a block edge, so the runtime cuts a tree there (runtime/decoding.py:
      StepTree.within_block). tests/engines/test_int4.py checks the kernels' premise and whole engines."""
    scores, values = _placed_scores(q, k, v, past_k, past_v, mask)
    e = torch.exp(scores - scores.amax(-1, keepdim=True))  # masked keys: exp(min - max) == 0
    total = e.double().sum(-1, keepdim=True).to(e.dtype)
    return (torch.matmul(e, values.to(e.dtype)) / total).reshape(q.shape).to(q.dtype)


def _place(k, v, past_k, past_v, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The new K/V [B, Hkv, S, D] written into the past's first max(past_lengths) + S keys at each
    sequence's length + slot (PlacedMask.slots)."""
    index = slots.expand(-1, past_k.shape[1], -1, k.shape[-1])
    return past_k.scatter(2, index, k), past_v.scatter(2, index, v)


def _placed_scores(q, k, v, past_k, past_v, mask: PlacedMask) -> tuple[torch.Tensor, torch.Tensor]:
    """The placed forms' float32 masked scores [B, Hkv, G*S, P] and values [B, Hkv, P, D]: each new
    token's K/V written at its own sequence's length + slot, the query heads grouped per KV head."""
    b, hq, s, d = q.shape
    keys, values = _place(k, v, past_k, past_v, mask.slots)
    mask = mask.mask
    hkv = past_k.shape[1]
    g = hq // hkv
    qg = q.reshape(b, hkv, g * s, d) * (1.0 / math.sqrt(d))
    scores = torch.matmul(qg, keys.transpose(-1, -2))
    return scores.masked_fill(~mask[:, None].repeat(1, 1, g, 1), torch.finfo(scores.dtype).min), values


def chain_f32_attention(q, k, v, past_k, past_v, mask: PlacedMask):
    """row_exact_f32's placed keys and grouped queries, with scores, mask, softmax and weighted sum
    in one ONNX Attention op (ONNX Runtime's kernel: MLAS GEMMs and Softmax, where row_exact_f32
    spends ten ops, seven of them on an exact softmax), exact for plain steps and chain trees only
    (AttentionForm.chains_only).

    The query heads of a KV head go in as that head's rows ([B, Hkv, G*S, D]), so the weighted sum
    always has G >= 3 rows per head as in row_exact_f32, never the one-row path whose sums differ.
    The softmax sums a row in vector lanes by key index. In a plain step, a prefill and a chain tree
    every visible key sits at its own position, so it lands in the same lane whatever the row count
    or the masked keys after it (exp of a masked score is 0, or too small to move a sum of at least
    1); a branching tree puts a deep node's ancestors at slot offsets, in other lanes, and its rows
    differ in the last bits. So the runtime verifies only a tree's main chain on an engine of this
    form (runtime/decoding.py). The weighted sum sums keys in blocks, which a chain never leaves.
    tests/engines/test_int4.py checks the kernel's premise and whole engines bitwise."""
    b, hq, s, d = q.shape
    keys, values = _place(k, v, past_k, past_v, mask.slots)
    hkv = past_k.shape[1]
    g = hq // hkv
    visible = mask.mask[:, None].repeat(1, 1, g, 1)
    return _grouped_attention_op()(q.reshape(b, hkv, g * s, d), keys, values, visible).reshape(q.shape)


@functools.cache
def _grouped_attention_op() -> Callable:
    """chain_f32's attention as a custom op, translated to one ONNX Attention (opset 23): grouped
    queries [B, Hkv, M, D], keys and values [B, Hkv, P, D], visible [B, 1, M, P] bool."""

    @torch.library.custom_op("medusa_trt::grouped_attention", mutates_args=())
    def op(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        scores = torch.matmul(q * (1.0 / math.sqrt(q.shape[-1])), keys.transpose(-1, -2))
        scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
        return torch.matmul(torch.softmax(scores, dim=-1), values)

    @op.register_fake
    def _(q, keys, values, visible):
        return torch.empty_like(q)

    return op


def _grouped_attention_translation(q, keys, values, visible):
    from onnxscript import opset23 as op

    y, _, _, _ = op.Attention(q, keys, values, visible)  # scale: 1 / sqrt(head_dim), the default
    return y


@functools.cache
def _fused_attention_op() -> Callable:
    """A custom op standing for one layer's attention, so the exporter can translate it to a fused
    ONNX op (torch.export keeps custom ops whole; its eager body is only used while tracing)."""

    @torch.library.custom_op("medusa_trt::attention_with_past", mutates_args=())
    def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor,
           mask: torch.Tensor) -> torch.Tensor:
        return attention_with_past(q, k, v, past_k, past_v, mask)

    @op.register_fake
    def _(q, k, v, past_k, past_v, mask):
        return torch.empty_like(q)

    return op


def fused_attention(q, k, v, past_k, past_v, mask):
    return _fused_attention_op()(q, k, v, past_k, past_v, mask)


def _attention23_translation(q, k, v, past_k, past_v, mask):
    from onnxscript import opset23 as op

    # The past goes in as part of K/V rather than through past_key/past_value: ONNX Runtime's CPU
    # kernel refuses a past without the present outputs, which nothing here reads; it would
    # concatenate the same bytes internally. 4-D inputs carry the head counts (GQA needs no attribute).
    keys, values = op.Concat(past_k, k, axis=2), op.Concat(past_v, v, axis=2)
    y, _, _, _ = op.Attention(q, keys, values, op.Unsqueeze(mask, [1]), softmax_precision=1)
    return y


@functools.cache
def _mha_schema():
    """The inputs of ONNX Runtime's contrib MultiHeadAttention this form uses (onnx has no schema for
    it, and the exporter's tracer needs one)."""
    import onnx

    p = onnx.defs.OpSchema.FormalParameter
    optional = onnx.defs.OpSchema.FormalParameterOption.Optional
    return onnx.defs.OpSchema(
        "MultiHeadAttention", "com.microsoft", 1,
        inputs=[p("query", "T"), p("key", "T"), p("value", "T"), p("bias", "T", param_option=optional),
                p("key_padding_mask", "M", param_option=optional),
                p("attention_bias", "T", param_option=optional)],
        outputs=[p("output", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], ""),
                          ("M", ["tensor(int32)"], "")],
        attributes=[onnx.defs.OpSchema.Attribute("num_heads", onnx.defs.OpSchema.AttrType.INT, "", required=True)],
    )


def _mha_translation(q, k, v, past_k, past_v, mask):
    from onnxscript import opset23 as op
    from onnxscript.values import Op, Opset

    # MultiHeadAttention has no GQA: KV heads (past included) are repeated to the query heads, the
    # copy this form pays per step. Query [B, S, H*D]; keys/values [B, H, T+S, D].
    b, heads, s, dim = (op.Shape(q, start=i, end=i + 1) for i in range(4))
    hkv = op.Shape(k, start=1, end=2)
    keys, values = op.Concat(past_k, k, axis=2), op.Concat(past_v, v, axis=2)
    length = op.Shape(keys, start=2, end=3)

    def repeat(x):  # [B, Hkv, L, D] -> [B, Hq, L, D] in repeat_interleave order
        x5 = op.Expand(op.Unsqueeze(x, [2]), op.Concat(b, hkv, op.Div(heads, hkv), length, dim, axis=0))
        return op.Reshape(x5, op.Concat(b, heads, length, dim, axis=0))

    query = op.Reshape(op.Transpose(q, perm=[0, 2, 1, 3]), op.Concat(b, s, op.Mul(heads, dim), axis=0))
    bias = op.Where(op.Unsqueeze(mask, [1]), op.CastLike(0.0, q), op.CastLike(-3.4028234663852886e38, q))
    mha = Op(Opset("com.microsoft", 1), "MultiHeadAttention", _mha_schema())
    y = mha(query, repeat(keys), repeat(values), None, None, bias, num_heads=q.shape[1])
    return op.Transpose(op.Reshape(y, op.Concat(b, s, heads, dim, axis=0)), perm=[0, 2, 1, 3])


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


def _export_fake_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return _fp8_ops()[0](x, scale.reshape(()))


def _export_dequant(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
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


def _fp8_translations() -> dict:
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


def _export_int4_matmul(x, packed, scales, zero_points, accuracy_level, bits):
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


def has_int4(model: MedusaModel) -> bool:
    return any(isinstance(m, Int4Linear) for m in model.modules())


def has_fp8(model: MedusaModel) -> bool:
    return any(isinstance(m, FP8Module) for m in model.modules())


@dataclass(frozen=True)
class AttentionForm:
    function: Callable  # replaces DecoderLayer.attend while tracing
    translation: Callable | None  # onnxscript function for the custom op, when the form uses one
    min_opset: int
    description: str
    # Tree steps must keep their slots inside one key_block-aligned block of the cache (engine.json
    # onnx.key_block; runtime/decoding.py: StepTree.within_block): None when any tree is exact.
    key_block: int | None = None
    # The form takes a PlacedMask and the buffer's first max(past_lengths) + S keys, and writes the
    # new K/V at each sequence's own position; otherwise a [B, S, P + S] mask, new keys after the past.
    places_new_keys: bool = False
    # Exact (Medusa greedy == plain greedy) for chain trees only: the runtime verifies a tree's main
    # chain (engine.json onnx.chains_only; tree.main_chain).
    chains_only: bool = False
    # The custom op `translation` replaces, registered on first call (default: attention_with_past).
    custom_op: Callable[[], Callable] | None = None


# ONNX Runtime's float32 MatMul (MLAS SGEMM) sums the reduced axis in blocks of 128, widened for
# narrow outputs (256 at head_dim 64, 512 at 32; measured with 1 and 2 threads). 128 divides them all.
KEY_BLOCK = 128

ATTENTION_FORMS: dict[str, AttentionForm] = {
    "split": AttentionForm(split_attention, None, MIN_OPSET, "plain ops, past never copied, GQA by query grouping"),
    "concat": AttentionForm(attention_with_past, None, MIN_OPSET,
                            "plain ops as the reference: concat past+new, repeat KV heads, masked softmax"),
    "attention23": AttentionForm(fused_attention, _attention23_translation, 23,
                                 "standard ONNX Attention (opset 23) with past_key/past_value inputs"),
    "mha": AttentionForm(fused_attention, _mha_translation, MIN_OPSET,
                         "ONNX Runtime com.microsoft MultiHeadAttention, KV heads repeated"),
    "row_exact": AttentionForm(row_exact_attention, None, MIN_OPSET,
                               "plain ops in float64: a row's output does not depend on the step's other rows"),
    "row_exact_f32": AttentionForm(row_exact_f32_attention, None, MIN_OPSET,
                                   "float32 with a float64 softmax sum: row_exact's guarantee within key blocks",
                                   KEY_BLOCK, places_new_keys=True),
    "chain_f32": AttentionForm(chain_f32_attention, _grouped_attention_translation, 23,
                               "row_exact_f32's layout in one ONNX Attention op: exact for plain steps and chain trees",
                               places_new_keys=True, chains_only=True, custom_op=_grouped_attention_op),
}
# Measured fastest on a 2-core CPU for decode and tree steps at 10M and 100M parameters
# (benchmarks/bench_onnx.py --sweep-attention); "split" is the fallback below opset 23.
DEFAULT_ATTENTION = "attention23"


# -- export ------------------------------------------------------------------------------------


def _head_branch(x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
    """One head's rows inside the fused step's If (_ExportModule._head_rows): ResBlocks from (W, b)
    pairs, then, when the count is odd, float32 logits through the last [W, d] matrix. Its tensors
    are operands, not closure cells: torch.cond traces pure functions."""
    layers = len(params) // 2
    z = resblocks(x, lambda h, layer: F.linear(h, params[2 * layer], params[2 * layer + 1]), range(layers))
    return F.linear(z, params[-1]).float() if len(params) % 2 else z


def _skipped_head(x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
    """The If's other branch: zeros of _head_branch's shape (rows past the tree's depth, never read)."""
    return x.new_zeros(x.shape[0], params[-1].shape[0], dtype=torch.float32) if len(params) % 2 else torch.zeros_like(x)


class _ExportModule(nn.Module):
    """The graph's interface around MedusaModel.forward (see the module docstring)."""

    def __init__(self, model: MedusaModel, committed_prefix: bool = True, places_new_keys: bool = False):
        super().__init__()
        self.model = model
        self.committed_prefix = committed_prefix
        self.places_new_keys = places_new_keys
        cfg = model.cfg
        pairs = [(h, i) for h in range(cfg.num_medusa_heads) for i in range(cfg.num_medusa_layers)]
        # Per-head 2-D weights, copies of the stacked parameters: torch.cond (the fused step's If per
        # head) rejects operands that share storage. FP8 heads as one FP8Linear per head and layer,
        # aliasing the stacked float8 weights and their scales (their step computes every head).
        self.head_fp8 = None
        if model.medusa_fp8 is not None:
            fp8 = model.medusa_fp8
            self.head_fp8 = nn.ModuleList(FP8Linear(cfg.hidden_size, cfg.hidden_size, bias=False) for _ in pairs)
            for lin, (h, i) in zip(self.head_fp8, pairs, strict=True):
                lin.weight = fp8.weight[h, i]
                lin.weights_scaling_factor = fp8.weights_scaling_factor[h, i].reshape(1)
                lin.activation_scaling_factor = fp8.activation_scaling_factor[h, i].reshape(1)
        self.head_w = nn.ParameterList(
            nn.Parameter(model.medusa_w[h, i].clone(), requires_grad=False) for h, i in pairs
        ) if self.head_fp8 is None else None
        self.head_b = nn.ParameterList(
            nn.Parameter(model.medusa_b[h, i].clone(), requires_grad=False)
            for h in range(cfg.num_medusa_heads) for i in range(cfg.num_medusa_layers)
        )
        # Heads that use the base lm_head (FasterDecoding v2 heads; the merged checkpoint holds a copy
        # per head) share one MatMul: [heads * rows, d] against one matrix instead of one per head.
        base_lm = getattr(model.lm_head, "weight", None)  # None: an int4 lm_head
        self.shared_lm_head = cfg.num_medusa_heads > 0 and (model.heads_use_lm_head or base_lm is not None and all(
            torch.equal(model.medusa_lm_head[h], base_lm) for h in range(cfg.num_medusa_heads)))
        self.head_lm = nn.ParameterList(
            nn.Parameter(model.medusa_lm_head[h], requires_grad=False) for h in range(cfg.num_medusa_heads)
        ) if not self.shared_lm_head else None
        # A draft vocabulary (docs/formats.md section 1): the heads' logits are computed over its V'
        # rows only, one [V', d] matrix when the heads share the lm_head.
        # int4 engines hold it as MatMulNBits (modeling.quantize_model_int4 with draft=True).
        self.draft_lm, self.draft_int4 = None, None
        self.draft_matrices = 0  # distinct draft matrices: 1 when the heads share one, else H; 0: none
        if cfg.draft_vocab and cfg.num_medusa_heads:
            lm = model.draft_lm_head
            shared = all(torch.equal(lm[h], lm[0]) for h in range(cfg.num_medusa_heads))
            self.draft_matrices = 1 if shared else cfg.num_medusa_heads
            if model.draft_int4 is not None:
                self.draft_int4 = model.draft_int4[:1] if shared else model.draft_int4
            else:
                self.draft_lm = nn.Parameter(lm[:1] if shared else lm, requires_grad=False)  # [1 or H, V', d]

    def medusa_heads(self, h: torch.Tensor) -> torch.Tensor:
        """Same math as MedusaModel.medusa_heads: h [B, S, d] -> [H, B, S, V]."""
        b, s, d = h.shape
        return self.medusa_rows(h.reshape(b * s, d)).permute(1, 0, 2).reshape(-1, b, s, self.model.cfg.vocab_size)

    def medusa_rows(self, x0: torch.Tensor) -> torch.Tensor:
        """Medusa logits [N, H, V] (row-major: the fused step takes its top-k without a transpose) of
        hidden rows x0 [N, d], with 2-D MatMuls (ONNX Runtime prepacks those): ResBlocks per head,
        logits per head or through the shared lm_head."""
        if self.draft_matrices:
            return self.model.draft_logits(self.draft_rows(x0))
        return self._rows(x0)

    def _draft_matmul(self, z: torch.Tensor, head: int) -> torch.Tensor:
        """z [..., d] -> head `head`'s draft logits [..., V'] (head 0 when the heads share one matrix)."""
        if self.draft_int4 is not None:
            return self.draft_int4[head](z)
        return F.linear(z, self.draft_lm[head])

    def draft_rows(self, x0: torch.Tensor, used: int | None = None) -> torch.Tensor:
        """Head logits over the draft vocabulary only, [N, H, V'] (H = `used` when given)."""
        if self.draft_matrices == 1:
            z = self._rows(x0, logits=False, used=used)  # [N, H, d]
            n, heads, d = z.shape
            return self._draft_matmul(z.reshape(n * heads, d), 0).float().reshape(n, heads, -1)
        if self.draft_int4 is None:  # a float matrix per head, computed with its head
            return self._head_rows(x0, list(self.draft_lm), used)
        # An int4 matrix per head: every head computed, then cut.
        z = self._head_rows(x0)
        out = torch.stack([self._draft_matmul(z[:, h], h) for h in range(z.shape[1])], dim=1).float()
        return out if used is None else out.narrow(1, 0, used)

    def draft_topk(self, x0: torch.Tensor, k: int, used: int | None = None) -> torch.Tensor:
        """Token ids [N, H, k] of each head's k most likely drafts at hidden rows x0 [N, d], of the
        first `used` heads only when given (H = used)."""
        if not self.draft_matrices:
            return self._rows(x0, used=used).topk(k, dim=-1).indices
        return self.model.draft_ids[self.draft_rows(x0, used).topk(k, dim=-1).indices]

    def _rows(self, x0: torch.Tensor, logits: bool = True, used: int | None = None) -> torch.Tensor:
        """Heads' logits [N, H, V] (hidden [N, H, d] when not `logits`); H = `used` when given."""
        cfg = self.model.cfg
        n, d = x0.shape
        if not cfg.num_medusa_heads:  # a model without heads still has the output, with zero heads
            return x0.new_zeros(n, 0, cfg.vocab_size, dtype=torch.float32)
        if logits and not self.shared_lm_head:  # each head's own [V, d] lm_head, computed with its head
            return self._head_rows(x0, list(self.head_lm), used)
        x = self._head_rows(x0, used=used)
        return self.model.lm_head(x.reshape(-1, d)).float().reshape(n, x.shape[1], -1) if logits else x

    def _head_rows(self, x0: torch.Tensor, tails: list[torch.Tensor] | None = None,
                   used: int | None = None) -> torch.Tensor:
        """Each head's ResBlock output [N, H, d] for hidden rows x0 [N, d], or with `tails` (a [W, d]
        matrix per head) its float32 logits [N, H, W]; 2-D MatMuls, which ONNX Runtime prepacks.
        `used` (the fused step's tree depth) keeps the first heads only, and head h > 0 then runs
        behind an If on `used > h`: a head the tree does not draft with reads none of its weights (on
        the int4 engine with tree [[0]], 3 of 4 heads: ~0.2 ms of a ~9 ms step; BENCHMARKS.md,
        issue 13)."""
        cfg = self.model.cfg
        heads, layers = cfg.num_medusa_heads, cfg.num_medusa_layers
        if self.head_fp8 is not None:  # FP8Linear modules cannot be If operands: every head computed, then cut
            x = torch.stack([self._fp8_head_rows(head, x0, tails) for head in range(heads)], dim=1)
            return x if used is None else x.narrow(1, 0, used)
        out = []
        for head in range(heads):
            params = [t for i in range(head * layers, (head + 1) * layers) for t in (self.head_w[i], self.head_b[i])]
            operands = (x0, *params, *([] if tails is None else [tails[head]]))
            gated = used is not None and head > 0  # a tree drafts with head 0 at least
            out.append(torch.cond(used > head, _head_branch, _skipped_head, operands) if gated else _head_branch(*operands))
        x = torch.stack(out, dim=1)
        return x if used is None else x.narrow(1, 0, used)

    def _fp8_head_rows(self, head: int, x: torch.Tensor, tails: list[torch.Tensor] | None) -> torch.Tensor:
        """_head_branch for FP8 heads: an FP8Linear per head and layer."""
        layers = self.model.cfg.num_medusa_layers
        z = resblocks(x, lambda h, layer: self.head_fp8[head * layers + layer](h) + self.head_b[head * layers + layer],
                      range(layers))
        return z if tails is None else F.linear(z, tails[head]).float()

    def forward(self, input_ids, position_ids, past_lengths, new_mask, logit_positions, past):
        b, s = input_ids.shape
        if self.committed_prefix:
            # Attention reads only the committed prefix [0, max(past_lengths)) of the cache buffer
            # (and the S keys after it when new keys are placed in it), so a step costs what the
            # cache holds, not its capacity (BENCHMARKS.md, issue 13).
            used = past_lengths.max().item()
            torch._check(used >= 0)
            end = used + s if self.places_new_keys else used
            torch._check(end <= past[0].shape[2])
            past = tuple(p.narrow(2, 0, end) for p in past)
        t = past[0].shape[2]
        keys = torch.arange(t, device=input_ids.device)
        if self.places_new_keys:  # new token j of sequence b at key past_lengths[b] + j
            after = keys[None, :] - past_lengths[:, None]  # [B, T]: a key's offset after the prefix
            new = (after >= 0) & (after < s)
            tree = new_mask.gather(2, after.clamp(0, s - 1)[:, None, :].expand(b, s, t)) & new[:, None, :]
            slots = (past_lengths[:, None] + torch.arange(s, device=input_ids.device))[:, None, :, None]
            mask = PlacedMask((after < 0)[:, None, :] | tree, slots)
        else:
            prefix = keys[None, None, :] < past_lengths[:, None, None]
            mask = torch.cat([prefix.expand(b, s, t), new_mask], dim=-1)  # [B, S, T+S]
        return self.model.forward_hidden(input_ids, position_ids, mask, past[0::2], past[1::2], logit_positions)


class _HeadsModule(nn.Module):
    """The heads graph: hidden [N, d] -> medusa_logits [H, N, V]. Separate from the decoder graph
    because a decoding step needs the heads at one row per sequence (the last accepted node, known
    only after verification), not at every tree slot: that halves a 64-slot step's cost here."""

    def __init__(self, decoder: _ExportModule):
        super().__init__()
        self.decoder = decoder

    def forward(self, hidden):
        return self.decoder.medusa_rows(hidden).permute(1, 0, 2)


class _FusedStepModule(nn.Module):
    """The fused greedy step graph (see the module docstring): one session call per decoding step
    instead of two, and no acceptance or top-k in host code (BENCHMARKS.md has the measured gain).
    Logits never leave the graph; only their argmax is read."""

    def __init__(self, decoder: _ExportModule, k: int):
        super().__init__()
        self.decoder, self.k = decoder, k

    def forward(self, input_ids, position_ids, past_lengths, new_mask, retrieve, candidate_index, past):
        # Logits only at the last W = 1 + len(candidate_index) slots: all of a tree's slots, and at a
        # prefill through this graph (runtime/decoding.py: _fused_prefill, the prompt's last token in
        # the last slot) a tree's width instead of the whole prompt's lm_head.
        b, s = input_ids.shape
        start = torch.sym_max(s - (candidate_index.shape[0] + 1), 0)
        rows = torch.arange(start, s, device=input_ids.device)[None].expand(b, -1)
        logits, hidden, new_k, new_v = self.decoder(input_ids, position_ids, past_lengths, new_mask, rows, past)
        argmax = logits.argmax(-1)
        argmax = torch.cat([argmax.new_zeros(b, start), argmax], dim=1)  # [B, S] by slot; < start never read
        best, accepted = greedy_accept(retrieve, input_ids, argmax)
        last = retrieve[best].gather(1, accepted[:, None])  # [B, 1] slot whose outputs continue
        root = argmax.gather(1, last).squeeze(1)
        h = hidden.gather(1, (last - start)[:, :, None].expand(-1, -1, hidden.shape[-1]))[:, 0]  # [B, d]
        # A tree of depth D drafts with heads 0..D-1 only: the others' lm_head rows are not computed
        # (on an int4 engine with tree [[0]], 1 of 4 rows; BENCHMARKS.md, issue 13).
        depth = retrieve.shape[1] - 1
        torch._check(depth >= 1)
        torch._check(depth <= self.decoder.model.cfg.num_medusa_heads)
        top = self.decoder.draft_topk(h, self.k, depth)  # [B, D, k]
        return best, accepted, candidates_from_topk(root, top, candidate_index), new_k, new_v


def step_example_inputs(model: MedusaModel) -> dict:
    """Fused step graph inputs: a 6-slot tree ([0], [1], [2], [0, 0], [0, 0, 0], cut to the model's
    heads when it has fewer than 3) and 7 candidates, sizes distinct from every other dimension."""
    inputs = example_inputs(model, batch=2, new=6, past=5)
    del inputs["logit_positions"]
    past = inputs.pop("past")
    depth = min(model.cfg.num_medusa_heads, 3)  # the graph drafts with as many heads as the tree is deep
    retrieve = torch.tensor([[0, 1, 4, 5], [0, 2, -1, -1], [0, 3, -1, -1]])[:, :depth + 1]
    return {**inputs, "retrieve": retrieve, "candidate_index": torch.arange(7) % (depth * step_topk(model)),
            "past": past}


def step_topk(model: MedusaModel) -> int:
    """Top-k the fused step graph takes of each head: the runtime's k for every tree whose ranks are
    below tree.CANDIDATE_TOPK (engine.json records it; the runtime uses the graph when they agree)."""
    return candidate_topk(model.cfg.vocab_size)


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """The exporter warns (Python warnings and its logger) about internals we do not control, such
    as torchvision not being installed; errors still raise."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _export_mode(model: MedusaModel, form: AttentionForm, heads: Callable, wrapper: nn.Module) -> Iterator[None]:
    """Swaps the attention form, the heads' op form and the FP8 ops for the duration of the trace."""
    saved = [layer.attend for layer in model.layers]
    for layer in model.layers:
        layer.attend = form.function
    model.medusa_heads = heads  # instance attribute shadows the method
    fp8 = [m for m in wrapper.modules() if isinstance(m, FP8Module)]
    for m in fp8:
        m.fake_quant, m.dequant = _export_fake_quant, _export_dequant
    int4 = [m for m in wrapper.modules() if isinstance(m, Int4Linear)]
    for m in int4:
        m.matmul = _export_int4_matmul
    try:
        yield
    finally:
        for layer, fn in zip(model.layers, saved, strict=True):
            layer.attend = fn
        del model.medusa_heads
        for m in fp8:
            m.fake_quant, m.dequant = fake_quant_fp8, dequantize_fp8
        for m in int4:
            m.matmul = nbits_matmul


def example_inputs(model: MedusaModel, batch: int = 2, new: int = 3, past: int = 5, logits: int = 2) -> dict:
    """Inputs in graph order (sizes distinct so the tracer infers no false equalities)."""
    cfg = model.cfg
    cache = torch.zeros(batch, cfg.num_kv_heads, past, cfg.head_dim, dtype=model.dtype)
    return {
        "input_ids": torch.zeros(batch, new, dtype=torch.long),
        "position_ids": torch.arange(new).repeat(batch, 1) + past,
        "past_lengths": torch.full((batch,), past, dtype=torch.long),
        "new_mask": torch.ones(batch, new, new, dtype=torch.bool).tril(),
        "logit_positions": torch.zeros(batch, logits, dtype=torch.long),
        "past": tuple(cache.clone() for _ in range(2 * cfg.num_layers)),
    }


@dataclass(frozen=True)
class ExportResult:
    path: Path  # the .onnx file
    files: tuple[Path, ...]  # every file written (the .onnx, plus external data when used)
    opset: int
    attention: str
    external_data: bool
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    heads_path: Path | None  # the heads graph (hidden [N, d] -> medusa_logits [H, N, V]); None without heads
    step_path: Path | None  # the fused greedy step graph; None without heads or when not asked for
    step_topk: int  # its per-head top-k
    shared_lm_head: bool  # heads use the base lm_head, as one MatMul


def export_onnx(
    model: MedusaModel,
    path: str | Path,
    *,
    attention: str = DEFAULT_ATTENTION,
    opset: int = DEFAULT_OPSET,
    external_data: bool | None = None,
    fused_step: bool = False,
    committed_prefix: bool = True,
) -> ExportResult:
    """Exports `model` (in its current dtype) to `path`. `external_data` None: only when the
    weights exceed the 2 GB protobuf limit. `fused_step`: also the fused greedy step graph (with its
    own copy of the decoder's weights: medusa-build then shares them, engines/onnx_weights.py). `committed_prefix`: attention reads only the
    cache's committed prefix (a Slice per past input); off, the past inputs go straight into the
    attention's Concat, the form the TensorRT rewrite (engines/onnx_rewrite.py) recognises."""
    if attention not in ATTENTION_FORMS:
        raise ValueError(f"attention form {attention!r} is unknown; expected one of {sorted(ATTENTION_FORMS)}")
    form = ATTENTION_FORMS[attention]
    if not MIN_OPSET <= opset <= DEFAULT_OPSET:
        raise ValueError(f"opset {opset} is not supported; expected {MIN_OPSET}..{DEFAULT_OPSET}")
    if opset < form.min_opset:
        raise ValueError(f"attention form {attention!r} needs opset >= {form.min_opset}, got opset {opset}")
    fp8 = has_fp8(model)
    if fp8 and opset < MIN_FP8_OPSET:
        raise ValueError(f"an FP8 model needs opset >= {MIN_FP8_OPSET} (float8 QuantizeLinear/DequantizeLinear), "
                         f"got opset {opset}")
    try:
        import onnxscript  # noqa: F401  (torch.onnx's exporter needs it; fail with a clear message)
    except ImportError as e:
        raise RuntimeError("ONNX export needs the 'onnxscript' package (pip install onnxscript)") from e
    from torch.export import Dim

    path = Path(path)
    cfg = model.cfg
    wrapper = _ExportModule(model, committed_prefix, form.places_new_keys).eval()
    inputs = example_inputs(model)
    batch, new, past, logits = Dim("batch"), Dim("new_tokens"), Dim("past"), Dim("num_logits")
    dynamic_shapes = {
        "input_ids": {0: batch, 1: new},
        "position_ids": {0: batch, 1: new},
        "past_lengths": {0: batch},
        "new_mask": {0: batch, 1: new, 2: new},
        "logit_positions": {0: batch, 1: logits},
        "past": tuple({0: batch, 2: past} for _ in range(2 * cfg.num_layers)),
    }
    table = {}
    if form.translation:
        table[(form.custom_op or _fused_attention_op)()._opoverload] = form.translation  # registers the op
    if fp8:
        table.update(_fp8_translations())
    if has_int4(model):
        _int4_op()  # registers torch.ops.medusa_trt.matmul_nbits
        table[torch.ops.medusa_trt.matmul_nbits.default] = _matmul_nbits_translation
    weight_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    if external_data is None:
        external_data = weight_bytes > MAX_PROTOBUF_BYTES - (64 << 20)  # leave room for the graph itself
    if external_data:
        log.info("%s: %.2f GB of weights go to external data files", path, weight_bytes / 1e9)
    with _export_mode(model, form, wrapper.medusa_heads, wrapper), torch.no_grad(), _quiet_exporter():
        program = torch.onnx.export(
            wrapper, (), kwargs=inputs, dynamic_shapes=dynamic_shapes, input_names=[*INPUT_NAMES, *past_names(cfg.num_layers)],
            output_names=list(OUTPUT_NAMES), opset_version=opset, dynamo=True, custom_translation_table=table or None,
            optimize=True, verbose=False,
        )
        heads_program = None
        if cfg.num_medusa_heads:
            hidden = torch.zeros(3, cfg.hidden_size, dtype=model.dtype)
            heads_program = torch.onnx.export(
                _HeadsModule(wrapper).eval(), (hidden,), dynamic_shapes=({0: Dim("rows")},),
                input_names=[HEADS_INPUT], output_names=[HEADS_OUTPUT], opset_version=opset, dynamo=True,
                custom_translation_table=table or None, optimize=True, verbose=False,
            )
        step_program = None
        if cfg.num_medusa_heads and fused_step:
            step_inputs = step_example_inputs(model)
            step_shapes = {**{k: v for k, v in dynamic_shapes.items() if k != "logit_positions"},
                           "retrieve": {0: Dim("paths"), 1: Dim("path_length")},
                           "candidate_index": {0: Dim("candidates")}}
            step_shapes = {k: step_shapes[k] for k in step_inputs}  # the module's argument order
            step_program = torch.onnx.export(
                _FusedStepModule(wrapper, step_topk(model)).eval(), (), kwargs=step_inputs,
                dynamic_shapes=step_shapes, input_names=[*STEP_INPUT_NAMES, *past_names(cfg.num_layers)],
                output_names=list(STEP_OUTPUT_NAMES), opset_version=opset, dynamo=True,
                custom_translation_table=table or None, optimize=True, verbose=False,
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    program.save(path, external_data=external_data)
    heads_path = None
    if heads_program is not None:
        heads_path = path.with_name(path.stem + "_heads.onnx")
        heads_program.save(heads_path, external_data=external_data)
    step_path = None
    if step_program is not None:
        step_path = path.with_name(path.stem + "_step.onnx")
        step_program.save(step_path, external_data=external_data)
    files = [p for p in (path, heads_path, step_path) if p is not None]
    if external_data:
        files += sorted(p for p in path.parent.glob(path.stem + "*.data"))
    return ExportResult(path, tuple(files), opset, attention, bool(external_data),
                        (*INPUT_NAMES, *past_names(cfg.num_layers)), OUTPUT_NAMES, heads_path, step_path,
                        step_topk(model), wrapper.shared_lm_head)
