"""medusa-convert vs a naive full-load conversion: peak resident memory and throughput.

Makes a synthetic Llama base of about 2 GB on disk (random float16 weights, written shard by
shard) and v1 Medusa heads, then converts it twice, each in a fresh subprocess: once with
`medusa_trt.converter.convert` (streaming) and once the naive way (load every tensor, build the
output dict, `safetensors.torch.save_file`). Peak RSS is each child's VmHWM (Linux). Both outputs
are compared tensor by tensor.

    .venv/bin/python benchmarks/bench_convert.py [--workdir build/bench_convert] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

# Runs in the child: the naive conversion everyone writes first.
NAIVE = r"""
import json, sys, time
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
start = time.perf_counter()
base, heads, out = map(Path, sys.argv[1:4])
cfg = json.loads((base / "config.json").read_text())
sd = {}
for shard in sorted(base.glob("*.safetensors")):
    sd.update(load_file(shard))
hd = load_file(heads)
w = {"transformer.vocab_embedding.weight": sd.pop("model.embed_tokens.weight")}
for i in range(cfg["num_hidden_layers"]):
    p, q = f"transformer.layers.{i}", f"model.layers.{i}"
    w[f"{p}.input_layernorm.weight"] = sd.pop(f"{q}.input_layernorm.weight")
    w[f"{p}.attention.qkv.weight"] = torch.cat([sd.pop(f"{q}.self_attn.{x}_proj.weight") for x in "qkv"])
    w[f"{p}.attention.dense.weight"] = sd.pop(f"{q}.self_attn.o_proj.weight")
    w[f"{p}.post_layernorm.weight"] = sd.pop(f"{q}.post_attention_layernorm.weight")
    w[f"{p}.mlp.fc.weight"] = sd.pop(f"{q}.mlp.gate_proj.weight")
    w[f"{p}.mlp.gate.weight"] = sd.pop(f"{q}.mlp.up_proj.weight")
    w[f"{p}.mlp.proj.weight"] = sd.pop(f"{q}.mlp.down_proj.weight")
w["transformer.ln_f.weight"] = sd.pop("model.norm.weight")
w["lm_head.weight"] = sd.pop("lm_head.weight")
n_heads = 1 + max(int(k.split(".")[0]) for k in hd)
for h in range(n_heads):
    w[f"medusa_heads.{h}.medusa_layers.0.linear.weight"] = hd[f"{h}.0.linear.weight"]
    w[f"medusa_heads.{h}.medusa_layers.0.linear.bias"] = hd[f"{h}.0.linear.bias"]
    w[f"medusa_heads.{h}.lm_head.weight"] = hd[f"{h}.1.weight"]
out.mkdir(parents=True, exist_ok=True)
save_file(w, out / "rank0.safetensors")
print(json.dumps({"seconds": time.perf_counter() - start}))
"""

# Appended to each child: its own peak RSS. VmHWM belongs to the child's post-exec address space;
# getrusage/wait4 ru_maxrss would also count the parent's RSS inherited at fork.
PEAK = r"""
import json as _j
_hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1]
print(_j.dumps({"vm_hwm_kb": int(_hwm)}))
"""

OURS = r"""
import json, sys
from medusa_trt.converter.merge import convert
s = convert(sys.argv[1], sys.argv[2], sys.argv[3], progress=False)
print(json.dumps({"seconds": s.seconds, "head_format": s.head_format}))
"""

IMPORT_ONLY = "import torch, safetensors.torch, medusa_trt.converter"


def run_child(code: str, *args: str) -> dict:
    """Run `python -c code args`; its JSON output lines merged, wall time and peak RSS (MB)."""
    os.sync()  # no run pays for writing back the previous run's output
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", code + PEAK, *args], stdout=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    if run.returncode != 0:
        raise SystemExit(f"child failed with exit code {run.returncode}")
    result: dict = {}
    for line in run.stdout.strip().splitlines():
        result.update(json.loads(line))
    peak_mb = result.pop("vm_hwm_kb") / 1024
    return {**result, "wall_s": wall, "peak_rss_mb": peak_mb}


def dir_bytes(directory: Path, pattern: str = "*") -> int:
    return sum(p.stat().st_size for p in directory.glob(pattern) if p.is_file())


def same_tensors(a: Path, b: Path) -> bool:
    import torch

    from medusa_trt.safetensors_io import SafetensorsFile

    with SafetensorsFile(a) as fa, SafetensorsFile(b) as fb:
        if sorted(fa.keys()) != sorted(fb.keys()):
            return False
        return all(torch.equal(fa.read(n), fb.read(n)) for n in fa.keys())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("build/bench_convert"))
    ap.add_argument("--layers", type=int, default=20, help="20 layers at hidden 2048 ~ 2.15 GB float16")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--json", type=Path, default=None, help="where to write results (default workdir)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per method, alternating; best time is kept")
    ap.add_argument("--no-verify", action="store_true", help="skip the tensor-by-tensor output comparison")
    args = ap.parse_args()

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test fixtures' model factories

    from synthetic import make_heads, make_large_base

    work = args.workdir
    base, heads = work / "base", work / "heads" / "medusa_lm_head.safetensors"
    stamp = work / "base.json"
    spec = {"layers": args.layers, "hidden": args.hidden, "dtype": "float16"}
    if not (stamp.exists() and json.loads(stamp.read_text()) == spec and heads.exists()):
        shutil.rmtree(work, ignore_errors=True)
        print(f"making a synthetic base in {base} ...", flush=True)
        make_large_base(base, hidden_size=args.hidden, layers=args.layers, intermediate=args.hidden * 11 // 4,
                        dtype=torch.float16)
        make_heads(heads, "medusa_v1", base, num_heads=4, num_layers=1, dtype=torch.float16)
        stamp.write_text(json.dumps(spec))
    model_bytes = dir_bytes(base, "*.safetensors")
    heads_bytes = heads.stat().st_size
    print(f"base {model_bytes / 1e9:.2f} GB, heads {heads_bytes / 1e9:.2f} GB", flush=True)

    results: dict = {"base_bytes": model_bytes, "heads_bytes": heads_bytes, "spec": spec,
                     "cpu_count": os.cpu_count()}
    results["import_only"] = run_child(IMPORT_ONLY)
    runs: dict[str, list[dict]] = {"streaming": [], "naive": []}
    for i in range(args.repeat):
        for name, code in (("streaming", OURS), ("naive", NAIVE)):
            out = work / f"out-{name}"
            shutil.rmtree(out, ignore_errors=True)
            print(f"converting ({name}, run {i + 1}/{args.repeat}) ...", flush=True)
            r = run_child(code, str(base), str(heads), str(out))
            r["output_bytes"] = dir_bytes(out, "rank*.safetensors")
            runs[name].append(r)
    for name, rs in runs.items():
        r = dict(min(rs, key=lambda r: r["wall_s"]))
        r["peak_rss_mb"] = max(x["peak_rss_mb"] for x in rs)  # the worst run's memory
        r["wall_s_all"] = [round(x["wall_s"], 2) for x in rs]
        r["mb_per_s_wall"] = r["output_bytes"] / 1e6 / r["wall_s"]
        r["peak_rss_over_base"] = r["peak_rss_mb"] * 1024 * 1024 / model_bytes
        results[name] = r
    if not args.no_verify:
        results["outputs_identical"] = same_tensors(work / "out-streaming/rank0.safetensors",
                                                    work / "out-naive/rank0.safetensors")
    for name in ("streaming", "naive"):
        shutil.rmtree(work / f"out-{name}", ignore_errors=True)
    s, n = results["streaming"], results["naive"]
    results["rss_ratio_naive_over_streaming"] = n["peak_rss_mb"] / s["peak_rss_mb"]
    results["speed_ratio_streaming_over_naive"] = n["wall_s"] / s["wall_s"]

    path = args.json or work / "bench_convert.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nbase {model_bytes / 1e9:.2f} GB float16 + heads {heads_bytes / 1e9:.2f} GB -> "
          f"output {s['output_bytes'] / 1e9:.2f} GB; python+torch import alone: "
          f"{results['import_only']['peak_rss_mb']:.0f} MB RSS")
    print(f"{'':<10} {'peak RSS':>10} {'% of base':>10} {'best wall s':>12} {'MB/s':>8}")
    for name in ("streaming", "naive"):
        r = results[name]
        print(f"{name:<10} {r['peak_rss_mb']:>8.0f}MB {100 * r['peak_rss_over_base']:>9.1f}% "
              f"{r['wall_s']:>12.1f} {r['mb_per_s_wall']:>8.0f}")
    print(f"naive/streaming peak RSS: {results['rss_ratio_naive_over_streaming']:.1f}x; "
          f"streaming speed vs naive: {results['speed_ratio_streaming_over_naive']:.2f}x; "
          f"outputs identical: {results.get('outputs_identical', 'not checked')}")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
