"""Does an Amphista drafter draft better from several of the base's layers than from its last hidden
state alone (EAGLE-3 fuses a low, a middle and the last layer's features), or when its adaptation
layers start as copies of the base's own layers rather than at the identity? A CPU-sized comparison
on the kept self-distilled text: the same sequences, the same steps and seed, held-out top-1 per head.

Variants (--variants):
- last: the shipped drafter (adaptation MLP 768 wide, identity start) on the last hidden state;
- fused: the drafter fed Linear([rms(h_low); rms(h_mid); h_last]) (3d -> d, started as the identity
  on h_last, so it starts equal to `last`);
- wide: `last` with the base's MLP width (1,536), the shape a copy of a base layer needs;
- base-layers: `wide` with SAL1 and SAL2 started as copies of two base layers (--copy, default the
  last two), their output matrices scaled by rms(h_last) / rms(the copied layer's input) so that
  what they add is at the scale of the state they add it to. A prior for a data-bound drafter: the
  base's own computation over a new token (drafters.md: small data suffices when the start is good).
The teacher is the base's own distribution from h_last in all of them. Nothing else changes.

    python benchmarks/investigations/bench_drafter_features.py --pack build/pack_v5.npz \
        --gguf build/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --train 400 --steps 400
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from medusa_trt.checkpoint import ModelConfig  # noqa: E402
from medusa_trt.drafters.amphista import Amphista  # noqa: E402
from medusa_trt.tools.distill import Sample  # noqa: E402
from medusa_trt.tools.train_drafter import TrainOptions, draft_vocabulary, evaluate, train_drafter  # noqa: E402


class FusedInput(nn.Module):
    """An Amphista drafter reading [n x d] features per row through one Linear to d."""

    def __init__(self, drafter: Amphista, d: int, n: int):
        super().__init__()
        self.drafter, self.d = drafter, d
        self.fuse = nn.Linear(n * d, d, bias=False)
        with torch.no_grad():  # the identity on the last layer's state: the same start as the baseline
            self.fuse.weight.zero_()
            self.fuse.weight[:, -d:] = torch.eye(d)

    def adapt(self, hidden, *args, **kwargs):
        return self.drafter.adapt(self.fuse(hidden), *args, **kwargs)

    def features(self, h1, h2):
        return self.drafter.features(h1, h2)


def features(model, tokens: list[int], layers: list[int]) -> torch.Tensor:
    """[rows - 1, (len(layers) + 1) * d] float16: the RMS-normalized residual stream after each of
    `layers`, then the final normed hidden state, for every row but the last."""
    with torch.no_grad():
        out = model.model(input_ids=torch.tensor([tokens]), output_hidden_states=True)
    parts = [out.hidden_states[i][0, :-1] for i in layers]
    parts = [p * torch.rsqrt(p.pow(2).mean(-1, keepdim=True) + 1e-6) for p in parts]
    return torch.cat(parts + [out.last_hidden_state[0, :-1]], -1).half()


def copy_base_layers(drafter: Amphista, model, layers: list[int], scale: float) -> None:
    """SAL1, SAL2 <- the base's decoder layers `layers` (Hugging Face Llama names), their attention
    and MLP output matrices x `scale`; fc1/fc2 stay the identity on h_t."""
    with torch.no_grad():
        for sal, i in zip((drafter.sal1, drafter.sal2), layers, strict=True):
            src = model.model.layers[i]
            a, m = src.self_attn, src.mlp
            sal.qkv.weight.copy_(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
            sal.dense.weight.copy_(a.o_proj.weight * scale)
            sal.input_layernorm.weight.copy_(src.input_layernorm.weight)
            sal.post_layernorm.weight.copy_(src.post_attention_layernorm.weight)
            sal.fc.weight.copy_(m.gate_proj.weight)
            sal.gate.weight.copy_(m.up_proj.weight)
            sal.proj.weight.copy_(m.down_proj.weight * scale)


def layer_scale(model, samples: list[Sample], layer: int) -> float:
    """rms(final normed state) / rms(the residual stream entering `layer`), over `samples`."""
    num = den = 0.0
    with torch.no_grad():
        for s in samples:
            out = model.model(input_ids=torch.tensor([s.tokens]), output_hidden_states=True)
            num += float(out.last_hidden_state.pow(2).mean())
            den += float(out.hidden_states[layer].pow(2).mean())
    return (num / den) ** 0.5


def train_eval(drafter: nn.Module, train: list[Sample], held: list[Sample], lm_head, embed, vocab,
               opts: TrainOptions) -> dict:
    """Trains as the recipe does (the teacher reads the last d columns: the final state) and evaluates."""
    t0 = time.perf_counter()
    losses = train_drafter(drafter, "amphista", train, lm_head, embed, vocab, opts)
    acc = evaluate(drafter, "amphista", held, lm_head, embed, vocab)
    return {"heldout_top1": [a[0] for a in acc], "heldout_top5": [a[-1] for a in acc],
            "final_loss": round(sum(losses[-50:]) / len(losses[-50:]), 3), "seconds": round(time.perf_counter() - t0)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pack", type=Path, required=True, help="the drafter recipe's pack (--stage pack)")
    p.add_argument("--corpus", type=Path, default=Path("data/drafter_corpus"), help="its decoded corpus")
    p.add_argument("--gguf", type=Path, required=True)
    p.add_argument("--config", type=Path, default=Path("build/smollm2_drafters/ckpt/config.json"),
                   help="the converted base's config.json (medusa-convert)")
    p.add_argument("--train", type=int, default=400, help="training sequences (a random draw of the kept ones)")
    p.add_argument("--held", type=int, default=64, help="held-out sequences evaluated")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-samples", type=int, default=8)
    p.add_argument("--layers", default="10,20", help="the residual streams fused beside the last state")
    p.add_argument("--variants", default="last,fused", help="comma list of last, fused, wide, base-layers")
    p.add_argument("--copy", default="", help="base-layers: the two base layers copied (default: the last two)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("build/drafter_features.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from train_smollm2_drafters import corpus_text, prompt_sets

    from medusa_trt import drafter_corpus
    from medusa_trt.converter.gguf import load_gguf

    held, train, _ = corpus_text(prompt_sets(np.load(args.pack)), drafter_corpus.read([args.corpus])[0])
    train = random.Random(0).sample(train, args.train)
    held = held[: args.held]
    model, _ = load_gguf(args.gguf, tokenizer=False)
    layers = [int(x) for x in args.layers.split(",")]
    d = model.config.hidden_size
    t0 = time.perf_counter()
    feats = {id(s): features(model, s.tokens, layers) for s in tqdm(train + held, desc="base features", mininterval=10)}
    print(f"features of {len(train) + len(held)} sequences in {time.perf_counter() - t0:.0f} s")
    lm_head = model.lm_head.weight.detach().float()
    embed = nn.Embedding.from_pretrained(model.model.embed_tokens.weight.detach().float())
    vocab, coverage = draft_vocabulary(train, 4096, lm_head.shape[0])
    base = ModelConfig.from_checkpoint_config(json.loads(args.config.read_text()))
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - {"last", "fused", "wide", "base-layers"})
    if unknown:
        p.error(f"--variants {','.join(unknown)}: expected last, fused, wide or base-layers")
    n_layers = model.config.num_hidden_layers
    copy = [int(x) for x in args.copy.split(",")] if args.copy else [n_layers - 2, n_layers - 1]
    opts = TrainOptions(steps=args.steps, batch_samples=args.batch_samples, max_len=1024)
    report = {"train_sequences": len(train), "rows": sum(len(s.tokens) - 1 for s in train), "held": len(held),
              "layers": layers, "steps": args.steps, "batch_samples": args.batch_samples,
              "draft_vocab_coverage": round(coverage, 4)}
    n = len(layers) + 1
    for variant in variants:
        width = 768 if variant in ("last", "fused") else 0  # 0: the base's own
        cfg = dataclasses.replace(base, drafter="amphista",
                                  drafter_options={"num_heads": 4, "sal_intermediate_size": width})
        torch.manual_seed(0)
        drafter = Amphista(cfg)
        drafter.reset_identity()
        pick = lambda f: f[:, -d:]  # noqa: E731
        if variant == "fused":
            drafter, pick = FusedInput(drafter, d, n), (lambda f: f)
        elif variant == "base-layers":
            scale = layer_scale(model, train[:32], copy[0])
            copy_base_layers(drafter, model, copy, scale)
            report["copied_layers"], report["copy_scale"] = copy, round(scale, 5)
        tr = [Sample(s.tokens, s.prompt_len, pick(feats[id(s)]), s.kind) for s in train]
        he = [Sample(s.tokens, s.prompt_len, pick(feats[id(s)]), s.kind) for s in held]
        report[variant] = train_eval(drafter, tr, he, lm_head, embed, vocab, opts)
        print(variant, report[variant], flush=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(args.out, {v: report[v]["heldout_top1"] for v in variants})
    return 0


if __name__ == "__main__":
    sys.exit(main())
