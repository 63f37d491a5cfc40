"""The sweeps that chose the ONNX Runtime engine's defaults (issue 4), on bench_onnx.py's random models.

--sweep-attention  the base-only model exported with each ONNX attention form, steps timed round-robin
                   (decided the opset-23 Attention op as the float default);
--sweep-options    session options (threads, optimization level, spinning) and IOBinding vs
                   session.run on the Medusa engine, each variant in a process of its own (decided
                   session.run on numpy views on the CPU and spinning off by default).

With neither flag, both run. The models are the ones benchmarks/bench_onnx.py measures (made and
cached under --workdir by benchmarks/common.py: random_models).

    .venv/bin/python benchmarks/investigations/bench_onnx_sweeps.py [--sizes 10M,100M] [--threads 1]
        [--rounds 7] [--sweep-attention] [--sweep-options] [--workdir build/bench_onnx] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from common import median_time, ort_backend, prepared, random_models, round_robin  # noqa: E402

THREADS = len(os.sched_getaffinity(0))  # --threads overrides

CASES = [(1, 1, 256), (1, 1, 1024), (3, 1, 1024), (1, 64, 256), (3, 64, 256)]  # batch, slots, past


def sweep_attention(paths: dict[str, Path], workdir: Path, rounds: int) -> dict:
    """The base-only model exported with each attention form, steps timed round-robin."""
    import shutil

    from medusa_trt.engines.onnx.attention import ATTENTION_FORMS
    from medusa_trt.engines.onnx.export import export_onnx
    from medusa_trt.modeling import MedusaModel

    model = MedusaModel.from_checkpoint(paths["merged-base"])
    backends = {}
    for form in ATTENTION_FORMS:
        engine = workdir / f"engine-base-{form}"
        if not (engine / "engine.json").is_file():
            shutil.copytree(paths["engine-base"], engine, dirs_exist_ok=True)
            export_onnx(model, engine / "model.onnx", attention=form)
            meta = json.loads((engine / "engine.json").read_text())
            meta["onnx"]["attention"] = form  # checksums are stale in these copies; only the form matters
            (engine / "engine.json").write_text(json.dumps(meta, indent=2))
        backends[form] = ort_backend(engine, THREADS)
    out: dict = {form: {} for form in backends}
    for b, s, past in CASES:
        case = f"B{b}_S{s}_P{past}"
        res = round_robin({form: prepared(be, b, s, past) for form, be in backends.items()}, rounds)
        for form in backends:
            out[form][case] = res[form]
    return out


OPTION_VARIANTS = {  # name -> session_options() keyword arguments, or "binding": the IOBinding path
    "default": {},
    "threads=1": {"threads": 1},
    "spinning": {"spin": True},
    "opt=extended": {"level": "extended"},
    "opt=basic": {"level": "basic"},
    "IOBinding (torch buffers bound by pointer)": {"binding": True},
}
OPTION_CASES = [(1, 1, 256), (1, 64, 256)]


def sweep_options(paths: dict[str, Path], rounds: int) -> dict:
    """Session options and IOBinding vs session.run on the Medusa engine. Each variant runs in its
    own process, variants taking turns: a spinning session in the same process would steal the
    CPU from the others and make every comparison meaningless."""
    import subprocess

    samples: dict[str, dict[str, list[float]]] = {name: {} for name in OPTION_VARIANTS}
    for _ in range(rounds):
        for name in OPTION_VARIANTS:
            run = subprocess.run([sys.executable, __file__, "--measure-variant", name, "--engine", str(paths["engine"]),
                                  "--threads", str(THREADS)],
                                 stdout=subprocess.PIPE, text=True, check=True)
            for case, ms in json.loads(run.stdout.strip().splitlines()[-1]).items():
                samples[name].setdefault(case, []).append(ms)
    return {name: {case: {"median_ms": round(statistics.median(v), 3), "min_ms": round(min(v), 3)}
                   for case, v in cases.items()} for name, cases in samples.items()}


def measure_variant(name: str, engine_dir: Path) -> dict:
    """In a child process: one variant's median step time per case (ms)."""
    import onnxruntime as ort

    from medusa_trt.runtime.ort.cache import BoundCache
    from medusa_trt.runtime.ort.session import OrtSessionOptions, session_options

    kwargs = dict(OPTION_VARIANTS[name])
    backend = ort_backend(engine_dir, THREADS)
    if kwargs.pop("binding", False):
        backend.cache_mode = BoundCache  # made at the next start()
        backend.start(1, 1)
    options = OrtSessionOptions(threads=kwargs.pop("threads", THREADS), spin=kwargs.pop("spin", False))
    so = session_options(options, **kwargs)
    backend.session = ort.InferenceSession(str(engine_dir / "model.onnx"), so, providers=["CPUExecutionProvider"])
    out = {}
    for b, s, past in OPTION_CASES:
        step = prepared(backend, b, s, past)
        out[f"B{b}_S{s}_P{past}"] = round(median_time(step, 10 if s == 1 else 5, warmup=2) * 1e3, 3)
    return out


def main(argv: list[str] | None = None) -> int:
    global THREADS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=Path("build/bench_onnx"))
    p.add_argument("--sizes", default="10M,100M")
    p.add_argument("--rounds", type=int, default=7, help="round-robin rounds per sweep case")
    p.add_argument("--json", type=Path)
    p.add_argument("--sweep-attention", action="store_true")
    p.add_argument("--sweep-options", action="store_true")
    p.add_argument("--threads", type=int, help=f"ONNX Runtime and torch threads (default: {THREADS}, the usable cores)")
    p.add_argument("--measure-variant", help=argparse.SUPPRESS)  # child process of --sweep-options
    p.add_argument("--engine", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    THREADS = args.threads or THREADS
    torch.set_num_threads(THREADS)  # torch's OpenMP threads spin at barriers: no more than ONNX Runtime's
    if args.measure_variant:
        print(json.dumps(measure_variant(args.measure_variant, args.engine)))
        return 0
    both = not (args.sweep_attention or args.sweep_options)
    results: dict = {"threads": THREADS, "sizes": {}}
    for size in args.sizes.split(","):
        paths = random_models(args.workdir, size)
        r: dict = {}
        if args.sweep_attention or both:
            print(f"[{size}] attention forms", file=sys.stderr)
            r["attention_forms_ms"] = sweep_attention(paths, args.workdir / size, args.rounds)
        if args.sweep_options or both:
            print(f"[{size}] session options", file=sys.stderr)
            r["session_options_ms"] = sweep_options(paths, args.rounds)
        results["sizes"][size] = r
        print(f"\n== {size}, {THREADS} threads")
        for key, rows in r.items():
            print(f"{key}: median (min) ms per step")
            for name, row in rows.items():
                print(f"    {name:30s} " + "  ".join(f"{c}={v['median_ms']:.2f}({v['min_ms']:.2f})" for c, v in row.items()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
