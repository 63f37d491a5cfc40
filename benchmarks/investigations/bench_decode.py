"""The drafter recipe's two decoders side by side on the same prompts: scripts/batched_greedy.py (a
preallocated cache read once a step) against transformers' `generate` (left-padded, dynamic cache).
It reports seconds per batch, the ratio, and whether the continuations are the same tokens.

Prompts are the pack's later human turns (the recipe's longest: ~460 tokens on average), the first
--prompts of them in the pack's (shuffled) order, in batches of consecutive ones: they pad more than
the recipe's batches, which group similar lengths. On a GPU this is the check to run before a
decode-only session; on this CPU it says whether the static cache pays at CPU sizes.

    python benchmarks/investigations/bench_decode.py --pack build/pack_v5.npz \
        --gguf build/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --prompts 16 --batch 8 --new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # the recipe puts the repo on the path

import train_smollm2_drafters as recipe  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pack", type=Path, required=True)
    p.add_argument("--gguf", type=Path, help="the base's GGUF, or a Hugging Face model dir (not with --cache-only)")
    p.add_argument("--prompts", type=int, default=16, help="later turns decoded, the first N of the pack's")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache-only", action="store_true", help="a random model of the base's attention shape (9 query, "
                   "3 key/value heads of 64) with 2 layers, a 64-wide MLP and a 1,024-token vocabulary, on random "
                   "prompts of the pack's lengths: the arithmetic gone, a step is its cache handling")
    p.add_argument("--out", type=Path, help="also write the figures here (JSON)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = True  # as the recipe's cuda stage decodes
    pack = np.load(args.pack)
    eos = int(pack["eos"])
    prompts = recipe._unragged(pack["later"], pack["later_offsets"])[: args.prompts]
    if args.cache_only:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=1025, hidden_size=576, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=4096)
        model = LlamaForCausalLM(cfg).to(args.device).eval()
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 1024, (len(q),), generator=g).tolist() for q in prompts]
        with torch.no_grad():  # EOS (1024) pads; its logit is 0, under the largest of 1,024 random ones
            model.lm_head.weight[1024] = 0
        eos = 1024
    else:
        model = recipe.load_base(args.gguf, torch.device(args.device))
    def timed(decode, new_tokens: int) -> tuple[float, list[list[int]]]:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        out = []
        for i in range(0, len(prompts), args.batch):
            out += decode(model, prompts[i : i + args.batch], new_tokens, eos)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return (time.perf_counter() - started) * args.batch / len(prompts), out

    times: dict[str, float] = {}
    prefill: dict[str, float] = {}
    conts: dict[str, list[list[int]]] = {}
    for name, decode in (("static", recipe.batched_greedy.greedy), ("generate", recipe._generate)):
        decode(model, prompts[:2], 2, eos)  # warm-up: allocator, kernels
        prefill[name] = timed(decode, 1)[0]  # the prompts and their first token: what a step is not
        times[name], conts[name] = timed(decode, args.new_tokens)
    same = sum(a == b for a, b in zip(conts["static"], conts["generate"], strict=True))
    agree = [next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
             for a, b in zip(conts["static"], conts["generate"], strict=True)]
    report = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else f"cpu, {args.threads} threads",
              "model": "cache only (2 layers, random)" if args.cache_only else str(args.gguf.name),
              "prompts": len(prompts), "mean_prompt_tokens": round(sum(map(len, prompts)) / len(prompts), 1),
              "batch": args.batch, "new_tokens": args.new_tokens,
              "seconds_per_batch": {k: round(v, 2) for k, v in times.items()},
              "generate_over_static": round(times["generate"] / times["static"], 2),
              "prefill_seconds_per_batch": {k: round(v, 2) for k, v in prefill.items()},
              "ms_per_step": {k: round(1000 * (times[k] - prefill[k]) / (args.new_tokens - 1), 1) for k in times},
              "same_continuations": f"{same}/{len(prompts)}", "mean_agreeing_prefix": round(sum(agree) / len(agree), 1)}
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
