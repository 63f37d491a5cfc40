"""Tree attention: the new tokens of a Medusa verify step attend to the KV cache and to their tree.

Contract (shared by the Triton kernel, the PyTorch reference and the TensorRT plugin):

    tree_attention(q, k, v, past_lens, packed_mask, scale=None, positions=None, window=0) -> out

- q: [B, Hq, T, D], queries of the T new tokens (tree slots in slot order; slot 0 is the root).
- k, v: [B, Hkv, S, D] with S = P + T. Positions [0, P) are the past cache, padded to one P for the
  whole batch; positions [P, P + T) hold the new tokens' keys/values in slot order.
  Hq % Hkv == 0 (GQA): query head h reads kv head h // (Hq // Hkv).
- past_lens: [B] int32, the valid past length of each sequence (0 <= past_lens[b] <= P). Past
  positions >= past_lens[b] are holes and are never attended.
- packed_mask: [T, W] int32 (one tree for the whole batch) or [B, T, W] (one per sequence), with
  W >= ceil(T / 32). Query slot i may attend new slot j iff bit (j % 32) of word (j // 32) of row i
  is set (little-endian bit order, the TensorRT-LLM packed mask; docs/formats.md section 4).
  Every query attends all valid past positions. A lower-triangular mask expresses causal prefill.
- positions: [B, T] int32, the new tokens' positions (a tree node's: past_lens[b] + its depth);
  read only with a window. Past position j holds the token at position j.
- window: a sliding window (0: none). A query at position p then sees only keys at positions
  > p - window, past and new alike (transformers' sliding_window_overlay), on top of the above.
- out: [B, Hq, T, D] in q's dtype. Scores are scaled by `scale` (default 1 / sqrt(D)), softmax and
  accumulation run in float32. A query row with no allowed key yields zeros, never NaN.
- dtypes: float16, bfloat16, float32 (q, k, v alike).

`reference_tree_attention` is the same computation in plain PyTorch with the dense boolean mask; it
is the test oracle and the fallback where Triton cannot run. `tree_attention` picks the Triton
kernel on CUDA tensors (and on CPU tensors when TRITON_INTERPRET=1 and triton runs interpreted) and
the reference otherwise.

Kernel design: flash-attention style online softmax over key blocks, one program per
(block of query rows, kv head, sequence). The query rows of a program are the flattened
(query head within the GQA group, tree slot) pairs of one kv head, so K/V blocks are read once per
group instead of once per query head; see `_tree_attention_fwd` for why.
"""

# Annotations stay strings ("tl.constexpr"), which triton reads as such: the kernel can be defined
# without importing triton.
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

# Triton is optional (the reference needs only torch) and imported on first use, not here: triton
# fixes compile-vs-interpret at its first import (see interpreter_active), and merely importing this
# module (say, for the plugin's constants) must not make that choice for the whole process.
triton = None
tl = None

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class TileConfig:
    """One launch configuration of the kernel: tile sizes and CUDA scheduling hints."""

    block_m: int  # query rows per program (flattened group-head x tree slot)
    block_n: int  # keys per inner-loop step
    num_warps: int
    num_stages: int


# GPU candidates, timed by triton.autotune (PyTorch path) and by TensorRT (plugin tactics, by index).
# Small on purpose: a verify step has G*T <= a few hundred rows, so large M tiles only add padding.
TUNING_CONFIGS: tuple[TileConfig, ...] = (
    TileConfig(16, 64, 4, 2),
    TileConfig(32, 64, 4, 2),
    TileConfig(64, 64, 4, 2),
    TileConfig(64, 32, 4, 3),
    TileConfig(64, 128, 8, 2),
    TileConfig(128, 64, 8, 2),
    TileConfig(128, 32, 8, 3),
)

# Under the interpreter every tile op is a numpy call, so fewer, larger tiles run fastest; one fixed
# config keeps the CPU tests to seconds (autotuning there would time the interpreter).
INTERPRETER_CONFIG = TileConfig(32, 32, 1, 1)


# ---------------------------------------------------------------------------------------------
# PyTorch reference
# ---------------------------------------------------------------------------------------------


def dense_mask_from_packed(packed_mask: torch.Tensor, n_tree: int) -> torch.Tensor:
    """Unpacks [..., T, W] int32 words into a [..., T, T] bool mask: out[..., i, j] = bit j of row i."""
    if packed_mask.dtype != torch.int32:
        raise ValueError(f"packed_mask: dtype {packed_mask.dtype}, expected torch.int32")
    words_needed = (n_tree + 31) // 32
    if packed_mask.shape[-1] < words_needed:
        raise ValueError(
            f"packed_mask: {packed_mask.shape[-1]} words per row, expected >= {words_needed} for T={n_tree}"
        )
    j = torch.arange(n_tree, device=packed_mask.device)
    words = packed_mask[..., j // 32]  # [..., T, T]: the word holding bit j, for every column j
    # Arithmetic shift of a negative word keeps bit 0 correct after `& 1`, so bit 31 works too.
    return ((words >> (j % 32).to(torch.int32)) & 1).bool()


def reference_tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past_lens: torch.Tensor,
    packed_mask: torch.Tensor,
    scale: float | None = None,
    positions: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Plain PyTorch tree attention with the equivalent dense mask (see the module docstring)."""
    batch, n_heads, n_tree, head_dim, n_kv_heads, past_cap = _check_inputs(q, k, v, past_lens, packed_mask)
    _check_past_lens_values(past_lens, past_cap)
    _check_window(positions, window, batch, n_tree)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)

    past_ok = (
        torch.arange(past_cap, device=q.device)[None, :] < past_lens.to(q.device).long()[:, None]
    )  # [B, P]
    tree_ok = dense_mask_from_packed(packed_mask.to(q.device), n_tree)  # [T, T] or [B, T, T]
    allowed = torch.cat(
        [past_ok[:, None, :].expand(batch, n_tree, past_cap), tree_ok.expand(batch, n_tree, n_tree)], dim=-1
    )  # [B, T, S]
    if window:
        query_pos = positions.to(q.device).long()  # [B, T]
        key_pos = torch.cat([torch.arange(past_cap, device=q.device).expand(batch, past_cap), query_pos], 1)
        allowed = allowed & (key_pos[:, None, :] > query_pos[:, :, None] - window)

    group = n_heads // n_kv_heads
    # Holes may hold garbage (even NaN from an uninitialised cache): zero them so 0 * NaN cannot leak.
    pos_ok = torch.cat([past_ok, past_ok.new_ones(batch, n_tree)], dim=1)[:, None, :, None]  # [B, 1, S, 1]
    kf = torch.where(pos_ok, k.float(), 0.0).repeat_interleave(group, dim=1)  # [B, Hq, S, D]
    vf = torch.where(pos_ok, v.float(), 0.0).repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale  # [B, Hq, T, S]
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(allowed[:, None], probs, 0.0)  # rows with no allowed key: NaN -> 0
    return torch.matmul(probs, vf).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# Input checks shared by every path
# ---------------------------------------------------------------------------------------------


def _check_inputs(q, k, v, past_lens, packed_mask) -> tuple[int, int, int, int, int, int]:
    """Validates shapes and dtypes; returns (B, Hq, T, D, Hkv, P)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name}: shape {tuple(t.shape)}, expected 4 dims [B, H, L, D]")
        if t.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype}, expected one of float16, bfloat16, float32")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    batch, n_heads, n_tree, head_dim = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k shape {tuple(k.shape)} != v shape {tuple(v.shape)}")
    kb, n_kv_heads, seq, kd = k.shape
    if kb != batch or kd != head_dim:
        raise ValueError(
            f"k/v shape {tuple(k.shape)} does not match q shape {tuple(q.shape)}: expected [{batch}, Hkv, S, {head_dim}]"
        )
    if n_kv_heads == 0 or n_heads % n_kv_heads != 0:
        raise ValueError(f"query heads {n_heads} not a multiple of kv heads {n_kv_heads}")
    if n_tree == 0:
        raise ValueError("q: T=0 new tokens, expected at least one")
    if seq < n_tree:
        raise ValueError(f"k/v length S={seq} < T={n_tree}: expected S = P + T with P >= 0")
    if past_lens.shape != (batch,) or past_lens.dtype.is_floating_point or past_lens.dtype == torch.bool:
        raise ValueError(
            f"past_lens: shape {tuple(past_lens.shape)} dtype {past_lens.dtype}, expected [{batch}] int32"
        )
    if packed_mask.dtype != torch.int32:
        raise ValueError(f"packed_mask: dtype {packed_mask.dtype}, expected torch.int32")
    words_needed = (n_tree + 31) // 32
    if packed_mask.dim() not in (2, 3) or packed_mask.shape[-2] != n_tree:
        raise ValueError(
            f"packed_mask: shape {tuple(packed_mask.shape)}, expected [{n_tree}, W] or [{batch}, {n_tree}, W]"
        )
    if packed_mask.dim() == 3 and packed_mask.shape[0] != batch:
        raise ValueError(
            f"packed_mask: batch {packed_mask.shape[0]}, expected {batch} (or a 2-D shared mask)"
        )
    if packed_mask.shape[-1] < words_needed:
        raise ValueError(
            f"packed_mask: W={packed_mask.shape[-1]} words per row, expected >= {words_needed} for T={n_tree}"
        )
    return batch, n_heads, n_tree, head_dim, n_kv_heads, seq - n_tree


def _check_window(positions: torch.Tensor | None, window: int, batch: int, n_tree: int) -> None:
    if window < 0:
        raise ValueError(f"window {window}: expected 0 (none) or a positive number of keys")
    if window and (positions is None or positions.shape != (batch, n_tree) or positions.dtype.is_floating_point
                   or positions.dtype == torch.bool):
        shape = None if positions is None else tuple(positions.shape)
        raise ValueError(f"positions: {shape}, expected [{batch}, {n_tree}] integer positions with window {window}")


def _check_past_lens_values(past_lens: torch.Tensor, past_cap: int) -> None:
    # Reads the values, so it syncs a GPU; the Triton path skips it there (the kernel clamps).
    if past_lens.numel() and (int(past_lens.min()) < 0 or int(past_lens.max()) > past_cap):
        raise ValueError(f"past_lens: values {past_lens.tolist()}, expected each in [0, P={past_cap}]")


# ---------------------------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------------------------


def _tree_attention_fwd(
    Q, K, V, PastLens, Mask, Positions,
    sm_scale,
    n_tree, past_cap, group,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_mb, stride_mt,
    stride_ob, stride_oh, stride_ot,
    Out,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,
):  # fmt: skip
    # Argument order is the TensorRT AOT launch order: input pointers, int scalars, output pointer
    # (sm_scale and WINDOW are compiled in as constants there). The last dim of every tensor is
    # contiguous; Positions [B, T] is contiguous.
    #
    # Rows of this program: the flattened (head within the kv group, tree slot) pairs of one kv
    # head, row r -> head kv_head * group + r // T, slot r % T. Why not one program per query
    # head: a verify step has few queries (T <= ~64) and long pasts, so the kernel is bound by
    # reading K/V. Flattening lets one tile cover several heads of a group (e.g. G=4, T=16 -> one
    # 64-row tile reads K/V once instead of four times) and wastes no padding rows when T is
    # small (T=5, G=4 -> 20 of 32 rows used, not 5 of 16 in each of four tiles). The mask depends
    # only on the slot, so heads share it too.
    pid_m = tl.program_id(0)
    kv_head = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)  # int64 offsets: B * Hkv * S * D can exceed 2**31

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < group * n_tree
    head = (kv_head * group + rows // n_tree).to(tl.int64)
    slot = rows % n_tree
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    q_ptrs = Q + b * stride_qb + head[:, None] * stride_qh + slot[:, None] * stride_qt + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # exp2 instead of exp: fold in log2(e)

    # m starts finite: a block where a row sees no key then gives p = exp2(-inf - m) = 0 and
    # alpha = 1, where an -inf start would give exp2(-inf + inf) = NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    k_base = K + b * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = V + b * stride_vb + kv_head.to(tl.int64) * stride_vh
    # Clamp so a bad length can never read outside the cache (the wrappers validate on the CPU).
    past_len = tl.minimum(tl.maximum(tl.load(PastLens + b), 0), past_cap)

    # Past keys: every query sees positions [0, past_len); blocks past it are never visited. With a
    # window, a row sees only keys at positions > its position - WINDOW, and the blocks before the
    # lowest such key of the tile are skipped too: a step reads the window, not the whole cache.
    first = 0
    if WINDOW > 0:
        q_pos = tl.load(Positions + b * n_tree + slot, mask=row_ok, other=0)  # [BLOCK_M]
        lowest = tl.min(tl.where(row_ok, q_pos - WINDOW + 1, past_cap), axis=0)
        first = (tl.maximum(lowest, 0) // BLOCK_N) * BLOCK_N
    for start in range(first, past_len, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        key_ok = offs_n < past_len
        kt = tl.load(k_base + offs_n[None, :] * stride_ks + offs_d[:, None],
                     mask=key_ok[None, :] & d_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]  # fmt: skip
        vb = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :],
                     mask=key_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]  # fmt: skip
        if UPCAST:
            kt = kt.to(tl.float32)
            vb = vb.to(tl.float32)
        s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale
        visible = key_ok[None, :]
        if WINDOW > 0:
            visible = visible & (offs_n[None, :] > (q_pos - WINDOW)[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision=DOT_PRECISION)
        m_i = m_new

    # Tree keys at cache positions P + j; the mask bit for (slot i, key j) is bit j % 32 of
    # word j // 32 of row i, gathered per (row, key) so any T and W work.
    mask_base = Mask + b * stride_mb + slot[:, None] * stride_mt
    for start in range(0, n_tree, BLOCK_N):
        offs_j = start + tl.arange(0, BLOCK_N)
        j_ok = offs_j < n_tree
        words = tl.load(mask_base + (offs_j // 32)[None, :], mask=row_ok[:, None] & j_ok[None, :], other=0)
        allowed = ((words >> (offs_j % 32)[None, :]) & 1) != 0  # [BLOCK_M, BLOCK_N]
        if WINDOW > 0:
            k_pos = tl.load(Positions + b * n_tree + offs_j, mask=j_ok, other=0)
            allowed = allowed & (k_pos[None, :] > (q_pos - WINDOW)[:, None])
        pos = past_cap + offs_j
        kt = tl.load(k_base + pos[None, :] * stride_ks + offs_d[:, None],
                     mask=j_ok[None, :] & d_ok[:, None], other=0.0)  # fmt: skip
        vb = tl.load(v_base + pos[:, None] * stride_vs + offs_d[None, :],
                     mask=j_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
        if UPCAST:
            kt = kt.to(tl.float32)
            vb = vb.to(tl.float32)
        s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # a row that saw no key keeps acc = 0 -> output 0
    out = acc / l_safe[:, None]
    o_ptrs = Out + b * stride_ob + head[:, None] * stride_oh + slot[:, None] * stride_ot + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# Kernel objects are built on first use from the plain function above, not by @triton.jit: that
# needs triton at import, and it picks compiled or interpreted from TRITON_INTERPRET when the
# decorator runs, which need not match the mode triton's own `tl` helpers were fixed in (see
# interpreter_active); the TensorRT plugin needs the compiled form whatever the mode.
_KERNELS: dict[str, object] = {}


def have_triton() -> bool:
    """Imports triton on first call (setting this module's `triton` and `tl`); False if absent."""
    global triton, tl
    if triton is None:
        try:
            import triton as triton_module
            import triton.language as tl_module
        except ImportError:
            return False
        triton, tl = triton_module, tl_module
    return True


def _require_triton() -> None:
    if not have_triton():
        raise RuntimeError("the Triton tree-attention kernel needs triton: pip install triton")


def jit_kernel():
    """The compiled-mode JITFunction (for triton.compile / the TensorRT AOT plugin)."""
    _require_triton()
    if "jit" not in _KERNELS:
        from triton.runtime.jit import JITFunction

        _KERNELS["jit"] = JITFunction(_tree_attention_fwd)
    return _KERNELS["jit"]


def _interpreted_kernel():
    _require_triton()
    if "interpret" not in _KERNELS:
        from triton.runtime.interpreter import InterpretedFunction

        _KERNELS["interpret"] = InterpretedFunction(_tree_attention_fwd)
    return _KERNELS["interpret"]


def _prune_configs(configs, named_args, **kwargs):
    rows = named_args["group"] * named_args["n_tree"]
    useful = max(16, triton.next_power_of_2(rows))
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= useful]
    return kept or configs[:1]


def _autotuned_kernel():
    _require_triton()
    if "autotune" not in _KERNELS:
        configs = [
            triton.Config(
                {"BLOCK_M": c.block_m, "BLOCK_N": c.block_n}, num_warps=c.num_warps, num_stages=c.num_stages
            )
            for c in TUNING_CONFIGS
        ]
        # Keyed on the tree shape, not on the past length, which changes every decode step.
        _KERNELS["autotune"] = triton.autotune(
            configs,
            key=["n_tree", "group", "HEAD_DIM"],
            prune_configs_by={"early_config_prune": _prune_configs},
        )(jit_kernel())
    return _KERNELS["autotune"]


def interpreter_active() -> bool:
    """True when triton runs kernels in its CPU interpreter in this process.

    Triton fixes that when it is first imported: with TRITON_INTERPRET=1 set at that moment its own
    `tl` helper functions become interpreted ones, and a compiled kernel can no longer call them
    (nor can an interpreted kernel run without them). So the mode is read from `tl`, not from the
    environment, which may have changed since (the interpreter still needs the variable set while it
    runs; `triton_tree_attention` checks that). Imports triton if nothing has yet.
    """
    return have_triton() and type(tl.zeros).__name__ == "InterpretedFunction"


def head_block(head_dim: int) -> int:
    """BLOCK_D for a head size: a power of two >= 16 (tl.dot's minimum); extra columns are masked."""
    return max(16, 1 << (head_dim - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs must not silently drop to TF32 on Ampere+; the setting is moot for 16-bit inputs.
    return "ieee" if dtype == torch.float32 else "tf32"


def triton_tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past_lens: torch.Tensor,
    packed_mask: torch.Tensor,
    scale: float | None = None,
    positions: torch.Tensor | None = None,
    window: int = 0,
    *,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """Runs the Triton kernel: compiled on CUDA tensors, or in triton's interpreter when that is active
    (see `interpreter_active`). `config` pins one tile config (default: autotune when compiled, the
    fixed INTERPRETER_CONFIG when interpreted)."""
    _require_triton()
    batch, n_heads, n_tree, head_dim, n_kv_heads, past_cap = _check_inputs(q, k, v, past_lens, packed_mask)
    _check_window(positions, window, batch, n_tree)
    # Without a window the kernel never reads Positions: any int32 pointer does.
    positions = (positions if window else past_lens).to(torch.int32).contiguous()
    for name, t in (("k", k), ("v", v), ("past_lens", past_lens), ("packed_mask", packed_mask),
                    ("positions", positions)):
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device}, expected q's device {q.device}")
    if not q.is_cuda:
        _check_past_lens_values(past_lens, past_cap)
    interpret = interpreter_active()
    if interpret and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise RuntimeError(
            "triton was imported with TRITON_INTERPRET=1, which has since been unset; its interpreter "
            "reads the variable while running too, so keep it set"
        )
    if not interpret and not q.is_cuda:
        raise RuntimeError(
            "the Triton kernel runs CPU tensors only in triton's interpreter: set TRITON_INTERPRET=1 "
            "before triton is first imported (or use reference_tree_attention)"
        )
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)

    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    past_lens = past_lens.to(torch.int32).contiguous()
    mask = packed_mask if packed_mask.stride(-1) == 1 else packed_mask.contiguous()
    stride_mb = mask.stride(0) if mask.dim() == 3 else 0  # shared mask: every sequence reads row block 0
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    group = n_heads // n_kv_heads

    args = (
        q, k, v, past_lens, mask, positions,
        scale,
        n_tree, past_cap, group,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        stride_mb, mask.stride(-2),
        out.stride(0), out.stride(1), out.stride(2),
        out,
    )  # fmt: skip
    consts = dict(HEAD_DIM=head_dim, BLOCK_D=head_block(head_dim), DOT_PRECISION=dot_precision(q.dtype),
                  WINDOW=int(window))

    if interpret:
        # tl.dot on bfloat16 is wrong in the interpreter: compute in float32 there.
        cfg = config or INTERPRETER_CONFIG
        grid = (triton.cdiv(group * n_tree, cfg.block_m), n_kv_heads, batch)
        _interpreted_kernel()[grid](*args, **consts, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, UPCAST=True)
    elif config is not None:
        grid = (triton.cdiv(group * n_tree, config.block_m), n_kv_heads, batch)
        jit_kernel()[grid](
            *args, **consts, BLOCK_M=config.block_m, BLOCK_N=config.block_n, UPCAST=False,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )  # fmt: skip
    else:

        def grid(meta):
            return (triton.cdiv(group * n_tree, meta["BLOCK_M"]), n_kv_heads, batch)

        _autotuned_kernel()[grid](*args, **consts, UPCAST=False)
    return out


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past_lens: torch.Tensor,
    packed_mask: torch.Tensor,
    scale: float | None = None,
    positions: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Tree attention (contract in the module docstring). Uses the Triton kernel on CUDA tensors when
    triton is installed, or on CPU tensors under TRITON_INTERPRET=1 when triton runs interpreted; the
    PyTorch reference otherwise (without importing triton for CPU tensors then)."""
    args = (q, k, v, past_lens, packed_mask, scale, positions, window)
    if q.is_cuda and have_triton():
        return triton_tree_attention(*args)
    if os.environ.get("TRITON_INTERPRET", "0") == "1" and interpreter_active():
        return triton_tree_attention(*args)
    return reference_tree_attention(*args)
