"""Medusa-1 head training on a frozen base model (FasterDecoding v1 or v2 head files as output).

Self-distillation: the targets are the base model's own greedy continuations, so the heads learn
what the base would say next, which is exactly what greedy verification accepts. Head k reads the
base's final normed hidden state at t and is trained to predict token t+2+k, loss weight 0.8^k.

The base is any Hugging Face causal LM (only `model.model(...)`, `lm_head` and a KV-cached forward
are used). Everything here runs on the CPU in minutes for models of a few million parameters.
"""

from __future__ import annotations

import inspect
import json
import math
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from medusa_trt.drafters.medusa import resblocks, stacked_linear
from medusa_trt.tools.train_drafter import autocast

LOSS_DECAY = 0.8  # Medusa-1's per-head loss weight: head k counts 0.8^k


def _by_length(seqs: list[list[int]], batch_size: int) -> list[list[int]]:
    """Indices of equal-length sequences in batches of at most batch_size: batching without padding
    keeps every row exactly what it would be alone (no pad tokens, no shifted positions)."""
    groups: dict[int, list[int]] = defaultdict(list)
    for i, s in enumerate(seqs):
        groups[len(s)].append(i)
    return [idx[j : j + batch_size] for _, idx in sorted(groups.items()) for j in range(0, len(idx), batch_size)]


@torch.inference_mode()
def greedy_continuations(model, prompts: list[list[int]], new_tokens: int, batch_size: int = 64,
                         progress: bool = False) -> list[list[int]]:
    """prompt + the base model's greedy continuation of `new_tokens` tokens, for each prompt.

    A plain KV-cached argmax loop rather than `generate`: generate stops at EOS or, with
    min_new_tokens, masks EOS out, and either way the continuation stops being the base's own
    argmax. Here EOS is just another token, as it is to greedy verification."""
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    out: list[list[int]] = [[] for _ in prompts]
    # transformers 5 renamed the cache argument and output `cache` (past_key_values warns, and goes in 5.40)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    batches = _by_length(prompts, batch_size)
    for idx in tqdm(batches, desc="greedy continuations", disable=not progress, leave=False):
        ids = torch.tensor([prompts[i] for i in idx])  # [B, S]
        res = model(input_ids=ids, use_cache=True)
        past = res[name]
        tok = res.logits[:, -1].argmax(-1)  # [B]
        gen = [tok]
        for _ in range(new_tokens - 1):
            res = model(input_ids=tok[:, None], use_cache=True, **{name: past})
            past = res[name]
            tok = res.logits[:, -1].argmax(-1)
            gen.append(tok)
        cont = torch.stack(gen, dim=1).tolist()  # [B, new]
        for row, i in enumerate(idx):
            out[i] = list(prompts[i]) + cont[row]
    return out


@torch.inference_mode()
def hidden_states(model, sequences: list[list[int]], batch_size: int = 32, progress: bool = False) -> list[torch.Tensor]:
    """Final normed hidden state [S, d] (float32) of each sequence (an HF causal LM's inner model)."""
    out: list[torch.Tensor] = [torch.empty(0)] * len(sequences)
    for idx in tqdm(_by_length(sequences, batch_size), desc="hidden states", unit="batch", disable=not progress):
        h = model.model(torch.tensor([sequences[i] for i in idx])).last_hidden_state.float()  # [B, S, d]
        for row, i in enumerate(idx):
            out[i] = h[row]
    return out


def head_pairs(model, sequences: list[list[int]], num_heads: int,
               starts: list[int] | None = None, progress: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Training pairs: hidden state at t [N, d] and targets tokens t+2+k [N, H], for every t >= the
    sequence's start with all H targets inside it. `starts` (default 0) skips prompt positions in
    self-distillation, whose next tokens are the data's, not the base's."""
    hs = hidden_states(model, sequences, progress=progress)
    xs, ys = [], []
    for i, (h, s) in enumerate(zip(hs, sequences, strict=True)):
        start = starts[i] if starts is not None else 0
        n = len(s) - 1 - num_heads - start  # positions t in [start, len - 1 - H)
        if n <= 0:
            continue
        xs.append(h[start : start + n])
        t = torch.tensor(s)
        ys.append(torch.stack([t[start + 2 + k : start + 2 + k + n] for k in range(num_heads)], dim=1))
    if not xs:
        raise ValueError(f"sequences are too short to train {num_heads} heads (each needs more than "
                         f"{num_heads + 1} tokens after its start)")
    return torch.cat(xs), torch.cat(ys)


def apply_heads(state: dict[str, torch.Tensor], x: torch.Tensor, num_heads: int, num_layers: int,
                lm_head: torch.Tensor | None = None) -> torch.Tensor:
    """Medusa logits [H, N, V] of a head state dict on hidden states x [N, d] (float32). v2 heads
    (no `{h}.{L}.weight`) use `lm_head`, the base's output matrix [V, d]."""
    out = []
    for h in range(num_heads):
        def linear(z: torch.Tensor, layer: int, h: int = h) -> torch.Tensor:
            w, b = state[f"{h}.{layer}.linear.weight"].float(), state[f"{h}.{layer}.linear.bias"].float()
            return z @ w.T + b

        z = resblocks(x, linear, range(num_layers))
        own = state.get(f"{h}.{num_layers}.weight")
        if own is None and lm_head is None:
            raise ValueError(f"head {h} has no lm_head ({h}.{num_layers}.weight): pass the base's lm_head")
        out.append(z @ (own if own is not None else lm_head).float().T)
    return torch.stack(out)


def rank_hits(logits: torch.Tensor, targets: torch.Tensor, topk: int) -> torch.Tensor:
    """[H, topk] counts of positions where head k's rank-r token equals the target. logits
    [H, N, V], targets [H, N] (-1 never matches)."""
    idx = logits.topk(min(topk, logits.shape[-1]), dim=-1).indices  # [H, N, k]
    hits = (idx == targets[..., None]).sum(1)
    if hits.shape[1] < topk:  # vocab smaller than topk: the missing ranks are never right
        hits = torch.cat([hits, hits.new_zeros(hits.shape[0], topk - hits.shape[1])], dim=1)
    return hits


@torch.inference_mode()
def head_accuracy(state: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, num_heads: int,
                  num_layers: int, topk: int = 10, chunk: int = 4096, lm_head: torch.Tensor | None = None) -> torch.Tensor:
    """[H, topk]: fraction of positions where head k's rank-r token is the target (not cumulative;
    top-k accuracy is the cumulative sum over r)."""
    hits = torch.zeros(num_heads, topk, dtype=torch.long)
    for i in range(0, len(x), chunk):
        logits = apply_heads(state, x[i : i + chunk], num_heads, num_layers, lm_head)  # [H, n, V]
        hits += rank_hits(logits, y[i : i + chunk].T, topk)
    return hits.double() / max(len(x), 1)


def train_heads(
    model,
    sequences: list[list[int]],
    num_heads: int = 4,
    num_layers: int = 1,
    steps: int = 300,
    lr: float = 3e-3,
    batch_tokens: int = 4096,
    seed: int = 0,
    progress: bool = True,
    starts: list[int] | None = None,
    bf16: bool = False,
    history: list[float] | None = None,
    pairs: tuple[torch.Tensor, torch.Tensor] | None = None,
    shared_lm_head: bool = False,
    lm_head: torch.Tensor | None = None,
    vocab: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Fits Medusa heads to `sequences` (token ids) with the base frozen; returns a v1 state dict,
    or with `shared_lm_head` a v2 one: ResBlocks only, logits through the base's frozen lm_head
    (a quarter of the parameters at 4 heads, and an engine runs all heads' logits as one MatMul).

    Heads start as the identity ResBlock (zero weights) with the base's lm_head, the way upstream
    initializes them, so step 0 already predicts "the next token" and training only has to learn
    the shift. AdamW with a cosine schedule; `bf16` runs the matmuls under CPU bf16 autocast (faster
    on CPUs with AVX512-BF16 / AMX, master weights stay float32). `history` receives the
    loss of every step; `pairs` (from head_pairs) skips recomputing the hidden states, and with
    `lm_head` (the base's output matrix [V, d]) `model` is not needed at all. `vocab` (token ids,
    shared lm_head only) restricts the softmax to those tokens: a large vocabulary's lm_head
    dominates a step's cost, and targets outside the subset are left out of the loss."""
    if num_heads < 1 or num_layers < 1:
        raise ValueError(f"num_heads and num_layers must be >= 1, got {num_heads} and {num_layers}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    g = torch.Generator().manual_seed(seed)
    x, y = pairs if pairs is not None else head_pairs(model, sequences, num_heads, starts)  # [N, d], [N, H]
    base_lm = (lm_head if lm_head is not None else model.get_output_embeddings().weight).detach().float()
    if vocab is not None:
        if not shared_lm_head:
            raise ValueError("vocab restricts a shared lm_head's softmax; heads with their own lm_head train on all of it")
        remap = torch.full((base_lm.shape[0],), -100, dtype=torch.long)
        remap[vocab] = torch.arange(len(vocab))
        base_lm, y = base_lm[vocab], remap[y]  # [V', d], [N, H] with -100 (ignored) outside the subset
    d = x.shape[1]
    w = torch.zeros(num_heads, num_layers, d, d, requires_grad=True)
    b = torch.zeros(num_heads, num_layers, d, requires_grad=True)
    lm = base_lm[None].expand(num_heads, -1, -1) if shared_lm_head else base_lm[None].repeat(num_heads, 1, 1)
    opt = torch.optim.AdamW([w, b] if shared_lm_head else [w, b, lm.requires_grad_(True)], lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warmup) * (0.55 + 0.45 * math.cos(math.pi * min(i, steps) / steps)))
    weights = torch.tensor([LOSS_DECAY**k for k in range(num_heads)])
    n = min(batch_tokens, len(x))
    bar = tqdm(range(steps), desc="training heads", disable=not progress)
    for _ in bar:
        idx = torch.randint(0, len(x), (n,), generator=g)
        xb = x[idx].float()
        with autocast("cpu", bf16):
            z = resblocks(xb[None].expand(num_heads, -1, -1), stacked_linear(w, b), range(num_layers))  # [H, n, d]
            logits = z @ base_lm.T if shared_lm_head else torch.einsum("hni,hvi->hnv", z, lm)  # [H, n, V]
        losses = torch.stack([F.cross_entropy(logits[k].float(), y[idx, k]) for k in range(num_heads)])
        loss = (weights * losses).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if history is not None:
            history.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
    state = {}
    for h in range(num_heads):
        for layer in range(num_layers):
            state[f"{h}.{layer}.linear.weight"] = w[h, layer].detach().clone()
            state[f"{h}.{layer}.linear.bias"] = b[h, layer].detach().clone()
        if not shared_lm_head:
            state[f"{h}.{num_layers}.weight"] = lm[h].detach().clone()
    return state


def load_head_file(path: str | Path) -> dict[str, torch.Tensor]:
    """The state dict of a head file written by `save_heads` (.pt or .safetensors)."""
    if str(path).endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, weights_only=True)


def save_heads(state: dict[str, torch.Tensor], out_dir: str | Path, base_dir: str | Path,
               num_heads: int, num_layers: int, dtype: torch.dtype = torch.float32,
               draft_vocab: list[int] | None = None) -> Path:
    """Writes the heads as FasterDecoding does: v1 (own lm_heads) as `medusa_lm_head.pt`, v2 (shared
    lm_head, no `{h}.{L}.weight`) as `medusa_lm_head.safetensors` with `version: "2"`; + config.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(dtype).contiguous() for k, v in state.items()}
    config = {"medusa_num_heads": num_heads, "medusa_num_layers": num_layers, "base_model_name_or_path": str(base_dir)}
    if draft_vocab is not None:  # trained over a vocabulary subset: the heads draft from it alone
        config["draft_vocab"] = sorted(int(i) for i in draft_vocab)
    if f"0.{num_layers}.weight" in state:
        path = out / "medusa_lm_head.pt"
        torch.save(tensors, path)
    else:
        from medusa_trt.safetensors_io import save_tensors

        path = out / "medusa_lm_head.safetensors"
        save_tensors(tensors, path)
        config["version"] = "2"
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
