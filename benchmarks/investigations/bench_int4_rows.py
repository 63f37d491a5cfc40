"""What does an int4 decoder layer's MatMulNBits cost at 1, 2, 3, 4 and 8 rows? (issue 13)

A Medusa step verifies a tree: every tree slot is one more row through every weight matrix. When a
matrix's cost is flat in the row count (reading the weights dominates), extra slots are nearly free
and a tree pays off; when it grows with the rows, each slot costs a share of a plain step and only
nodes accepted more often than that share pay. This times one decoder layer's four MatMulNBits
(fused QKV, output projection, fused gate+up, down) of a model config at each row count, at the
accuracy levels ONNX Runtime's CPU kernel has, with random int4 weights quantized the way
`medusa-build --weights int4` quantizes them (quant.quantize_int4).

    python benchmarks/investigations/bench_int4_rows.py [--checkpoint build/real/ckpt] [--threads 1,2] [--spin] [--block-size 32]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from medusa_trt.quant import INT4_ACCURACY_LEVELS
from medusa_trt.runtime.ort.session import OrtSessionOptions, matmul_nbits_session

ROWS = (1, 2, 3, 4, 8)
# SmolLM2-135M (hidden 576, 9 query heads and 3 KV heads of 64, MLP 1536) when no checkpoint is named.
DEFAULT_SHAPES = {"hidden": 576, "heads": 9, "kv_heads": 3, "head_dim": 64, "intermediate": 1536}


def layer_shapes(checkpoint: Path | None) -> dict[str, tuple[int, int]]:
    """(K, N) of one decoder layer's four matrices, from a merged checkpoint's config.json."""
    c = dict(DEFAULT_SHAPES)
    if checkpoint is not None:
        cfg = json.loads((checkpoint / "config.json").read_text())
        c = {"hidden": cfg["hidden_size"], "heads": cfg["num_attention_heads"],
             "kv_heads": cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
             "intermediate": cfg["intermediate_size"]}
        c["head_dim"] = cfg.get("head_dim") or c["hidden"] // c["heads"]
    d, hd = c["hidden"], c["head_dim"]
    return {"qkv": (d, (c["heads"] + 2 * c["kv_heads"]) * hd), "o": (c["heads"] * hd, d),
            "gate_up": (d, 2 * c["intermediate"]), "down": (c["intermediate"], d)}


def matmul_session(k: int, n: int, block_size: int, level: int, threads: int, spinning: bool):
    """One MatMulNBits node over random int4 weights [N, K], in a session with the engine's options."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n * 7 + k)) * 0.05
    return matmul_nbits_session(w, block_size, level, OrtSessionOptions(threads=threads, spin=spinning))


def best_us(session, rows: int, k: int, calls: int = 200, repeats: int = 5) -> float:
    """Fastest mean call time over `repeats` rounds of `calls` (the machine is shared and noisy)."""
    a = np.random.default_rng(rows).standard_normal((rows, k), dtype=np.float32)
    for _ in range(20):
        session.run(None, {"A": a})
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            session.run(None, {"A": a})
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, help="merged checkpoint whose config gives the shapes "
                   "(default: SmolLM2-135M's)")
    p.add_argument("--threads", default="1,2", help="comma-separated intra-op thread counts")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--spin", action="store_true", help="spinning worker threads (bench_peers.py --spin)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()
    shapes = layer_shapes(args.checkpoint)
    threads = [int(t) for t in args.threads.split(",")]
    runs = [(t, lvl, name) for t in threads for lvl in INT4_ACCURACY_LEVELS for name in shapes]
    us: dict = {}
    for t, level, name in tqdm(runs, desc="MatMulNBits", unit="matrix"):
        k, n = shapes[name]
        session = matmul_session(k, n, args.block_size, level, t, args.spin)
        for rows in ROWS:
            us[(t, level, name, rows)] = best_us(session, rows, k)
    print(f"\none decoder layer's MatMulNBits (block {args.block_size}; shapes K x N: "
          + ", ".join(f"{n} {k}x{nn}" for n, (k, nn) in shapes.items()) + ")")
    print("| threads | accuracy level | " + " | ".join(f"{r} row{'s' if r > 1 else ''}" for r in ROWS) + " |")
    print("|---|---|" + "---|" * len(ROWS))
    table = []
    for t in threads:
        for level in INT4_ACCURACY_LEVELS:
            total = [sum(us[(t, level, name, r)] for name in shapes) for r in ROWS]
            cells = [f"{total[0]:.0f} us"] + [f"{x:.0f} us ({x / total[0]:.2f}x)" for x in total[1:]]
            print(f"| {t} | {level} | " + " | ".join(cells) + " |")
            table.append({"threads": t, "accuracy_level": level, "us": dict(zip(ROWS, total, strict=True))})
    if args.json:
        args.json.write_text(json.dumps({"shapes": shapes, "block_size": args.block_size, "layer": table,
                                         "per_matrix_us": {f"{t}/{lvl}/{n}/{r}": v for (t, lvl, n, r), v in us.items()}},
                                        indent=1))


if __name__ == "__main__":
    main()
