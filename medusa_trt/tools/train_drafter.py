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

import contextlib
import json
import math
import time
from collections.abc import Callable, Hashable
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
    warmup: int = 0  # linear warm-up steps; 0: a twentieth of steps
    bf16: bool = False  # the drafter's forward and backward under bfloat16 autocast (weights stay float32)


def target_counts(samples: list[Sample], vocab_size: int) -> torch.Tensor:
    """How often each token id is generated in `samples`: the drafters' targets."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in samples:
        counts += torch.bincount(torch.tensor(s.tokens[s.prompt_len :]), minlength=vocab_size)
    return counts


def coverage(counts: torch.Tensor, vocab: torch.Tensor) -> float:
    """The share of the targets counted in `counts` (target_counts) that the draft vocabulary holds."""
    return float(counts[vocab].sum() / counts.sum().clamp(min=1))


def draft_vocabulary(samples: list[Sample], size: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """The `size` most frequent generated tokens (sorted ids) and the share of targets they cover:
    those that occur, and at least MIN_DRAFT_VOCAB ids (the next ones in id order where the targets
    hold fewer distinct tokens), the least a checkpoint's draft vocabulary holds."""
    from medusa_trt.checkpoint import MIN_DRAFT_VOCAB

    counts = target_counts(samples, vocab_size)
    seen = int((counts > 0).sum())
    ids = counts.argsort(descending=True, stable=True)[: min(size, max(seen, MIN_DRAFT_VOCAB))]
    return ids.sort().values, coverage(counts, ids)


def _batch(samples: list[Sample], max_len: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors of a few sequences, on the device of their hidden states: h [B, S, d]
    float32, the token after each row tokens [B, S], the tokens from row 2 on for targets, and where
    drafting rows start."""
    rows = [min(len(s.hidden), max_len) for s in samples]
    s_max, d = max(rows), samples[0].hidden.shape[1]
    dev = samples[0].hidden.device
    h = torch.zeros(len(samples), s_max, d, device=dev)
    after = torch.zeros(len(samples), s_max, dtype=torch.long)
    target = torch.full((len(samples), s_max + 1), -1, dtype=torch.long)  # target[t] = token t + 2
    first = torch.zeros(len(samples), dtype=torch.long)  # first row that drafts: the prompt's last token
    for i, (s, r) in enumerate(zip(samples, rows, strict=True)):
        start = len(s.hidden) - r
        h[i, :r] = s.hidden[start:].float()
        tok = torch.tensor(s.tokens[start : start + r + 1])
        after[i, :r] = tok[1:]
        target[i, : r - 1] = tok[2:]
        first[i] = max(s.prompt_len - 1 - start, 0)
    return {"h": h, "after": after.to(dev), "target": target.to(dev), "first": first.to(dev),
            "rows": torch.tensor(rows, device=dev)}


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
    positions = torch.arange(s, device=h.device).expand(b, s)  # RoPE is relative: a window's offset changes nothing
    mask = torch.ones(s, s, dtype=torch.bool, device=h.device).tril().expand(b, s, s)
    h1, h2, _, _ = drafter.adapt(h, after, embed, positions, mask)
    return drafter.features(h1[rows], h2[rows])


@dataclass
class Objective:
    """What a training step scores against: the base's output rows over the draft vocabulary and
    the map from a token id to its draft index (-100: outside the draft vocabulary, ignored)."""

    w_sub: torch.Tensor  # [V', d] float32
    remap: torch.Tensor  # [V + 1] long; index -1 (padding) maps to -100 too

    @classmethod
    def make(cls, lm_head: torch.Tensor, vocab: torch.Tensor) -> Objective:
        vocab = vocab.to(lm_head.device)
        remap = torch.full((lm_head.shape[0] + 1,), -100, dtype=torch.long, device=lm_head.device)
        remap[vocab] = torch.arange(len(vocab), device=lm_head.device)
        return cls(lm_head[vocab].float(), remap)


def step_loss(drafter: nn.Module, arch: str, bt: dict[str, torch.Tensor], obj: Objective, embed: nn.Module,
              opts: TrainOptions, noise_gen: torch.Generator | None = None) -> torch.Tensor:
    """The training loss of one batch (`_batch`), on the batch's device (module docstring). The base's
    distribution comes from the last d columns of h: the final hidden state, after any other features
    a drafter reads (benchmarks/investigations/bench_drafter_features.py)."""
    h = bt["h"]
    b, s, _ = h.shape
    with torch.no_grad():
        final = h[..., -obj.w_sub.shape[1] :]
        teacher = torch.softmax(final @ obj.w_sub.T, dim=-1)  # [B, S, V'] the base's distribution at each row
    if opts.noise:
        rms = h.pow(2).mean(-1, keepdim=True).sqrt()
        h = h + opts.noise * rms * torch.randn(h.shape, generator=noise_gen, device=h.device)
    row = torch.arange(s, device=h.device)
    drafting = (row[None] >= bt["first"][:, None]) & (row[None] + 1 < bt["rows"][:, None])  # [B, S] head 0's rows
    z = drafter_features(drafter, arch, h, bt["after"], embed, drafting)  # [K, N, d]
    loss = h.new_zeros(())
    for k in range(z.shape[0]):
        # rows t that draft, with the target row t + 1 + k inside the sequence
        valid = drafting & (row[None] + 1 + k < bt["rows"][:, None])  # [B, S]
        if not valid.any():
            continue
        logp = torch.log_softmax((z[k][valid[drafting]] @ obj.w_sub.T).float(), dim=-1)  # [N, V']
        t_rows = (row[None] + 1 + k).clamp(max=s - 1).expand(b, s)[valid]
        soft = -(teacher[torch.nonzero(valid)[:, 0], t_rows] * logp).sum(-1).mean()
        hard_t = obj.remap[bt["target"].gather(1, (row + k).clamp(max=s).expand(b, s))[valid]]
        hard = F.nll_loss(logp, hard_t, ignore_index=-100) if (hard_t >= 0).any() else logp.new_zeros(())
        loss = loss + opts.head_decay**k * (opts.align_weight * soft + opts.lm_weight * hard)
    return loss


def optimizer(drafter: nn.Module, opts: TrainOptions):
    """AdamW with a linear warm-up (opts.warmup steps, or a twentieth of opts.steps) and a cosine decay
    over opts.steps, read at each step (a run that sizes its steps to a time budget may set them after
    a few timed steps; it gives a fixed warm-up, or the placeholder steps would stretch it)."""
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=opts.lr, weight_decay=opts.weight_decay)

    def factor(i: int) -> float:
        warmup = opts.warmup or max(1, opts.steps // 20)
        return min(1.0, (i + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(i, opts.steps) / opts.steps))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def update(drafter: nn.Module, opt, sched, loss: torch.Tensor) -> None:
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in drafter.parameters() if p.requires_grad], 1.0)
    opt.step()
    sched.step()


def neighbours(order: list[int], n: int, g: torch.Generator) -> list[int]:
    """n neighbours in length order around a random sequence: little padding, random content."""
    j = int(torch.randint(0, len(order), (1,), generator=g))
    lo = min(max(0, j - n // 2), max(0, len(order) - n))
    return order[lo : lo + n]


def autocast(device_type: str, bf16: bool):
    """bfloat16 autocast for a training step's matmuls where `bf16` (a 1.6x faster Amphista step on a
    CPU with AVX512-BF16; on a GPU run it drafted as well as float32: docs/benchmarks/issue-35-amphista.md,
    f and v), else nothing."""
    return torch.autocast(device_type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def train_drafter(drafter: nn.Module, arch: str, samples: list[Sample], lm_head: torch.Tensor, embed: nn.Module,
                  vocab: torch.Tensor, opts: TrainOptions, progress: bool = True) -> list[float]:
    """Fits `drafter` (Amphista, or MedusaHeads with their ResBlocks trained and the base's lm_head)
    in place; returns the loss of every step. lm_head [V, d] is the base's output matrix."""
    g = torch.Generator().manual_seed(opts.seed)
    obj = Objective.make(lm_head, vocab)
    opt, sched = optimizer(drafter, opts)
    history: list[float] = []
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].hidden))
    drafter.train()
    bar = tqdm(range(opts.steps), desc=f"training {arch}", disable=not progress)
    for _ in bar:
        bt = _batch([samples[i] for i in neighbours(order, opts.batch_samples, g)], opts.max_len)
        with autocast(bt["h"].device.type, opts.bf16):
            loss = step_loss(drafter, arch, bt, obj, embed, opts, g)
        update(drafter, opt, sched, loss)
        history.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
    drafter.eval()
    return history


def evaluate(drafter: nn.Module, arch: str, samples: list[Sample], lm_head: torch.Tensor, embed: nn.Module,
             vocab: torch.Tensor | None, topk: int = 5) -> list[list[float]]:
    """[K][topk] cumulative top-r accuracy of each head over every drafting row of `samples`, against
    the data's token, full vocabulary (a token outside the draft vocabulary is a miss)."""
    return evaluate_groups(drafter, arch, samples, lm_head, embed, vocab, lambda s: None, topk)[None]


def evaluate_groups(drafter: nn.Module, arch: str, samples: list[Sample], lm_head: torch.Tensor, embed: nn.Module,
                    vocab: torch.Tensor | None, group: Callable[[Sample], Hashable],
                    topk: int = 5) -> dict[Hashable, list[list[float]]]:
    """evaluate's accuracies for each group of `samples` (`group(sample)` names it: a kind, a prompt)
    and, under None, for all of them together, from one pass (a row counts once in each figure)."""
    counts = hit_counts(drafter, arch, samples, lm_head, embed, vocab, group, topk)
    parts = list(counts.values())
    counts[None] = (sum(h for h, _ in parts), sum(t for _, t in parts)) if parts else (torch.zeros(0, topk), None)
    return {g: accuracy(h, t) for g, (h, t) in counts.items()}


def accuracy(hits: torch.Tensor, total: torch.Tensor) -> list[list[float]]:
    """[K][topk] cumulative top-r accuracy from hit_counts' hits [K, topk] and rows [K]."""
    return [[round(float(v), 4) for v in (hits[k].cumsum(0) / total[k].clamp(min=1))] for k in range(len(hits))]


@torch.no_grad()
def hit_counts(drafter: nn.Module, arch: str, samples: list[Sample], lm_head: torch.Tensor, embed: nn.Module,
               vocab: torch.Tensor | None, group: Callable[[Sample], Hashable],
               topk: int = 5) -> dict[Hashable, tuple[torch.Tensor, torch.Tensor]]:
    """Per group of `samples`: how many drafting rows of each head had the data's token at each rank
    (hits [K, topk], float) and how many rows each head drafted at (total [K]); sums of these combine
    groups exactly."""
    w = lm_head.float() if vocab is None else lm_head[vocab.to(lm_head.device)].float()
    counts: dict = {}
    for s in samples:
        bt = _batch([s], 10**9)
        rows = int(bt["rows"][0])
        z = drafter_features(drafter, arch, bt["h"], bt["after"], embed,
                             torch.ones(1, rows, dtype=torch.bool, device=bt["h"].device))
        k_heads = z.shape[0]
        hits, total = counts.setdefault(group(s), (torch.zeros(k_heads, topk), torch.zeros(k_heads)))
        for k in range(k_heads):
            first = int(bt["first"][0])
            if first >= rows - 1 - k:  # a continuation too short for head k (the base stopped at once)
                continue
            t = torch.arange(first, rows - 1 - k, device=z.device)
            top = (z[k, t] @ w.T).topk(topk, dim=-1).indices.cpu()  # [N, topk]
            if vocab is not None:
                top = vocab.cpu()[top]
            want = bt["target"][0, k + t].cpu()
            hits[k] += (top == want[:, None]).float().sum(0)
            total[k] += len(t)
    return counts


def new_amphista(base_dir: str | Path, num_heads: int = 4, sal_intermediate_size: int = 0, seed: int = 0,
                 noise: float = 0.0) -> nn.Module:
    """An Amphista drafter shaped for the Hugging Face base in `base_dir` (its adaptation layers take
    the base's shape, a Qwen2 base's q/k/v biases too), at its identity start: it drafts the next token
    at every head. `noise` (x a standard normal, seeded by `seed`) moves every weight off that start, so
    that every part shows in the drafts of an untrained drafter (tests, gpu-check)."""
    import dataclasses

    from medusa_trt.checkpoint import ModelConfig
    from medusa_trt.converter.hf_base import base_config, read_base
    from medusa_trt.drafters.amphista import Amphista

    cfg = dataclasses.replace(ModelConfig.from_checkpoint_config(base_config(read_base(Path(base_dir)))),
                              drafter="amphista",
                              drafter_options={"num_heads": num_heads, "sal_intermediate_size": sal_intermediate_size})
    torch.manual_seed(seed)
    drafter = Amphista(cfg)
    drafter.reset_identity()
    if noise:
        with torch.no_grad():
            for p in drafter.parameters():
                p.add_(noise * torch.randn_like(p))
    return drafter


def save_amphista(drafter: nn.Module, out_dir: str | Path, *, base: str, vocab: torch.Tensor | None,
                  dtype: torch.dtype = torch.float32) -> Path:
    """The drafter in this project's Amphista format (docs/formats.md): amphista.safetensors (its
    parameters by module name) + config.json (shape, draft vocabulary, the base it belongs to)."""
    from medusa_trt.safetensors_io import save_tensors

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_tensors({k: v.detach().to(dtype) for k, v in drafter.named_parameters()}, out / "amphista.safetensors")
    config = {"drafter": "amphista", "amphista": drafter.options.to_dict(), "hidden_size": drafter.hidden_size,
              "vocab_size": drafter.vocab_size, "num_attention_heads": drafter.num_attention_heads,
              "num_key_value_heads": drafter.num_kv_heads, "head_dim": drafter.head_dim, "base_model_name_or_path": base}
    if vocab is not None:
        config["draft_vocab"] = [int(i) for i in vocab]
    (out / "config.json").write_text(json.dumps(config) + "\n")
    return out / "amphista.safetensors"


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0
