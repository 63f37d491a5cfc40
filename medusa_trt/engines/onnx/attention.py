"""The attention forms an exported decoder graph can use, the default one, and what a form means for the engine.

Each form is one way to write a layer's attention in ONNX (ATTENTION_FORMS, dispatched once by
export.export_onnx, which swaps the form in for DecoderLayer.attend while tracing). A form has the
signature of modeling.attention_with_past: q [B, Hq, S, D], k/v [B, Hkv, S, D], past_k/past_v
[B, Hkv, T, D], mask [B, S, T+S] bool -> [B, Hq, S, D] (the placed forms take a PlacedMask).

Float engines use the fused ONNX Attention op; int4 engines need forms whose rows do not depend on
the step's other rows (row_exact_attention says why). What a form implies for the rest of the
engine (tree steps kept inside a key block, chain trees only, new keys written into the cache) is
derived in one place, engine_attention, which the builder records in engine.json.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from medusa_trt.modeling import attention_with_past

MIN_OPSET = 18  # the dynamo exporter's floor

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
    logits of the two paths differ enough that greedy tokens part at near-ties. In float64 the
    differences stay at float64's rounding, far below float32's rounding step, so the rounded output
    is the same bits whatever the row count or tree (docs/benchmarks/issue-13-int4.md: int4 row
    invariance).

    The scores stay in the model dtype: each is one dot product over head_dim, which ONNX Runtime's
    MatMul accumulates in the same order whatever the row and key counts (tests/engines/onnx/
    test_attention.py: test_float32_scores_are_row_invariant_in_onnx_runtime;
    test_int4_rows_are_bitwise_row_invariant checks a whole engine). That spares casting the keys, half of the cache prefix, to float64 in
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
      StepTree.within_block). tests/engines/onnx/test_attention.py checks the kernels' premise and whole engines."""
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
    tests/engines/onnx/test_attention.py checks the kernel's premise and whole engines bitwise."""
    b, hq, s, d = q.shape
    keys, values = _place(k, v, past_k, past_v, mask.slots)
    hkv = past_k.shape[1]
    g = hq // hkv
    visible = mask.mask[:, None].repeat(1, 1, g, 1)
    return grouped_attention_op()(q.reshape(b, hkv, g * s, d), keys, values, visible).reshape(q.shape)


@functools.cache
def grouped_attention_op() -> Callable:
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


def grouped_attention_translation(q, keys, values, visible):
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
    # The custom op `translation` replaces, registered on first call (forms with a translation).
    custom_op: Callable[[], Callable] | None = None


# ONNX Runtime's float32 MatMul (MLAS SGEMM) sums the reduced axis in blocks of 128, widened for
# narrow outputs (256 at head_dim 64, 512 at 32; measured with 1 and 2 threads). 128 divides them all.
KEY_BLOCK = 128

# In the order medusa-build --attention lists them (its choices are this table's keys).
ATTENTION_FORMS: dict[str, AttentionForm] = {
    "attention23": AttentionForm(fused_attention, _attention23_translation, 23,
                                 "standard ONNX Attention (opset 23) with past_key/past_value inputs",
                                 custom_op=_fused_attention_op),
    "split": AttentionForm(split_attention, None, MIN_OPSET, "plain ops, past never copied, GQA by query grouping"),
    "concat": AttentionForm(attention_with_past, None, MIN_OPSET,
                            "plain ops as the reference: concat past+new, repeat KV heads, masked softmax"),
    "mha": AttentionForm(fused_attention, _mha_translation, MIN_OPSET,
                         "ONNX Runtime com.microsoft MultiHeadAttention, KV heads repeated",
                         custom_op=_fused_attention_op),
    "row_exact": AttentionForm(row_exact_attention, None, MIN_OPSET,
                               "plain ops in float64: a row's output does not depend on the step's other rows"),
    "row_exact_f32": AttentionForm(row_exact_f32_attention, None, MIN_OPSET,
                                   "float32 with a float64 softmax sum: row_exact's guarantee within key blocks",
                                   KEY_BLOCK, places_new_keys=True),
    "chain_f32": AttentionForm(chain_f32_attention, grouped_attention_translation, 23,
                               "row_exact_f32's layout in one ONNX Attention op: exact for plain steps and chain trees",
                               places_new_keys=True, chains_only=True, custom_op=grouped_attention_op),
}
# Measured fastest on a 2-core CPU for decode and tree steps at 10M and 100M parameters
# (benchmarks/bench_onnx.py --sweep-attention); "split" is the fallback below opset 23.
DEFAULT_ATTENTION = "attention23"


def default_attention(opset: int, weights: dict) -> str:
    """The fastest exact attention form for an engine's weights (engine.json "weights"): int4
    weights with int8 activations (accuracy level 4) turn float32 rounding noise into different
    logits, so their tree rows and one-row steps must agree bit for bit. "chain_f32" does for plain
    steps and chain trees, the trees that pay on a CPU (every tuned int4 tree so far is one), and is
    faster a step than "row_exact_f32", which keeps branching trees exact too, and than "row_exact",
    in float64 (docs/benchmarks/issue-13-int4.md). int8 engines round every Linear's input rows to
    int8 too, so the same holds for them. Float engines keep the fused Attention op ("split" below
    opset 23)."""
    if (weights.get("format") == "int4" and weights.get("accuracy_level") == 4) or weights.get("format") == "int8":
        return "chain_f32"
    return DEFAULT_ATTENTION if opset >= 23 else "split"


@dataclass(frozen=True)
class EngineAttention:
    """What an engine's attention form means for the rest of the engine: the engine.json onnx keys
    the runtime reads, and whether the builder rewrites the graphs to write the cache in place."""

    form: str
    # Tree steps stay inside one block of this many keys (engine.json onnx.key_block): None when
    # any tree is exact.
    key_block: int | None
    # Only chain trees are exact: the runtime verifies a tree's main chain (engine.json
    # onnx.chains_only; tree.main_chain).
    chains_only: bool
    # The graph writes each new token's K/V at its own sequence's length (PlacedMask).
    places_new_keys: bool
    # The decoder and step graphs write new K/V into the cache buffers the runtime binds
    # (ort/fusions.py: write_cache_in_place; engine.json onnx.cache_in_place).
    cache_in_place: bool


def engine_attention(form: str, device: str = "cpu", cache_in_place: bool = True) -> EngineAttention:
    """The consequences of attention form `form` for an engine on `device`: the cache is written
    in place when the form places each new token at its own sequence's length, on the CPU (the
    runtime binds the cache buffers there), unless `cache_in_place` (medusa-build
    --no-cache-in-place) turns it off."""
    spec = ATTENTION_FORMS[form]
    return EngineAttention(form, spec.key_block, spec.chains_only, spec.places_new_keys,
                           spec.places_new_keys and device == "cpu" and cache_in_place)
