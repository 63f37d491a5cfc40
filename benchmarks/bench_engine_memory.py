"""On-disk size and resident memory of ONNX Runtime engines against the weights they hold (issue 13).

For each engine: the engine directory's size, the distinct weight bytes its graphs hold (initializers
of every graph, one copy per distinct content: the weights an engine cannot do without), the
checkpoint's rank*.safetensors size, and the process's resident memory (VmRSS) after loading the
engine (OrtBackend) and decoding 16 tokens, per mode, each in a fresh process: `medusa` (greedy
Medusa: the fused step session alone), `plain` (the decoder session alone), `both` (one of each, in
one process: two sessions, two packed copies of the decoder's weights). `bare` is the process's RSS
before loading (python, torch, onnxruntime imported).

    python benchmarks/bench_engine_memory.py --engine float32=build/e1 --engine int4=build/e2 \\
        [--checkpoint build/ckpt] [--threads 1] [--modes medusa,plain,both] [--medusa-choices TREE] [--json FILE]
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


def measure_loaded(engine_dir: Path, threads: int, mode: str, tree: str | None) -> dict:
    """Runs in the child process: RSS before and after loading + decoding in `mode`."""
    import torch

    from medusa_trt.runtime.decoding import GenerationConfig, decode
    from medusa_trt.runtime.ort.backend import OrtBackend
    from medusa_trt.runtime.ort.session import OrtSessionOptions

    torch.set_num_threads(1)
    bare = rss_bytes()
    backend = OrtBackend(engine_dir, options=OrtSessionOptions(threads=threads))
    loaded = rss_bytes()
    prompt = [[1, 2, 3, 4, 5, 6, 7, 8]]
    if mode in ("medusa", "both"):
        choices = {"medusa_choices": tree} if tree else {}  # the default: mc_sim_7b_63, 64 slots
        decode(backend, prompt, GenerationConfig(max_new_tokens=16, use_medusa=True, **choices))
    if mode in ("plain", "both"):
        decode(backend, prompt, GenerationConfig(max_new_tokens=16, use_medusa=False))
    sessions = [name for name in ("session", "heads_session", "step_session") if name in backend.open_session_names]
    return {"bare": bare, "loaded": loaded, "decoded": rss_bytes(), "sessions": sessions}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", action="append", default=[], help="NAME=DIR (repeatable)")
    p.add_argument("--checkpoint", type=Path, help="the merged checkpoint the engines were built from")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--modes", default="medusa,plain,both", help="comma-separated: medusa, plain, both")
    p.add_argument("--medusa-choices", help="the Medusa mode's tree: a preset name or a JSON file")
    p.add_argument("--json", type=Path)
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    if args.child:
        print(json.dumps(measure_loaded(args.child, args.threads, modes[0], args.medusa_choices)))
        return 0
    ckpt = sum(f.stat().st_size for f in args.checkpoint.glob("rank*.safetensors")) if args.checkpoint else None
    results = {}
    for name, d in (e.split("=", 1) for e in args.engine):
        d = Path(d)
        disk = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
        weights = distinct_weight_bytes(d)
        line = f"{name}: dir {disk / MIB:.0f} MiB, distinct weights {weights / MIB:.0f} MiB (dir/weights {disk / weights:.2f}x)"
        if ckpt:
            line += f"; checkpoint {ckpt / MIB:.0f} MiB (dir/checkpoint {disk / ckpt:.2f}x)"
        print(line, flush=True)
        results[name] = {"dir_bytes": disk, "weight_bytes": weights, "checkpoint_bytes": ckpt, "modes": {}}
        for mode in modes:
            tree = ["--medusa-choices", args.medusa_choices] if args.medusa_choices else []
            out = subprocess.run([sys.executable, __file__, "--child", str(d), "--threads", str(args.threads),
                                  "--modes", mode, *tree], check=True, capture_output=True, text=True).stdout
            mem = json.loads(out.strip().splitlines()[-1])
            results[name]["modes"][mode] = mem
            print(f"  {mode}: sessions {'+'.join(mem['sessions'])}; RSS bare {mem['bare'] / MIB:.0f} MiB, after "
                  f"decoding {mem['decoded'] / MIB:.0f} MiB (RSS/weights {mem['decoded'] / weights:.2f}x, "
                  f"(RSS-bare)/weights {(mem['decoded'] - mem['bare']) / weights:.2f}x)", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
