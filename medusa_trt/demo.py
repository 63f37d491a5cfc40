"""`make demo`: the main job end to end on a small model, on the CPU.

Builds a small random Llama-architecture base (transformers, saved like the Hub's) and fits Medusa
heads to it by self-distillation (FasterDecoding v1 file), merges them with medusa-convert, builds
the ONNX Runtime engine when that backend is available, and generates on a few prompts with plain
and Medusa decoding on the same engine, printing tokens per step and the speedup.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import time
from pathlib import Path

import torch

from medusa_trt.converter import convert
from medusa_trt.runtime.decoding import GenerationConfig, decode
from medusa_trt.runtime.loading import load_backend
from medusa_trt.synthetic import EOS, make_base
from medusa_trt.training import greedy_continuations, save_v1_heads, train_heads


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m medusa_trt.demo", description=__doc__)
    p.add_argument("--workdir", type=Path, default=Path("build/demo"))
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args(argv)
    work = args.workdir
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    torch.manual_seed(0)

    print("1/4 base model: a small random Llama (transformers save_pretrained)")
    base = make_base(work / "base", "llama", hidden_size=128, layers=4, heads=8, kv_heads=4, vocab=512,
                     intermediate=256, max_position_embeddings=1024)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(base).eval()
    rng = random.Random(0)
    train = [[rng.randrange(3, 512) for _ in range(8)] for _ in range(128)]
    print("2/4 Medusa heads: self-distillation on the base's own greedy continuations")
    state = train_heads(hf, greedy_continuations(hf, train, 96), num_heads=4, steps=300)
    save_v1_heads(state, work / "heads", base, num_heads=4, num_layers=1)

    print("3/4 medusa-convert")
    summary = convert(base, work / "heads", work / "merged")
    print(f"    {summary}")
    engine_dir = work / "merged"
    try:
        from medusa_trt.engines.build import build_engine

        print("4/4 medusa-build --backend onnxruntime")
        build_engine(work / "merged", work / "engine", backend="onnxruntime")
        engine_dir = work / "engine"
    except ImportError:
        print("4/4 (ONNX Runtime engine not available yet: running the PyTorch reference)")

    backend = load_backend(engine_dir)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (6, 9, 12)]
    kw = dict(max_new_tokens=args.max_new_tokens, stop_token_ids=(EOS,))
    decode(backend, prompts[:1], GenerationConfig(**kw))  # warm-up
    t0 = time.perf_counter()
    plain = decode(backend, prompts, GenerationConfig(use_medusa=False, **kw))
    t1 = time.perf_counter()
    medusa = decode(backend, prompts, GenerationConfig(**kw))
    t2 = time.perf_counter()
    same = plain.tokens == medusa.tokens
    for i, s in enumerate(medusa.stats):
        print(f"prompt {i}: {s.new_tokens} tokens in {s.steps} steps = {s.tokens_per_step:.2f} tokens/step, "
              f"accepted {s.accepted_draft_tokens} draft tokens")
    n = sum(len(t) for t in medusa.tokens)
    print(f"\nbackend {type(backend).__name__}: plain {n / (t1 - t0):.1f} tokens/s, Medusa {n / (t2 - t1):.1f} "
          f"tokens/s, speedup {(t1 - t0) / (t2 - t1):.2f}x; Medusa output == plain greedy: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
