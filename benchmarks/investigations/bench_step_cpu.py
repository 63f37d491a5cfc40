"""Single-thread step cost of ONNX Runtime engines as the calling thread's CPU time (issue 13).

A 1-thread ONNX Runtime session runs on the calling thread, so its CPU time barely moves when other
processes load the machine (wall time does). Engines take turns (round robin); each row is the
median over rounds of the median of 5 steps, committed 128, capacity 512; ratios to the first engine.

    python benchmarks/investigations/bench_step_cpu.py --rounds 9 base=build/e1 fused=build/e2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from common import step_call  # noqa: E402

from medusa_trt.runtime.ort.backend import OrtBackend  # noqa: E402
from medusa_trt.runtime.ort.session import OrtSessionOptions  # noqa: E402

SHAPES = [(1, 1), (1, 4), (4, 1), (4, 4)]  # (batch, slots)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("engines", nargs="+", help="NAME=DIR")
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    engines = {k: OrtBackend(v, options=OrtSessionOptions(threads=1)) for k, v in (a.split("=", 1) for a in args.engines)}
    calls = {(n, b, s): step_call(be, b, s, 128, 512) for n, be in engines.items() for b, s in SHAPES}
    for f in calls.values():
        f()
    samples: dict = {k: [] for k in calls}
    for _ in range(args.rounds):
        for k, f in calls.items():
            ts = []
            for _ in range(5):
                t = time.thread_time()
                f()
                ts.append(time.thread_time() - t)
            samples[k].append(statistics.median(ts))
    first = next(iter(engines))
    for b, s in SHAPES:
        base = statistics.median(samples[(first, b, s)])
        print(f"batch {b} slots {s}: " + "  ".join(
            f"{n} {statistics.median(samples[(n, b, s)]) * 1e3:.2f} ms ({statistics.median(samples[(n, b, s)]) / base:.3f})"
            for n in engines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
