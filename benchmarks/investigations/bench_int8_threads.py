"""What a second thread buys an int8 engine's matrix products at batch 1 (issue 35, section aj).

An int8 plain step gains less from a second thread than llama.cpp's Q8_0 on a CPU without VNNI
(section ai). This times one graph shaped as SmolLM2-135M's 30 layers of Linears, each feeding the
next as in a step (fused qkv 576 -> 960, o, fused gate_up 576 -> 3072, down 1536 -> 576), random
weights, in three forms at 1 and 2 threads:
- `per-row`: each Linear as an int8 engine runs it (ops._matmul_int8_translation: Abs, ReduceMax,
  Div, Max, the zero point's QuantizeLinear, the row's QuantizeLinear, MatMulIntegerToFloat, Mul),
  weights read as uint8 as int8_weights_as_unsigned does where the u8 x s8 kernel saturates;
- `static`: one QuantizeLinear by a constant scale, then the same MatMulIntegerToFloat and Mul (not
  exact per row across steps of different row counts' scales, only a bound: the product alone);
- `float32`: MatMul over float32 weights.

    python benchmarks/investigations/bench_int8_threads.py [--rows 1,5] [--threads 1,2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from onnx import TensorProto, helper, numpy_helper

LAYERS = 30
D, FFN, QKV = 576, 1536, 960


def graph(form: str, layers: int = LAYERS):
    """The chain of `layers` layers of Linears in `form` ("per-row", "static", "float32")."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []

    def const(name: str, value) -> str:
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    const("c127", np.float32(127))
    const("min_scale", np.float32(np.finfo(np.float32).tiny))
    const("max_float", np.float32(np.finfo(np.float32).max))
    const("zero128", np.uint8(128))
    const("one", np.float32(1))
    const("last_axis", np.array([-1], np.int64))
    const("static_scale", np.float32(0.02))

    def linear(x: str, k: int, n: int, i: int) -> str:
        w = rng.integers(-127, 128, (k, n))
        if form == "float32":
            nodes.append(helper.make_node("MatMul", [x, const(f"w{i}", (w * 1e-3).astype(np.float32))], [f"y{i}"]))
            return f"y{i}"
        const(f"w{i}", (w + 128).astype(np.uint8))
        const(f"col{i}", rng.random(n).astype(np.float32) * 1e-3)
        if form == "per-row":
            nodes.extend([
                helper.make_node("Abs", [x], [f"abs{i}"]),
                helper.make_node("ReduceMax", [f"abs{i}", "last_axis"], [f"max{i}"], keepdims=1),
                helper.make_node("Div", [f"max{i}", "c127"], [f"div{i}"]),
                helper.make_node("Max", [f"div{i}", "min_scale"], [f"s{i}"]),
                helper.make_node("QuantizeLinear", [f"s{i}", "max_float", "zero128"], [f"z{i}"], axis=1),
                helper.make_node("QuantizeLinear", [x, f"s{i}", f"z{i}"], [f"q{i}"], axis=-1, block_size=k)])
            scale = f"s{i}"
        else:
            nodes.append(helper.make_node("QuantizeLinear", [x, "static_scale", "zero128"], [f"q{i}"]))
            scale = "static_scale"
        nodes.append(helper.make_node("MatMulIntegerToFloat", [f"q{i}", f"w{i}", "one", f"col{i}", "zero128", "zero128"],
                                      [f"p{i}"], domain="com.microsoft"))
        nodes.append(helper.make_node("Mul", [f"p{i}", scale], [f"y{i}"]))
        return f"y{i}"

    x = "x"
    for layer in range(layers):
        i = 4 * layer
        nodes.append(helper.make_node("Split", [linear(x, D, QKV, i), const(f"qkv{layer}", [D, QKV - D])],
                                      [f"q_{layer}", f"kv_{layer}"], axis=-1))
        nodes.append(helper.make_node("Add", [x, linear(f"q_{layer}", D, D, i + 1)], [f"h{layer}"]))
        nodes.append(helper.make_node("Split", [linear(f"h{layer}", D, 2 * FFN, i + 2), const(f"gu{layer}", [FFN, FFN])],
                                      [f"g{layer}", f"u{layer}"], axis=-1))
        nodes.append(helper.make_node("Mul", [f"g{layer}", f"u{layer}"], [f"m{layer}"]))
        nodes.append(helper.make_node("Add", [f"h{layer}", linear(f"m{layer}", FFN, D, i + 3)], [f"x{layer}"]))
        x = f"x{layer}"
    g = helper.make_graph(nodes, form, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", D])],
                          [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["M", D])], inits)
    return helper.make_model(g, ir_version=10, opset_imports=[helper.make_opsetid("", 23),
                                                              helper.make_opsetid("com.microsoft", 1)])


def median_ms(session, rows: int, calls: int = 40, rounds: int = 3) -> float:
    """The best of `rounds` medians of `calls` runs (the machine is shared and noisy)."""
    a = (np.random.default_rng(rows).standard_normal((rows, D)) * 0.1).astype(np.float32)
    for _ in range(5):
        session.run(None, {"x": a})
    best = float("inf")
    for _ in range(rounds):
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            session.run(None, {"x": a})
            times.append(time.perf_counter() - t)
        best = min(best, float(np.median(times)))
    return best * 1e3


def main() -> None:
    import onnxruntime as ort

    from medusa_trt.runtime.ort.session import OrtSessionOptions, session_options

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,5")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--forms", default="per-row,static,float32")
    args = p.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    print(f"ms per run of {LAYERS} layers x 4 Linears; spin on; columns: rows x threads")
    ms = {}
    for form in args.forms.split(","):
        model = graph(form).SerializeToString()
        for t in threads:
            options = session_options(OrtSessionOptions(threads=t, spin=True))
            session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
            for r in rows:
                ms[form, r, t] = median_ms(session, r)
        print(f"{form:8s} " + "  ".join(f"{r} row(s) x {t}: {ms[form, r, t]:6.2f}" for r in rows for t in threads)
              + "  | 2nd thread: " + "  ".join(f"{ms[form, r, threads[0]] / ms[form, r, threads[-1]]:.2f}x" for r in rows),
              flush=True)


if __name__ == "__main__":
    main()
