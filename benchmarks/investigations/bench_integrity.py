"""What the integrity checks cost (issue 14), as ratios measured side by side in one run:
- sha256 of a 538 MB graph data file vs creating an ONNX Runtime session on it (decides what
  engine_dir.LOAD_DIGEST_BYTES hashes at every load);
- safetensors_io.check_finite (aminmax) vs the dtype cast every converted tensor goes through.

    python benchmarks/investigations/bench_integrity.py [--mb 538] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def _median(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=538)
    p.add_argument("--workdir", type=Path)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        measure(args, args.workdir or Path(tmp))


def measure(args, work: Path) -> None:
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from medusa_trt.engine_dir import sha256_file
    from medusa_trt.safetensors_io import check_finite

    rows = 4096
    w = np.random.rand(rows, args.mb * 10**6 // 4 // rows).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, rows])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, w.shape[1]])],
                              [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save_model(model, work / "m.onnx", save_as_external_data=True, location="m.onnx.data")
    del w, model, graph
    so = ort.SessionOptions()
    hashing, loading = [], []
    for _ in range(args.reps):  # interleaved: both see the same page cache and machine load
        hashing.append(_median(lambda: sha256_file(work / "m.onnx.data"), 1))
        loading.append(_median(lambda: ort.InferenceSession(str(work / "m.onnx"), so,
                                                            providers=["CPUExecutionProvider"]), 1))
    size = (work / "m.onnx.data").stat().st_size / 1e6
    print(f"{size:.0f} MB: sha256 {statistics.median(hashing):.3f} s, ORT session {statistics.median(loading):.3f} s, "
          f"ratio {statistics.median(hashing) / statistics.median(loading):.2f}")
    t = torch.randn(8192, 8192, dtype=torch.bfloat16)
    cast = _median(lambda: t.to(torch.float16), args.reps * 2)
    check = _median(lambda: check_finite(t, "t"), args.reps * 2)
    print(f"8192x8192 bf16: cast to float16 {cast * 1e3:.1f} ms, check_finite {check * 1e3:.1f} ms, "
          f"ratio {check / cast:.2f}")


if __name__ == "__main__":
    main()
