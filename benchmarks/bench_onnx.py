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

The sweeps that chose the engine's defaults (attention forms, session options) are
benchmarks/investigations/bench_onnx_sweeps.py, on the same cached models.

    .venv/bin/python benchmarks/bench_onnx.py [--sizes 10M,100M] [--new-tokens 64] [--json FILE]
        [--workdir build/bench_onnx]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from common import SIZES, ort_backend, param_count, prepared, random_models, round_robin

PROMPT_LEN = 32
TREE_SLOTS = (1, 4, 8, 16, 32, 64)
THREADS = len(os.sched_getaffinity(0))  # --threads overrides; every framework gets the same count


# -- (a) plain decoding ------------------------------------------------------------------------


def bench_plain(paths: dict[str, Path], vocab: int, new_tokens: int, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    from medusa_trt.modeling import MedusaModel
    from medusa_trt.runtime.decoding import GenerationConfig, decode
    from medusa_trt.runtime.torch_backend import TorchBackend

    prompt = torch.randint(3, vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(0)).tolist()
    cfg = GenerationConfig(max_new_tokens=new_tokens, use_medusa=False)
    hf = AutoModelForCausalLM.from_pretrained(paths["base"], dtype=torch.float32).eval()
    ids = torch.tensor([prompt])

    def hf_generate():
        with torch.inference_mode():
            return hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                               eos_token_id=None, pad_token_id=0)[0, PROMPT_LEN:].tolist()

    runners = {
        "onnxruntime engine": ort_backend(paths["engine-base"], THREADS),
        "pytorch eager (MedusaModel)": TorchBackend(MedusaModel.from_checkpoint(paths["merged-base"])),
        "onnxruntime engine + 4 heads": ort_backend(paths["engine"], THREADS),
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


def bench_tree(paths: dict[str, Path], past: int, rounds: int, batch: int = 1) -> dict:
    """Steps of each tree size, timed round-robin, against the 1-slot step of the Medusa engine.

    The engine computes every head at every slot, but the decoding loop reads them at one slot
    only; the base-only engine's steps plus one slot's worth of heads show what a step would cost
    if heads ran only there."""

    capacity = past + max(TREE_SLOTS) + 1  # what the decoding loop allocates for the largest tree
    engines = {"medusa": ort_backend(paths["engine"], THREADS), "base": ort_backend(paths["engine-base"], THREADS)}
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

    backend = ort_backend(engine_dir, THREADS)
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


# -- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    global THREADS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=Path("build/bench_onnx"))
    p.add_argument("--sizes", default="10M,100M")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement in (a)-(c)")
    p.add_argument("--rounds", type=int, default=7, help="round-robin rounds of the tree-verify steps in (b)")
    p.add_argument("--json", type=Path)
    p.add_argument("--threads", type=int, help=f"threads for every framework (default: {THREADS}, the usable cores)")
    args = p.parse_args(argv)
    THREADS = args.threads or THREADS
    # The same thread count everywhere: torch's OpenMP threads spin at barriers, so a torch with
    # more threads than free cores slows down by an order of magnitude on a shared machine.
    torch.set_num_threads(THREADS)
    results: dict = {"threads": THREADS, "new_tokens": args.new_tokens, "prompt_len": PROMPT_LEN, "sizes": {}}
    for size in args.sizes.split(","):
        paths = random_models(args.workdir, size)
        r: dict = {"base_params": param_count(paths["merged-base"]), "params_with_heads": param_count(paths["merged"])}
        print(f"[{size}] (a) plain decoding", file=sys.stderr)
        r["plain_decoding"] = bench_plain(paths, SIZES[size]["vocab"], args.new_tokens, args.repeats)
        print(f"[{size}] (b) tree-verify cost", file=sys.stderr)
        r["tree_verify"] = bench_tree(paths, past=128, rounds=args.rounds)
        print(f"[{size}] (c) host time per Medusa step", file=sys.stderr)
        r["host_per_step"] = bench_host(paths["engine"], args.new_tokens)
        results["sizes"][size] = r
        print_table(size, r)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def print_table(size: str, r: dict) -> None:
    print(f"\n== {size}: {r['base_params'] / 1e6:.1f}M base parameters, {r['params_with_heads'] / 1e6:.1f}M with heads, "
          f"{THREADS} threads")
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


if __name__ == "__main__":
    sys.exit(main())
