"""Batched greedy decoding of a transformers Llama-family model with a preallocated cache: what the
drafter recipe's GPU stage (train_smollm2_drafters.py --stage cuda) decodes its training text with.

Why not `generate`: at the recipe's batches (1,024 prompts of ~460 tokens, 256 new tokens; ~33 GB
of float32 cache at the end) each of its steps copies every layer's cache: its dynamic cache
concatenates the new key/value onto the old ones, and with a padded batch (a mask) its attention
expands the 3 key/value heads to SmolLM2's 9 query heads first, a copy three times the cache. It
took 51 s a batch on an H100 (docs/benchmarks/issue-35-amphista.md, section j), 200 ms a step.
Here a step writes its key/value in place and reads the cache once, each query head grouped with
its key/value head; a prompt is prefilled with SDPA's fused kernel, the keys expanded once.

The math is the model's own modules (projections, norms, MLP, rotary table) and attention as
transformers computes it: softmax(q k^T * scaling) v over the keys the mask allows, in float32,
and positions counted from each prompt's first real token as `generate` counts them for a
left-padded batch. A sliding window is refused (`supports`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def supports(model) -> str | None:
    """None where `greedy` decodes `model`, else why not (one line)."""
    cfg = model.config
    if cfg.model_type not in ("llama", "mistral", "qwen2"):
        return f"model_type {cfg.model_type!r}: batched_greedy knows llama, mistral and qwen2"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", cfg.model_type == "mistral"):
        return f"a sliding window of {cfg.sliding_window}: batched_greedy attends over the whole cache"
    return None


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def _layer(layer, x, cos, sin, keys, values, at: int, mask) -> torch.Tensor:
    """One decoder layer over x [B, S, d] at cache rows [at, at + S): writes their keys/values, then
    attends over rows [0, at + S) where mask [B, S, at + S] allows."""
    attn = layer.self_attn
    b, s, _ = x.shape
    d = attn.head_dim
    h = layer.input_layernorm(x)
    q = attn.q_proj(h).view(b, s, -1, d).transpose(1, 2)  # [B, H, S, D]
    k = attn.k_proj(h).view(b, s, -1, d).transpose(1, 2)  # [B, Hkv, S, D]
    v = attn.v_proj(h).view(b, s, -1, d).transpose(1, 2)
    cos, sin = cos[:, None], sin[:, None]
    keys[:, :, at : at + s] = _rope(k, cos, sin)
    values[:, :, at : at + s] = v
    hkv, groups, t = keys.shape[1], q.shape[1] // keys.shape[1], at + s
    q = _rope(q, cos, sin)
    if s > 1:  # a prompt: SDPA's fused kernel, the keys/values expanded once (transformers' repeat_kv)
        out = F.scaled_dot_product_attention(q, keys[:, :, :t].repeat_interleave(groups, 1),
                                             values[:, :, :t].repeat_interleave(groups, 1), attn_mask=mask[:, None],
                                             scale=attn.scaling)
    else:  # a step: query head j * groups + i reads key/value head j, the cache read as it lies
        scores = (q.reshape(b, hkv, groups, d) @ keys[:, :, :t].transpose(-1, -2)) * attn.scaling
        scores = scores.float().masked_fill(~mask[:, None], torch.finfo(torch.float32).min)
        out = torch.softmax(scores, -1).to(x.dtype) @ values[:, :, :t]
    out = out.reshape(b, hkv * groups, s, d).transpose(1, 2).reshape(b, s, -1)
    x = x + attn.o_proj(out)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def _forward(model, tokens, positions, keys, values, at: int, mask) -> torch.Tensor:
    """The logits (float32) of the last of `tokens` [B, S], written to cache rows [at, at + S)."""
    x = model.model.embed_tokens(tokens)
    cos, sin = model.model.rotary_emb(x, positions)
    for i, layer in enumerate(model.model.layers):
        x = _layer(layer, x, cos, sin, keys[i], values[i], at, mask)
    return model.lm_head(model.model.norm(x[:, -1])).float()


@torch.no_grad()
def greedy(model, prompts: list[list[int]], new_tokens: int, eos: int, prefill_rows: int = 32768) -> list[list[int]]:
    """Each prompt's greedy continuation (at most `new_tokens`, cut after its first `eos`), the batch
    left-padded in one preallocated cache. The prompts are prefilled `prefill_rows` tokens at a time
    (their [S, S] scores are the prefill's largest tensor)."""
    cfg, dev, dtype = model.config, model.device, model.dtype
    b, n = len(prompts), max(len(p) for p in prompts)
    lengths = torch.tensor([len(p) for p in prompts], device=dev)
    first = n - lengths  # each row's first real column
    cols = torch.arange(n + new_tokens, device=dev)
    valid = cols[None, :] >= first[:, None]  # the generated columns are filled before they are read
    tokens = torch.full((b, n), eos, dtype=torch.long)
    for r, p in enumerate(prompts):
        tokens[r, n - len(p) :] = torch.tensor(p, dtype=torch.long)
    tokens = tokens.to(dev)
    d = cfg.head_dim if getattr(cfg, "head_dim", None) else cfg.hidden_size // cfg.num_attention_heads
    shape = (b, cfg.num_key_value_heads, n + new_tokens, d)
    # zeros, not empty: a masked column's value still meets a zero probability, and 0 * NaN is NaN
    keys = [torch.zeros(shape, dtype=dtype, device=dev) for _ in model.model.layers]
    values = [torch.zeros(shape, dtype=dtype, device=dev) for _ in model.model.layers]
    positions = (cols[None, :n] - first[:, None]).clamp(min=0)
    # A padding row attends to itself alone: finite, and no real row reads it.
    causal = cols[None, :n, None] >= cols[None, None, :n]
    diagonal = cols[None, :n, None] == cols[None, None, :n]
    step = max(1, prefill_rows // n)
    logits = []
    for r in range(0, b, step):
        rows = slice(r, r + step)
        mask = (causal & valid[rows, None, :n]) | diagonal
        logits.append(_forward(model, tokens[rows], positions[rows], [k[rows] for k in keys],
                               [v[rows] for v in values], 0, mask))
    token = torch.cat(logits).argmax(-1)
    out = [token]
    done = token == eos
    for t in range(1, new_tokens):
        if t % 8 == 0 and bool(done.all()):  # a host sync every 8 steps, not every step
            break
        at = n + t - 1
        logits = _forward(model, token[:, None], (lengths + t - 1)[:, None], keys, values, at,
                          valid[:, None, : at + 1])
        token = torch.where(done, eos, logits.argmax(-1))
        done |= token == eos
        out.append(token)
    rows = torch.stack(out, 1).tolist()
    return [row[: row.index(eos) + 1] if eos in row else row for row in rows]
