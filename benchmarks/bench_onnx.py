"""The ONNX Runtime engine on this CPU: plain decoding speed, tree-verify cost, host overhead.

For random Llama models of about 10M and 100M base parameters (made by transformers, converted by
medusa-convert, built by medusa-build; cached under --workdir), all measured side by side in one run:

(a) plain greedy decoding tokens/s, batch 1: the ONNX Runtime engine vs the PyTorch reference
    (MedusaModel eager, same decoding loop) vs transformers `generate(do_sample=False)`. The base-only
    engine (no Medusa heads) computes exactly what transformers computes; the Medusa engine row
    shows what its heads cost when decoding plainly.
(b) one tree-verify step of T slots (the default tree cut to T) relative to one plain decode step,
    T in 1..64, on the Medusa engine: Medusa pays off when its tokens per step exceed this ratio.
(c) host time per Medusa step spent outside the ONNX Runtime session (candidates, acceptance, KV
    compaction, binding), as a share of the step.

Optional sweeps that chose the engine's defaults: --sweep-attention (the four ONNX attention forms)
and --sweep-options (threads, optimization level, spinning, IOBinding vs session.run).

    .venv/bin/python benchmarks/bench_onnx.py [--sizes 10M,100M] [--new-tokens 64] [--json FILE]
        [--workdir build/bench_onnx] [--sweep-attention] [--sweep-options]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

SIZES = {  # base parameters: 9.8M and 100.1M (untied embeddings); 4 Medusa heads of 1 layer on top
    "10M": dict(hidden_size=256, layers=6, heads=4, kv_heads=2, intermediate=768, vocab=10000),
    "100M": dict(hidden_size=768, layers=12, heads=12, kv_heads=4, intermediate=2048, vocab=16000),
}
PROMPT_LEN = 32
TREE_SLOTS = (1, 4, 8, 16, 32, 64)
THREADS = len(os.sched_getaffinity(0))  # --threads overrides; every framework gets the same count


def ort_backend(engine_dir: Path):
    from medusa_trt.runtime.ort_backend import OrtBackend

    return OrtBackend(engine_dir, threads=THREADS)


# -- models ------------------------------------------------------------------------------------


def prepare(workdir: Path, size: str) -> dict[str, Path]:
    """HF base, merged checkpoint with heads, base-only checkpoint, and an engine for each (cached)."""
    from medusa_trt.checkpoint import load_checkpoint, write_checkpoint
    from medusa_trt.converter import convert
    from medusa_trt.engines.build import BuildOptions, build_engine
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test fixtures' model factories
    from synthetic import make_base, make_heads

    root = workdir / size
    paths = {name: root / name for name in ("base", "heads", "merged", "merged-base", "engine", "engine-base")}
    if not (paths["base"] / "config.json").is_file():
        print(f"[{size}] making the random base and heads", file=sys.stderr)
        make_base(paths["base"], "llama", max_position_embeddings=2048, **SIZES[size])
        make_heads(paths["heads"], "medusa_v1", paths["base"], num_heads=4)
    if not (paths["merged"] / "config.json").is_file():
        convert(paths["base"], paths["heads"], paths["merged"], progress=False, force=True)
    if not (paths["merged-base"] / "config.json").is_file():
        config, weights = load_checkpoint(paths["merged"])
        config = {**config, "num_medusa_heads": 0}
        write_checkpoint(paths["merged-base"], config, {k: v for k, v in weights.items() if not k.startswith("medusa")})
    for ckpt, engine in (("merged", "engine"), ("merged-base", "engine-base")):
        if _stale(paths[engine]):
            print(f"[{size}] medusa-build {paths[ckpt]} -> {paths[engine]}", file=sys.stderr)
            build_engine(BuildOptions(checkpoint=paths[ckpt], out=paths[engine], force=True, max_seq_len=2048))
    return paths


def _stale(engine_dir: Path) -> bool:
    """No engine yet, or one of another engine format or attention form than today's default."""
    from medusa_trt.engine_dir import ENGINE_FORMAT_VERSION
    from medusa_trt.engines.onnx.attention import DEFAULT_ATTENTION

    path = engine_dir / "engine.json"
    if not path.is_file():
        return True
    engine = json.loads(path.read_text())
    return engine.get("format_version") != ENGINE_FORMAT_VERSION or engine["onnx"]["attention"] != DEFAULT_ATTENTION


def param_count(ckpt: Path) -> int:
    from medusa_trt.checkpoint import SafetensorsFile

    with SafetensorsFile(ckpt / "rank0.safetensors") as f:
        return sum(int(np.prod(f.info(n).shape)) for n in f.keys())


def median_time(fn, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# -- (a) plain decoding ------------------------------------------------------------------------


def bench_plain(paths: dict[str, Path], vocab: int, new_tokens: int, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    from medusa_trt.modeling import MedusaModel
    from medusa_trt.runtime.backend import TorchBackend
    from medusa_trt.runtime.decoding import GenerationConfig, decode

    prompt = torch.randint(3, vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(0)).tolist()
    cfg = GenerationConfig(max_new_tokens=new_tokens, use_medusa=False)
    hf = AutoModelForCausalLM.from_pretrained(paths["base"], dtype=torch.float32).eval()
    ids = torch.tensor([prompt])

    def hf_generate():
        with torch.inference_mode():
            return hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                               eos_token_id=None, pad_token_id=0)[0, PROMPT_LEN:].tolist()

    runners = {
        "onnxruntime engine": ort_backend(paths["engine-base"]),
        "pytorch eager (MedusaModel)": TorchBackend(MedusaModel.from_checkpoint(paths["merged-base"])),
        "onnxruntime engine + 4 heads": ort_backend(paths["engine"]),
    }
    calls = {name: (lambda b=b: decode(b, [prompt], cfg).tokens[0]) for name, b in runners.items()}
    calls["transformers generate"] = hf_generate
    outputs = {name: fn() for name, fn in calls.items()}  # warm-up, and the same tokens everywhere
    reference = outputs["transformers generate"]
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):  # interleaved, so load from other processes hits every runner alike
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    rows = {name: {"tokens_per_s": round(new_tokens / statistics.median(t), 2), "same_tokens": outputs[name] == reference}
            for name, t in times.items()}
    base = rows["transformers generate"]["tokens_per_s"]
    for row in rows.values():
        row["vs_transformers"] = round(row["tokens_per_s"] / base, 2)
    return rows


# -- (b) tree-verify cost ----------------------------------------------------------------------


def tree_inputs(slots: int, num_heads: int):
    from medusa_trt.tree import DEFAULT_TREE, build_tree, parse_medusa_choices, validate_and_expand

    nodes = validate_and_expand(parse_medusa_choices(DEFAULT_TREE), num_heads)[: slots - 1]
    if not nodes:
        return torch.zeros(1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool)
    tree = build_tree(nodes, num_heads, 63)
    return torch.tensor(tree.position_offsets), torch.tensor(tree.attention_mask)


def bench_tree(paths: dict[str, Path], past: int, rounds: int, batch: int = 1) -> dict:
    """Steps of each tree size, timed round-robin, against the 1-slot step of the Medusa engine.

    The engine computes every head at every slot, but the decoding loop reads them at one slot
    only; the base-only engine's steps plus one slot's worth of heads show what a step would cost
    if heads ran only there."""

    capacity = past + max(TREE_SLOTS) + 1  # what the decoding loop allocates for the largest tree
    engines = {"medusa": ort_backend(paths["engine"]), "base": ort_backend(paths["engine-base"])}
    calls = {f"{name} {s}": prepared(be, batch, s, past, capacity) for name, be in engines.items() for s in TREE_SLOTS}
    res = {k: v["median_ms"] for k, v in round_robin(calls, rounds).items()}
    plain = res["medusa 1"]
    heads_one_slot = plain - res["base 1"]
    return {
        "ms": {s: res[f"medusa {s}"] for s in TREE_SLOTS},
        "ratio_vs_plain_step": {s: round(res[f"medusa {s}"] / plain, 2) for s in TREE_SLOTS},
        "ratio_if_heads_at_one_slot": {s: round((res[f"base {s}"] + heads_one_slot) / plain, 2) for s in TREE_SLOTS},
    }


# -- (c) host time per Medusa step -------------------------------------------------------------


class _TimedSession:
    """Wraps an InferenceSession to add up the time spent inside it."""

    def __init__(self, session):
        self.session, self.seconds = session, 0.0

    def io_binding(self):
        return self.session.io_binding()

    def run(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.session.run(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start

    def run_with_iobinding(self, io):
        start = time.perf_counter()
        try:
            return self.session.run_with_iobinding(io)
        finally:
            self.seconds += time.perf_counter() - start


def _timed(fn, totals: dict, key: str):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[key] = totals.get(key, 0.0) + time.perf_counter() - start

    return wrapper


def bench_host(engine_dir: Path, new_tokens: int, batch: int = 1) -> dict:
    """Steady-state Medusa steps (default tree, greedy): where the step time goes."""
    from medusa_trt.runtime.decoding import GenerationConfig, generate

    backend = ort_backend(engine_dir)
    timed = _TimedSession(backend.session)
    backend.session = timed
    totals: dict[str, float] = {}
    backend.forward = _timed(backend.forward, totals, "forward")
    backend.commit = _timed(backend.commit, totals, "commit")
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, backend.info.vocab_size, (batch, PROMPT_LEN), generator=g).tolist()
    cfg = GenerationConfig(max_new_tokens=new_tokens)  # default tree, greedy acceptance
    for _ in generate(backend, prompts, cfg):  # warm-up
        pass
    it = generate(backend, prompts, cfg)
    next(it)  # prefill and the first step are not steady-state steps
    timed.seconds = 0.0
    totals.clear()
    steps = 0
    start = time.perf_counter()
    for _ in it:
        steps += 1
    total = time.perf_counter() - start

    def ms(x: float) -> float:
        return round(x / steps * 1e3, 3)

    return {"steps": steps, "step_ms": ms(total), "session_ms": ms(timed.seconds),
            "host_ms": ms(total - timed.seconds), "host_share": round(1 - timed.seconds / total, 4),
            "host_backend_ms": ms(totals["forward"] - timed.seconds + totals["commit"]),
            "host_decoding_loop_ms": ms(total - totals["forward"] - totals["commit"])}


# -- sweeps ------------------------------------------------------------------------------------


def round_robin(calls: dict, rounds: int, inner: int = 3) -> dict:
    """Median and min over `rounds` of each call's median-of-`inner` time (ms), the calls taking
    turns so that load from other processes spreads over all of them."""
    for fn in calls.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            samples[name].append(median_time(fn, inner, warmup=0))
    return {name: {"median_ms": round(statistics.median(t) * 1e3, 3), "min_ms": round(min(t) * 1e3, 3)}
            for name, t in samples.items()}


def step_inputs(backend, batch: int, slots: int, past: int):
    """A decode (slots=1) or tree step with `past` committed entries in every sequence."""
    offsets, mask = tree_inputs(slots, max(backend.info.num_medusa_heads, 4))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, backend.info.vocab_size, (batch, slots), generator=g)
    return ids, (past + offsets)[None].expand(batch, -1), mask[None].expand(batch, -1, -1)


def prepared(backend, batch: int, slots: int, past: int, capacity: int | None = None):
    """A callable running one step on `backend`, with `past` committed entries per sequence."""
    ids, pos, mask = step_inputs(backend, batch, slots, past)
    capacity = capacity or past + slots

    def step():
        if backend.keys.shape[1] != batch or backend.keys.shape[3] != capacity:
            backend.start(batch, capacity)
            backend.lengths = torch.full((batch,), past)
        return backend.forward(ids, pos, mask)

    return step


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
        backends[form] = ort_backend(engine)
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
    "spinning": {"spinning": True},
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

    from medusa_trt.runtime.ort_backend import session_options

    kwargs = dict(OPTION_VARIANTS[name])
    backend = ort_backend(engine_dir)
    backend.use_binding = kwargs.pop("binding", False)
    so = session_options(kwargs.pop("threads", THREADS), **kwargs)
    backend.session = ort.InferenceSession(str(engine_dir / "model.onnx"), so, providers=["CPUExecutionProvider"])
    out = {}
    for b, s, past in OPTION_CASES:
        step = prepared(backend, b, s, past)
        out[f"B{b}_S{s}_P{past}"] = round(median_time(step, 10 if s == 1 else 5, warmup=2) * 1e3, 3)
    return out


# -- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    global THREADS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=Path("build/bench_onnx"))
    p.add_argument("--sizes", default="10M,100M")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement in (a)-(c)")
    p.add_argument("--rounds", type=int, default=7, help="round-robin rounds per sweep case")
    p.add_argument("--json", type=Path)
    p.add_argument("--sweep-attention", action="store_true")
    p.add_argument("--sweep-options", action="store_true")
    p.add_argument("--skip-main", action="store_true", help="only the sweeps")
    p.add_argument("--threads", type=int, help=f"threads for every framework (default: {THREADS}, the usable cores)")
    p.add_argument("--measure-variant", help=argparse.SUPPRESS)  # child process of --sweep-options
    p.add_argument("--engine", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    THREADS = args.threads or THREADS
    # The same thread count everywhere: torch's OpenMP threads spin at barriers, so a torch with
    # more threads than free cores slows down by an order of magnitude on a shared machine.
    torch.set_num_threads(THREADS)
    if args.measure_variant:
        print(json.dumps(measure_variant(args.measure_variant, args.engine)))
        return 0
    results: dict = {"threads": THREADS, "new_tokens": args.new_tokens, "prompt_len": PROMPT_LEN, "sizes": {}}
    for size in args.sizes.split(","):
        paths = prepare(args.workdir, size)
        r: dict = {"base_params": param_count(paths["merged-base"]), "params_with_heads": param_count(paths["merged"])}
        if not args.skip_main:
            print(f"[{size}] (a) plain decoding", file=sys.stderr)
            r["plain_decoding"] = bench_plain(paths, SIZES[size]["vocab"], args.new_tokens, args.repeats)
            print(f"[{size}] (b) tree-verify cost", file=sys.stderr)
            r["tree_verify"] = bench_tree(paths, past=128, rounds=args.rounds)
            print(f"[{size}] (c) host time per Medusa step", file=sys.stderr)
            r["host_per_step"] = bench_host(paths["engine"], args.new_tokens)
        if args.sweep_attention:
            print(f"[{size}] attention forms", file=sys.stderr)
            r["attention_forms_ms"] = sweep_attention(paths, args.workdir / size, args.rounds)
        if args.sweep_options:
            print(f"[{size}] session options", file=sys.stderr)
            r["session_options_ms"] = sweep_options(paths, args.rounds)
        results["sizes"][size] = r
        print_table(size, r)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def print_table(size: str, r: dict) -> None:
    print(f"\n== {size}: {r['base_params'] / 1e6:.1f}M base parameters, {r['params_with_heads'] / 1e6:.1f}M with heads, "
          f"{THREADS} threads")
    if "plain_decoding" in r:
        print("(a) plain greedy decoding, batch 1")
        for name, row in r["plain_decoding"].items():
            print(f"    {name:32s} {row['tokens_per_s']:9.1f} tok/s  x{row['vs_transformers']:.2f} vs transformers"
                  f"{'' if row['same_tokens'] else '  (TOKENS DIFFER)'}")
        tv = r["tree_verify"]
        print("(b) tree-verify step / plain decode step (Medusa engine, past 128):\n    as built:            "
              + ", ".join(f"{s}: {tv['ratio_vs_plain_step'][s]:.2f}x" for s in TREE_SLOTS)
              + "\n    heads at one slot:   "
              + ", ".join(f"{s}: {tv['ratio_if_heads_at_one_slot'][s]:.2f}x" for s in TREE_SLOTS))
        h = r["host_per_step"]
        print(f"(c) Medusa step {h['step_ms']:.2f} ms: session {h['session_ms']:.2f} ms, host {h['host_ms']:.2f} ms "
              f"({100 * h['host_share']:.1f}%: backend binding + KV compaction {h['host_backend_ms']:.2f} ms, "
              f"decoding loop {h['host_decoding_loop_ms']:.2f} ms)")
    for key in ("attention_forms_ms", "session_options_ms"):
        if key in r:
            print(f"{key}: median (min) ms per step")
            for name, row in r[key].items():
                print(f"    {name:30s} " + "  ".join(f"{c}={v['median_ms']:.2f}({v['min_ms']:.2f})" for c, v in row.items()))


if __name__ == "__main__":
    sys.exit(main())
