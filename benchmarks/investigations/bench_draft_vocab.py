"""What the draft vocabulary costs the drafters' accuracy: how many held-out targets each vocabulary
holds (a target outside it is a miss whatever the drafter does), and held-out top-1 per head of saved
drafters scored over their own vocabulary, wider ones (their own plus the training text's most
frequent targets) and the full vocabulary, without retraining. The drafters' output rows are the
base's lm_head rows, so a wider vocabulary adds no parameters, only rows to score each step.

    python benchmarks/investigations/bench_draft_vocab.py --pack build/pack_v8.npz \
        --gguf build/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --sizes 8192,16384
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # the recipe puts the repo on the path

import train_smollm2_drafters as recipe  # noqa: E402

from medusa_trt import drafter_corpus  # noqa: E402
from medusa_trt.tools.train_drafter import coverage, evaluate, target_counts  # noqa: E402


def widened(own: torch.Tensor, by_count: torch.Tensor, size: int) -> torch.Tensor:
    """`own` plus the most frequent targets it lacks, `size` tokens in all (sorted ids)."""
    extra = by_count[~torch.isin(by_count, own)][: max(0, size - len(own))]
    return torch.cat([own, extra]).sort().values


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pack", type=Path, required=True)
    p.add_argument("--gguf", type=Path, required=True)
    p.add_argument("--corpus", type=Path, default=recipe.REPO / "data" / "drafter_corpus")
    p.add_argument("--drafters", type=Path, default=recipe.REPO / "medusa_trt" / "assets" / "smollm2")
    p.add_argument("--sizes", default="8192,16384", help="wider vocabularies to score, in tokens")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    pack = recipe.load_pack(args.pack)
    held, train, _ = recipe.corpus_text(recipe.prompt_sets(pack), drafter_corpus.read([args.corpus])[0])
    model = recipe.load_base(args.gguf, torch.device("cpu"))
    lm_head, embed = recipe.drafter_inputs(model)
    by_count = torch.argsort(target_counts(train, lm_head.shape[0]), descending=True)
    held = recipe._hidden_kept(model, held, 16)
    counts = {"all": target_counts(held, lm_head.shape[0]),  # the held-out targets, counted once
              **{k: target_counts([s for s in held if s.kind == k], lm_head.shape[0]) for k in sorted({s.kind for s in held})}}
    report = {}
    for arch, (drafter, own) in recipe.load_drafters(json.loads(str(pack["config"])), args.drafters).items():
        vocabs = {f"own ({len(own)})": own, **{str(n): widened(own, by_count, n) for n in map(int, args.sizes.split(","))},
                  "full": None}
        for name, vocab in vocabs.items():
            row = {"coverage": {k: round(coverage(c, vocab), 4) if vocab is not None else 1.0 for k, c in counts.items()},
                   "top1": [a[0] for a in evaluate(drafter, arch, held, lm_head, embed, vocab)]}
            report[f"{arch} {name}"] = row
            print(f"{arch}, vocabulary {name}: held-out targets covered {row['coverage']}, top-1 {row['top1']}",
                  flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
