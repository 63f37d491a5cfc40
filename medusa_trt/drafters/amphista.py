"""Amphista (Li et al., NAACL 2025; ../docs/formats.md section "Amphista drafter"): Staged Adaptation
Layers over fc([h_t; e(x_{t+1})]) with a cache of their own, then an Auto-embedding Block that lets
the K head slots attend to each other, then one logits projection per head.

    x1 = fc1([h_t; e(x_{t+1})]);  h1 = SAL1(x1)   (causal decoder layer, RoPE, own KV cache)
    x2 = fc2([h1;  e(x_{t+1})]);  h2 = SAL2(x2)
    z_k = r_k + silu(W_k r_k + b_k),  r_k = h1 for the first half of the heads, h2 for the second
    Z = AEB([z_1 .. z_K] + PE)      (bidirectional self-attention across the K slots, no mask, no RoPE)
    logits_k = lm_k(Z_k)            (the base's lm_head, over the draft vocabulary when set, or own)

Head k at row t scores token t + 2 + k (the root x_{t+1} is the base model's own pick). The SAL cache
holds committed rows only: each step appends the rows the base committed with the token chosen
after each, and is never rolled back (drafters/__init__.py).

Choices the paper leaves open, made here (and written down in docs/formats.md): the SAL layers are
decoder layers of the base's shape (heads, KV heads, RoPE, SwiGLU, RMSNorm); fc1/fc2 have a bias;
e() is the base model's own input embedding (frozen, shared); the per-head MLP is a Medusa ResBlock;
the AEB is the paper's self-attention alone (pre-norm, residual, the base's head count, no MLP);
the slots go to the logits projection without a final norm. With fc = [I, 0], zero output projections and zero
ResBlocks, the drafter is the identity on h_t (every head predicts the next token), the
initialization training starts from.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from medusa_trt.config import ModelConfig
from medusa_trt.drafters.base import Drafter, QuantizedLinear, linear_of, scatter_full_vocab, topk_logp
from medusa_trt.layers import DecoderLayer, RMSNorm, rope_inv_freq

PREFIX = "amphista."  # its tensors' names in a merged checkpoint (docs/formats.md)
LM_HEAD_KINDS = ("base", "own")


@dataclass(frozen=True)
class AmphistaConfig:
    """The drafter's shape: config `medusa_trt.amphista` of a merged checkpoint."""

    num_heads: int = 4
    sal_intermediate_size: int = 0  # 0: the base's intermediate_size
    aeb_layers: int = 1  # self-attention layers across the head slots (Amphista-alpha: 2)
    lm_head: str = "base"  # "base": the base model's lm_head; "own": a [V, d] matrix per head

    @classmethod
    def from_dict(cls, d: dict | None, where: str = "config") -> AmphistaConfig:
        if d is not None and not isinstance(d, dict):
            raise ValueError(f"{where}: medusa_trt.amphista {d!r:.60}: expected an object of the drafter's shape "
                             "(num_heads, sal_intermediate_size, aeb_layers, lm_head)")
        d = dict(d or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"{where}: medusa_trt.amphista has unknown key(s) {', '.join(unknown)}; "
                             f"expected {', '.join(sorted(names))}")
        out = cls(**d)
        for name in ("num_heads", "aeb_layers"):
            v = getattr(out, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{where}: medusa_trt.amphista.{name} {v!r}: expected an integer >= 1")
        for name in ("sal_intermediate_size",):
            v = getattr(out, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{where}: medusa_trt.amphista.{name} {v!r}: expected an integer >= 0 "
                                 "(0: the default)")
        if out.lm_head not in LM_HEAD_KINDS:
            raise ValueError(f"{where}: medusa_trt.amphista.lm_head {out.lm_head!r}: expected one of "
                             f"{', '.join(LM_HEAD_KINDS)}")
        return out

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def stage_of(head: int, num_heads: int) -> int:
    """Which adaptation layer feeds head `head`: 0 for the first half, 1 for the second (the first
    half holds the middle head when K is odd)."""
    return 0 if head < (num_heads + 1) // 2 else 1


class AutoEmbeddingLayer(nn.Module):
    """Bidirectional self-attention across the K head slots (the paper's eq. 5), pre-norm, residual."""

    def __init__(self, d: int, heads: int, eps: float):
        super().__init__()
        self.heads = heads
        self.norm = RMSNorm(d, eps)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        *lead, k, d = z.shape  # z [..., K, d]
        q, kk, v = self.qkv(self.norm(z)).view(*lead, k, 3, self.heads, d // self.heads).unbind(-3)
        q, kk, v = (t.transpose(-2, -3) for t in (q, kk, v))  # [..., heads, K, hd]
        scores = (q.float() @ kk.float().transpose(-1, -2)) / math.sqrt(d // self.heads)
        att = (torch.softmax(scores, dim=-1).to(v.dtype) @ v).transpose(-2, -3).reshape(*lead, k, d)
        return z + self.out(att)


class Amphista(Drafter):
    kind = "amphista"
    reads_tokens = True
    has_cache = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        a = AmphistaConfig.from_dict(cfg.drafter_options)
        d, v = cfg.hidden_size, cfg.vocab_size
        self.options = a
        self.num_heads, self.vocab_size, self.hidden_size = a.num_heads, v, d
        sal_cfg = dataclasses.replace(cfg, intermediate_size=a.sal_intermediate_size or cfg.intermediate_size)
        self.fc1 = nn.Linear(2 * d, d)
        self.sal1 = DecoderLayer(sal_cfg)
        self.fc2 = nn.Linear(2 * d, d)
        self.sal2 = DecoderLayer(sal_cfg)
        self.w = nn.Parameter(torch.zeros(a.num_heads, d, d))  # per-head ResBlock [K, out, in]
        self.b = nn.Parameter(torch.zeros(a.num_heads, d))
        self.pos_embed = nn.Parameter(torch.zeros(a.num_heads, d))
        self.aeb = nn.ModuleList(AutoEmbeddingLayer(d, cfg.num_heads, cfg.norm_eps) for _ in range(a.aeb_layers))
        self.lm_heads = nn.Parameter(torch.zeros(a.num_heads, v, d)) if a.lm_head == "own" else None
        self._rope = (rope_inv_freq, cfg)  # inv_freq made where it is used: the model may be built on meta
        self.register_buffer("draft_ids", None, persistent=False)
        self.register_buffer("draft_lm", None, persistent=False)
        self.num_kv_heads, self.head_dim = cfg.num_kv_heads, cfg.head_dim
        self.num_attention_heads = cfg.num_heads  # the base's, which the adaptation layers split by
        # Quantized forms (quantize_weights; FP8 builds keep the drafter float): w_int4, a module per
        # head for the ResBlock matrices; draft_int4, the logits projection (one module, or one per
        # head with lm_head "own").
        self.fp8, self.draft_int4, self.w_int4 = None, None, None

    def set_draft_vocab(self, ids, base_lm_head: torch.Tensor | None = None) -> None:
        """Drafts over the token ids `ids` alone; with the base's lm_head, its rows for them are kept
        as the draft matrix [V', d] (the base lm_head may later be quantized; this matrix keeps its
        own form: float, or int4 or int8 through quantize_weights)."""
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.pos_embed.device)
        self.register_buffer("draft_ids", ids_t, persistent=False)
        rows = None if base_lm_head is None or self.lm_heads is not None else base_lm_head.detach()[ids_t].clone()
        self.register_buffer("draft_lm", rows, persistent=False)

    def quantize_weights(self, make: QuantizedLinear) -> list[str]:
        """Every matrix of the drafter: on an int4 engine its float32 weights would be read every
        step beside a base 7x smaller (46% of a plain int4 step; docs/benchmarks/issue-35-amphista.md).
        Drafts never change the output, so this costs draft quality at most, never exactness."""
        skipped = []
        for name, module in list(self.named_modules()):
            if isinstance(module, nn.Linear):
                quantized = make(module)
                owner, _, attr = name.rpartition(".")
                if quantized is None:
                    skipped.append(f"{PREFIX}{name}")
                else:
                    setattr(self.get_submodule(owner) if owner else self, attr, quantized)
        w = [make(linear_of(m)) for m in self.w]
        draft = self._draft_matrices()
        lm = None if draft is None else [make(linear_of(m)) for m in draft]
        if any(m is None for m in w):
            skipped.append(f"{PREFIX}w")
        else:
            self.w_int4 = nn.ModuleList(w)
        if lm is not None and any(m is None for m in lm):
            skipped.append(f"{PREFIX}draft matrix")
        elif lm is not None:
            self.draft_int4 = nn.ModuleList(lm)
        return skipped

    def _draft_matrices(self) -> torch.Tensor | None:
        """The logits projection as matrices [1 or K, V' or V, d], None when it is the base's lm_head
        module over the whole vocabulary."""
        if self.lm_heads is not None:
            return self.lm_heads if self.draft_ids is None else self.lm_heads[:, self.draft_ids]
        return None if self.draft_lm is None else self.draft_lm[None]

    def reset_identity(self) -> None:
        """The identity drafter (module docstring): where training starts."""
        d = self.hidden_size
        with torch.no_grad():
            for fc in (self.fc1, self.fc2):
                fc.weight.zero_()
                fc.weight[:, :d].copy_(torch.eye(d))
                fc.bias.zero_()
            for layer in (self.sal1, self.sal2):
                layer.dense.weight.zero_()
                layer.proj.weight.zero_()
            for layer in self.aeb:
                layer.out.weight.zero_()
            self.w.zero_()
            self.b.zero_()
            self.pos_embed.zero_()

    # -- the math ----------------------------------------------------------------------------------

    def adapt(self, hidden: torch.Tensor, next_tokens: torch.Tensor, embed: nn.Module, positions: torch.Tensor,
              mask: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None = None):
        """The staged adaptation layers over new rows: hidden [B, S, d], next_tokens [B, S], positions
        [B, S], mask [B, S, P+S] over the past [2, B, Hkv, P, D] (K, V of both layers) then the new
        rows. Returns (h1, h2) [B, S, d] and the new rows' K, V [2, B, Hkv, S, D] each."""
        e = embed(next_tokens).to(hidden.dtype)
        inv_freq, cfg = self._rope
        freqs = positions[..., None].float() * inv_freq(cfg).to(hidden.device)
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]
        cos, sin = emb.cos().to(hidden.dtype), emb.sin().to(hidden.dtype)
        if past is None:
            b = hidden.shape[0]
            empty = hidden.new_zeros(2, b, self.num_kv_heads, 0, self.head_dim)
            past = (empty, empty)
        h1, k1, v1 = self.sal1(self.fc1(torch.cat([hidden, e], -1)), cos, sin, mask, past[0][0], past[1][0])
        h2, k2, v2 = self.sal2(self.fc2(torch.cat([h1, e], -1)), cos, sin, mask, past[0][1], past[1][1])
        return h1, h2, torch.stack([k1, k2]), torch.stack([v1, v2])

    def features(self, h1: torch.Tensor, h2: torch.Tensor) -> torch.Tensor:
        """The K head slots [K, ..., d] after the auto-embedding block, from the adapted states [..., d]
        of the rows to draft at (what the logits projection reads)."""
        k = self.num_heads
        r = torch.stack([h1 if stage_of(i, k) == 0 else h2 for i in range(k)])  # [K, ..., d]
        bias = self.b.reshape(k, *(1,) * (r.dim() - 2), -1)
        if self.w_int4 is not None:
            wr = torch.stack([m(r[i]) for i, m in enumerate(self.w_int4)])
        else:  # a 2-D product per head, not a batched einsum: ONNX Runtime prepacks a MatMul's constant
            # 2-D weight, and its Einsum took 3.3 ms of a float32 step for SmolLM2's [4, 576, 576]
            wr = torch.stack([F.linear(r[i], self.w[i]) for i in range(k)])
        z = r + F.silu(wr + bias)
        z = z.movedim(0, -2) + self.pos_embed  # [..., K, d]
        for layer in self.aeb:
            z = layer(z)
        return z.movedim(-2, 0)

    def _logits(self, z: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """The head slots z [K, ..., d] -> logits [K, ..., W], W the draft vocabulary's size when it
        has one (never scattered), else the whole vocabulary's."""
        if self.draft_int4 is not None:
            if len(self.draft_int4) == 1:
                return self.draft_int4[0](z)
            return torch.stack([m(z[i]) for i, m in enumerate(self.draft_int4)])
        w = self._draft_matrices()
        if w is None:
            return lm_head(z) if self.draft_ids is None else z @ lm_head.weight[self.draft_ids].T
        return z @ w[0].T if w.shape[0] == 1 else torch.stack([z[i] @ w[i].T for i in range(w.shape[0])])

    def topk(self, h1: torch.Tensor, h2: torch.Tensor, lm_head: nn.Module, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [B, K, k] of each head's k most likely drafts from the adapted states [B, d], and
        their log-probabilities (the fused step graph's form: logits over the draft vocabulary only,
        never scattered)."""
        logits = self._logits(self.features(h1, h2), lm_head)  # [K, B, W]
        top, logp = topk_logp(logits.transpose(0, 1), k)  # [B, K, k]
        return (top if self.draft_ids is None else self.draft_ids[top]), logp

    def heads(self, h1: torch.Tensor, h2: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Logits [K, ..., V] float32 from the adapted states [..., d] of the rows to draft at."""
        logits = self._logits(self.features(h1, h2), lm_head).float()
        return logits if self.draft_ids is None else scatter_full_vocab(logits, self.draft_ids, self.vocab_size)

    def forward(self, hidden: torch.Tensor, next_tokens: torch.Tensor | None, lm_head: nn.Module,
                embed: nn.Module | None = None) -> torch.Tensor:
        """Drafts at every row of whole sequences (rows 0..S-1 of each, no cache): the reference."""
        if next_tokens is None or embed is None:
            raise ValueError("an Amphista drafter reads the token chosen after each row and the base's embedding")
        b, s, _ = hidden.shape
        positions = torch.arange(s, device=hidden.device).expand(b, s)
        mask = torch.ones(s, s, dtype=torch.bool, device=hidden.device).tril().expand(b, s, s)
        h1, h2, _, _ = self.adapt(hidden, next_tokens, embed, positions, mask)
        return self.heads(h1, h2, lm_head)

    def append(self, hidden: torch.Tensor, next_tokens: torch.Tensor, lm_head: nn.Module, embed: nn.Module,
               past: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One sequence's cached step: its newly committed rows hidden [1, c, d] with the tokens after
        them [1, c] are appended to `past` (K, V [2, 1, Hkv, n, D], None when empty); returns the
        drafts at the last of them, logits [K, V], and the grown cache."""
        n = 0 if past is None else past[0].shape[3]
        c = hidden.shape[1]
        positions = torch.arange(n, n + c, device=hidden.device)[None]
        mask = torch.cat([torch.ones(1, c, n, dtype=torch.bool, device=hidden.device),
                          torch.ones(c, c, dtype=torch.bool, device=hidden.device).tril()[None]], dim=-1)
        h1, h2, k, v = self.adapt(hidden, next_tokens, embed, positions, mask, past)
        grown = (k, v) if past is None else (torch.cat([past[0], k], dim=3), torch.cat([past[1], v], dim=3))
        return self.heads(h1[0, -1], h2[0, -1], lm_head), grown
