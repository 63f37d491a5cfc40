"""Weight quantization of the reference model for the engines' weight schemes (int4, int8), as
modules swapped into a MedusaModel. An FP8 checkpoint's numerics are medusa_trt/fp8.py's.

modeling.py is the float model and knows none of this (gpt-fast's model.py / quantize.py split):
the functions here rewrite a model in place, and each quantized module computes what an engine's
quantized op computes, so engine-vs-reference parity stays tight.

int4 (medusa-build --weights int4, `quantize_model_int4`) runs ONNX Runtime's MatMulNBits
arithmetic on the same packed bytes the engine holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

# -- int4 weight-only quantization (medusa-build --weights int4) ---------------------------------
# The numbers of ONNX Runtime's com.microsoft MatMulNBits (bits=4): W [N, K] is cut along K into
# blocks of `block_size`; each block has a float32 scale and a 4-bit zero point (asymmetric, the
# block's [min(w, 0), max(w, 0)] mapped onto 0..15) and dequantizes as (q - zero_point) * scale.
# That grid passes through zero, so it cannot hold a block whose values sit on a grid that does not
# (a GGUF's Q4_1 block: d * q + m): `offsets` instead maps [min(w), max(w)] onto 0..15 and keeps
# the block's offset as a float, w = scale * (q - 8) + offset, run as MatMulNBits without zero points
# plus blocksum(x) @ offsets^T (exact for Q4_1 blocks, for some cost a step: docs/benchmarks/issue-13-int4.md,
# (p)).
# The lm_head may be 8-bit instead (symmetric, w = scale * (q - 128): exact for a GGUF's Q8_0).
# The engine holds the packed bytes; the reference dequantizes the same bytes, so both multiply by
# the same float32 weights.

INT4_BLOCK_SIZES = (16, 32, 64, 128, 256)  # MatMulNBits: a power of two >= 16
INT4_ACCURACY_LEVELS = (0, 4)  # MatMulNBits: 0 float compute, 4 int8 activations (per block)
LM_HEAD_BITS = (4, 8)


def quantize_int4(w: torch.Tensor, block_size: int, importance: torch.Tensor | None = None,
                  rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [N, K] (K divisible by block_size) -> packed [N, K/bs, bs/2] uint8 (element 2j in the low
    nibble, 2j+1 in the high one), scales [N, K/bs] float32, zero points [N, ceil(K/bs / 2)] uint8
    (two 4-bit values per byte, block 2j low): MatMulNBits' B, scales and zero_points.
    `importance` [K] (the mean square of each input channel, calibrate_input_power): each block's
    grid is searched for the least importance-weighted squared error (_search_int4_grid) instead of
    rounding onto the block's own range; `rows` [N] bool: only those output rows are searched
    (choose_searched_rows), the others keep the nearest grid."""
    n, k = w.shape
    blocks = w.detach().to(torch.float32).reshape(n, k // block_size, block_size)
    q, scale, zp = _nearest_int4_grid(blocks)
    if importance is not None:
        idx = torch.arange(n) if rows is None else rows.nonzero().flatten()
        weight = importance.detach().to(torch.float32).reshape(1, k // block_size, block_size)
        # Rows in chunks: the search holds a few copies of the blocks at once.
        parts = [_search_int4_grid(blocks[i], weight.expand(len(i), -1, -1)) for i in idx.split(INT4_SEARCH_ROWS)]
        if parts:
            q[idx], scale[idx], zp[idx] = (torch.cat(t) for t in zip(*parts, strict=True))
    q = q.to(torch.uint8)
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    z = F.pad(zp, (0, zp.shape[1] % 2)).to(torch.uint8)
    return packed.contiguous(), scale.contiguous(), (z[:, 0::2] | (z[:, 1::2] << 4)).contiguous()


def _range_over_15(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """(hi - lo) / 15, the scale of a block's range on 16 codes. Rounded as written: a Q4_1 block of
    a GGUF (d * q + m, both end codes used) gives back d to float32 rounding. A range past float32's
    maximum (inf as written) is divided before it is subtracted instead."""
    scale = (hi - lo) / 15.0
    return torch.where(torch.isfinite(scale), scale, hi / 15.0 - lo / 15.0)


def _nearest_int4_grid(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes, scales and zero points of each block's [min(w, 0), max(w, 0)] mapped onto 0..15."""
    lo = blocks.amin(-1).clamp(max=0.0)
    hi = blocks.amax(-1).clamp(min=0.0)
    scale = _range_over_15(lo, hi)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block: any scale is exact
    zp = torch.round(-lo / scale).clamp(0, 15)
    return torch.round(blocks / scale[..., None] + zp[..., None]).clamp(0, 15), scale, zp


# The calibrated int4 grid search: candidate scales are these multiples of the nearest grid's, each
# with its zero point and the two beside it; the winner's scale is then refitted by least squares.
# On SmolLM2 this took top-1 agreement with float32 from 0.684 to 0.776 and KL from 0.452 to 0.193
# (docs/benchmarks/issue-35-amphista.md, section ad). Rows per chunk bound the search's memory.
INT4_SEARCH_FACTORS = tuple(0.8 + 0.02 * i for i in range(16))
INT4_SEARCH_ROWS = 4096


def _search_int4_grid(blocks: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes, scales and zero points of blocks [n, b, bs] that minimize sum(weight * (w - w')^2) per
    block over INT4_SEARCH_FACTORS x (zero point -1, 0, +1), each candidate's scale refitted once by
    least squares for its codes (the codes then re-rounded to it), starting from the nearest grid, so
    no block's weighted error exceeds the nearest grid's. Deterministic: ties keep the earlier."""
    best_q, base, best_z = _nearest_int4_grid(blocks)  # the search starts from it: never worse
    best_s = base
    best_err = (weight * (blocks - (best_q - best_z[..., None]) * base[..., None]) ** 2).sum(-1)
    lo = blocks.amin(-1).clamp(max=0.0)
    for f in INT4_SEARCH_FACTORS:
        s = base * f
        z_mid = torch.round(-lo / s)
        for dz in (-1.0, 0.0, 1.0):
            z = (z_mid + dz).clamp(0, 15)
            q = torch.round(blocks / s[..., None] + z[..., None]).clamp(0, 15)
            c = q - z[..., None]
            fit = (weight * blocks * c).sum(-1) / (weight * c * c).sum(-1).clamp(min=1e-30)
            s2 = torch.where(fit > 0, fit, s)
            q = torch.round(blocks / s2[..., None] + z[..., None]).clamp(0, 15)
            err = (weight * (blocks - (q - z[..., None]) * s2[..., None]) ** 2).sum(-1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_q = torch.where(better[..., None], q, best_q)
            best_s, best_z = torch.where(better, s2, best_s), torch.where(better, z, best_z)
    return best_q, best_s, best_z


def quantize_int4_offsets(w: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [N, K] -> packed (as quantize_int4), scales [N, K/bs] and offsets [N, K/bs] float32: each
    block's [min, max] onto 0..15, dequantizing as scale * (q - 8) + offset. A block whose values are
    d * q + m with both end codes used (every Q4_1 block of a GGUF) comes back to float32 rounding.
    A constant block is code 8 (its int4 part is zero) and its value the offset: with code 0 and offset
    lo + 8, the int4 part's -8 * blocksum(x) would have to cancel in the offset's term, and at accuracy
    level 4 the int4 part sees x rounded to int8 while the offset's term does not."""
    n, k = w.shape
    blocks = w.detach().to(torch.float32).reshape(n, k // block_size, block_size)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    scale = _range_over_15(lo, hi)
    constant = scale == 0
    scale = torch.where(constant, torch.ones_like(scale), scale)
    q = torch.round((blocks - lo[..., None]) / scale[..., None]).clamp(0, 15)
    q = torch.where(constant[..., None], 8.0, q).to(torch.uint8)
    offsets = torch.where(constant, lo, lo + 8.0 * scale)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous(), scale.contiguous(), offsets.contiguous()


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
    MatMulNBits with accuracy_level 4 multiplies instead of x: ONNX Runtime's CPU kernel rounds its
    activations so, and engine parity at level 4 holds only with this rounding in the reference."""
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
    offsets' blocksum(x) @ offsets^T. `grid`: the int4 tensors computed before (a calibrated search),
    in place of the nearest grid. `matmul` is a plain attribute so the exporter can swap in the
    MatMulNBits op."""

    def __init__(self, linear: nn.Linear, block_size: int, accuracy_level: int, offsets: bool = False,
                 bits: int = 4, grid: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
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
            tensors = quantize_int4(linear.weight, block_size) if grid is None else grid
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


def quantize_model_int4(model: nn.Module, block_size: int, accuracy_level: int, lm_head: bool = True,
                        draft: bool = False, offsets: bool = False, lm_head_bits: int = 4,
                        embedding: bool = False, grids: dict[str, tuple[torch.Tensor, ...]] | None = None) -> list[str]:
    """Replaces the decoder's Linears (and the lm_head with `lm_head`) by Int4Linear in place: what
    medusa-build --weights int4 exports and what medusa-check runs as the reference. Deterministic,
    so both get the same bytes. Medusa heads that use the base lm_head (v2) then use the int4 one.
    `draft`: the drafter's own matrices too, as its Drafter.quantize_weights chooses (Medusa heads: the
    draft-vocabulary matrices; Amphista: all of them). `offsets`: per-block float offsets (quantize_int4_offsets)
    instead of zero points; `lm_head_bits` 8: the lm_head as int8 blocks; `embedding`: the input
    embedding as int8 rows (Int8Embedding); `grids`: per base Linear name, its MatMulNBits tensors
    (packed, scales, zero points) from the calibrated search (calibration.activations), used in place
    of the nearest grid. Returns the names of the Linears left in the model dtype because their input
    size is not a multiple of block_size (the caller warns)."""
    if block_size not in INT4_BLOCK_SIZES:
        raise ValueError(f"int4 block size {block_size}: expected one of {INT4_BLOCK_SIZES}")
    if accuracy_level not in INT4_ACCURACY_LEVELS:
        raise ValueError(f"int4 accuracy level {accuracy_level}: expected one of {INT4_ACCURACY_LEVELS}")
    if lm_head_bits not in LM_HEAD_BITS:
        raise ValueError(f"lm_head bits {lm_head_bits}: expected one of {LM_HEAD_BITS}")
    grids = dict(grids or {})
    unknown = sorted(set(grids) - set(base_linear_names(model)))
    if unknown:
        raise ValueError(f"int4 grids for {', '.join(unknown)}: expected base Linear names")

    def make(name: str, linear: nn.Linear) -> Int4Linear | None:
        if linear.in_features % block_size:
            return None
        grid = grids.get(name)
        expected = (linear.out_features, linear.in_features // block_size, block_size // 2)
        if grid is not None and tuple(grid[0].shape) != expected:
            raise ValueError(f"int4 grid for {name}: packed shape {tuple(grid[0].shape)}, expected {expected}")
        return Int4Linear(linear, block_size, accuracy_level, offsets, lm_head_bits if name == "lm_head" else 4,
                          grid)  # int4 zero-point grids only: int8 blocks and offsets ignore it

    if embedding:
        quantize_embedding_int8(model)
    return _quantize_linears(model, make, lm_head, draft, "int4")


def base_linear_names(model: nn.Module, lm_head: bool = True) -> list[str]:
    """The base's Linears the quantizers replace, in their order: each layer's, then the lm_head."""
    names = [f"layers.{i}.{n}" for i in range(len(model.layers)) for n in ("qkv", "dense", "fc", "gate", "proj")]
    return [*names, "lm_head"] if lm_head else names


def _quantize_linears(model: nn.Module, make: Callable[[str, nn.Linear], nn.Module | None], lm_head: bool,
                      draft: bool, scheme: str) -> list[str]:
    """Swaps the decoder's Linears, the lm_head with `lm_head` and the drafter's own matrices with
    `draft` for `make(name, linear)` (None: left as they are); returns the names left."""
    names = base_linear_names(model, lm_head)
    if lm_head and model.cfg.drafter == "medusa":
        h = model.cfg.num_medusa_heads
        model.drafter.uses_base_lm_head = bool(h) and all(
            torch.equal(model.drafter.lm_heads[k], model.lm_head.weight) for k in range(h))
    skipped = []
    for name in names:
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        linear = getattr(owner, attr)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"{name}: {type(linear).__name__} cannot be {scheme}-quantized (FP8 checkpoints stay FP8)")
        quantized = make(name, linear)
        if quantized is None:
            skipped.append(name)
        else:
            setattr(owner, attr, quantized)
    if draft:
        skipped += model.drafter.quantize_weights(lambda linear: make("drafter", linear))
    return skipped


# -- int8 weights and activations (medusa-build --weights int8) ----------------------------------
# W [N, K] as int8 per output channel (symmetric: scale = max|w_n| / 127), and each input row x [K]
# rounded to int8 before the product (symmetric, the row's own scale max|x| / 127), as ONNX's
# MatMulInteger then computes it: y = (q_x . q_w) * (s_x * s_w). The integer sum is exact whatever
# the number of rows, so a row's output never depends on the rows beside it; and a CPU with int8
# dot products (VNNI) runs it as a GEMM whose rows after the first cost about a fifth of what
# MatMulNBits charges each row, which is about as much as the first's weight reads
# (docs/benchmarks/issue-35-amphista.md, sections x and y): the kernel a verify step wants.


# A row's scale is at least float32's smallest normal: a zero row then rounds to zeros (and so comes
# out 0) with no branch in the graph, and no scale is denormal.
INT8_MIN_SCALE = float(torch.finfo(torch.float32).tiny)


def quantize_int8_channels(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> q [N, K] int8 in [-127, 127] and scales [N] float32 (max|w_n| / 127; 1 for a zero row)."""
    w = w.detach().to(torch.float32)
    scale = w.abs().amax(-1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous(), scale.contiguous()


def int8_matmul(x: torch.Tensor, qweight_t: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., K] float32 @ the int8 weight qweight_t [K, N] with per-column scales [N], as the
    engine's graph computes it (ops.int8_translations): each row of x rounded to int8 by its own
    scale, the integer product summed exactly (float64 holds it: K x 127 x 127 < 2^53), rounded to
    float32 once as the GEMM converts its int32 sums, then scaled by s_w and then by s_x, in that
    order: ONNX Runtime's MatMulIntegerToFloat multiplies by the column scale in its output stage,
    and the graph by the row's after it (an engine's Int8Linear equals this bit for bit:
    tests/test_quant.py)."""
    s = (x.abs().amax(-1, keepdim=True) / 127.0).clamp_min(INT8_MIN_SCALE)
    q = torch.round(x / s)
    acc = (q.double() @ qweight_t.double()).to(torch.float32)
    return (acc * scales) * s


class Int8Linear(nn.Module):
    """A Linear whose weight is int8 per output channel (quantize_int8_channels), run as the int8
    graph runs it (int8_matmul). `matmul` is a plain attribute so the exporter can swap in its op.

    `float_channels`: input channels kept in float (calibrate_float_channels picks the few whose
    values are largest). A row's int8 scale is set by its largest value, so a handful of outlier
    channels otherwise coarsen every other channel's rounding; here they are zeroed before the row
    is rounded (their int8 weight columns are zero too) and their product [rows, k] @ [k, N] is added
    in float32. Each row still depends on itself only, so Medusa steps stay equal to plain ones."""

    def __init__(self, linear: nn.Linear, float_channels: Sequence[int] = ()):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().to(torch.float32)
        self.kept: tuple[str, ...] = ("qweight_t", "scales")
        if float_channels:
            idx = torch.tensor(sorted(set(float_channels)), dtype=torch.int64)
            if idx.numel() != len(float_channels) or idx[0] < 0 or idx[-1] >= self.in_features:
                raise ValueError(f"float channels {list(float_channels)}: expected distinct input channels "
                                 f"in [0, {self.in_features})")
            mask = torch.ones(self.in_features)
            mask[idx] = 0.0
            self.kept += ("float_channels", "channel_mask", "float_weight_t")
            self.register_buffer("float_channels", idx)
            self.register_buffer("channel_mask", mask)
            self.register_buffer("float_weight_t", w[:, idx].T.contiguous())  # [k, N]
            w = w * mask
        q, scales = quantize_int8_channels(w)
        self.register_buffer("qweight_t", q.T.contiguous())  # [K, N]: MatMulInteger's B as it lies
        self.register_buffer("scales", scales)
        self.bias = linear.bias
        self.matmul = int8_matmul

    _apply = Int4Linear._apply  # dtype casts leave the int8 weight and its float32 tensors alone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "float_channels" in self.kept:
            y = self.matmul(x * self.channel_mask, self.qweight_t, self.scales)
            y = y + x.index_select(-1, self.float_channels) @ self.float_weight_t
        else:
            y = self.matmul(x, self.qweight_t, self.scales)
        return y if self.bias is None else y + self.bias


class Int8Embedding(nn.Module):
    """The input embedding as int8 per row (quantize_int8_channels: each token's row by its own scale),
    looked up as the codes of the rows asked for times their scales: a quarter of a float32 table's
    bytes (SmolLM2: 113 MB -> 28 MB, most of what an int4 engine held besides its matrices). Plain
    and Medusa steps read the same rows, so speculation stays exact; int8 and int4 engines hold it
    (engine.json `weights.embedding`), float ones keep the float table transformers reads."""

    kept = ("qweight", "scales")
    _apply = Int4Linear._apply  # dtype casts leave the int8 codes and their float32 scales alone

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        q, scales = quantize_int8_channels(embedding.weight)
        self.register_buffer("qweight", q)  # [V, d]
        self.register_buffer("scales", scales)  # [V]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight[ids].to(torch.float32) * self.scales[ids].unsqueeze(-1)


def quantize_embedding_int8(model: nn.Module) -> None:
    """Swaps model.vocab_embedding for its Int8Embedding in place (the drafters that read the base's
    embedding read the same module)."""
    if not isinstance(model.vocab_embedding, Int8Embedding):
        model.vocab_embedding = Int8Embedding(model.vocab_embedding)


def quantize_model_int8(model: nn.Module, lm_head: bool = True, draft: bool = True, embedding: bool = False,
                        float_channels: dict[str, Sequence[int]] | None = None) -> list[str]:
    """Replaces the decoder's Linears, the lm_head and (with `draft`) the drafter's own matrices by
    Int8Linear in place, and with `embedding` the input embedding by Int8Embedding: what medusa-build
    --weights int8 exports and medusa-check runs as the reference. `float_channels`: per Linear name
    (layers.{i}.qkv, ..., lm_head), the input channels it keeps in float (calibrate_float_channels).
    Every matrix qualifies (no block), so nothing is left float; returns []."""
    if embedding:
        quantize_embedding_int8(model)
    channels = dict(float_channels or {})
    done = _quantize_linears(model, lambda name, linear: Int8Linear(linear, channels.pop(name, ())), lm_head,
                             draft, "int8")
    if channels:
        raise ValueError(f"float channels for {sorted(channels)}: the model has no such base Linear")
    return done
