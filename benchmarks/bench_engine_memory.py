"""On-disk size and resident memory of ONNX Runtime engines against the weights they hold (issue 13).

For each engine: the engine directory's size, the distinct weight bytes its graphs hold (initializers
of every graph, one copy per distinct content: the weights an engine cannot do without), the
checkpoint's rank*.safetensors size, and the process's resident memory (VmRSS) after loading the
engine (OrtBackend: decoder, heads and fused step sessions) and decoding 16 tokens with Medusa greedy
(the fused step) and 16 plainly (the decoder session). Each engine is measured in a fresh process;
`bare` is that process's RSS before loading (python, torch, onnxruntime imported).

`--step-only` loads the fused step graph alone and runs it three times on a 2-slot tree: the
resident memory an engine would have if one session served every greedy call (one packed copy of
the decoder's weights instead of one per session), measured before building it.

    python benchmarks/bench_engine_memory.py --engine float32=build/e1 --engine int4=build/e2 \\
        [--checkpoint build/ckpt] [--threads 1] [--step-only] [--json FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

MIB = 1 << 20


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def distinct_weight_bytes(engine_dir: Path) -> int:
    """Bytes of the distinct initializers (by content) of every .onnx graph in engine_dir."""
    import onnx
    from onnx import numpy_helper

    seen = set()
    total = 0
    for path in sorted(engine_dir.glob("*.onnx")):
        model = onnx.load(str(path), load_external_data=True)
        for init in model.graph.initializer:
            data = numpy_helper.to_array(init).tobytes()
            key = hashlib.sha256(data).hexdigest()
            if key not in seen:
                seen.add(key)
                total += len(data)
    return total


def measure_loaded(engine_dir: Path, threads: int) -> dict:
    """Runs in the child process: RSS before and after loading + decoding."""
    import torch

    from medusa_trt.runtime.decoding import GenerationConfig, decode
    from medusa_trt.runtime.ort_backend import OrtBackend

    torch.set_num_threads(1)
    bare = rss_bytes()
    backend = OrtBackend(engine_dir, threads=threads)
    loaded = rss_bytes()
    prompt = [[1, 2, 3, 4, 5, 6, 7, 8]]
    decode(backend, prompt, GenerationConfig(max_new_tokens=16, use_medusa=True))
    decode(backend, prompt, GenerationConfig(max_new_tokens=16, use_medusa=False))
    return {"bare": bare, "loaded": loaded, "decoded": rss_bytes()}


def measure_step_only(engine_dir: Path, threads: int) -> dict:
    """Runs in the child process: RSS before and after loading and running the step graph alone."""
    import numpy as np

    from medusa_trt.runtime.ort_backend import make_session

    bare = rss_bytes()
    engine = json.loads((engine_dir / "engine.json").read_text())
    session = make_session(engine_dir / engine["onnx"]["step_file"], "cpu", threads)
    loaded = rss_bytes()
    m = engine["model"]
    feeds = {"input_ids": np.array([[5, 6]]), "position_ids": np.array([[8, 9]]), "past_lengths": np.array([8]),
             "new_mask": np.array([[[True, False], [True, True]]]), "retrieve": np.array([[0, 1]]),
             "candidate_index": np.array([0])}
    past = np.zeros((1, m["num_kv_heads"], 64, m["head_dim"]), np.float32)
    feeds.update({f"past_{kind}_{i}": past for i in range(m["num_layers"]) for kind in ("key", "value")})
    for _ in range(3):
        session.run(None, feeds)
    return {"bare": bare, "loaded": loaded, "decoded": rss_bytes()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", action="append", default=[], help="NAME=DIR (repeatable)")
    p.add_argument("--checkpoint", type=Path, help="the merged checkpoint the engines were built from")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--step-only", action="store_true", help="load and run the fused step graph alone")
    p.add_argument("--json", type=Path)
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        measure = measure_step_only if args.step_only else measure_loaded
        print(json.dumps(measure(args.child, args.threads)))
        return 0
    ckpt = sum(f.stat().st_size for f in args.checkpoint.glob("rank*.safetensors")) if args.checkpoint else None
    results = {}
    for name, d in (e.split("=", 1) for e in args.engine):
        d = Path(d)
        disk = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
        weights = distinct_weight_bytes(d)
        child = [sys.executable, __file__, "--child", str(d), "--threads", str(args.threads)]
        out = subprocess.run(child + ["--step-only"] * args.step_only, check=True, capture_output=True,
                             text=True).stdout
        mem = json.loads(out.strip().splitlines()[-1])
        r = {"dir_bytes": disk, "weight_bytes": weights, "checkpoint_bytes": ckpt, **mem}
        results[name] = r
        line = (f"{name}: dir {disk / MIB:.0f} MiB, distinct weights {weights / MIB:.0f} MiB "
                f"(dir/weights {disk / weights:.2f}x); RSS bare {mem['bare'] / MIB:.0f} MiB, loaded "
                f"{mem['loaded'] / MIB:.0f} MiB, after decoding {mem['decoded'] / MIB:.0f} MiB "
                f"(RSS/weights {mem['decoded'] / weights:.2f}x, (RSS-bare)/weights "
                f"{(mem['decoded'] - mem['bare']) / weights:.2f}x)")
        if ckpt:
            line += f"; checkpoint {ckpt / MIB:.0f} MiB (dir/checkpoint {disk / ckpt:.2f}x)"
        print(line, flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
