"""How much a held-out figure depends on its prompts, and how far the drafters generalize: the
drafters scored on the two parts of the pack's held-out set, prompts.json's 128 (the set of record
until 2026-11-27: 55 questions and 64 code windows once prompts the training side also has are left
out) and the 400 that `--stage pack` adds (`more_heldout`), per kind; with --fit, also on text of the
training side they trained on and on the recipe's validation slice, which they never trained on.
The continuations come from the corpus (`--stage cuda --decode-only` decodes held-out prompts first).

Besides the row-weighted top-1 (the figure of record: every drafting row counts once), each prompt's
own head-1 top-1 is averaged, with its standard error: a few long, repetitive continuations can carry
the row-weighted figure of a small set.

    python benchmarks/investigations/bench_heldout_parts.py --pack build/pack_v7.npz --fit

--fit rebuilds the validation slice from the pack's order of prompts, so it needs a pack with the
training prompts of the run that trained the shipped drafters: pack_v6 or pack_v7 (`--stage pack
--extra-code 10000`); the held-out set is the same in pack_v7 and later packs.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402
import train_smollm2_drafters as recipe  # noqa: E402

from medusa_trt import drafter_corpus  # noqa: E402

FIRST = 128  # prompts.json's held-out prompts, the pack's first
# The corpus the shipped drafters trained on (summary.json): its training-side list, shuffled as the
# recipe shuffles it, gives back their validation slice.
TRAINED_ON = ("part-20261126-222816-00.npz.xz", "part-20261127-013400-2f3d-00.npz.xz",
              "part-20261127-013400-2f3d-01.npz.xz")


def heldout_sets(corpus: list[Path], sets: dict) -> dict[str, list]:
    """The held-out continuations by part (record: prompts.json's; added: --stage pack's) and kind."""
    first = {drafter_corpus.prompt_key(q) for q in sets["eval"][0][:FIRST]}
    held, _, _ = recipe.corpus_text(sets, drafter_corpus.read(corpus)[0])
    if len(held) < len(sets["eval"][0]) // 2:
        raise SystemExit(f"{', '.join(map(str, corpus))}: continuations of {len(held)} of the pack's {len(sets['eval'][0])} held-out "
                         "prompts; expected most (decode them: --stage cuda --decode-only)")

    def part(s) -> str:
        return "record" if drafter_corpus.prompt_key(s.tokens[: s.prompt_len]) in first else "added"

    return {f"{where} {kind}": [s for s in held if where in ("all", part(s)) and kind in ("all", s.kind)]
            for where in ("record", "added", "all") for kind in ("chat", "code", "all")}


def fit_sets(corpus: Path, sets: dict, seed: int, val: int) -> dict[str, list]:
    """Training-side text of the shipped drafters by kind (first-turn questions, code, later turns):
    60 sequences they trained on, and the recipe's validation slice (never trained on)."""
    parts = [corpus / name for name in TRAINED_ON]
    for path in parts:
        if not path.is_file():
            raise SystemExit(f"{path}: missing; expected the corpus part the shipped drafters trained on")
    _, train, later = recipe.corpus_text(sets, drafter_corpus.read(parts)[0])
    order = list(range(len(train)))
    random.Random(seed + 3).shuffle(order)  # as cuda_stage sets its validation slice aside
    aside = set(order[:val])
    first = len(train) - later

    def kind(i: int) -> str:
        return "later" if i >= first else train[i].kind

    rng = random.Random(0)
    out = {}
    for k in ("chat", "code", "later"):
        out[f"trained-on {k}"] = rng.sample([train[i] for i in range(len(train)) if i not in aside and kind(i) == k], 60)
        out[f"validation {k}"] = [train[i] for i in sorted(aside) if kind(i) == k]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", type=Path, default=ROOT / "build/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--pack", type=Path, default=ROOT / "build/pack_v7.npz")
    p.add_argument("--corpus", type=Path, nargs="+", default=[ROOT / "data/drafter_corpus"],
                   help="corpus folders; the first holds the parts the shipped drafters trained on")
    p.add_argument("--drafters", type=Path, default=ROOT / "medusa_trt/assets/smollm2")
    p.add_argument("--fit", action="store_true", help="also the shipped drafters' training text and validation slice")
    p.add_argument("--seed", type=int, default=0, help="--fit: the training run's --seed")
    p.add_argument("--val", type=int, default=128, help="--fit: the training run's --val")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from medusa_trt.tools.train_drafter import accuracy, hit_counts

    pack = recipe.load_pack(args.pack)
    sets = recipe.prompt_sets(pack)
    groups = heldout_sets(args.corpus, sets)
    if args.fit:
        groups.update(fit_sets(args.corpus[0], sets, args.seed, args.val))
    model = recipe.load_base(args.gguf, torch.device("cpu"))
    samples = list({id(s): s for g in groups.values() for s in g}.values())
    kept = dict(zip(map(id, samples), recipe._hidden_kept(model, samples, 16), strict=True))
    groups = {name: [kept[id(s)] for s in g] for name, g in groups.items()}
    lm_head, embed = recipe.drafter_inputs(model)
    print("| set | prompts | rows | drafter | top-1 heads 1-4 (rows) | head 1, mean of prompts (median, s.e.) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for arch, (d, vocab) in recipe.load_drafters(json.loads(str(pack["config"])), args.drafters).items():
        counts = hit_counts(d, arch, list(kept.values()), lm_head, embed, vocab, id, topk=1)  # per sequence
        for name, g in groups.items():
            hits = sum(counts[id(s)][0] for s in g)
            total = sum(counts[id(s)][1] for s in g)
            # each prompt's own head-1 top-1, where its continuation has a drafting row
            one = [accuracy(*counts[id(s)])[0][0] for s in g if counts[id(s)][1][0] > 0]
            print(f"| {name} | {len(g)} | {sum(len(s.tokens) - s.prompt_len for s in g)} | {arch} | "
                  f"{' / '.join(f'{a[0]:.3f}' for a in accuracy(hits, total))} | {statistics.mean(one):.3f} "
                  f"({statistics.median(one):.3f}, {statistics.stdev(one) / math.sqrt(len(one)):.3f}) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
