"""What does one more row cost an int4 model's MatMulNBits, with the weights streamed as in a step,
and does cutting a matrix into narrower ones change it? (issue 35, section u)

bench_int4_rows.py times one decoder layer's matrices hot in cache. A step reads all of a model's
(~80 MB for SmolLM2-135M) once, so this builds one graph of `--layers` copies of a matrix shape,
each with its own random int4 weights quantized as `medusa-build --weights int4` does, and times it
at 1-8 rows. `--split` cuts each copy along N into that many matrices of N/split columns: if a row
costs a re-read of weights that fell out of cache, narrower matrices (which stay in L2 while the
kernel goes over the rows) cost less per row; if it costs arithmetic, they cost the same.
`--prefill` times prompt-sized row counts instead (or `--rows`), against the same matrices computed
by level 0 (float arithmetic over the int4 blocks), by float32 MatMul, and (`int8`) as `medusa-build
--weights int8` computes them: each row rounded to int8 by its own scale, MatMulInteger over int8
weights, the scales (issue-35-amphista.md, section x).

    python benchmarks/investigations/bench_int4_row_cost.py [--threads 1] [--split 1,4]
    python benchmarks/investigations/bench_int4_row_cost.py --prefill [--rows 1,4,8,64,256] [--kernels level4,int8]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from onnx import TensorProto, helper, numpy_helper

from medusa_trt.quant import quantize_int4
from medusa_trt.runtime.ort.session import OrtSessionOptions, session_options

ROWS = (1, 2, 3, 4, 6, 8)
# SmolLM2-135M's matrices as (N, K), and how many of each a step reads: 30 layers and the lm_head.
SHAPES = {"qkv": ((960, 576), 30), "o": ((576, 576), 30), "gate_up": ((3072, 576), 30),
          "down": ((576, 1536), 30), "lm_head": ((49152, 576), 1)}


def session(n: int, k: int, copies: int, split: int, threads: int, kernel: str = "level4"):
    """`copies` x `split` nodes of [N / split, K], all reading input A: MatMulNBits (block 32) at accuracy
    level 4 or 0 over random int4 weights, or ("float32") MatMul over the float weights."""
    import onnxruntime as ort

    g = torch.Generator().manual_seed(n + k)
    if kernel == "int8":
        return int8_session(n, k, copies, threads, g)
    nodes, weights, outputs = [], [], []
    for i in range(copies * split):
        w = torch.randn(n // split, k, generator=g) * 0.05
        if kernel == "float32":
            nodes.append(helper.make_node("MatMul", ["A", f"W{i}"], [f"Y{i}"]))
            weights.append(numpy_helper.from_array(w.T.contiguous().numpy(), f"W{i}"))
        else:
            packed, scales, zero_points = (t.numpy() for t in quantize_int4(w, 32))
            nodes.append(helper.make_node("MatMulNBits", ["A", f"B{i}", f"S{i}", f"Z{i}"], [f"Y{i}"],
                                          domain="com.microsoft", K=k, N=n // split, bits=4, block_size=32,
                                          accuracy_level=int(kernel[-1])))
            weights += [numpy_helper.from_array(packed, f"B{i}"), numpy_helper.from_array(scales.reshape(-1), f"S{i}"),
                        numpy_helper.from_array(zero_points, f"Z{i}")]
        outputs.append(helper.make_tensor_value_info(f"Y{i}", TensorProto.FLOAT, ["M", n // split]))
    graph = helper.make_graph(nodes, "rows", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])], outputs,
                              weights)
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21),
                                                                   helper.make_opsetid("com.microsoft", 1)])
    return ort.InferenceSession(model.SerializeToString(), session_options(OrtSessionOptions(threads=threads)),
                                providers=["CPUExecutionProvider"])


def int8_session(n: int, k: int, copies: int, threads: int, g: torch.Generator):
    """`copies` int8 layers [N, K] as an int8 engine's graph holds them (quant.Int8Linear, exported
    by engines/onnx/ops.py: each rounds the input's rows itself, as each Linear of an engine does)."""
    import onnxruntime as ort

    from medusa_trt.engines.onnx.ops import export_int8_matmul, int8_translations
    from medusa_trt.quant import Int8Linear

    torch.manual_seed(g.initial_seed())
    layers = torch.nn.ModuleList(Int8Linear(torch.nn.Linear(k, n, bias=False)) for _ in range(copies))
    for m in layers:
        m.matmul = export_int8_matmul

    class All(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = layers

        def forward(self, a):
            return tuple(m(a) for m in self.layers)

    program = torch.onnx.export(All(), (torch.randn(3, k),), dynamo=True, opset_version=23, verbose=False,
                                custom_translation_table=int8_translations(), dynamic_shapes=({0: "M"},))
    return ort.InferenceSession(program.model_proto.SerializeToString(),
                                session_options(OrtSessionOptions(threads=threads)), providers=["CPUExecutionProvider"])


def median_ms(s, rows: int, k: int, calls: int = 15, rounds: int = 2) -> float:
    """The best of `rounds` medians of `calls` runs (the machine is shared and noisy)."""
    a = np.random.default_rng(rows).standard_normal((rows, k), dtype=np.float32)
    best = float("inf")
    for _ in range(rounds):
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            s.run(None, {s.get_inputs()[0].name: a})
            times.append(time.perf_counter() - t)
        best = min(best, float(np.median(times)) * 1e3)
    return best


def prefill(threads: int, rows: tuple[int, ...] = (16, 64, 256),
            kernels: tuple[str, ...] = ("level4", "level0", "float32", "int8")) -> None:
    """Every matrix a step reads at prompt-sized row counts, by each of `kernels`."""
    total = {(kn, r): 0.0 for kn in kernels for r in rows}
    for (n, k), copies in SHAPES.values():
        for kn in kernels:
            s = session(n, k, copies, 1, threads, kn)
            for r in rows:
                total[(kn, r)] += median_ms(s, r, k, calls=5)
    print(f"all matrices, ms per run ({threads} thread(s)), and ms per row")
    for r in rows:
        print(f"{r:4d} rows: " + "  ".join(f"{kn} {total[(kn, r)]:7.1f} ({total[(kn, r)] / r:.2f})" for kn in kernels))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--split", default="1,4", help="comma-separated ways to cut each matrix along N")
    p.add_argument("--prefill", action="store_true", help="prompt-sized row counts, by several kernels")
    p.add_argument("--rows", default="16,64,256", help="--prefill: comma-separated row counts")
    p.add_argument("--kernels", default="level4,level0,float32,int8", help="--prefill: comma-separated kernels")
    args = p.parse_args()
    if args.prefill:
        prefill(args.threads, tuple(int(r) for r in args.rows.split(",")), tuple(args.kernels.split(",")))
        return
    print(f"ms per run, {args.threads} thread(s); the last column: ms per row from 2 to 8 rows, and multiply-adds "
          "per second of it")
    total = dict.fromkeys(ROWS, 0.0)
    for name, ((n, k), copies) in SHAPES.items():
        for split in (int(s) for s in args.split.split(",")):
            s = session(n, k, copies, split, args.threads)
            ms = {r: median_ms(s, r, k) for r in ROWS}
            if split == 1:
                total = {r: total[r] + ms[r] for r in ROWS}
            per_row = (ms[8] - ms[2]) / 6
            print(f"{name:8s} {copies:2d} x {n}x{k}, split {split}: " + "  ".join(f"{r}:{ms[r]:6.2f}" for r in ROWS)
                  + f"  | {per_row:.3f} ms/row, {copies * n * k / per_row / 1e6:.0f} GMAC/s")
    print("all, unsplit: " + "  ".join(f"{r}:{total[r]:6.2f}" for r in ROWS)
          + f"  | {(total[8] - total[2]) / 6:.3f} ms/row")


if __name__ == "__main__":
    main()
