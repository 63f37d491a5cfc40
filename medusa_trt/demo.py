"""`make demo`: the main job end to end on the committed demo model, on the CPU.

The demo model (assets/demo_model, made by scripts/train_demo_model.py) is a small Llama trained
on Python's standard library with Medusa-1 heads self-distilled on it, stored like a user's model:
an HF dir and a FasterDecoding v1 head file. The demo merges them with medusa-convert, builds the
ONNX Runtime engine with medusa-build, and completes held-out code prompts with plain and Medusa
decoding on the same engine, printing the text, tokens per step and the speedup.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "demo_model"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m medusa_trt.demo", description=__doc__)
    p.add_argument("--workdir", type=Path, default=Path("build/demo"))
    p.add_argument("--assets", type=Path, default=ASSETS, help="demo model dir (base/, heads/, prompts)")
    p.add_argument("--prompts", type=int, default=4, help="held-out prompts to complete (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--medusa-choices", help="tree (default: the assets' tree.json tuned by medusa-tune-tree, "
                   "else mc_sim_7b_63)")
    args = p.parse_args(argv)

    from medusa_trt.bench import ForwardTimer, timed_decode
    from medusa_trt.converter import ConvertError, convert
    from medusa_trt.runtime.decoding import GenerationConfig
    from medusa_trt.runtime.loading import load_backend, load_tokenizer, stop_tokens
    from medusa_trt.training import read_samples
    from medusa_trt.tree import DEFAULT_TREE

    assets, work = args.assets, args.workdir
    needed = [assets / "base" / "config.json", assets / "heads" / "config.json", assets / "prompts_heldout.jsonl"]
    missing = [str(f) for f in needed if not f.is_file()]
    if not any((assets / "heads").glob("medusa_lm_head.*")):
        missing.append(str(assets / "heads" / "medusa_lm_head.{pt,safetensors}"))
    if missing:
        print(f"demo: error: missing {', '.join(missing)}; run scripts/train_demo_model.py first", file=sys.stderr)
        return 2
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    summary = json.loads((assets / "summary.json").read_text()) if (assets / "summary.json").is_file() else {}
    b = summary.get("base", {})
    print(f"demo model: {assets}")
    if b:
        print(f"  Llama {b['parameters'] / 1e6:.1f}M params trained on Python's standard library (held-out loss "
              f"{b['heldout_loss']:.2f}), {summary['heads']['num_heads']} Medusa heads self-distilled "
              f"(held-out top-1 {', '.join(f'{a:.2f}' for a in summary['heads']['heldout_top1'])})")

    t0 = time.perf_counter()
    print("1/3 medusa-convert: HF base + FasterDecoding v1 heads -> merged checkpoint (float32 for the CPU)")
    try:
        result = convert(assets / "base", assets / "heads", work / "ckpt", dtype="float32", progress=False)
    except ConvertError as e:
        print(f"demo: error: {e}", file=sys.stderr)
        return 2
    print("    " + str(result).replace("\n", "\n    "))
    try:
        from medusa_trt.engines.build import BuildOptions, build_engine
    except ImportError as e:
        print(f"2/3 ONNX Runtime engine unavailable ({e}): running the PyTorch reference instead")
        engine_dir = work / "ckpt"
    else:
        print("2/3 medusa-build --backend onnxruntime")
        built = build_engine(BuildOptions(checkpoint=work / "ckpt", out=work / "engine", progress=True))
        engine_dir = work / "engine"
        print(f"    {engine_dir} ({built.seconds:.1f} s)")
    print(f"    setup took {time.perf_counter() - t0:.1f} s")

    backend = load_backend(engine_dir)
    tok = load_tokenizer(engine_dir)
    stops = stop_tokens(engine_dir, tok)
    tree = args.medusa_choices or (str(assets / "tree.json") if (assets / "tree.json").is_file() else DEFAULT_TREE)
    texts = read_samples(assets / "prompts_heldout.jsonl")[: args.prompts]
    prompts = [tok.encode(t) for t in texts]
    plain_cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, use_medusa=False, stop_token_ids=stops)
    medusa_cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, medusa_choices=tree, stop_token_ids=stops)
    timer = ForwardTimer(backend)
    for cfg in (plain_cfg, medusa_cfg):  # warm-up: first calls pay for ONNX Runtime's lazy setup
        timed_decode(timer, prompts[0], GenerationConfig(**{**cfg.__dict__, "max_new_tokens": 8}))

    print(f"3/3 {len(prompts)} held-out prompts, {args.max_new_tokens} new tokens, greedy, batch 1, "
          f"{type(backend).__name__}, tree {Path(tree).name if str(tree).endswith('.json') else tree}")
    totals = {"plain": [0, 0.0], "medusa": [0, 0.0]}
    steps, same = 0, True
    for i, prompt in enumerate(prompts):
        order = ("plain", "medusa") if i % 2 == 0 else ("medusa", "plain")  # alternate: fair to both
        runs = {m: timed_decode(timer, prompt, plain_cfg if m == "plain" else medusa_cfg) for m in order}
        for m, run in runs.items():
            totals[m][0] += run.stats.new_tokens
            totals[m][1] += run.wall_s
        med, pl = runs["medusa"], runs["plain"]
        steps += med.stats.steps
        same &= med.tokens == pl.tokens
        print(f"\n--- prompt {i + 1} ({texts[i].count(chr(10))} lines from a held-out file) ---")
        print(texts[i] + "\033[1m" + tok.decode(med.tokens, skip_special_tokens=True) + "\033[0m"
              if sys.stdout.isatty() else texts[i] + tok.decode(med.tokens, skip_special_tokens=True))
        print(f"--- {med.stats.new_tokens} tokens in {med.stats.steps} Medusa steps = "
              f"{med.stats.tokens_per_step:.2f} tokens/step; speedup over plain {pl.wall_s / med.wall_s:.2f}x "
              f"({1e3 * pl.wall_s:.0f} ms -> {1e3 * med.wall_s:.0f} ms)")
    plain_tps = totals["plain"][0] / totals["plain"][1]
    medusa_tps = totals["medusa"][0] / totals["medusa"][1]
    print(f"\nall prompts: plain {plain_tps:.0f} tokens/s, Medusa {medusa_tps:.0f} tokens/s -> speedup "
          f"{medusa_tps / plain_tps:.2f}x; {totals['medusa'][0] / steps:.2f} tokens/step; "
          f"Medusa output == plain greedy: {same}")
    tuned = _tuned(tree)
    if tuned is not None and tuned.get("recommendation") == "plain":
        pred = tuned.get("predicted", {}).get("tuned", {})
        print(f"note: medusa-tune-tree found no tree that beats plain decoding for this model on the machine it "
              f"was tuned on (best predicted {pred.get('speedup_vs_plain', float('nan')):.2f}x at "
              f"{pred.get('tokens_per_step', float('nan')):.2f} tokens/step): the heads guess too rarely for the "
              "cost of a tree step there; retune on yours with medusa-tune-tree")
    print("measure more with: medusa-bench --engine " f"{engine_dir} --prompts {assets / 'prompts_heldout.jsonl'} "
          f"--medusa-choices {tree}")
    return 0 if same else 1


def _tuned(tree) -> dict | None:
    """The medusa-tune-tree report when the tree is its tree.json."""
    path = Path(str(tree))
    if path.suffix != ".json" or not path.is_file():
        return None
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else None


if __name__ == "__main__":
    sys.exit(main())
