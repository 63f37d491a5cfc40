"""Step time of ONNX Runtime engines against committed length and cache capacity (issue 13).

Every engine's steps are timed round-robin in one run (benchmarks/common.py: round_robin), so the
figures are ratios taken side by side. A step is a decoder forward over 1 (plain) or 8 (a tree of
8 slots) new tokens per sequence with `committed` cached tokens, in a cache allocated for
`capacity` tokens.

    python benchmarks/investigations/bench_engine_steps.py --engine old=build/e1 --engine new=build/e2 \\
        --committed 128,1024,4096 --capacity 512,8192 --batch 1,4 --slots 1,8 --threads 1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from common import round_robin, step_call  # noqa: E402

from medusa_trt.runtime.ort.backend import OrtBackend  # noqa: E402
from medusa_trt.runtime.ort.session import OrtSessionOptions  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", action="append", required=True, help="NAME=DIR (repeatable)")
    p.add_argument("--committed", default="128,1024,4096")
    p.add_argument("--capacity", default="512,8192")
    p.add_argument("--window", type=int, help="instead of --capacity: a cache of committed + slots + WINDOW keys "
                   "(issue-35-amphista.md, section aa)")
    p.add_argument("--batch", default="1,4")
    p.add_argument("--slots", default="1,8")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    torch.set_num_threads(1)
    engines = {k: OrtBackend(v, options=OrtSessionOptions(threads=args.threads)) for k, v in (e.split("=", 1) for e in args.engine)}
    calls = {}
    for name, be in engines.items():
        for b in ints(args.batch):
            for s in ints(args.slots):
                for c in ints(args.committed):
                    for cap in [c + s + args.window] if args.window is not None else ints(args.capacity):
                        if c + s <= cap:
                            calls[f"{name} b{b} s{s} committed {c} capacity {cap}"] = step_call(be, b, s, c, cap)
    results = round_robin(calls, args.rounds)
    for key, r in results.items():
        print(f"{key}: {r['median_ms']:.2f} ms (min {r['min_ms']:.2f})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
