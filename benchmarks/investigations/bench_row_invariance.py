"""Does an engine compute a position the same in a one-row step and inside a many-row forward?
And where Medusa greedy departs from plain greedy, how close was the base's top-2 there? (issue 13)

Float32 engines differ only by rounding (~1e-5), so Medusa greedy equals plain greedy. In int4
engines (MatMulNBits at accuracy level 4) float32 rounding noise reaches an int8 rounding of the
activations and moves whole quanta, so the int4 attention forms (`chain_f32`, the default, and
`row_exact_f32`) give a row the same bits whatever the step's row count; on CPUs whose MatMulNBits
has a one-row kernel, the backend runs one-token steps and lone logits rows as two rows
(OrtBackend.pad_one_row). Three ways to compute the last prompt position's logits are compared: a
prefill of the whole prompt, one one-token step after the rest, and the second row of a two-token
chain step (the layout of a Medusa tree step's rows).

    python benchmarks/investigations/bench_row_invariance.py build/real/engine build/real/engine_int4 [--prompts 8]
        [--diverge 32 --medusa-choices-int4 medusa_trt/assets/smollm2/tree_int4.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from common import read_prompts  # noqa: E402  (the held-out prompts as the peers benchmark renders them)

from medusa_trt.runtime.decoding import GenerationConfig, decode  # noqa: E402
from medusa_trt.runtime.loading import load_backend, load_tokenizer, stop_tokens  # noqa: E402
from medusa_trt.runtime.ort.session import OrtSessionOptions  # noqa: E402
from medusa_trt.runtime.steps import prefill  # noqa: E402

ASSETS = Path(__file__).resolve().parents[2] / "medusa_trt" / "assets" / "smollm2"


def row_difference(backend, prompts) -> dict:
    """The last position's logits: prefill of the whole prompt, and a one-token step after the rest,
    each against the second row of a two-token step (a chain tree's rows)."""
    diffs, flips = {"prefill": [], "one_row_step": []}, 0
    for q in prompts:
        ids = q.ids
        backend.start(1, len(ids) + 4)
        many, _, _ = prefill(backend, [ids])
        backend.start(1, len(ids) + 4)
        prefill(backend, [ids[:-1]])
        one, _ = backend.forward(torch.tensor([[ids[-1]]]), backend.lengths[:, None],
                                 torch.ones(1, 1, 1, dtype=torch.bool), with_heads=False)
        backend.start(1, len(ids) + 4)
        prefill(backend, [ids[:-2]])
        chain, _ = backend.forward(torch.tensor([ids[-2:]]), backend.lengths[:, None] + torch.arange(2),
                                   torch.ones(1, 2, 2, dtype=torch.bool).tril(), with_heads=False)
        diffs["prefill"].append(float((many[0] - chain[0, 1]).abs().max()))
        diffs["one_row_step"].append(float((one[0, 0] - chain[0, 1]).abs().max()))
        flips += int(one[0, 0].argmax() != chain[0, 1].argmax())
    return {**{f"{k}_vs_chain_max_abs_logit_diff": max(v) for k, v in diffs.items()}, "argmax_flips": flips}


def divergence(backend, prompts, tree, stops) -> dict:
    """Medusa vs plain greedy per prompt; at the first differing token, the base's top-2 margin."""
    plain = GenerationConfig(max_new_tokens=128, use_medusa=False, stop_token_ids=stops)
    medusa = GenerationConfig(max_new_tokens=128, medusa_choices=tree, stop_token_ids=stops)
    margins = []
    for q in tqdm(prompts, desc="divergence", file=sys.stderr):
        p, m = decode(backend, [q.ids], plain).tokens[0], decode(backend, [q.ids], medusa).tokens[0]
        if p == m:
            continue
        i = next((k for k in range(min(len(p), len(m))) if p[k] != m[k]), min(len(p), len(m)))
        backend.start(1, len(q.ids) + len(p) + 4)
        logits, _, _ = prefill(backend, [q.ids + p[:i]])
        top = logits[0].topk(2).values
        margins.append(float(top[0] - top[1]))
    return {"prompts": len(prompts), "equal_to_plain": len(prompts) - len(margins),
            "top2_margin_at_divergence_median": statistics.median(margins) if margins else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_row_invariance", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engines", nargs="+", type=Path)
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts for the row comparison")
    p.add_argument("--diverge", type=int, default=0, help="held-out prompts for the divergence analysis (0: skip)")
    p.add_argument("--medusa-choices", default=str(ASSETS / "tree.json"))
    p.add_argument("--medusa-choices-int4", default=str(ASSETS / "tree_int4.json"))
    args = p.parse_args(argv)
    report = {}
    for engine in args.engines:
        backend, tok = load_backend(engine, ort_options=OrtSessionOptions(threads=1)), load_tokenizer(engine)
        prompts = read_prompts(ASSETS / "prompts_heldout.jsonl", tok, max(args.prompts, args.diverge))
        report[str(engine)] = row_difference(backend, prompts[: args.prompts])
        if args.diverge:
            int4 = json.loads((engine / "engine.json").read_text()).get("weights", {}).get("format") == "int4"
            tree = args.medusa_choices_int4 if int4 else args.medusa_choices
            report[str(engine)].update(divergence(backend, prompts[: args.diverge], tree, stop_tokens(engine, tok)))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
