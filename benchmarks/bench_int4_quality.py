"""What 4-bit (and 8-bit) weights cost in quality: teacher-forced next-token agreement with float32 on
held-out text, for this project's engines and the peers bench_peers runs (issue 13).

Every system reads the same token ids (the held-out prompts as bench_peers feeds them: code as it
is, chat in the chat template) in one forward pass and gives logits at every position. The reference
is transformers in float32 on the HF dir dequantized from the GGUF (the weights all systems start
from). Per system, over all positions that predict a next token:
  top-1     share of positions whose argmax is the reference's argmax
  top-5     share where the reference's argmax is among the system's five largest logits
  KL        mean KL(reference || system) of the next-token distributions, in nats
  ppl       perplexity of the text itself (exp of the mean negative log-likelihood of the next token)
Systems: ours (--engine NAME=DIR, any number: float32, int4 at several block sizes, int8, ...), the
onnxruntime-genai int4 and int8 models bench_peers builds (--genai-int4 DIR, --genai-int8 DIR, run by
onnxruntime itself, each where it exists), and llama.cpp on the Q4_1 GGUF and on the Q8_0 one
bench_peers requantizes (where it exists) when llama-cpp-python is installed (`pip install -e '.[bench]'`).

    python benchmarks/bench_int4_quality.py --engine float32=build/real/engine --engine int4=build/real/engine_int4
        [--genai-int4 DIR] [--genai-int8 DIR] [--gguf-q8 FILE] [--limit N] [--threads 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
from common import DEFAULT_PROMPTS, BenchInputError, float32_hf_dir, read_prompts
from tqdm import tqdm

PROG = "bench_int4_quality"


# -- logits at every position, per system ------------------------------------------------------


def ours(engine_dir: Path, threads: int):
    from medusa_trt.runtime.ort.backend import OrtBackend
    from medusa_trt.runtime.ort.session import OrtSessionOptions

    backend = OrtBackend(engine_dir, options=OrtSessionOptions(threads=threads))

    def logits(ids: list[int]) -> np.ndarray:
        s = len(ids)
        backend.start(1, s + 2)
        out, _ = backend.forward(torch.tensor([ids]), torch.arange(s)[None], torch.ones(1, s, s, dtype=torch.bool).tril(),
                                 torch.arange(s)[None], with_heads=False)
        return out[0].numpy()

    return logits


def genai_onnx(model_dir: Path, threads: int):
    """onnxruntime-genai's decoder graph run by onnxruntime directly: an empty past, every position."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(str(model_dir / "model.onnx"), options, providers=["CPUExecutionProvider"])
    inputs = session.get_inputs()
    head_size = json.loads((model_dir / "genai_config.json").read_text())["model"]["decoder"]["head_size"]

    def logits(ids: list[int]) -> np.ndarray:
        s = len(ids)
        feeds = {}
        for i in inputs:
            if i.name == "input_ids":
                feeds[i.name] = np.array([ids], dtype=np.int64)
            elif i.name == "attention_mask":
                feeds[i.name] = np.ones((1, s), dtype=np.int64)
            elif i.name == "position_ids":
                feeds[i.name] = np.arange(s, dtype=np.int64)[None]
            elif i.name.startswith("past_key_values."):
                feeds[i.name] = np.zeros((1, i.shape[1], 0, head_size), dtype=np.float32)  # an empty past
            else:
                raise BenchInputError(f"{model_dir / 'model.onnx'}: input {i.name!r}: not one this benchmark feeds")
        return session.run(["logits"], feeds)[0][0]

    return logits


def llama_cpp(gguf: Path, threads: int, n_ctx: int):
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=n_ctx,
                logits_all=True, seed=0, verbose=False)

    def logits(ids: list[int]) -> np.ndarray:
        llm.reset()
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float32)

    return logits


# -- the comparison ----------------------------------------------------------------------------


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare(ref: np.ndarray, other: np.ndarray, next_ids: np.ndarray) -> dict:
    """Sums over positions (the last position predicts nothing in the text and is dropped)."""
    ref, other = ref[:-1], other[:-1]
    top_ref = ref.argmax(-1)
    top5 = np.argpartition(-other, 5, axis=-1)[:, :5]
    lr, lo = log_softmax(ref), log_softmax(other)
    return {"positions": len(top_ref),
            "top1": int((other.argmax(-1) == top_ref).sum()),
            "top5": int((top5 == top_ref[:, None]).any(-1).sum()),
            "kl": float((np.exp(lr) * (lr - lo)).sum(-1).sum()),
            "nll": float(-lo[np.arange(len(next_ids)), next_ids].sum())}


def _sum(per_prompt) -> dict:
    sums: dict = {}
    for d in per_prompt:
        for k, v in d.items():
            sums[k] = sums.get(k, 0) + v
    return sums


def summary(sums: dict) -> dict:
    n = sums["positions"]
    return {"positions": n, "top1": sums["top1"] / n, "top5": sums["top5"] / n, "kl": sums["kl"] / n,
            "ppl": math.exp(sums["nll"] / n)}


def markdown(results: dict[str, dict]) -> str:
    lines = ["| system | positions | top-1 agreement | top-5 holds ref top-1 | KL(ref ‖ system), nats | perplexity |",
             "|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['positions']} | {r['top1']:.4f} | {r['top5']:.4f} | {r['kl']:.5f} | {r['ppl']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", action="append", default=[], metavar="NAME=DIR", help="one of our engines (repeatable)")
    p.add_argument("--genai-int4", type=Path, default=Path("build/bench_peers/ortgenai-int4"),
                   help="onnxruntime-genai's int4 model dir (bench_peers builds it; skipped when absent)")
    p.add_argument("--genai-int8", type=Path, default=Path("build/bench_peers/ortgenai-int8"),
                   help="onnxruntime-genai's int8 model dir (bench_peers builds it; skipped when absent)")
    p.add_argument("--gguf-q8", type=Path, default=Path("build/bench_peers/smollm2.Q8_0.gguf"),
                   help="llama.cpp's Q8_0 GGUF (bench_peers requantizes it); skipped where absent")
    p.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    p.add_argument("--limit", type=int, default=None, help="first N prompts (an even share of code and chat)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workdir", type=Path, default=Path("build/bench_peers"), help="cache of the float32 HF dir")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    try:
        engines = {}
        for spec in args.engine:
            name, sep, path = spec.partition("=")
            if not sep or not name or not (Path(path) / "engine.json").is_file():
                raise BenchInputError(f"--engine {spec!r}: expected NAME=DIR of an engine (a dir with engine.json)")
            engines[name] = Path(path)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from medusa_trt.converter.gguf import fetch_smollm2

        gguf = fetch_smollm2()
        hf_dir = float32_hf_dir(gguf, args.workdir, PROG)
        tok = AutoTokenizer.from_pretrained(hf_dir)
        prompts = read_prompts(args.prompts, tok, args.limit)
    except BenchInputError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        refs = [model(torch.tensor([pr.ids])).logits[0].numpy() for pr in tqdm(prompts, desc="transformers float32")]
    del model

    systems = {f"ours {name}": (lambda d=d: ours(d, args.threads)) for name, d in engines.items()}
    for bits, model_dir in (("int4", args.genai_int4), ("int8", args.genai_int8)):
        if (model_dir / "model.onnx").is_file():
            systems[f"ort-genai {bits}"] = lambda d=model_dir: genai_onnx(d, args.threads)
        else:
            print(f"{PROG}: ort-genai {bits} skipped: {model_dir / 'model.onnx'} not found (bench_peers builds it)",
                  file=sys.stderr)
    n_ctx = max(len(pr.ids) for pr in prompts) + 8
    if not args.no_llama_cpp:
        systems["llama.cpp Q4_1"] = lambda: llama_cpp(gguf, args.threads, n_ctx)
        if args.gguf_q8.is_file():
            systems["llama.cpp Q8_0"] = lambda: llama_cpp(args.gguf_q8, args.threads, n_ctx)
    results = {"transformers float32": summary(_sum(compare(r, r, np.array(pr.ids[1:])) for pr, r in zip(prompts, refs, strict=True)))}
    for name, open_system in systems.items():
        try:
            logits = open_system()
        except ImportError as e:
            print(f"{PROG}: {name} skipped: {e}", file=sys.stderr)
            continue
        results[name] = summary(_sum(compare(ref, logits(pr.ids), np.array(pr.ids[1:]))
                                     for pr, ref in zip(tqdm(prompts, desc=name), refs, strict=True)))
    print(f"{len(prompts)} held-out prompts ({args.prompts}), reference transformers float32 ({hf_dir}):")
    print(markdown(results))
    if args.json:
        args.json.write_text(json.dumps({"prompts": str(args.prompts), "n": len(prompts), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
