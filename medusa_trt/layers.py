"""The decoder layer math the reference model and the drafters share: RoPE, attention over a past,
RMSNorm, one Llama-family decoder layer (the merged checkpoint's weight names, fused qkv)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from medusa_trt.config import ModelConfig


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
    scores = scores.masked_fill(~mask[:, None], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v)


def sliding_window_mask(mask: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor,
                        window: int) -> torch.Tensor:
    """`mask` [B, S, K] with the keys outside the sliding window cut: a query at position p sees keys
    at positions > p - window, itself and the window - 1 before it (transformers'
    sliding_window_overlay: kv_idx > q_idx - sliding_window). query_positions [B, S], key_positions
    [B, K]. Tree nodes have their depth's position, so a node sees the same keys as the token at
    that position of a plain decode."""
    return mask & (key_positions[:, None, :] > query_positions[:, :, None] - window)


def attention_with_past(q, k, v, past_k, past_v, mask):
    """One layer's attention step: new queries over [past + new] keys. Engines swap it per layer
    (`DecoderLayer.attend`) to export another attention form with the same math."""
    return attention(q, torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2), mask)


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
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        d, inter = cfg.hidden_size, cfg.intermediate_size
        self.input_layernorm = RMSNorm(d, cfg.norm_eps)
        self.qkv = nn.Linear(d, qkv_out, bias=cfg.qkv_bias)
        self.dense = nn.Linear(cfg.num_heads * cfg.head_dim, d, bias=False)
        self.post_layernorm = RMSNorm(d, cfg.norm_eps)
        self.fc = nn.Linear(d, inter, bias=False)  # HF gate_proj
        self.gate = nn.Linear(d, inter, bias=False)  # HF up_proj
        self.proj = nn.Linear(inter, d, bias=False)  # HF down_proj
        # What the cache does to new keys/values, when it stores another form than the model dtype
        # (fp8.FP8KVCache): a token then attends to its own K/V as later steps read them back.
        self.kv_cache: nn.Module | None = None
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
        if self.kv_cache is not None:  # the new tokens included
            k, v = self.kv_cache(k), self.kv_cache(v)
        out = self.attend(q, k, v, past_k, past_v, mask)
        x = x + self.dense(out.transpose(1, 2).reshape(b, s, -1))
        h = self.post_layernorm(x)
        x = x + self.proj(F.silu(self.fc(h)) * self.gate(h))
        return x, k, v
