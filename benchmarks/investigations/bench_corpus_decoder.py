"""Could the product decode the drafter recipe's text faster on a CPU than the recipe's own decoder?
(issue 35, section u)

The recipe's cuda stage decodes its corpus with `scripts/batched_greedy.py` (torch, one batch). This
decodes the same pack prompts (code windows or later turns) with it, then with an ONNX Runtime engine
of the same base, plain and with the engine's drafter at a per-step tree, in batches, and says how
many continuations each gave the same as the torch decoder. The engine needs `--max-batch-size` at
least `--batch` (medusa-build).

    python benchmarks/investigations/bench_corpus_decoder.py --engine build/eng_b32 --pack build/pack_v8.npz \
        --gguf build/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --kind code --prompts 64
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import batched_greedy  # noqa: E402
from train_smollm2_drafters import load_base, load_pack, prompt_sets  # noqa: E402

from medusa_trt.runtime.config import GenerationConfig  # noqa: E402
from medusa_trt.runtime.decoding import decode  # noqa: E402
from medusa_trt.runtime.loading import load_backend  # noqa: E402
from medusa_trt.runtime.ort.session import OrtSessionOptions  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", type=Path, required=True, help="float32 engine of the base, with a drafter")
    p.add_argument("--pack", type=Path, required=True)
    p.add_argument("--gguf", type=Path, required=True)
    p.add_argument("--kind", choices=("code", "later"), default="code")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tree", default="dynamic:8")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    pack = load_pack(args.pack)
    sets, eos = prompt_sets(pack), int(pack["eos"])
    pool = ([q for q in sets["later"][0] if len(q) <= 600] if args.kind == "later"
            else [q for q, k in zip(*sets["first"], strict=True) if k == "code"])
    random.Random(1).shuffle(pool)
    prompts = sorted(pool[: args.prompts], key=len)
    print(f"{len(prompts)} {args.kind} prompts, {np.mean([len(q) for q in prompts]):.0f} tokens on average, "
          f"{args.new_tokens} new at most, {args.threads} threads")
    model = load_base(args.gguf, torch.device("cpu"))
    t = time.perf_counter()
    ref = batched_greedy.greedy(model, prompts, args.new_tokens, eos)
    seconds = time.perf_counter() - t
    print(f"torch static decoder, one batch: {sum(map(len, ref)) / seconds:.1f} tokens/s")
    backend = load_backend(args.engine, ort_options=OrtSessionOptions(threads=args.threads))
    for label, cfg in (("engine, plain", GenerationConfig(max_new_tokens=args.new_tokens, use_medusa=False,
                                                          stop_token_ids=(eos,))),
                       (f"engine, {args.tree}", GenerationConfig(max_new_tokens=args.new_tokens,
                                                                 medusa_choices=args.tree, stop_token_ids=(eos,)))):
        t = time.perf_counter()
        out = [c for i in range(0, len(prompts), args.batch) for c in decode(backend, prompts[i : i + args.batch], cfg).tokens]
        seconds = time.perf_counter() - t
        same = sum(a == b for a, b in zip(out, ref, strict=True))
        print(f"{label}, batches of {args.batch}: {sum(map(len, out)) / seconds:.1f} tokens/s, "
              f"{same}/{len(prompts)} continuations the same")


if __name__ == "__main__":
    main()
