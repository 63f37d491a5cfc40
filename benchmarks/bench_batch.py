"""Batched decoding on one engine: Medusa vs plain throughput at batch B with ragged prompts (issue 13).

Held-out prompts (code and chat alternating) in groups of B (their lengths differ, so every batch is
ragged); per group, plain
greedy and Medusa greedy decode the same batch back to back, the order alternating between groups so
drift on a shared machine hits both alike. Figures: tokens/s of each (new tokens over wall time of
the whole batch), Medusa's speedup, tokens per step, and whether Medusa's tokens equal plain's.

    python benchmarks/bench_batch.py --engine build/real/engine [--batch 4] [--groups 8]
        [--medusa-choices medusa_trt/assets/smollm2/tree.json] [--threads 1] [--spin] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from common import read_prompts  # the held-out prompts as the peers benchmark renders them
from tqdm import tqdm

from medusa_trt.runtime.decoding import GenerationConfig, decode
from medusa_trt.runtime.loading import load_backend, load_tokenizer, stop_tokens
from medusa_trt.runtime.ort.session import OrtSessionOptions

ASSETS = Path(__file__).resolve().parents[1] / "medusa_trt" / "assets" / "smollm2"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_batch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", type=Path, required=True)
    p.add_argument("--prompts", type=Path, default=ASSETS / "prompts_heldout.jsonl")
    p.add_argument("--medusa-choices", default=str(ASSETS / "tree.json"))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--spin", action="store_true")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)

    backend = load_backend(args.engine, ort_options=OrtSessionOptions(threads=args.threads, spin=args.spin))
    tok = load_tokenizer(args.engine)
    stops = stop_tokens(args.engine, tok)
    prompts = read_prompts(args.prompts, tok, args.batch * args.groups)
    code = [q.ids for q in prompts if q.kind == "code"]
    chat = [q.ids for q in prompts if q.kind == "chat"]
    ids = [x for pair in zip(code, chat, strict=False) for x in pair]  # code and chat mixed in every batch
    batches = [ids[i:i + args.batch] for i in range(0, len(ids), args.batch) if len(ids[i:i + args.batch]) == args.batch]
    cfgs = {"plain": GenerationConfig(max_new_tokens=args.max_new_tokens, use_medusa=False, stop_token_ids=stops),
            "medusa": GenerationConfig(max_new_tokens=args.max_new_tokens, medusa_choices=args.medusa_choices,
                                       stop_token_ids=stops)}
    for cfg in cfgs.values():  # first calls pay for allocation and open the mode's session
        decode(backend, batches[0], cfg)
    totals = {m: {"tokens": 0, "wall_s": 0.0, "steps": 0} for m in cfgs}
    equal = 0
    for g, batch in enumerate(tqdm(batches, desc="bench_batch", file=sys.stderr)):
        outs = {}
        for mode in (("plain", "medusa") if g % 2 == 0 else ("medusa", "plain")):
            t = time.perf_counter()
            res = decode(backend, batch, cfgs[mode])
            totals[mode]["wall_s"] += time.perf_counter() - t
            totals[mode]["tokens"] += sum(len(x) for x in res.tokens)
            totals[mode]["steps"] += sum(s.steps for s in res.stats)
            outs[mode] = res.tokens
        equal += outs["plain"] == outs["medusa"]
    rate = {m: v["tokens"] / v["wall_s"] for m, v in totals.items()}
    report = {"engine": str(args.engine), "batch": args.batch, "groups": len(batches), "threads": args.threads,
              "spin": args.spin, "medusa_choices": args.medusa_choices, "max_new_tokens": args.max_new_tokens,
              "plain_tokens_per_s": round(rate["plain"], 2), "medusa_tokens_per_s": round(rate["medusa"], 2),
              "speedup": round(rate["medusa"] / rate["plain"], 3),
              "tokens_per_step": round(totals["medusa"]["tokens"] / max(totals["medusa"]["steps"], 1), 3),
              "batches_equal_to_plain": f"{equal}/{len(batches)}"}
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
