"""What keeping the base's hidden states as float16 or bfloat16 (the drafter recipe's --keep-hidden
with --kept-dtype) does to the teacher: the base's distribution softmax(lm_head(h)) from the rounded
state against the float32 one, per row, on the real base over the pack's later human turns.

    python benchmarks/investigations/bench_kept_dtype.py --pack build/pack_v5.npz \
        --gguf build/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --prompts 8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # the recipe puts the repo on the path

import train_smollm2_drafters as recipe  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pack", type=Path, required=True)
    p.add_argument("--gguf", type=Path, required=True)
    p.add_argument("--prompts", type=int, default=8, help="later turns read, from the 100th of the pack's")
    args = p.parse_args()
    pack = np.load(args.pack)
    prompts = recipe._unragged(pack["later"], pack["later_offsets"])[100 : 100 + args.prompts]
    model = recipe.load_base(args.gguf, torch.device("cpu"))
    w = model.lm_head.weight.float()
    kl = {torch.float16: [], torch.bfloat16: []}
    same = {dt: [] for dt in kl}
    largest = 0.0
    with torch.no_grad():
        for prompt in prompts:
            h = model.model(input_ids=torch.tensor([prompt])).last_hidden_state[0]
            largest = max(largest, h.abs().max().item())
            ref = torch.log_softmax(h @ w.T, -1)
            for dt in kl:
                got = torch.log_softmax(h.to(dt).float() @ w.T, -1)
                kl[dt].append((ref.exp() * (ref - got)).sum(-1))
                same[dt].append(ref.argmax(-1) == got.argmax(-1))
    rows = sum(len(x) for x in prompts)
    print(f"{len(prompts)} prompts, {rows} rows; largest |h| {largest:.1f} (float16 holds 65,504)")
    for dt in kl:
        k, s = torch.cat(kl[dt]), torch.cat(same[dt]).float()
        print(f"{str(dt)[6:]:>9}: KL to the float32 teacher mean {k.mean():.1e}, max {k.max():.1e}; "
              f"same top-1 {s.mean():.4f}")


if __name__ == "__main__":
    main()
