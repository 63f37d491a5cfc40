"""An in-place int4 decoder step by rows, with its per-layer Slice of the cache and without: the
decoder graph as built, and a copy whose attention reads the bound cache buffer whole (the runtime
would bind a window of max(past_lengths) + S keys, rounded up to --window, instead of the whole
capacity). Both run on the same bound cache, interleaved; the script checks that their logits are
the same bits, then prints the median step time per (rows, past).

    python benchmarks/investigations/bench_cache_window.py --engine build/b1127/engine_int4_amphista --threads 1
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from medusa_trt.runtime.ort.session import OrtSessionOptions, SharedWeights, make_session  # noqa: E402


def without_slices(src: Path, dst: Path) -> int:
    """A copy of decoder graph `src` at `dst` whose attention reads each present_key/value buffer
    whole: the Slice after each in-place TensorScatter is dropped and the key count (max(past_lengths)
    + S, the Range's end) becomes the bound buffer's length. Returns the Slices dropped."""
    import onnx
    from onnx import helper

    model = onnx.load(str(src), load_external_data=False)
    nodes = list(model.graph.node)
    end = next(n for n in nodes if n.op_type == "Range").input[1]
    producer = next(n for n in nodes if end in n.output)
    renamed, kept = {}, []
    for n in nodes:
        if n is producer:
            kept += [helper.make_node("Shape", ["past_key_0"], ["window_length"], start=2, end=3),
                     helper.make_node("Squeeze", ["window_length"], [end])]
        elif n.op_type == "Slice" and n.input[0].startswith("present_"):
            renamed[n.output[0]] = n.input[0]
        else:
            kept.append(n)
    for n in kept:
        n.input[:] = [renamed.get(x, x) for x in n.input]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    onnx.save_model(model, str(dst))
    return len(renamed)


def bound(session, layers: int, kv_heads: int, head_dim: int, capacity: int, rows: int, past: int, vocab: int):
    """An IOBinding of `session` for one step of `rows` new tokens after `past` cached ones, each
    layer's cache buffer (capacity keys) bound as its past input and present output."""
    io = session.io_binding()
    keep = [np.zeros((1, kv_heads, capacity, head_dim), np.float32) for _ in range(2 * layers)]
    for i in range(layers):
        for j, kind in enumerate(("key", "value")):
            b = keep[2 * i + j]
            io.bind_input(f"past_{kind}_{i}", "cpu", 0, np.float32, list(b.shape), b.ctypes.data)
            io.bind_output(f"present_{kind}_{i}", "cpu", 0, np.float32, list(b.shape), b.ctypes.data)
    feeds = dict(input_ids=np.full((1, rows), 100, np.int64), position_ids=(past + np.arange(rows))[None],
                 past_lengths=np.array([past]), new_mask=np.tril(np.ones((rows, rows), bool))[None],
                 logit_positions=np.array([[rows - 1]]))
    for name, value in feeds.items():
        io.bind_cpu_input(name, value)
    logits = np.empty((1, 1, vocab), np.float32)
    io.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
    io.bind_output("hidden")
    return io, logits, (keep, feeds)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", type=Path, required=True, help="an int4 ONNX Runtime engine dir (cache written in place)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--spin", action="store_true")
    p.add_argument("--rows", default="1,2,3,4,5,6,8")
    p.add_argument("--past", default="60,250,500")
    p.add_argument("--window", type=int, default=32, help="the window's length is a multiple of this")
    p.add_argument("--reps", type=int, default=25)
    args = p.parse_args()
    engine = json.loads((args.engine / "engine.json").read_text())
    if not engine["onnx"].get("cache_in_place"):
        raise SystemExit(f"{args.engine}: the cache is not written in place; expected an int4 CPU engine")
    cfg = engine["model"]
    layers, kv_heads, head_dim = cfg["num_layers"], cfg["num_kv_heads"], cfg["head_dim"]
    work = Path(tempfile.mkdtemp(prefix="cache_window_"))
    try:
        graph = args.engine / engine["onnx"]["file"]
        # ONNX Runtime reads external data from the graph's own folder only: a hard link, not a copy.
        (work / "weights.bin").hardlink_to((args.engine / "weights.bin").resolve())
        dropped = without_slices(graph, work / "model.onnx")
        options = OrtSessionOptions(threads=args.threads, spin=args.spin)
        weights = [SharedWeights(args.engine / "weights.bin"), SharedWeights(work / "weights.bin")]
        sessions = [make_session(graph, options=options, weights=weights[0]),
                    make_session(work / "model.onnx", options=options, weights=weights[1])]
        print(f"{args.engine}: {dropped} Slices dropped; {args.threads} thread(s){', spin' if args.spin else ''}")
        print("rows  past  with Slice  window   window / Slice")
        for past in (int(x) for x in args.past.split(",")):
            for rows in (int(x) for x in args.rows.split(",")):
                window = -(-(past + rows) // args.window) * args.window
                runs = [bound(s, layers, kv_heads, head_dim, capacity, rows, past, cfg["vocab_size"])
                        for s, capacity in zip(sessions, (past + rows + 512, window), strict=True)]
                for (io, _, _), s in zip(runs, sessions, strict=True):
                    for _ in range(3):
                        s.run_with_iobinding(io)
                if not np.array_equal(runs[0][1], runs[1][1]):
                    raise SystemExit(f"rows {rows} past {past}: the two graphs' logits differ")
                times = [[], []]
                for _ in range(args.reps):
                    for k, ((io, _, _), s) in enumerate(zip(runs, sessions, strict=True)):
                        t0 = time.perf_counter()
                        s.run_with_iobinding(io)
                        times[k].append(time.perf_counter() - t0)
                a, b = (statistics.median(t) * 1e3 for t in times)
                print(f"{rows:4d} {past:5d}  {a:8.2f} ms {b:6.2f} ms  {b / a:6.3f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
