"""medusa-convert: merge a Hugging Face base model and Medusa heads into one checkpoint."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from medusa_trt.checkpoint import DEFAULT_MAX_DRAFT_LEN
from medusa_trt.cli.common import add_quiet_arg, int_up_to, new_parser, positive_int, run_cli
from medusa_trt.converter.merge import convert
from medusa_trt.converter.quantize import KV_CACHE_DTYPES, QUANTIZE_CHOICES, QuantOptions
from medusa_trt.tree import MAX_DRAFT_LEN

PROG = "medusa-convert"


def parser() -> argparse.ArgumentParser:
    p = new_parser(
        PROG,
        "Merge a Hugging Face or GGUF Llama/Mistral/Qwen2 model and a drafter (Medusa heads: FasterDecoding "
        "v1/v2, Medusa-2 full model, ModelOpt export; or an Amphista drafter) into a TensorRT-LLM "
        "MedusaForCausalLM checkpoint.")
    p.add_argument("--base", required=True, help="Hugging Face model directory (config.json + weights), or a "
                   "llama.cpp GGUF file (the gguf extra), dequantized to --dtype")
    p.add_argument("--heads", help="the drafter: Medusa heads (medusa_lm_head.pt/.safetensors, a file or its "
                                   "directory) or an Amphista drafter directory (amphista.safetensors); optional "
                                   "when the base directory holds the heads")
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"],
                   help="output dtype (default: the base's dtype)")
    p.add_argument("--tp-size", type=positive_int, default=1, help="tensor-parallel ranks to write (default 1)")
    p.add_argument("--max-draft-len", type=int_up_to(MAX_DRAFT_LEN), default=DEFAULT_MAX_DRAFT_LEN,
                   help=f"largest Medusa tree the engine will verify (default {DEFAULT_MAX_DRAFT_LEN})")
    q = p.add_argument_group("FP8 quantization (TensorRT-LLM per-tensor FP8, calibrated)")
    q.add_argument("--quantize", choices=QUANTIZE_CHOICES,
                   help="quantize the decoder linears (qkv, dense, fc, gate, proj): FP8 weights and "
                        "calibrated activation scales; lm_head, embeddings and norms stay in --dtype")
    q.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, help="FP8 KV cache scales (calibrated)")
    q.add_argument("--calib-data", help="calibration text: .txt with one sample per line, or .jsonl with a "
                                        "'text' field; required with --quantize or --kv-cache-dtype")
    q.add_argument("--calib-samples", type=positive_int,
                   help="use the first N samples (default 512)")
    q.add_argument("--calib-seq-len", type=positive_int,
                   help="cut samples to L tokens (default: whole samples, an error past the model's "
                        "max_position_embeddings)")
    q.add_argument("--quantize-heads", action="store_true",
                   help="quantize the Medusa ResBlock linears too (their lm_heads stay in --dtype)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    add_quiet_arg(p, help="no progress bar or summary")
    return p


def _main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    quant = QuantOptions(quantize=args.quantize, kv_cache_dtype=args.kv_cache_dtype,
                         calib_data=args.calib_data, calib_samples=args.calib_samples,
                         calib_seq_len=args.calib_seq_len, quantize_heads=args.quantize_heads)
    summary = convert(args.base, args.heads, args.out, dtype=args.dtype, tp_size=args.tp_size,
                      max_draft_len=args.max_draft_len, force=args.force, progress=not args.quiet,
                      quant=quant)
    if not args.quiet:
        print(f"{PROG}: wrote {summary.out}")
        print(summary)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(PROG, lambda: _main(argv))


if __name__ == "__main__":
    sys.exit(main())
