"""`make gpu-check`: everything that needs an NVIDIA GPU, in one command, with one JSON report.

On a machine with a CUDA GPU it
1. runs the tree-attention Triton kernel against its PyTorch reference on the device, and times it
   against PyTorch SDPA with a dense boolean mask (past 1k-8k tokens, trees of 16-64 nodes), with
   the bandwidth each reaches as % of the GPU's peak HBM bandwidth (K/V bytes read / time);
2. builds the demo model with `medusa-build --backend tensorrt` (plugin and native attention) and
   runs `medusa-check` on each; then the demo base with an Amphista drafter (drafter.engine, its own
   cache; the drafter's weights are its identity start plus noise, so every part of it drafts);
3. builds ONNX Runtime engines for the CUDA provider (Medusa heads, and the Amphista drafter whose
   own cache stays on the host) and runs `medusa-check --device cuda` on each;
4. times Medusa against plain decoding on each engine (`medusa-bench`, one run, alternating);
5. with `--gguf`, runs SmolLM2-135M-Instruct on CUDA through the PyTorch reference (float32 and
   bfloat16): plain greedy against transformers, Medusa greedy against plain (the CPU's tuned tree,
   mc_sim_7b_63 and a tree medusa-tune-tree picks on this GPU), tokens/s of each;
installs what is missing first (the `tensorrt` extra and onnxruntime-gpu; `--wheels DIR` installs
from carried wheels on a machine without network), writes `--out` (JSON) and prints a short table.
Every step is recorded, a failing step does not stop the others; the exit code is 1 if one failed.

Without a CUDA GPU it prints one line saying so and exits 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROG = "gpu-check"
NEEDS = {"tensorrt": "tensorrt>=10.15,<12", "onnx_graphsurgeon": "onnx-graphsurgeon>=0.5", "triton": "triton>=3.3"}
PASTS = (1024, 2048, 4096, 8192)
TREES = (16, 32, 64)


def gpu_summary() -> dict | None:
    """The device, or None when torch sees no CUDA GPU (or torch is missing)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    p = torch.cuda.get_device_properties(0)
    clock_khz, bus_bits = getattr(p, "memory_clock_rate", None), getattr(p, "memory_bus_width", None)
    # Double data rate: two transfers per memory clock on the whole bus.
    peak = 2 * clock_khz * 1e3 * bus_bits / 8 if clock_khz and bus_bits else None
    return {"name": p.name, "capability": f"{p.major}.{p.minor}", "memory_gib": round(p.total_memory / 2**30, 1),
            "peak_hbm_bytes_per_s": peak, "torch": torch.__version__, "cuda": torch.version.cuda}


def install(wheels: Path | None) -> dict:
    """pip installs what the GPU steps need and is missing. The wheels are fetched first and the CPU
    onnxruntime is removed only once they are here: a machine without an index (or without the
    carried wheels) keeps what it had instead of losing onnxruntime altogether."""
    import tempfile

    missing = [spec for module, spec in NEEDS.items() if importlib.util.find_spec(module) is None]
    cpu_onnxruntime = False
    try:
        import onnxruntime as ort

        # onnxruntime and onnxruntime-gpu share the module: the CPU wheel must go before the GPU one.
        cpu_onnxruntime = "CUDAExecutionProvider" not in ort.get_available_providers()
    except ImportError:
        pass
    if cpu_onnxruntime or importlib.util.find_spec("onnxruntime") is None:
        missing.append("onnxruntime-gpu")
    if not missing:
        return {"installed": []}
    source = ["--no-index", "--find-links", str(wheels)] if wheels else []
    with tempfile.TemporaryDirectory() as fetched:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "-d", fetched, *missing, *source],
                              capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"pip download {' '.join(missing)} failed (nothing was changed): "
                               f"{done.stderr.strip()[-400:]}")
        if cpu_onnxruntime:
            subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", "onnxruntime"], check=False)
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", fetched,
                               *missing], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"pip install {' '.join(missing)} failed: {done.stderr.strip()[-400:]}")
    return {"installed": missing}


def _time_cuda(fn, reps: int = 50, warmup: int = 5) -> float:
    """Median milliseconds of fn() with CUDA events."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_case(past: int, nodes: int, heads: int = 32, kv_heads: int = 8, dim: int = 128, batch: int = 1) -> dict:
    """One (past, tree) point: Triton kernel vs reference (max abs diff) and vs SDPA with a dense mask."""
    import torch
    import torch.nn.functional as F

    from medusa_trt.runtime.trt.tree_attention.kernel import (
        dense_mask_from_packed,
        reference_tree_attention,
        triton_tree_attention,
    )
    from medusa_trt.tree import build_tree, read_tree

    g = torch.Generator(device="cuda").manual_seed(past + nodes)
    dev, dt = "cuda", torch.float16
    # The first nodes-1 of the 63-node tree in (depth, path) order: prefix-closed, so a valid tree.
    paths = read_tree("mc_sim_7b_63", num_heads=8)[: nodes - 1]
    tree = build_tree(paths, 8, nodes - 1)  # root + nodes-1 slots
    t = tree.num_slots
    packed = torch.tensor(tree.packed_mask, device=dev)
    q = torch.randn(batch, heads, t, dim, device=dev, dtype=dt, generator=g)
    k = torch.randn(batch, kv_heads, past + t, dim, device=dev, dtype=dt, generator=g)
    v = torch.randn(batch, kv_heads, past + t, dim, device=dev, dtype=dt, generator=g)
    lens = torch.full((batch,), past, device=dev, dtype=torch.int32)
    got = triton_tree_attention(q, k, v, lens, packed)
    want = reference_tree_attention(q, k, v, lens, packed)
    diff = float((got.float() - want.float()).abs().max())
    mask = torch.cat([torch.ones(t, past, dtype=torch.bool, device=dev), dense_mask_from_packed(packed, t)], dim=-1)
    kr, vr = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    kernel_ms = _time_cuda(lambda: triton_tree_attention(q, k, v, lens, packed))
    sdpa_ms = _time_cuda(lambda: F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask[None, None]))
    kv_bytes = 2 * batch * kv_heads * (past + t) * dim * k.element_size()  # what the kernel must read
    return {"past": past, "tree_nodes": t, "max_abs_diff_vs_reference": diff, "passed": diff <= 2e-3,
            "kernel_ms": round(kernel_ms, 4), "sdpa_dense_mask_ms": round(sdpa_ms, 4),
            "speedup_vs_sdpa": round(sdpa_ms / kernel_ms, 3), "kv_bytes": kv_bytes,
            "kernel_bytes_per_s": kv_bytes / (kernel_ms / 1e3)}


def real_model(gguf: Path, work: Path, limit: int, max_new_tokens: int = 128, device: str = "cuda",
               on_progress=None) -> dict:
    """SmolLM2-135M-Instruct (the GGUF of the real-model issue) on CUDA through the PyTorch reference
    (medusa_trt.modeling), per dtype: plain greedy against transformers' greedy on the same GPU, and
    Medusa greedy (the CPU-tuned shipped tree, the 63-node preset and a tree tuned on this GPU)
    against plain greedy, on held-out prompts, with tokens/s of each (one prompt at a time, the
    modes in turn per prompt). `on_progress(report)` runs after each dtype (the caller saves what
    is done so far).

    Exactness on a GPU is a measurement, not a given: cuBLAS may pick other kernels, so other
    summation orders, for the tree's T rows than for one row, so a near-tie can break the other way."""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_peers import agreement as bench_agreement
    from bench_peers import read_prompts

    from medusa_trt.converter.gguf import write_hf_dir
    from medusa_trt.runtime.decoding import GenerationConfig, decode
    from medusa_trt.runtime.loading import load_backend, load_tokenizer, stop_tokens
    from medusa_trt.tools.demo import ASSETS

    ckpt, hf_dir = work / "smollm2_ckpt", work / "smollm2_hf"
    report: dict = {"convert": run_tool("medusa_trt.cli.convert", [
        "--base", str(gguf), "--heads", str(ASSETS / "heads"), "--out", str(ckpt), "--dtype", "float32",
        "--force", "--quiet"])}
    if report["convert"]["rc"] != 0:
        return report
    if not (hf_dir / "config.json").is_file():
        write_hf_dir(gguf, hf_dir)
    tok = load_tokenizer(ckpt)
    prompts = [p.ids for p in read_prompts(ASSETS / "prompts_heldout.jsonl", tok, limit)]
    stops = stop_tokens(ckpt, tok)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    trees = {"tuned_cpu": json.loads((ASSETS / "tree.json").read_text())["medusa_choices"], "mc_sim_7b_63": "mc_sim_7b_63"}
    # The tree for this GPU: medusa-tune-tree on the float32 reference here (step cost is nearly flat
    # in the tree's size on a GPU, so it picks a much larger tree than the CPU engines' 1-2 nodes).
    tree_file = work / "tree_cuda.json"
    report["tune_tree"] = run_tool("medusa_trt.cli.tune_tree", [
        "--engine", str(ckpt), "--device", device, "--prompts", str(ASSETS / "prompts_calib.jsonl"), "--limit", "16",
        "--max-nodes", "63", "--no-measure", "--quiet", "--out", str(tree_file)])
    if report["tune_tree"]["rc"] == 0:
        tuned = json.loads(tree_file.read_text())
        trees["tuned_here"] = tuned["medusa_choices"]
        report["tune_tree"]["tree"] = {"nodes": len(tuned["medusa_choices"]), "predicted": tuned["predicted"]["tuned"]}

    def agreement(outs: list[list[int]], refs: list[list[int]]) -> dict:
        rows = [bench_agreement(out, ref) for out, ref in zip(outs, refs, strict=True)]
        return {"equal": sum(r[0] for r in rows), "of": len(rows),
                "common_prefix_share_of_unequal": [round(r[1], 3) for r in rows if not r[0]]}

    def round_robin(modes: dict) -> dict[str, dict]:
        """Every mode on every prompt, the modes taking turns per prompt (the order rotated by one each
        prompt) so that drift on the machine hits them alike; one warm-up prompt each first (cuBLAS
        handles, kernels loaded). A mode is ids -> (new tokens, steps)."""
        for fn in modes.values():
            fn(prompts[0])
        names, runs = list(modes), {name: {"out": [], "seconds": 0.0, "steps": 0} for name in modes}
        for i, ids in enumerate(prompts):
            for name in names[i % len(names):] + names[: i % len(names)]:
                sync()
                t0 = time.perf_counter()
                out, steps = modes[name](ids)
                sync()
                run = runs[name]
                run["seconds"] += time.perf_counter() - t0
                run["out"].append(out)
                run["steps"] += steps
        for run in runs.values():
            run["tokens_per_s"] = sum(map(len, run["out"])) / run["seconds"]
        return runs

    for dtype in ("float32", "bfloat16"):
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype)).to(device).eval()
        backend = load_backend(ckpt, dtype=dtype, device=device)

        def hf_greedy(ids, hf=hf):
            x = torch.tensor([ids], device=device)
            with torch.inference_mode():
                out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                                  eos_token_id=list(stops), pad_token_id=stops[0])[0, len(ids):].tolist()
            return out, len(out)

        def ours(ids, choices=None, backend=backend):
            cfg = GenerationConfig(max_new_tokens=max_new_tokens, use_medusa=choices is not None,
                                   medusa_choices=choices or [[0]], stop_token_ids=stops)
            r = decode(backend, [ids], cfg)
            return r.tokens[0], r.stats[0].steps

        runs = round_robin({"transformers": hf_greedy, "plain": ours,
                            **{name: (lambda ids, c=choices: ours(ids, c)) for name, choices in trees.items()}})
        plain = runs["plain"]
        entry = {"transformers_tokens_per_s": round(runs["transformers"]["tokens_per_s"], 1),
                 "plain_tokens_per_s": round(plain["tokens_per_s"], 1),
                 "plain_vs_transformers": agreement(plain["out"], runs["transformers"]["out"]), "medusa": {}}
        for name in trees:
            run = runs[name]
            entry["medusa"][name] = {"tokens_per_s": round(run["tokens_per_s"], 1),
                                     "speedup_vs_plain": round(run["tokens_per_s"] / plain["tokens_per_s"], 3),
                                     "tokens_per_step": round(sum(map(len, run["out"])) / run["steps"], 3),
                                     "vs_plain": agreement(run["out"], plain["out"])}
        report[dtype] = entry
        if on_progress:
            on_progress(report)
        del hf, backend
    return report


def run_tool(module: str, args: list[str], timeout: float = 3600) -> dict:
    """A medusa-trt CLI as a child process: its exit code and the tail of its output."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)
    return {"rc": done.returncode, "seconds": round(time.perf_counter() - start, 1),
            "tail": (done.stdout + done.stderr).strip().splitlines()[-8:]}


def amphista_drafter(base: Path, out: Path) -> Path:
    """An Amphista drafter for `base` in this project's format: its identity start (it drafts the next
    token at every head) plus noise, so that every part of the drafter engine shows in its drafts."""
    from medusa_trt.tools.train_drafter import new_amphista, save_amphista

    save_amphista(new_amphista(base, noise=0.02), out, base=str(base), vocab=None)
    return out


def engine_steps(work: Path, name: str, build_args: list[str], device: str, ckpt: str = "ckpt") -> list[dict]:
    """Build, medusa-check, medusa-bench for one engine kind (from work/ckpt)."""
    engine = work / name
    steps = [{"step": f"build {name}", **run_tool("medusa_trt.cli.build", [
        "--checkpoint", str(work / ckpt), "--out", str(engine), "--force", "--quiet", *build_args])}]
    if steps[0]["rc"] != 0:
        return steps
    steps.append({"step": f"check {name}", **run_tool("medusa_trt.cli.check", [
        "--engine", str(engine), "--device", device, "--json", str(work / f"{name}.check.json")])})
    bench_json = work / f"{name}.bench.json"
    tree = ROOT / "assets" / "demo_model" / "tree.json"
    steps.append({"step": f"bench {name}", **run_tool("medusa_trt.cli.bench", [
        "--engine", str(engine), "--prompts", str(ROOT / "assets" / "demo_model" / "prompts_heldout.jsonl"),
        "--limit", "8", "--no-hf", "--quiet", "--json", str(bench_json),
        *(["--medusa-choices", str(tree)] if tree.is_file() else [])])})
    if bench_json.is_file():
        modes = json.loads(bench_json.read_text()).get("modes", {})
        steps[-1]["tokens_per_s"] = {m: v.get("tokens_per_s") for m, v in modes.items()}
    return steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "build" / "gpu_check" / "report.json")
    p.add_argument("--wheels", type=Path, help="install missing packages from this folder of wheels (no network)")
    p.add_argument("--no-install", action="store_true", help="use what is installed")
    p.add_argument("--skip-engines", action="store_true", help="kernel only")
    p.add_argument("--gguf", type=Path, help="SmolLM2-135M-Instruct's GGUF (build/smollm2): also run the real model "
                   "on CUDA through the PyTorch reference")
    p.add_argument("--limit", type=int, default=16, help="held-out prompts for --gguf (default 16)")
    args = p.parse_args(argv)
    gpu = gpu_summary()
    if gpu is None:
        print(f"{PROG}: no CUDA GPU here (torch sees none); nothing to check")
        return 0
    report: dict = {"gpu": gpu, "python": platform.python_version(), "steps": [], "kernel": []}
    work = args.out.parent
    work.mkdir(parents=True, exist_ok=True)
    try:
        if not args.no_install:
            report["install"] = install(args.wheels)
        for past in PASTS:
            for nodes in TREES:
                case = kernel_case(past, nodes)
                if gpu["peak_hbm_bytes_per_s"]:
                    case["kernel_pct_of_peak_hbm"] = round(100 * case["kernel_bytes_per_s"] / gpu["peak_hbm_bytes_per_s"], 1)
                report["kernel"].append(case)
        if not args.skip_engines:
            demo = ROOT / "assets" / "demo_model"
            report["steps"].append({"step": "convert demo model", **run_tool("medusa_trt.cli.convert", [
                "--base", str(demo / "base"), "--heads", str(demo / "heads"), "--out", str(work / "ckpt"),
                "--force", "--quiet", "--dtype", "float16"])})
            for name, build_args, device in (
                    ("tensorrt-plugin", ["--backend", "tensorrt", "--trt-attention", "plugin"], "cuda"),
                    ("tensorrt-native", ["--backend", "tensorrt", "--trt-attention", "native"], "cuda"),
                    ("onnxruntime-cuda", ["--device", "cuda", "--dtype", "float16"], "cuda")):
                report["steps"] += engine_steps(work, name, build_args, device)
            report["steps"].append({"step": "convert demo base + Amphista", **run_tool("medusa_trt.cli.convert", [
                "--base", str(demo / "base"), "--heads", str(amphista_drafter(demo / "base", work / "amphista")),
                "--out", str(work / "ckpt_amphista"), "--force", "--quiet", "--dtype", "float16"])})
            report["steps"] += engine_steps(work, "tensorrt-amphista", ["--backend", "tensorrt"], "cuda", "ckpt_amphista")
            report["steps"] += engine_steps(work, "onnxruntime-cuda-amphista", ["--device", "cuda", "--dtype", "float16"],
                                            "cuda", "ckpt_amphista")
        if args.gguf:
            def save(partial: dict) -> None:  # a run cut off by a time limit keeps what it measured
                args.out.write_text(json.dumps({**report, "real_model": partial}, indent=2) + "\n")

            report["real_model"] = real_model(args.gguf, work, args.limit, on_progress=save)
    except Exception as e:  # the report says how far it got
        report["error"] = f"{type(e).__name__}: {e}"
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{gpu['name']} (sm {gpu['capability']}), peak HBM "
          f"{gpu['peak_hbm_bytes_per_s'] / 1e12:.2f} TB/s" if gpu["peak_hbm_bytes_per_s"] else gpu["name"])
    print(f"{'past':>6} {'tree':>5} {'kernel ms':>10} {'SDPA ms':>9} {'x SDPA':>7} {'% HBM':>6}  ok")
    for c in report["kernel"]:
        print(f"{c['past']:>6} {c['tree_nodes']:>5} {c['kernel_ms']:>10.4f} {c['sdpa_dense_mask_ms']:>9.4f} "
              f"{c['speedup_vs_sdpa']:>7.2f} {c.get('kernel_pct_of_peak_hbm', math.nan):>6.1f}  "
              f"{'PASS' if c['passed'] else 'FAIL'}")
    for s in report["steps"]:
        extra = f"  {s['tokens_per_s']}" if s.get("tokens_per_s") else ""
        verdict = "PASS" if s["rc"] == 0 else f"FAIL (rc {s['rc']})"
        print(f"{s['step']:<28} {verdict}  {s['seconds']} s{extra}")
    real = report.get("real_model") or {}
    for dtype in ("float32", "bfloat16"):
        if dtype in real:
            e, agree = real[dtype], real[dtype]["plain_vs_transformers"]
            print(f"SmolLM2 CUDA {dtype}: transformers {e['transformers_tokens_per_s']} tok/s, plain "
                  f"{e['plain_tokens_per_s']} tok/s (== transformers {agree['equal']}/{agree['of']})")
            for name, m in e["medusa"].items():
                print(f"  medusa {name}: {m['tokens_per_s']} tok/s, {m['speedup_vs_plain']}x plain, "
                      f"{m['tokens_per_step']} tokens/step, == plain {m['vs_plain']['equal']}/{m['vs_plain']['of']}")
    failed = ("error" in report or real.get("convert", {}).get("rc", 0) != 0 or any(not c["passed"] for c in report["kernel"])
              or any(s["rc"] != 0 for s in report["steps"]))
    print(f"{PROG}: {'FAIL' if failed else 'PASS'}; report {args.out}" + (f" ({report['error']})" if "error" in report else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
