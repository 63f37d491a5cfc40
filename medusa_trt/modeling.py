"""PyTorch reference model: a Llama-family decoder plus Medusa heads.

It reads the merged checkpoint's own weight names (the TensorRT-LLM layout: fused qkv, `mlp.fc` is
HF gate_proj, `mlp.gate` is HF up_proj) so every backend is checked against one model that loads the
exact bytes they build from. Everything a tree verify needs is explicit in `forward`: position ids
(tree nodes share positions by depth), a boolean attention mask over [past + new] keys (causal for a
prompt, the tree mask for a verify step), and the past key/values. The module holds no cache state,
which keeps it exportable to ONNX as one graph.

FP8 checkpoints (`quantization.quant_algo == "FP8"`, docs/formats.md section 2) run as fake quantization:
quantized Linears keep their float8_e4m3fn weights and dequantize them (q * scale, in float32) at
each call, and quantize-dequantize their input with the calibrated activation scale; with an FP8 KV
cache the new keys/values go through the same round trip before attention, so a token reads its own
K/V exactly as later steps read them from the cache. This is the arithmetic of the engines' explicit
QuantizeLinear/DequantizeLinear graphs, which makes engine-vs-reference parity tight.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from medusa_trt.checkpoint import (
    CONFIG_DTYPES,
    LM_HEAD,
    LN_F,
    VOCAB_EMBEDDING,
    dequantize_fp8,
    is_fp8_module,
    layer_prefix,
    medusa_linear_prefix,
    medusa_lm_head,
    quantize_fp8,
)

# Head logit of a token outside the draft vocabulary: far below any real logit (they stay within
# +-100), and small enough that statistics over whole logit tensors (medusa-check's comparator
# squares them) do not overflow float32.
OUTSIDE_DRAFT_LOGIT = -1e4


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"type": "llama3"|"linear", "factor", ...} or None
    norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    qkv_bias: bool = False
    num_medusa_heads: int = 0
    num_medusa_layers: int = 1
    sliding_window: int | None = None
    dtype: str = "float32"
    quantization: dict | None = None  # the checkpoint's block: quant_algo, kv_cache_quant_algo, exclude_modules
    # Token ids the heads draft from (their logits elsewhere are OUTSIDE_DRAFT_LOGIT): a vocabulary
    # subset set by head training makes a step's head logits cost V'/V of the full lm_head.
    draft_vocab: tuple[int, ...] | None = None

    def is_fp8(self, module: str) -> bool:
        """Whether the Linear named `module` (TensorRT-LLM name) holds FP8 weights and scales."""
        return is_fp8_module(module, {"quantization": self.quantization})

    @property
    def kv_cache_fp8(self) -> bool:
        return (self.quantization or {}).get("kv_cache_quant_algo") == "FP8"

    @classmethod
    def from_checkpoint_config(cls, cfg: dict) -> ModelConfig:
        """Reads the merged checkpoint's config.json (TensorRT-LLM key names)."""
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_size") or cfg["hidden_size"] // heads,
            rope_theta=float(cfg.get("rotary_base", 10000.0)),
            rope_scaling=cfg.get("rotary_scaling"),
            norm_eps=float(cfg.get("norm_epsilon", 1e-6)),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            qkv_bias=bool(cfg.get("attn_bias", cfg.get("model_type") == "qwen2")),
            num_medusa_heads=cfg.get("num_medusa_heads", 0),
            num_medusa_layers=cfg.get("num_medusa_layers", 1),
            sliding_window=cfg.get("sliding_window"),
            dtype=cfg.get("dtype", "float32"),
            quantization=cfg.get("quantization"),
            draft_vocab=tuple(cfg["medusa_trt"]["draft_vocab"]) if (cfg.get("medusa_trt") or {}).get("draft_vocab")
            else None,
        )


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], with llama3 or linear scaling applied."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("type") or scaling.get("rope_type") or "default"
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth blend between.
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_ctx / wavelen) - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        medium = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv_freq = torch.where(medium, blended, inv_freq)
    elif kind != "default":
        raise ValueError(f"rotary_scaling type {kind!r} is not supported; expected llama3, linear or none")
    return inv_freq.to(torch.float32)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, H, S, D]; cos/sin [B, 1, S, D]; GPT-NeoX style: rotate the two halves.
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, S, D], k/v [B, Hkv, P+S, D], mask [B, S, P+S] bool -> [B, Hq, S, D].

    Plain ops (repeat for GQA, masked softmax in float32) so the graph exports to ONNX as-is; a
    fully masked row (padding) gets a uniform distribution instead of NaN.
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask[:, None], torch.finfo(torch.float32).min)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v)


def attention_with_past(q, k, v, past_k, past_v, mask):
    """One layer's attention step: new queries over [past + new] keys. Engines swap it per layer
    (`DecoderLayer.attend`) to export another attention form with the same math."""
    return attention(q, torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2), mask)


def fake_quant_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Quantize to float8_e4m3fn and back (in float32), returned in x's dtype: what a value looks like
    after an FP8 GEMM input or an FP8 KV cache. `scale` broadcasts against x."""
    return dequantize_fp8(quantize_fp8(x, scale), scale, x.dtype)


class FP8Module(nn.Module):
    """Base of the modules holding float8 weights and float32 scales as buffers (named in `kept`).

    nn.Module.to(dtype) casts every floating-point tensor, float8 included, so `model.to(float16)`
    would silently turn an FP8 model into a float16 one and round its scales. Dtype casts skip the
    kept buffers; device moves still apply to them. `fake_quant` and `dequant` are plain attributes
    (like DecoderLayer.attend) so an exporter can swap them for explicit Q/DQ ops.
    """

    kept: tuple[str, ...] = ()

    def __init__(self) -> None:
        super().__init__()
        self.fake_quant = fake_quant_fp8
        self.dequant = dequantize_fp8

    def _apply(self, fn, recurse=True):
        saved = {n: self._buffers.pop(n) for n in self.kept if self._buffers.get(n) is not None}
        try:
            return super()._apply(fn, recurse)
        finally:
            device = fn(torch.empty(0)).device  # where fn sends tensors, whatever it does to dtypes
            self._buffers.update({n: t.to(device) for n, t in saved.items()})


class FP8Linear(FP8Module):
    """A TensorRT-LLM FP8 Linear emulated in the model dtype: y = dq(q(x)) @ dq(W)^T + b, per-tensor
    scales, weight stored as float8_e4m3fn. Loads the checkpoint's names (`weight`,
    `weights_scaling_factor`, `activation_scaling_factor`, `bias`)."""

    kept = ("weight", "weights_scaling_factor", "activation_scaling_factor")

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn))
        self.register_buffer("weights_scaling_factor", torch.ones(1))
        self.register_buffer("activation_scaling_factor", torch.ones(1))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fake_quant(x, self.activation_scaling_factor)
        w = self.dequant(self.weight, self.weights_scaling_factor, x.dtype)
        return F.linear(x, w, self.bias)


class FP8KVCache(FP8Module):
    """The round trip of keys/values through an FP8 KV cache with one per-layer scale."""

    kept = ("scale",)

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fake_quant(x, self.scale)


class FP8HeadLinears(FP8Module):
    """Every Medusa ResBlock linear of an FP8 checkpoint, stacked like MedusaModel.medusa_w: weight
    [H, L, d, d] float8_e4m3fn and per-tensor scales [H, L] (each head and layer has its own)."""

    kept = ("weight", "weights_scaling_factor", "activation_scaling_factor")

    def __init__(self, num_heads: int, num_layers: int, dim: int):
        super().__init__()
        self.register_buffer("weight", torch.zeros(num_heads, num_layers, dim, dim, dtype=torch.float8_e4m3fn))
        self.register_buffer("weights_scaling_factor", torch.ones(num_heads, num_layers))
        self.register_buffer("activation_scaling_factor", torch.ones(num_heads, num_layers))

    def layer(self, x: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [H, ..., d] -> (x quantized-dequantized per head, weights [H, d, d] in x's dtype)."""
        shape = (-1,) + (1,) * (x.dim() - 1)
        xq = self.fake_quant(x, self.activation_scaling_factor[:, layer].reshape(shape))
        w = self.dequant(self.weight[:, layer], self.weights_scaling_factor[:, layer].reshape(-1, 1, 1), x.dtype)
        return xq, w


# -- Medusa heads ------------------------------------------------------------------------------
# A head is L ResBlocks (x <- x + silu(W x + b)) and an lm_head; head k reads the final normed hidden
# state at t and predicts token t+2+k. The ResBlock math is here once: the reference model, the ONNX
# export, head training and FP8 calibration all run `resblocks`, each with the linear form it needs
# (all heads stacked in one batched matmul here and in training, 2-D matrices per head in the
# export, whose constant 2-D weights ONNX Runtime prepacks).

HeadLinear = Callable[[torch.Tensor, int], torch.Tensor]  # (x, layer) -> W_layer x + b_layer


def resblocks(x: torch.Tensor, linear: HeadLinear, layers: Iterable[int]) -> torch.Tensor:
    """x after the Medusa ResBlocks `layers` (in order): x <- x + silu(linear(x, layer)).

    `linear(x, layer)` is the layer's W x + b in whatever layout the caller holds x in: every head
    at once (`stacked_linear`, x [H, ..., d]) or one head's 2-D weights (x [..., d])."""
    for layer in layers:
        x = x + F.silu(linear(x, layer))
    return x


def stacked_linear(w: torch.Tensor | None, b: torch.Tensor, fp8: FP8HeadLinears | None = None) -> HeadLinear:
    """The ResBlock linear of every head as one batched matmul: x [H, ..., d] -> W_h x_h + b_h, from
    weights w [H, L, d, d] (out, in) and biases b [H, L, d], or from FP8 weights (`fp8`, w None),
    whose inputs are quantized-dequantized first as an FP8 GEMM's are."""

    def linear(x: torch.Tensor, layer: int) -> torch.Tensor:
        xin, wl = (x, w[:, layer]) if fp8 is None else fp8.layer(x, layer)  # wl [H, d, d]
        bias = b[:, layer].reshape(b.shape[0], *(1,) * (x.dim() - 2), b.shape[-1])  # [H, 1.., d]
        return torch.einsum("h...i,hoi->h...o", xin, wl) + bias

    return linear


# -- int4 weight-only quantization (medusa-build --weights int4) ---------------------------------
# The numbers of ONNX Runtime's com.microsoft MatMulNBits (bits=4): W [N, K] is cut along K into
# blocks of `block_size`; each block has a float32 scale and a 4-bit zero point (asymmetric, the
# block's [min(w, 0), max(w, 0)] mapped onto 0..15) and dequantizes as (q - zero_point) * scale.
# That grid passes through zero, so it cannot hold a block whose values sit on a grid that does not
# (a GGUF's Q4_1 block: d * q + m): `offsets` instead maps [min(w), max(w)] onto 0..15 and keeps
# the block's offset as a float, w = scale * (q - 8) + offset, run as MatMulNBits without zero points
# plus blocksum(x) @ offsets^T (exact for Q4_1 blocks; 1.15-1.23x a step, BENCHMARKS.md, issue 13 (p)).
# The lm_head may be 8-bit instead (symmetric, w = scale * (q - 128): exact for a GGUF's Q8_0).
# The engine holds the packed bytes; the reference dequantizes the same bytes, so both multiply by
# the same float32 weights.

INT4_BLOCK_SIZES = (16, 32, 64, 128, 256)  # MatMulNBits: a power of two >= 16
INT4_ACCURACY_LEVELS = (0, 4)  # MatMulNBits: 0 float compute, 4 int8 activations (per block)
LM_HEAD_BITS = (4, 8)


def quantize_int4(w: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [N, K] (K divisible by block_size) -> packed [N, K/bs, bs/2] uint8 (element 2j in the low
    nibble, 2j+1 in the high one), scales [N, K/bs] float32, zero points [N, ceil(K/bs / 2)] uint8
    (two 4-bit values per byte, block 2j low): MatMulNBits' B, scales and zero_points."""
    n, k = w.shape
    blocks = w.detach().to(torch.float32).reshape(n, k // block_size, block_size)
    lo = blocks.amin(-1).clamp(max=0.0)
    hi = blocks.amax(-1).clamp(min=0.0)
    scale = (hi - lo) / 15.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block: any scale is exact
    zp = torch.round(-lo / scale).clamp(0, 15)
    q = torch.round(blocks / scale[..., None] + zp[..., None]).clamp(0, 15).to(torch.uint8)
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    z = F.pad(zp, (0, zp.shape[1] % 2)).to(torch.uint8)
    return packed.contiguous(), scale.contiguous(), (z[:, 0::2] | (z[:, 1::2] << 4)).contiguous()


def quantize_int4_offsets(w: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [N, K] -> packed (as quantize_int4), scales [N, K/bs] and offsets [N, K/bs] float32: each
    block's [min, max] onto 0..15, dequantizing as scale * (q - 8) + offset. A block whose values are
    d * q + m with both end codes used (every Q4_1 block of a GGUF) comes back to float32 rounding."""
    n, k = w.shape
    blocks = w.detach().to(torch.float32).reshape(n, k // block_size, block_size)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    scale = (hi - lo) / 15.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant block: q = 0, offset exact
    q = torch.round((blocks - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous(), scale.contiguous(), (lo + 8.0 * scale).contiguous()


def quantize_int8(w: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> packed [N, K/bs, bs] uint8 (q + 128) and scales [N, K/bs] float32, symmetric
    (scale = max|w| / 127): MatMulNBits bits=8 without zero points. Exact for a GGUF's Q8_0 blocks."""
    n, k = w.shape
    blocks = w.detach().to(torch.float32).reshape(n, k // block_size, block_size)
    scale = blocks.abs().amax(-1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(blocks / scale[..., None]).clamp(-128, 127) + 128
    return q.to(torch.uint8).contiguous(), scale.contiguous()


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None) -> torch.Tensor:
    """The float32 W [N, K] that quantize_int4's output stands for: (q - zero_point) * scale; without
    zero points (quantize_int4_offsets), MatMulNBits' implicit 8."""
    n, blocks, half = packed.shape
    q = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(n, blocks, 2 * half).to(torch.float32)
    if zero_points is None:
        return ((q - 8.0) * scales[..., None]).reshape(n, blocks * 2 * half)
    zp = torch.stack([zero_points & 0x0F, zero_points >> 4], dim=-1).reshape(n, -1)[:, :blocks].to(torch.float32)
    return ((q - zp[..., None]) * scales[..., None]).reshape(n, blocks * 2 * half)


def dequantize_int8(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 W [N, K] of quantize_int8's output: (q - 128) * scale."""
    n, blocks, bs = packed.shape
    return ((packed.to(torch.float32) - 128.0) * scales[..., None]).reshape(n, blocks * bs)


def block_sums(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """x [..., K] -> [..., K / block_size]: the sum of each block, what per-block offsets multiply."""
    return x.reshape(*x.shape[:-1], -1, block_size).sum(-1)


def fake_quant_int8_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """x [..., K] quantized to int8 and back per block of K (symmetric, scale = amax / 127): what
    MatMulNBits with accuracy_level 4 multiplies instead of x (measured on ONNX Runtime 1.31's CPU
    kernel: outputs match this to 2e-6, against 2e-2 without it)."""
    xb = x.float().reshape(*x.shape[:-1], -1, block_size)
    scale = xb.abs().amax(-1, keepdim=True) / 127.0
    q = torch.round(xb / torch.where(scale > 0, scale, torch.ones_like(scale)))
    return (q * scale).reshape(x.shape).to(x.dtype)


def nbits_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None,
                 accuracy_level: int, bits: int) -> torch.Tensor:
    """MatMulNBits' arithmetic: x [..., K] @ dequantized W^T, activations per-block int8 at level 4."""
    if accuracy_level == 4:
        x = fake_quant_int8_blocks(x, packed.shape[2] * 8 // bits)
    w = dequantize_int4(packed, scales, zero_points) if bits == 4 else dequantize_int8(packed, scales)
    return F.linear(x, w.to(x.dtype))


class Int4Linear(nn.Module):
    """A Linear whose weight is int4 blocks (quantize_int4, or quantize_int4_offsets with `offsets`)
    or, with bits=8, int8 blocks (quantize_int8), run as MatMulNBits runs it (nbits_matmul), plus the
    offsets' blocksum(x) @ offsets^T. `matmul` is a plain attribute so the exporter can swap in the
    MatMulNBits op."""

    def __init__(self, linear: nn.Linear, block_size: int, accuracy_level: int, offsets: bool = False,
                 bits: int = 4):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.block_size, self.accuracy_level, self.bits = block_size, accuracy_level, bits
        self.register_buffer("zero_points", None)  # the schemes without them: MatMulNBits' implicit one
        self.register_buffer("offsets", None)
        if bits == 8:
            self.kept: tuple[str, ...] = ("packed", "scales")
            tensors = quantize_int8(linear.weight, block_size)
        elif offsets:
            self.kept = ("packed", "scales", "offsets")
            tensors = quantize_int4_offsets(linear.weight, block_size)
        else:
            self.kept = ("packed", "scales", "zero_points")
            tensors = quantize_int4(linear.weight, block_size)
        for name, t in zip(self.kept, tensors, strict=True):
            self.register_buffer(name, t)
        self.bias = linear.bias
        self.matmul = nbits_matmul

    def _apply(self, fn, recurse=True):  # dtype casts leave the packed bytes and float32 scales alone
        saved = {n: self._buffers.pop(n) for n in self.kept}
        try:
            return super()._apply(fn, recurse)
        finally:
            device = fn(torch.empty(0)).device
            self._buffers.update({n: t.to(device) for n, t in saved.items()})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.packed, self.scales, self.zero_points, self.accuracy_level, self.bits)
        if self.offsets is not None:  # in x's own precision: ReduceSum and a float MatMul in the graph
            y = y + F.linear(block_sums(x, self.block_size), self.offsets.to(x.dtype))
        return y if self.bias is None else y + self.bias


def quantize_model_int4(model: MedusaModel, block_size: int, accuracy_level: int, lm_head: bool = True,
                        draft: bool = False, offsets: bool = False, lm_head_bits: int = 4) -> list[str]:
    """Replaces the decoder's Linears (and the lm_head with `lm_head`) by Int4Linear in place: what
    medusa-build --weights int4 exports and what medusa-check runs as the reference. Deterministic,
    so both get the same bytes. Medusa heads that use the base lm_head (v2) then use the int4 one.
    `draft`: the heads' draft-vocabulary matrices too (`draft_int4`, one Int4Linear per head), when
    the heads have a draft vocabulary. `offsets`: per-block float offsets (quantize_int4_offsets)
    instead of zero points; `lm_head_bits` 8: the lm_head as int8 blocks. Returns the names of the
    Linears left in the model dtype because their input size is not a multiple of block_size (the
    caller warns)."""
    if block_size not in INT4_BLOCK_SIZES:
        raise ValueError(f"int4 block size {block_size}: expected one of {INT4_BLOCK_SIZES}")
    if accuracy_level not in INT4_ACCURACY_LEVELS:
        raise ValueError(f"int4 accuracy level {accuracy_level}: expected one of {INT4_ACCURACY_LEVELS}")
    if lm_head_bits not in LM_HEAD_BITS:
        raise ValueError(f"lm_head bits {lm_head_bits}: expected one of {LM_HEAD_BITS}")
    names = [f"layers.{i}.{n}" for i in range(len(model.layers)) for n in ("qkv", "dense", "fc", "gate", "proj")]
    if lm_head:
        h = model.cfg.num_medusa_heads
        model.heads_use_lm_head = bool(h) and all(
            torch.equal(model.medusa_lm_head[k], model.lm_head.weight) for k in range(h))
        names.append("lm_head")
    skipped = []
    for name in names:
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        linear = getattr(owner, attr)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"{name}: {type(linear).__name__} cannot be int4-quantized (FP8 checkpoints stay FP8)")
        if linear.in_features % block_size:
            skipped.append(name)
            continue
        bits = lm_head_bits if name == "lm_head" else 4
        setattr(owner, attr, Int4Linear(linear, block_size, accuracy_level, offsets, bits))
    if draft and model.cfg.draft_vocab and model.cfg.num_medusa_heads:
        # The draft matrix is the heads' largest float32 read per step ([V', d] a head; issue 13).
        if model.cfg.hidden_size % block_size:
            skipped.append("draft_lm_head")
        else:
            heads = []
            for w in model.draft_lm_head:  # [H, V', d]
                linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
                linear.weight.data = w.float()
                heads.append(Int4Linear(linear, block_size, accuracy_level, offsets))
            model.draft_int4 = nn.ModuleList(heads)
    return skipped


def _linear(cfg: ModelConfig, name: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
    if cfg.is_fp8(name):
        return FP8Linear(in_features, out_features, bias)
    return nn.Linear(in_features, out_features, bias=bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.cfg = cfg
        qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        d, inter, p = cfg.hidden_size, cfg.intermediate_size, layer_prefix(index)
        self.input_layernorm = RMSNorm(d, cfg.norm_eps)
        self.qkv = _linear(cfg, f"{p}.attention.qkv", d, qkv_out, cfg.qkv_bias)
        self.dense = _linear(cfg, f"{p}.attention.dense", cfg.num_heads * cfg.head_dim, d, False)
        self.post_layernorm = RMSNorm(d, cfg.norm_eps)
        self.fc = _linear(cfg, f"{p}.mlp.fc", d, inter, False)  # HF gate_proj
        self.gate = _linear(cfg, f"{p}.mlp.gate", d, inter, False)  # HF up_proj
        self.proj = _linear(cfg, f"{p}.mlp.proj", inter, d, False)  # HF down_proj
        self.kv_cache = FP8KVCache() if cfg.kv_cache_fp8 else None
        self.attend = attention_with_past  # plain attribute, not a module: the ONNX exporter swaps it

    def forward(self, x, cos, sin, mask, past_k, past_v):
        cfg = self.cfg
        b, s, _ = x.shape
        qkv = self.qkv(self.input_layernorm(x))
        # One view and transpose for all heads, then split: in an exported graph that is 2 ops where
        # splitting first costs 6 (a per-op dispatch matters at one new token; issue 13).
        heads = qkv.view(b, s, cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        q, k, v = heads.split([cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads], 1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.kv_cache is not None:  # the cache holds what FP8 can represent, the new tokens included
            k, v = self.kv_cache(k), self.kv_cache(v)
        out = self.attend(q, k, v, past_k, past_v, mask)
        x = x + self.dense(out.transpose(1, 2).reshape(b, s, -1))
        h = self.post_layernorm(x)
        x = x + self.proj(F.silu(self.fc(h)) * self.gate(h))
        return x, k, v


class MedusaModel(nn.Module):
    """Base decoder + Medusa heads. See `forward` for the contract every backend reproduces."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d, n_heads, n_layers = cfg.hidden_size, cfg.num_medusa_heads, cfg.num_medusa_layers
        self.vocab_embedding = nn.Embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.ln_f = RMSNorm(d, cfg.norm_eps)
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        # Heads stacked so all of them run as one batched matmul per ResBlock layer.
        self.medusa_w = nn.Parameter(torch.zeros(n_heads, n_layers, d, d))  # [H, L, out, in]
        self.medusa_fp8: FP8HeadLinears | None = None
        if n_heads and _fp8_heads(cfg):  # the weights live there instead, as float8 + scales
            self.register_parameter("medusa_w", None)
            self.medusa_fp8 = FP8HeadLinears(n_heads, n_layers, d)
        self.medusa_b = nn.Parameter(torch.zeros(n_heads, n_layers, d))
        self.medusa_lm_head = nn.Parameter(torch.zeros(n_heads, cfg.vocab_size, d))
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.draft_int4: nn.ModuleList | None = None  # int4 draft-vocabulary matrices (quantize_model_int4)

    heads_use_lm_head = False  # v2 heads through an int4 lm_head (quantize_model_int4)

    @property
    def dtype(self) -> torch.dtype:
        return self.vocab_embedding.weight.dtype

    def medusa_heads(self, h: torch.Tensor) -> torch.Tensor:
        """h [B, S, d] final normed hidden state -> [H, B, S, V] float32 logits (head k predicts t+2+k)."""
        x = h.unsqueeze(0).expand(self.cfg.num_medusa_heads, *h.shape)  # [H, B, S, d]
        linear = stacked_linear(self.medusa_w, self.medusa_b, self.medusa_fp8)
        x = resblocks(x, linear, range(self.cfg.num_medusa_layers))
        if self.draft_int4 is not None:
            return self.draft_logits(torch.stack([m(x[h]) for h, m in enumerate(self.draft_int4)]).float())
        if self.cfg.draft_vocab:
            return self.draft_logits(torch.einsum("hbsi,hvi->hbsv", x, self.draft_lm_head).float())
        if self.heads_use_lm_head:
            return self.lm_head(x).float()
        return torch.einsum("hbsi,hvi->hbsv", x, self.medusa_lm_head).float()

    def draft_logits(self, sub: torch.Tensor) -> torch.Tensor:
        """Head logits over the draft vocabulary [..., V'] -> [..., V], OUTSIDE_DRAFT_LOGIT elsewhere
        (top-k then never picks a token outside it)."""
        out = torch.full((*sub.shape[:-1], self.cfg.vocab_size), OUTSIDE_DRAFT_LOGIT, dtype=sub.dtype,
                         device=sub.device)
        return out.scatter(-1, self.draft_ids.expand(*sub.shape[:-1], -1), sub)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        past_keys: torch.Tensor,
        past_values: torch.Tensor,
        logit_positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`forward_hidden` with the Medusa heads applied: logits [B, K, V] f32, medusa_logits
        [H, B, K, V] f32, present keys/values of the new tokens [L, B, Hkv, S, D]."""
        logits, h, new_k, new_v = self.forward_hidden(
            input_ids, position_ids, attention_mask, past_keys, past_values, logit_positions
        )
        return logits, self.medusa_heads(h), new_k, new_v

    def forward_hidden(
        self,
        input_ids: torch.Tensor,  # [B, S] int64
        position_ids: torch.Tensor,  # [B, S] int64, absolute positions (tree nodes: prefix length + depth)
        attention_mask: torch.Tensor,  # [B, S, P+S] bool, True = may attend
        past_keys: torch.Tensor,  # [L, B, Hkv, P, D]
        past_values: torch.Tensor,  # [L, B, Hkv, P, D]
        logit_positions: torch.Tensor | None = None,  # [B, K] int64: rows of S to produce logits for
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns logits [B, K, V] f32, the final normed hidden state [B, K, d] at the same rows (what
        the Medusa heads read), and the NEW tokens' present keys/values [L, B, Hkv, S, D] (the caller
        owns the cache and decides where they go). K = S when `logit_positions` is None; prompts
        pass their last position to skip the [S, V] products nobody reads. The heads are separate
        (`medusa_heads`) because a decoding step needs them at one row only: the last accepted
        tree node, known after verification."""
        x = self.vocab_embedding(input_ids)
        freqs = position_ids[..., None].float() * self.inv_freq  # [B, S, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, S, D]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            x, k, v = layer(x, cos, sin, attention_mask, past_keys[i], past_values[i])
            new_k.append(k)
            new_v.append(v)
        h = self.ln_f(x)
        if logit_positions is not None:
            h = torch.gather(h, 1, logit_positions[..., None].expand(-1, -1, h.shape[-1]))
        logits = self.lm_head(h).float()
        # cat + view rather than stack: one Concat in an exported graph instead of an Unsqueeze per layer.
        shape = (len(new_k), *new_k[0].shape)
        return logits, h, torch.cat(new_k).view(shape), torch.cat(new_v).view(shape)

    def empty_cache(self, batch: int, length: int = 0, device: torch.device | str | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, length, cfg.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=device), torch.zeros(shape, dtype=self.dtype, device=device)

    # -- loading -------------------------------------------------------------------------------

    @classmethod
    def from_weights(cls, config: dict, weights: dict[str, torch.Tensor], dtype: str | None = None) -> MedusaModel:
        """Builds the model from a merged checkpoint's config and full (unsharded) weights."""
        cfg = ModelConfig.from_checkpoint_config(config)
        torch_dtype = CONFIG_DTYPES[dtype or cfg.dtype]
        with torch.device("meta"):
            model = cls(cfg)
        model.load_state_dict(_to_module_names(cfg, weights), assign=True, strict=True)
        model.inv_freq = rope_inv_freq(cfg)
        if cfg.draft_vocab:
            ids = torch.tensor(cfg.draft_vocab, dtype=torch.long)
            model.register_buffer("draft_ids", ids, persistent=False)
            model.register_buffer("draft_lm_head", model.medusa_lm_head.detach()[:, ids].clone(), persistent=False)
        return model.to(torch_dtype).eval()

    @classmethod
    def from_checkpoint(cls, path: str | Path, dtype: str | None = None) -> MedusaModel:
        """`dtype` overrides the compute dtype; FP8 weights and their float32 scales stay as stored."""
        from medusa_trt.checkpoint import load_checkpoint

        config, weights = load_checkpoint(path)
        return cls.from_weights(config, weights, dtype)


def _fp8_heads(cfg: ModelConfig) -> bool:
    """Whether the Medusa linears are FP8: all of them or none (one stacked tensor holds them)."""
    names = [medusa_linear_prefix(h, j) for h in range(cfg.num_medusa_heads) for j in range(cfg.num_medusa_layers)]
    flags = {cfg.is_fp8(n) for n in names}
    if len(flags) > 1:
        raise ValueError(f"quantization.exclude_modules {(cfg.quantization or {}).get('exclude_modules')} "
                         "quantizes some Medusa linears but not others; expected all or none")
    return flags == {True}


_LINEAR_SUFFIXES = ("weight", "bias", "weights_scaling_factor", "activation_scaling_factor")


def _to_module_names(cfg: ModelConfig, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """TensorRT-LLM checkpoint names -> this module's parameter names (lm_heads unpadded)."""
    v = cfg.vocab_size
    out = {
        "vocab_embedding.weight": w[VOCAB_EMBEDDING],
        "ln_f.weight": w[LN_F],
        "lm_head.weight": w[LM_HEAD][:v],
    }
    for i in range(cfg.num_layers):
        src, dst = f"{layer_prefix(i)}.", f"layers.{i}."
        names = {"input_layernorm.weight": "input_layernorm.weight", "post_layernorm.weight": "post_layernorm.weight"}
        linears = {"attention.qkv": "qkv", "attention.dense": "dense", "mlp.fc": "fc", "mlp.gate": "gate",
                   "mlp.proj": "proj"}
        for a, b in linears.items():
            fp8 = cfg.is_fp8(src + a)
            for suffix in _LINEAR_SUFFIXES:
                if suffix == "weight" or (suffix == "bias" and a == "attention.qkv" and cfg.qkv_bias) or (
                        fp8 and suffix.endswith("scaling_factor")):
                    names[f"{a}.{suffix}"] = f"{b}.{suffix}"
        if cfg.kv_cache_fp8:
            names["attention.kv_cache_scaling_factor"] = "kv_cache.scale"
        out.update({dst + b: w[src + a] for a, b in names.items()})
    H, L = cfg.num_medusa_heads, cfg.num_medusa_layers
    if H:
        def stacked(param: str) -> torch.Tensor:  # [H, L, ...]
            return torch.stack([torch.stack([w[f"{medusa_linear_prefix(h, j)}.{param}"] for j in range(L)])
                                for h in range(H)])

        if _fp8_heads(cfg):
            out["medusa_fp8.weight"] = stacked("weight")
            for scale in ("weights_scaling_factor", "activation_scaling_factor"):
                out[f"medusa_fp8.{scale}"] = stacked(scale).reshape(H, L)
        else:
            out["medusa_w"] = stacked("weight")
        out["medusa_b"] = stacked("bias")
        out["medusa_lm_head"] = torch.stack(
            [w.get(medusa_lm_head(h), w[LM_HEAD])[:v] for h in range(H)]
        )
    else:
        d = cfg.hidden_size
        out.update(medusa_w=torch.zeros(0, L, d, d), medusa_b=torch.zeros(0, L, d), medusa_lm_head=torch.zeros(0, v, d))
    return out
