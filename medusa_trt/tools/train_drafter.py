"""Drafter training on self-distilled data (tools/distill.py): an Amphista drafter or Medusa heads,
against the base model's own distributions, with the base frozen.

Head k at row t scores token t + 2 + k. Its targets there: the base's distribution at t + 1 + k,
softmax(lm_head(h_{t+1+k})) over the draft vocabulary (soft labels, "alignment"), and the token the
data has there (on self-distilled text the base's own greedy pick, what greedy verification
accepts). Loss = sum over heads of 0.8^k x (align_weight x soft CE + lm_weight x hard CE), counted at
the rows a drafter drafts from at run time: the prompt's last token and every generated one. An
Amphista drafter still reads the whole prompt (its adaptation layers are causal over every row).

The softmax runs over a draft vocabulary (the most frequent target tokens): the 49152-wide lm_head
would cost 12x more per step on SmolLM2, and the engine then drafts from that vocabulary too.
Overfitting on small data is held off by weight decay and noise on the hidden states (EAGLE's
remedy), and measured: `evaluate` on held-out samples.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from medusa_trt.drafters.medusa import resblocks, stacked_linear
from medusa_trt.tools.distill import Sample

ARCHS = ("amphista", "medusa")


@dataclass
class TrainOptions:
    steps: int = 2000
    lr: float = 1e-3
    batch_samples: int = 8  # sequences per step (every row of each)
    max_len: int = 512  # rows per sequence (longer ones keep their last max_len)
    weight_decay: float = 0.1
    noise: float = 0.05  # Gaussian noise on the input hidden states, relative to each row's RMS
    align_weight: float = 1.0  # soft cross-entropy against the base's distribution
    lm_weight: float = 0.2  # hard cross-entropy against the data's token
    head_decay: float = 0.8  # head k's loss weight is head_decay ** k
    seed: int = 0


def draft_vocabulary(samples: list[Sample], size: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """The `size` most frequent generated tokens (sorted ids) and the share of targets they cover."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in samples:
        counts += torch.bincount(torch.tensor(s.tokens[s.prompt_len :]), minlength=vocab_size)
    ids = counts.argsort(descending=True)[:size]
    ids = ids[counts[ids] > 0].sort().values
    return ids, float(counts[ids].sum() / counts.sum().clamp(min=1))


def _batch(samples: list[Sample], max_len: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors of a few sequences: h [B, S, d] float32, the token after each row
    tokens [B, S], the tokens from row 2 on for targets, and where drafting rows start."""
    rows = [min(len(s.hidden), max_len) for s in samples]
    s_max, d = max(rows), samples[0].hidden.shape[1]
    h = torch.zeros(len(samples), s_max, d)
    after = torch.zeros(len(samples), s_max, dtype=torch.long)
    target = torch.full((len(samples), s_max + 1), -1, dtype=torch.long)  # target[t] = token t + 2
    first = torch.zeros(len(samples), dtype=torch.long)  # first row that drafts: the prompt's last token
    n = torch.tensor(rows)
    for i, (s, r) in enumerate(zip(samples, rows, strict=True)):
        start = len(s.hidden) - r
        h[i, :r] = s.hidden[start:].float()
        tok = torch.tensor(s.tokens[start : start + r + 1])
        after[i, :r] = tok[1:]
        target[i, : r - 1] = tok[2:]
        first[i] = max(s.prompt_len - 1 - start, 0)
    return {"h": h, "after": after, "target": target, "first": first, "rows": n}


class MedusaResBlocks(nn.Module):
    """Medusa heads' trainable part (FasterDecoding v2: the logits come from the base's lm_head)."""

    def __init__(self, num_heads: int, num_layers: int, d: int):
        super().__init__()
        self.num_heads, self.num_layers = num_heads, num_layers
        self.w = nn.Parameter(torch.zeros(num_heads, num_layers, d, d))  # identity start, as upstream
        self.b = nn.Parameter(torch.zeros(num_heads, num_layers, d))

    def state(self) -> dict[str, torch.Tensor]:
        """FasterDecoding's head-file names (train_heads.save_heads writes them)."""
        return {f"{h}.{j}.linear.{n}": t[h, j].detach().clone() for h in range(self.num_heads)
                for j in range(self.num_layers) for n, t in (("weight", self.w), ("bias", self.b))}


def drafter_features(drafter: nn.Module, arch: str, h: torch.Tensor, after: torch.Tensor,
                     embed: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """The K head features [K, N, d] (what the logits projection reads) at the rows where the bool
    mask rows [B, S] is set; an Amphista drafter's adaptation layers still read every row."""
    if arch == "medusa":
        x = h[rows]
        return resblocks(x.unsqueeze(0).expand(drafter.num_heads, *x.shape), stacked_linear(drafter.w, drafter.b),
                         range(drafter.num_layers))
    b, s, _ = h.shape
    positions = torch.arange(s).expand(b, s)  # RoPE is relative: a window's offset changes nothing
    mask = torch.ones(s, s, dtype=torch.bool).tril().expand(b, s, s)
    h1, h2, _, _ = drafter.adapt(h, after, embed, positions, mask)
    return drafter.features(h1[rows], h2[rows])


def train_drafter(drafter: nn.Module, arch: str, samples: list[Sample], lm_head: torch.Tensor, embed: nn.Module,
                  vocab: torch.Tensor, opts: TrainOptions, progress: bool = True) -> list[float]:
    """Fits `drafter` (Amphista, or MedusaHeads with their ResBlocks trained and the base's lm_head)
    in place; returns the loss of every step. lm_head [V, d] is the base's output matrix."""
    g = torch.Generator().manual_seed(opts.seed)
    w_sub = lm_head[vocab].float()  # [V', d]
    remap = torch.full((lm_head.shape[0] + 1,), -100, dtype=torch.long)  # token -> draft index; -1 -> ignored
    remap[vocab] = torch.arange(len(vocab))
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=opts.lr, weight_decay=opts.weight_decay)
    warmup = max(1, opts.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(i, opts.steps) / opts.steps)))
    history: list[float] = []
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].hidden))
    drafter.train()
    bar = tqdm(range(opts.steps), desc=f"training {arch}", disable=not progress)
    for _ in bar:
        # Neighbours in length order around a random sequence: little padding, random content.
        j = int(torch.randint(0, len(order), (1,), generator=g))
        lo = min(max(0, j - opts.batch_samples // 2), max(0, len(order) - opts.batch_samples))
        idx = order[lo : lo + opts.batch_samples]
        bt = _batch([samples[i] for i in idx], opts.max_len)
        h = bt["h"]
        b, s, _ = h.shape
        with torch.no_grad():
            teacher = torch.softmax(h @ w_sub.T, dim=-1)  # [B, S, V'] the base's distribution at each row
        rms = h.pow(2).mean(-1, keepdim=True).sqrt()
        noisy = h + opts.noise * rms * torch.randn(h.shape, generator=g) if opts.noise else h
        row = torch.arange(s)
        drafting = (row[None] >= bt["first"][:, None]) & (row[None] + 1 < bt["rows"][:, None])  # [B, S] head 0's rows
        z = drafter_features(drafter, arch, noisy, bt["after"], embed, drafting)  # [K, N, d]
        loss = h.new_zeros(())
        for k in range(z.shape[0]):
            # rows t that draft, with the target row t + 1 + k inside the sequence
            valid = drafting & (row[None] + 1 + k < bt["rows"][:, None])  # [B, S]
            if not valid.any():
                continue
            logp = torch.log_softmax((z[k][valid[drafting]] @ w_sub.T).float(), dim=-1)  # [N, V']
            t_rows = (row[None] + 1 + k).clamp(max=s - 1).expand(b, s)[valid]
            soft = -(teacher[torch.nonzero(valid)[:, 0], t_rows] * logp).sum(-1).mean()
            hard_t = remap[bt["target"].gather(1, (row + k).clamp(max=s).expand(b, s))[valid]]
            hard = F.nll_loss(logp, hard_t, ignore_index=-100) if (hard_t >= 0).any() else logp.new_zeros(())
            loss = loss + opts.head_decay**k * (opts.align_weight * soft + opts.lm_weight * hard)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        history.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
    drafter.eval()
    return history


@torch.no_grad()
def evaluate(drafter: nn.Module, arch: str, samples: list[Sample], lm_head: torch.Tensor, embed: nn.Module,
             vocab: torch.Tensor | None, topk: int = 5) -> list[list[float]]:
    """[K][topk] cumulative top-r accuracy of each head over every drafting row of `samples`, against
    the data's token, full vocabulary (a token outside the draft vocabulary is a miss)."""
    w = lm_head.float() if vocab is None else lm_head[vocab].float()
    hits, total = None, None
    for s in samples:
        bt = _batch([s], 10**9)
        rows = int(bt["rows"][0])
        z = drafter_features(drafter, arch, bt["h"], bt["after"], embed, torch.ones(1, rows, dtype=torch.bool))
        k_heads = z.shape[0]
        if hits is None:
            hits, total = torch.zeros(k_heads, topk), torch.zeros(k_heads)
        for k in range(k_heads):
            t = torch.arange(int(bt["first"][0]), rows - 1 - k)
            if len(t) == 0:
                continue
            top = (z[k, t] @ w.T).topk(topk, dim=-1).indices  # [N, topk]
            if vocab is not None:
                top = vocab[top]
            want = bt["target"][0, k + t]
            hits[k] += (top == want[:, None]).float().sum(0)
            total[k] += len(t)
    return [[round(float(v), 4) for v in (hits[k].cumsum(0) / total[k].clamp(min=1))] for k in range(len(hits))]


def save_amphista(drafter: nn.Module, out_dir: str | Path, *, base: str, vocab: torch.Tensor | None,
                  dtype: torch.dtype = torch.float32) -> Path:
    """The drafter in this project's Amphista format (docs/formats.md): amphista.safetensors (its
    parameters by module name) + config.json (shape, draft vocabulary, the base it belongs to)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to(dtype).contiguous() for k, v in drafter.named_parameters()}, out / "amphista.safetensors")
    config = {"drafter": "amphista", "amphista": drafter.options.to_dict(), "hidden_size": drafter.hidden_size,
              "vocab_size": drafter.vocab_size, "base_model_name_or_path": base}
    if vocab is not None:
        config["draft_vocab"] = [int(i) for i in vocab]
    (out / "config.json").write_text(json.dumps(config) + "\n")
    return out / "amphista.safetensors"


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0
