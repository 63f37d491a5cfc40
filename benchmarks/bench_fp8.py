"""FP8 (medusa-convert --quantize fp8) vs the unquantized checkpoint: quality, Medusa acceptance, size.

Both checkpoints are float16 (what would be deployed); both run on the PyTorch reference in float32
on this CPU, the FP8 one with fake quantization (FP8 weights and scales as stored, inputs
quantized-dequantized with the calibrated scales: the arithmetic of the FP8 engines). Measured on
held-out text (never used for calibration or head training):

- top-1 agreement: teacher-forced next-token argmax of the FP8 model == the unquantized one, over
  every position of every held-out sample;
- greedy agreement over --new-tokens new tokens per prompt: the share of positions where the two
  greedy continuations hold the same token, and the mean length of their common prefix;
- Medusa tokens per step (greedy, default tree mc_sim_7b_63) for both, and how far each Medusa
  output equals its own model's plain greedy output. Unquantized, they are equal (lossless). With
  FP8 they can part at a near-tie: a tree step computes a token in a 64-row matmul, a plain step in
  a 1-row one, and float32 differences of 1e-7 between the two can flip an e4m3 rounding (the same
  flips medusa-check admits), which moves logits by up to ~1e-1;
- checkpoint sizes: rank files, and the quantized linears alone (FP8 + scales vs float16).

Variants: FP8 linears; FP8 linears + FP8 KV cache. The model: --assets DIR (a trained base/ and
heads/ with prompts_calib.jsonl and prompts_heldout.jsonl, as scripts/train_demo_model.py writes)
when given, else a random Llama (transformers) with Medusa heads self-distilled on its own greedy
continuations (medusa_trt.tools.train_heads), as tests/runtime/test_decoding.py's `distilled` fixture makes them.
A random base has flat, near-tied logits, so its agreement figures are a floor for trained models.

    .venv/bin/python benchmarks/bench_fp8.py [--assets assets/demo_model] [--workdir build/bench_fp8]
        [--json FILE] [--prompts 16] [--new-tokens 64] [--calib-samples 64]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from medusa_trt.checkpoint import rank_file  # noqa: E402
from medusa_trt.converter.merge import convert  # noqa: E402
from medusa_trt.converter.quantize import QuantOptions  # noqa: E402
from medusa_trt.modeling import MedusaModel  # noqa: E402
from medusa_trt.runtime.decoding import GenerationConfig, decode  # noqa: E402
from medusa_trt.runtime.torch_backend import TorchBackend  # noqa: E402
from medusa_trt.safetensors_io import SafetensorsFile  # noqa: E402

SYNTHETIC = dict(hidden_size=256, layers=4, heads=8, kv_heads=4, intermediate=768, vocab=256,
                 max_position_embeddings=1024)
LINEARS = (".attention.qkv.", ".attention.dense.", ".mlp.fc.", ".mlp.gate.", ".mlp.proj.")
PROMPT_TOKENS = 24
WORDS = ("model", "token", "head", "tree", "draft", "verify", "accept", "cache", "layer", "scale",
         "the", "a", "of", "to", "and", "is", "it", "we", "FP8", "Medusa", "runs", "fast", "on", "CPU",
         "42", "7", "2024", "-", "!", "?", ".", ",", "it's", "don't")


def sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(12, 40))) for _ in range(n)]


def synthetic_model(work: Path) -> tuple[Path, Path, list[str], list[str]]:
    """A random base + self-distilled v1 heads (cached in `work`), calibration and held-out text."""
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test fixtures' model factories

    from synthetic import make_base

    from medusa_trt.tools.train_heads import greedy_continuations, save_heads, train_heads

    base, heads = work / "base", work / "heads"
    stamp = work / "model.json"
    if not (stamp.exists() and json.loads(stamp.read_text()) == SYNTHETIC and (heads / "config.json").exists()):
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(heads, ignore_errors=True)
        print("making a random base and self-distilling heads on it ...", flush=True)
        make_base(base, "llama", dtype=torch.float16, **SYNTHETIC)
        hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        rng = random.Random(100)
        train = [[rng.randrange(3, 72) for _ in range(8)] for _ in range(128)]  # ids of the real tokenizer
        state = train_heads(hf, greedy_continuations(hf, train, 64), num_heads=4, steps=300,
                            batch_tokens=2048, progress=False)
        save_heads(state, heads, base, num_heads=4, num_layers=1, dtype=torch.float16)
        stamp.write_text(json.dumps(SYNTHETIC))
    return base, heads, sentences(256, seed=1), sentences(64, seed=2)


def demo_model(assets: Path) -> tuple[Path, Path, list[str], list[str]]:
    def texts(name: str) -> list[str]:
        lines = (assets / name).read_text().splitlines()
        return [json.loads(line)["text"] for line in lines if line.strip()]

    return assets / "base", assets / "heads", texts("prompts_calib.jsonl"), texts("prompts_heldout.jsonl")


def linear_bytes(ckpt: Path) -> int:
    with SafetensorsFile(rank_file(ckpt, 0)) as f:
        return sum(i.nbytes for n, i in f.tensors.items() if any(x in n for x in LINEARS))


@torch.inference_mode()
def teacher_forced_argmax(model: MedusaModel, samples: list[list[int]]) -> list[torch.Tensor]:
    out = []
    for ids in samples:
        s = len(ids)
        mask = torch.ones(s, s, dtype=torch.bool).tril()[None]
        logits, _, _, _ = model(torch.tensor([ids]), torch.arange(s)[None], mask, *model.empty_cache(1))
        out.append(logits[0].argmax(-1))
    return out


def evaluate(model: MedusaModel, heldout: list[list[int]], prompts: list[list[int]], new_tokens: int) -> dict:
    backend = TorchBackend(model)
    start = time.perf_counter()
    plain = decode(backend, prompts, GenerationConfig(max_new_tokens=new_tokens, use_medusa=False)).tokens
    medusa = decode(backend, prompts, GenerationConfig(max_new_tokens=new_tokens))
    steps = sum(s.steps for s in medusa.stats)
    return {
        "argmax": teacher_forced_argmax(model, heldout),
        "greedy": plain,
        "medusa_vs_own_greedy": _agreement(plain, medusa.tokens),
        "tokens_per_step": sum(s.new_tokens for s in medusa.stats) / steps,
        "acceptance_rate": sum(s.accepted_draft_tokens for s in medusa.stats) / sum(s.draft_tokens for s in medusa.stats),
        "seconds": time.perf_counter() - start,
    }


def _agreement(ref: list[list[int]], other: list[list[int]]) -> tuple[float, float]:
    """(share of positions holding the same token, mean length of the common prefix)."""
    same, prefix, total = 0, 0, 0
    for a, b in zip(ref, other, strict=True):
        same += sum(x == y for x, y in zip(a, b, strict=True))
        total += len(a)
        prefix += next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    return same / total, prefix / len(ref)


def agreement(ref: dict, other: dict) -> dict:
    top1 = torch.cat([a == b for a, b in zip(ref["argmax"], other["argmax"], strict=True)]).float().mean().item()
    tokens, prefix = _agreement(ref["greedy"], other["greedy"])
    return {"top1_agreement": top1, "greedy_token_agreement": tokens, "greedy_common_prefix": prefix}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--assets", type=Path, help="trained model dir (base/, heads/, prompts_*.jsonl)")
    ap.add_argument("--workdir", type=Path, default=REPO / "build" / "bench_fp8")
    ap.add_argument("--json", type=Path, help="where to write results (default WORKDIR/results.json)")
    ap.add_argument("--prompts", type=int, default=16, help="held-out samples (default 16)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--calib-samples", type=int, default=64)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    base, heads, calib, heldout_texts = demo_model(args.assets) if args.assets else synthetic_model(work)
    calib_file = work / "calib.jsonl"
    calib_file.write_text("".join(json.dumps({"text": t}) + "\n" for t in calib))

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    heldout = [tok(t)["input_ids"][:256] for t in heldout_texts[: args.prompts]]
    prompts = [ids[:PROMPT_TOKENS] for ids in heldout]

    variants = {"float16": None,
                "fp8": QuantOptions(quantize="fp8", calib_data=calib_file, calib_samples=args.calib_samples,
                                    calib_seq_len=256),
                "fp8+kv": QuantOptions(quantize="fp8", kv_cache_dtype="fp8", calib_data=calib_file,
                                       calib_samples=args.calib_samples, calib_seq_len=256)}
    results: dict = {"model": str(args.assets or "synthetic random llama " + json.dumps(SYNTHETIC)),
                     "prompts": len(prompts), "new_tokens": args.new_tokens, "variants": {}}
    evals = {}
    for name, quant in variants.items():
        ckpt = work / f"ckpt-{name}"
        summary = convert(base, heads, ckpt, dtype="float16", force=True, progress=False, quant=quant)
        model = MedusaModel.from_checkpoint(ckpt, dtype="float32")
        print(f"{name}: converted in {summary.seconds:.1f} s, evaluating ...", flush=True)
        evals[name] = evaluate(model, heldout, prompts, args.new_tokens)
        row = {"checkpoint_bytes": summary.weight_bytes, "linear_bytes": linear_bytes(ckpt),
               "tokens_per_step": round(evals[name]["tokens_per_step"], 3),
               "acceptance_rate": round(evals[name]["acceptance_rate"], 4),
               "medusa_vs_own_greedy_tokens": round(evals[name]["medusa_vs_own_greedy"][0], 4),
               "medusa_vs_own_greedy_prefix": round(evals[name]["medusa_vs_own_greedy"][1], 2)}
        if name != "float16":
            row.update({k: round(v, 4) for k, v in agreement(evals["float16"], evals[name]).items()})
            row["linear_bytes_vs_float16"] = round(row["linear_bytes"] / results["variants"]["float16"]["linear_bytes"], 4)
            row["checkpoint_vs_float16"] = round(summary.weight_bytes / results["variants"]["float16"]["checkpoint_bytes"], 4)
        results["variants"][name] = row

    out = args.json or work / "results.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nmodel: {results['model']}; {len(prompts)} held-out prompts, {args.new_tokens} new tokens")
    print(f"{'variant':<9} {'top-1 agr':>9} {'greedy agr':>10} {'prefix':>7} {'tok/step':>8} {'accept':>7} "
          f"{'medusa=own':>10} {'ckpt MB':>8} {'linears':>8}")
    for name, r in results["variants"].items():
        print(f"{name:<9} {r.get('top1_agreement', 1):>9.2%} {r.get('greedy_token_agreement', 1):>10.2%} "
              f"{r.get('greedy_common_prefix', args.new_tokens):>7.1f} {r['tokens_per_step']:>8.2f} "
              f"{r['acceptance_rate']:>7.2%} {r['medusa_vs_own_greedy_tokens']:>10.2%} "
              f"{r['checkpoint_bytes'] / 1e6:>8.2f} {r.get('linear_bytes_vs_float16', 1):>7.1%}")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
