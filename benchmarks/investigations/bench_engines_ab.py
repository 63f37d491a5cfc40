"""Two or more builds of an engine decoding the same prompts, taking turns prompt by prompt (the
first engine of each prompt alternates), plain and Medusa: whole-run tokens/s of each, their ratio
to the first engine's, whether each engine's Medusa decoded its own plain tokens, and whether its
plain decoded the first engine's. For a change to the engine's graphs or runtime, where two
medusa-bench runs one after the other differ by more than the change on a shared machine
(issue-35-amphista.md, section aa).

    python benchmarks/investigations/bench_engines_ab.py --engine old=build/eng4e --engine new=build/eng4w \
        --limit 32 --threads 1 --medusa-choices dynamic:16
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from common import DEFAULT_PROMPTS, read_prompts  # noqa: E402

from medusa_trt.runtime.decoding import GenerationConfig, decode  # noqa: E402
from medusa_trt.runtime.loading import load_tokenizer  # noqa: E402
from medusa_trt.runtime.ort.backend import OrtBackend  # noqa: E402
from medusa_trt.runtime.ort.session import OrtSessionOptions  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", action="append", required=True, help="NAME=DIR (repeatable; the first is the baseline)")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    p.add_argument("--limit", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--medusa-choices", default="dynamic:16")
    args = p.parse_args(argv)
    engines = {k: OrtBackend(v, options=OrtSessionOptions(threads=args.threads))
               for k, v in (e.split("=", 1) for e in args.engine)}
    first = next(iter(engines.values()))
    prompts = read_prompts(args.prompts, load_tokenizer(first.engine_dir), args.limit)
    modes = {"plain": GenerationConfig(max_new_tokens=args.max_new_tokens, use_medusa=False),
             "medusa": GenerationConfig(max_new_tokens=args.max_new_tokens, use_medusa=True,
                                        medusa_choices=args.medusa_choices)}
    seconds = {(e, m): 0.0 for e in engines for m in modes}
    tokens = {(e, m): [] for e in engines for m in modes}
    names = list(engines)
    for i, prompt in enumerate(prompts):
        order = names[i % len(names):] + names[:i % len(names)]
        for mode, cfg in modes.items():
            for name in order:
                t0 = time.perf_counter()
                out = decode(engines[name], [prompt.ids], cfg).tokens[0]
                seconds[name, mode] += time.perf_counter() - t0
                tokens[name, mode].append(out)
        print(f"prompt {i + 1}/{len(prompts)}", end="\r", file=sys.stderr)
    base = names[0]
    for mode in modes:
        n = {name: sum(map(len, tokens[name, mode])) for name in names}
        for name in names:
            # Medusa against the engine's own plain (exactness); plain against the first engine's plain.
            ref = (name, "plain") if mode == "medusa" else (base, "plain")
            print(f"{mode:6s} {name:10s} {n[name] / seconds[name, mode]:7.2f} tokens/s  "
                  f"{(n[name] / seconds[name, mode]) / (n[base] / seconds[base, mode]):.3f}x {base}  "
                  f"same tokens as {ref[0]} plain: {tokens[name, mode] == tokens[ref]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
