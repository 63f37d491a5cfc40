"""Whether a per-step tree would pick better nodes if the drafter's probabilities were calibrated.

A dynamic tree scores a drafter node by the product of the drafter's probabilities along its path
(runtime/dynamic.py). That is the node's chance of acceptance only if each head's probability is its
chance of being right given that the path above it was. This script decodes training-side prompts the
shipped drafters never trained on (corpus parts after TRAINED_ON), greedily with the root-only tree
(the drafter runs at every position, the text is the base's greedy continuation), and records each
step's top-k per head. It prints, per head and probability bucket, the share of candidates that were
right given a right path above them, fits a monotone calibration on half of the prompts and replays
the other half: drafter-only trees and chains of each budget built from raw and from calibrated
scores, and the drafted tokens each accepts per step.

    python benchmarks/investigations/bench_drafter_calibration.py --engine build/b1127/engine_amphista --pack build/pack_v8.npz
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "benchmarks" / "investigations"))

import train_smollm2_drafters as recipe  # noqa: E402
from bench_heldout_parts import TRAINED_ON  # noqa: E402

import medusa_trt.runtime.steps as steps  # noqa: E402
from medusa_trt import drafter_corpus  # noqa: E402
from medusa_trt.runtime.config import GenerationConfig  # noqa: E402
from medusa_trt.runtime.decoding import generate  # noqa: E402
from medusa_trt.runtime.dynamic import best_paths, best_union_chain  # noqa: E402
from medusa_trt.runtime.loading import load_backend  # noqa: E402
from medusa_trt.runtime.ort.session import OrtSessionOptions  # noqa: E402

EDGES = np.log([1e-30, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.01])


def untrained_prompts(pack: Path, corpus: Path, n: int) -> list[list[int]]:
    """`n` prompts, code windows and later turns alternating, whose continuations are in corpus parts the
    shipped drafters did not train on (training side only: never a held-out prompt)."""
    parts = sorted(p for p in corpus.glob("*" + drafter_corpus.SUFFIX) if p.name not in TRAINED_ON)
    have, _ = drafter_corpus.read(parts, splits=("first", "later"))
    sets = recipe.prompt_sets(recipe.load_pack(pack))
    kinds: dict[str, list[list[int]]] = {"code": [], "chat": []}
    for split in ("first", "later"):
        for prompt, kind in zip(*sets[split], strict=True):
            if drafter_corpus.prompt_key(prompt) in have:
                kinds[kind].append(prompt)
    for prompts in kinds.values():
        random.Random(0).shuffle(prompts)
    return [p for pair in zip(kinds["code"], kinds["chat"], strict=False) for p in pair][:n]


def collect(engine: Path, prompts: list[list[int]], threads: int) -> list[list[tuple]]:
    """Per prompt, at every step: (top-k ids [H, k], log-probs [H, k], the H tokens that followed the root)."""
    from tqdm import tqdm

    seen: list = []
    hooked = steps.step_trees

    def record(tree, roots, top_ids, top_logp, context, **kw):
        seen.append((len(context.indexes[0].tokens), top_ids[0].numpy().copy(), top_logp[0].numpy().copy(), context))
        return hooked(tree, roots, top_ids, top_logp, context, **kw)

    steps.step_trees = record
    backend = load_backend(engine, ort_options=OrtSessionOptions(threads=threads))
    cfg = GenerationConfig(max_new_tokens=128, medusa_choices="dynamic:16,cost=1000")  # the root only
    out = []
    for prompt in tqdm(prompts, desc="decoding", mininterval=10):
        seen.clear()
        for _ in generate(backend, [prompt[-600:]], cfg):
            pass
        text = seen[-1][3].indexes[0].tokens
        heads = seen[0][1].shape[0]
        out.append([(ids, logp, text[at + 1 : at + 1 + heads]) for at, ids, logp, _ in seen if at + heads < len(text)])
    steps.step_trees = hooked
    return out


def buckets(records) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per head and bucket: candidates, right ones, summed probability; a head counts only where every
    head above it had the right token among its candidates (a path to it exists in the tree)."""
    heads = records[0][0].shape[0]
    n, right, p = (np.zeros((heads, len(EDGES) - 1)) for _ in range(3))
    for ids, logp, truth in records:
        for d in range(heads):
            b = np.searchsorted(EDGES, logp[d], side="right") - 1
            np.add.at(n[d], b, 1)
            np.add.at(right[d], b, ids[d] == truth[d])
            np.add.at(p[d], b, np.exp(logp[d]))
            if truth[d] not in ids[d]:
                break
    return n, right, p


def monotone(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Pool-adjacent-violators: the non-decreasing fit of y with weights w."""
    blocks: list[list[float]] = []
    for v, weight in zip(y, w, strict=True):
        blocks.append([v, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            b, a = blocks.pop(), blocks.pop()
            blocks.append([(a[0] * a[1] + b[0] * b[1]) / (a[1] + b[1]), a[1] + b[1], a[2] + b[2]])
    return np.array([v for v, _, k in blocks for _ in range(int(k))])


def accepted(nodes, truth: list[int]) -> int:
    paths = {p for _, p in nodes}
    a = 0
    while a < len(truth) and tuple(truth[: a + 1]) in paths:
        a += 1
    return a


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", type=Path, required=True, help="an engine of the shipped drafter (float32)")
    p.add_argument("--pack", type=Path, required=True, help="the recipe's pack (--stage pack)")
    p.add_argument("--corpus", type=Path, default=ROOT / "data" / "drafter_corpus")
    p.add_argument("--prompts", type=int, default=160)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    per_prompt = collect(args.engine, untrained_prompts(args.pack, args.corpus, args.prompts), args.threads)
    # Fit on every other prompt, replay the rest (steps of one prompt are alike).
    fit, test = ([r for prompt in per_prompt[i::2] for r in prompt] for i in (0, 1))
    n, right, prob = buckets(fit)
    print(f"{len(fit) + len(test)} steps of {len(per_prompt)} prompts. Per head: bucket's mean probability -> share right given a right path above (candidates)")
    for d in range(n.shape[0]):
        print(f"  head {d + 1}: " + "  ".join(f"{prob[d, b] / n[d, b]:.2f}->{right[d, b] / n[d, b]:.2f} ({int(n[d, b])})"
                                            for b in range(n.shape[1]) if n[d, b]))
    # Calibrated score of a bucket: its share right, one pseudo-candidate at its mean probability, made monotone.
    table = np.log(np.maximum(np.stack([monotone((right[d] + prob[d] / np.maximum(n[d], 1)) / (n[d] + 1), n[d] + 1)
                                        for d in range(n.shape[0])]), 1e-9))

    def calibrated(logp: np.ndarray) -> np.ndarray:
        return np.stack([table[d][np.searchsorted(EDGES, logp[d], side="right") - 1] for d in range(len(logp))])

    print("drafted tokens accepted per step (replay of the other half):")
    for budget in (2, 4, 8, 16):
        for chain in (False, True):
            got = []
            for score in (lambda lp: lp, calibrated):
                total = 0
                for ids, logp, truth in test:
                    nodes = best_paths(ids.tolist(), score(logp).tolist(), 8 * budget if chain else budget)
                    if chain:
                        nodes = best_union_chain({path: s for s, path in nodes}, budget)
                    total += accepted(nodes, truth)
                got.append(total / len(test))
            print(f"  budget {budget:2d} {'chain' if chain else 'tree '}: raw {got[0]:.3f}, calibrated {got[1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
