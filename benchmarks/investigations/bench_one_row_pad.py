"""What the one-row pad costs an int4 plain step (OrtBackend.pad_one_row): plain greedy decode on an
int4 engine with a lone row padded to two (what keeps Medusa == plain greedy on ONNX Runtime's AVX2
build) and without, the same prompts and session, alternating, best of --reps.

    python benchmarks/investigations/bench_one_row_pad.py --engine build/dyn/engine5_int4_amphista --threads 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from medusa_trt.runtime.config import GenerationConfig  # noqa: E402
from medusa_trt.runtime.decoding import generate  # noqa: E402
from medusa_trt.runtime.loading import load_backend, load_tokenizer  # noqa: E402
from medusa_trt.runtime.ort.session import OrtSessionOptions  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", type=Path, required=True, help="an int4 ONNX Runtime engine dir")
    p.add_argument("--prompts", type=Path, default=Path("medusa_trt/assets/smollm2/prompts_heldout.jsonl"))
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    tok = load_tokenizer(args.engine)
    prompts = [tok.encode(json.loads(line)["text"]) for line in args.prompts.open()][: args.limit]
    backend = load_backend(args.engine, ort_options=OrtSessionOptions(threads=args.threads, spin=True))
    if not backend.pad_one_row:
        print(f"{args.engine}: pad_one_row is off here (not an int4 engine, or this CPU's one-row kernel matches)")
    cfg = GenerationConfig(max_new_tokens=args.new_tokens, use_medusa=False)
    best = {True: float("inf"), False: float("inf")}
    for _ in range(args.reps):
        for pad in (True, False):
            backend.pad_one_row = pad
            seconds, steps = 0.0, 0
            for prompt in prompts:
                it = generate(backend, [prompt], cfg)
                next(it)  # the prefill and its token: not a decode step
                t0 = time.perf_counter()
                steps += sum(1 for _ in it)
                seconds += time.perf_counter() - t0
            best[pad] = min(best[pad], seconds / steps * 1e3)
    print(f"{args.threads} thread(s): ms per plain decode step, padded to two rows {best[True]:.2f}, one row "
          f"{best[False]:.2f}: the pad costs {100 * (best[True] / best[False] - 1):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
