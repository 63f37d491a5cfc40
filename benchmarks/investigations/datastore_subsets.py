"""Datastores of a random share of a corpus's training-side text, each beside an existing engine's
files (symlinks) in an engine dir of its own, for medusa-bench to compare with and without it: how
large a datastore must be to pay (docs/benchmarks/issue-35-amphista.md, t).

    python benchmarks/investigations/datastore_subsets.py --engine build/b1127/engine_amphista --shares 0.01,0.1 --out build/dsz
    medusa-bench --engine build/dsz/share_0.01 --prompts medusa_trt/assets/smollm2/prompts_heldout.jsonl --limit 32 --no-hf \\
        --threads 2 --spin --medusa-choices dynamic:16 --also dynamic:16/no-datastore
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from medusa_trt import datastore  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", type=Path, required=True, help="an engine dir (its files are linked, not copied)")
    p.add_argument("--corpus", type=Path, default=Path("data/drafter_corpus"))
    p.add_argument("--shares", default="0.01,0.1")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    vocab_size = json.loads((args.engine / "engine.json").read_text())["model"]["vocab_size"]
    sequences = datastore.read_source(args.corpus, args.engine, vocab_size)
    random.Random(args.seed).shuffle(sequences)
    for share in (float(x) for x in args.shares.split(",")):
        part = sequences[: max(1, int(len(sequences) * share))]
        out = args.out / f"share_{share:g}"
        out.mkdir(parents=True, exist_ok=True)
        for f in args.engine.resolve().iterdir():
            if f.name != datastore.FILE and not (out / f.name).exists():
                (out / f.name).symlink_to(f)
        store = datastore.build(part)
        datastore.save(store, out / datastore.FILE, source=f"{share:g} of {args.corpus}")
        print(f"{out}: {len(part)} sequences, {len(store)} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
