"""The drafter recipe's two decoders side by side on the same prompts: scripts/batched_greedy.py (a
preallocated cache read once a step) against transformers' `generate` (left-padded, dynamic cache).
It reports seconds per batch, the ratio, and whether the continuations are the same tokens.

Prompts are the pack's later human turns (the recipe's longest: ~460 tokens on average), the
batches the recipe's own grouping (similar lengths together). On a GPU this is the check to run
before a decode-only session; on this CPU it says whether the static cache pays at CPU sizes.

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

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import batched_greedy  # noqa: E402
import train_smollm2_drafters as recipe  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pack", type=Path, required=True)
    p.add_argument("--gguf", type=Path, required=True, help="the base's GGUF, or a Hugging Face model dir")
    p.add_argument("--prompts", type=int, default=16, help="later turns decoded, the first N of the pack's")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, help="also write the figures here (JSON)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = True  # as the recipe's cuda stage decodes
    pack = np.load(args.pack)
    eos = int(pack["eos"])
    prompts = recipe._unragged(pack["later"], pack["later_offsets"])[: args.prompts]
    model = recipe.load_base(args.gguf, torch.device(args.device))
    times: dict[str, float] = {}
    conts: dict[str, list[list[int]]] = {}
    for name, decode in (("static", batched_greedy.greedy), ("generate", recipe._generate)):
        decode(model, prompts[:2], 2, eos)  # warm-up: allocator, kernels
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        out = []
        for i in range(0, len(prompts), args.batch):
            out += decode(model, prompts[i : i + args.batch], args.new_tokens, eos)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        times[name], conts[name] = time.perf_counter() - started, out
    same = sum(a == b for a, b in zip(conts["static"], conts["generate"], strict=True))
    agree = [next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
             for a, b in zip(conts["static"], conts["generate"], strict=True)]
    report = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else f"cpu, {args.threads} threads",
              "prompts": len(prompts), "mean_prompt_tokens": round(sum(map(len, prompts)) / len(prompts), 1),
              "batch": args.batch, "new_tokens": args.new_tokens,
              "seconds_per_batch": {k: round(v * args.batch / len(prompts), 2) for k, v in times.items()},
              "generate_over_static": round(times["generate"] / times["static"], 2),
              "same_continuations": f"{same}/{len(prompts)}", "mean_agreeing_prefix": round(sum(agree) / len(agree), 1)}
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
