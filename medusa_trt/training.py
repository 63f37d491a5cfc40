"""Medusa-1 head training on a frozen base model (the FasterDecoding v1 head format as output).

Self-distillation: the targets are the base model's own greedy continuations, so the heads learn
what the base would say next, which is exactly what greedy verification accepts. Head k reads the
base's final normed hidden state at t and is trained to predict token t+2+k, loss weight 0.8^k.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm


@torch.inference_mode()
def greedy_continuations(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """prompt + the base model's greedy continuation, for each prompt (HF causal LM)."""
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             min_new_tokens=new_tokens, pad_token_id=0)
        out.append(gen[0].tolist())
    return out


@torch.inference_mode()
def hidden_states(model, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Final normed hidden state [S, d] of each sequence (HF causal LM's inner model)."""
    return [model.model(torch.tensor([s])).last_hidden_state[0].float() for s in sequences]


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
) -> dict[str, torch.Tensor]:
    """Fits Medusa heads to `sequences` (token ids) with the base frozen; returns a v1 state dict."""
    torch.manual_seed(seed)
    hs = hidden_states(model, sequences)
    # Pairs (h_t, token t+2+k) for every position that has all targets.
    xs, ys = [], []
    for h, s in zip(hs, sequences, strict=True):
        n = len(s) - 1 - num_heads
        if n <= 0:
            continue
        xs.append(h[:n])
        ys.append(torch.stack([torch.tensor(s[2 + k : 2 + k + n]) for k in range(num_heads)], dim=1))
    if not xs:
        raise ValueError(f"sequences are too short to train {num_heads} heads (need > {num_heads + 1} tokens)")
    x, y = torch.cat(xs), torch.cat(ys)  # [N, d], [N, H]
    base_lm = model.get_output_embeddings().weight.detach().float()
    d = x.shape[1]
    w = torch.zeros(num_heads, num_layers, d, d, requires_grad=True)
    b = torch.zeros(num_heads, num_layers, d, requires_grad=True)
    lm = base_lm[None].repeat(num_heads, 1, 1).requires_grad_(True)
    opt = torch.optim.AdamW([w, b, lm], lr=lr, weight_decay=0.0)
    weights = torch.tensor([0.8**k for k in range(num_heads)])
    bar = tqdm(range(steps), desc="training heads", disable=not progress)
    for _ in bar:
        idx = torch.randint(0, len(x), (min(batch_tokens, len(x)),))
        z = x[idx][None].expand(num_heads, -1, -1)
        for layer in range(num_layers):
            z = z + F.silu(torch.einsum("hni,hoi->hno", z, w[:, layer]) + b[:, layer, None, :])
        logits = torch.einsum("hni,hvi->hnv", z, lm)
        losses = torch.stack([F.cross_entropy(logits[k], y[idx, k]) for k in range(num_heads)])
        loss = (weights * losses).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    state = {}
    for h in range(num_heads):
        for layer in range(num_layers):
            state[f"{h}.{layer}.linear.weight"] = w[h, layer].detach().clone()
            state[f"{h}.{layer}.linear.bias"] = b[h, layer].detach().clone()
        state[f"{h}.{num_layers}.weight"] = lm[h].detach().clone()
    return state


def save_v1_heads(state: dict[str, torch.Tensor], out_dir: str | Path, base_dir: str | Path,
                  num_heads: int, num_layers: int, dtype: torch.dtype = torch.float32) -> Path:
    """Writes `medusa_lm_head.pt` + config.json the way FasterDecoding's v1 training does."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.to(dtype) for k, v in state.items()}, out / "medusa_lm_head.pt")
    config = {"medusa_num_heads": num_heads, "medusa_num_layers": num_layers, "base_model_name_or_path": str(base_dir)}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out / "medusa_lm_head.pt"
