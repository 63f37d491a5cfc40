"""Host cost of trees chosen per step: the choice (runtime/dynamic.py: step_trees, the context lookup
included) per step, for each budget, beside the engine step it precedes.

    .venv/bin/python benchmarks/bench_step_trees.py --engine build/dyn/engine3_amphista \
        --prompts medusa_trt/assets/smollm2/prompts_heldout.jsonl --budgets 4,8,16

Decodes each prompt with dynamic:N on the engine, timing every step_trees call and every engine
call (the backend's fused_step), and prints the choice's share of a step.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from medusa_trt.runtime import dynamic, steps
from medusa_trt.runtime.decoding import GenerationConfig, decode
from medusa_trt.runtime.loading import load_backend, load_tokenizer
from medusa_trt.runtime.ort.session import OrtSessionOptions


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", type=Path, required=True)
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--budgets", default="4,8,16")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    backend = load_backend(args.engine, ort_options=OrtSessionOptions(threads=args.threads))
    tok = load_tokenizer(args.engine)
    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()][: args.limit]
    prompts = [tok.encode(r["text"]) for r in rows]
    spent = {"choice": 0.0, "engine": 0.0, "steps": 0}

    def timed(fn, key):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[key] += time.perf_counter() - t0
        return wrapper

    steps.step_trees = timed(dynamic.step_trees, "choice")  # the name the decoding steps call
    backend.fused_step = timed(backend.fused_step, "engine")
    print(f"{'budget':>8}{'steps':>8}{'choice us/step':>16}{'engine ms/step':>16}{'choice share':>14}")
    for budget in (int(b) for b in args.budgets.split(",")):
        cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, medusa_choices=f"dynamic:{budget}")
        decode(backend, prompts[:1], cfg)  # warm-up
        spent.update(choice=0.0, engine=0.0)
        n = sum(s.steps for p in prompts for s in decode(backend, [p], cfg).stats)
        print(f"{budget:>8}{n:>8}{spent['choice'] / n * 1e6:>16.0f}{spent['engine'] / n * 1e3:>16.2f}"
              f"{spent['choice'] / (spent['choice'] + spent['engine']):>14.2%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
