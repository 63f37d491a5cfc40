"""Is ONNX Runtime's GroupQueryAttention row-invariant? (issue 13: why the int4 engine does not use it)

onnxruntime-genai's graphs run attention as one com.microsoft GroupQueryAttention op per layer, with
past and present sharing one buffer. Medusa greedy equals plain greedy on an int4 engine only if a
position's attention output has the same bits in a one-token step and in a tree step (MatMulNBits
turns any float32 difference into different int8 activations). This runs one GQA node (9 query
heads over 3 KV heads of 64, SmolLM2-135M's shape) on random caches and compares, bitwise:

  chain   three new tokens in one call (causal) against the same tokens one call each
  branch  a root with two children (the second one's attention bias hides the first) against the
          root then that child one call each

with the cache bound as both past and present (IOBinding, as onnxruntime-genai runs it), RoPE in the
op or not. A row differs when any of its 576 outputs differs.

    python benchmarks/investigations/bench_gqa_invariance.py [--trials 100] [--threads 1]
"""

from __future__ import annotations

import argparse

import numpy as np

HQ, HKV, D, CAP = 9, 3, 64, 512


def gqa_model(rotary: bool) -> bytes:
    import onnx
    from onnx import TensorProto as T
    from onnx import helper as h

    def info(name, elem, shape):
        return h.make_tensor_value_info(name, elem, shape)

    inputs = [info("q", T.FLOAT, [1, "S", HQ * D]), info("k", T.FLOAT, [1, "S", HKV * D]),
              info("v", T.FLOAT, [1, "S", HKV * D]), info("past_k", T.FLOAT, [1, HKV, CAP, D]),
              info("past_v", T.FLOAT, [1, HKV, CAP, D]), info("seqlens_k", T.INT32, [1]),
              info("total", T.INT32, []), info("pos", T.INT64, [1, "S"]), info("bias", T.FLOAT, [1, 1, "S", "T"])]
    freqs = np.arange(CAP)[:, None] / 10000 ** (np.arange(D // 2)[None] / (D // 2))
    inits = [onnx.numpy_helper.from_array(np.cos(freqs).astype(np.float32), "cos"),
             onnx.numpy_helper.from_array(np.sin(freqs).astype(np.float32), "sin")] if rotary else []
    node = h.make_node("GroupQueryAttention",
                       ["q", "k", "v", "past_k", "past_v", "seqlens_k", "total", *(("cos", "sin", "pos") if rotary else ("", "", "")),
                        "bias"], ["y", "present_k", "present_v"],
                       domain="com.microsoft", num_heads=HQ, kv_num_heads=HKV, do_rotary=int(rotary), scale=D ** -0.5)
    outputs = [info("y", T.FLOAT, [1, "S", HQ * D]), info("present_k", T.FLOAT, [1, HKV, CAP, D]),
               info("present_v", T.FLOAT, [1, HKV, CAP, D])]
    graph = h.make_graph([node], "gqa", [i for i in inputs if i.name in node.input], outputs, inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 21), h.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model.SerializeToString()


def step(session, cache, q, k, v, past: int, positions, mask) -> np.ndarray:
    """One GQA call writing the new K/V into `cache` (past and present bound to the same memory)."""
    s = q.shape[1]
    bias = np.zeros((1, 1, s, past + s), np.float32)
    bias[0, 0, :, past:] = np.where(mask, 0, -np.inf)
    names = {i.name for i in session.get_inputs()}
    feeds = {"q": q, "k": k, "v": v, "seqlens_k": np.array([past + s - 1], np.int32),
             "total": np.array(past + s, np.int32), "pos": np.asarray(positions, np.int64)[None], "bias": bias}
    io = session.io_binding()
    for name, array in feeds.items():
        if name in names:
            io.bind_cpu_input(name, np.ascontiguousarray(array))
    y = np.empty((1, s, HQ * D), np.float32)
    io.bind_output("y", "cpu", 0, np.float32, list(y.shape), y.ctypes.data)
    for kind, buf in zip("kv", cache, strict=True):
        io.bind_input(f"past_{kind}", "cpu", 0, np.float32, list(buf.shape), buf.ctypes.data)
        io.bind_output(f"present_{kind}", "cpu", 0, np.float32, list(buf.shape), buf.ctypes.data)
    session.run_with_iobinding(io)
    return y[0]


def main() -> None:
    import onnxruntime as ort

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=100)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    for rotary in (False, True):
        session = ort.InferenceSession(gqa_model(rotary), options, providers=["CPUExecutionProvider"])
        differ = {"chain": 0, "branch": 0}
        worst = 0.0
        for _ in range(args.trials):
            past = int(rng.integers(1, 400))
            base = [np.zeros((1, HKV, CAP, D), np.float32) for _ in range(2)]
            for buf in base:
                buf[:, :, :past] = rng.standard_normal((1, HKV, past, D))
            q, k, v = (rng.standard_normal((1, 3, n * D), dtype=np.float32) for n in (HQ, HKV, HKV))

            def fresh(base=base):
                return [b.copy() for b in base]
            tree = step(session, fresh(), q, k, v, past, np.arange(past, past + 3), np.tril(np.ones((3, 3), bool)))
            cache = fresh()
            one = np.stack([step(session, cache, q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], past + i, [past + i],
                                 np.ones((1, 1), bool))[0] for i in range(3)])
            differ["chain"] += int((tree != one).any(1).sum() > 0)
            worst = max(worst, float(np.abs(tree - one).max()))
            mask = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)  # slot 2: the root's second child
            branch = step(session, fresh(), q, k, v, past, [past, past + 1, past + 1], mask)
            cache = fresh()
            step(session, cache, q[:, :1], k[:, :1], v[:, :1], past, [past], np.ones((1, 1), bool))
            child = step(session, cache, q[:, 2:3], k[:, 2:3], v[:, 2:3], past + 1, [past + 1], np.ones((1, 1), bool))
            differ["branch"] += int((branch[2] != child[0]).any())
        print(f"rotary in the op: {rotary}: steps whose rows differ from one-token steps: chain "
              f"{differ['chain']}/{args.trials}, branch {differ['branch']}/{args.trials} (largest difference {worst:.1e})")


if __name__ == "__main__":
    main()
