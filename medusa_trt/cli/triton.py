"""medusa-triton: write a Triton Inference Server model repository for an engine
(medusa_trt.serving.triton_repo)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from medusa_trt.cli.common import (
    add_device_arg,
    add_source_args,
    add_threads_arg,
    add_tree_arg,
    int_up_to,
    new_parser,
    positive_int,
    queue_delay_us,
    run_cli,
)
from medusa_trt.engine_dir import MAX_BATCH_SIZE
from medusa_trt.runtime.config import ACCEPTANCE
from medusa_trt.serving.triton_repo import default_tree, read_engine_info, write_triton_repo

PROG = "medusa-triton"


def parser() -> argparse.ArgumentParser:
    p = new_parser(PROG, "Write a Triton model repository for an engine dir or merged checkpoint (Python "
                   "backend), or a TensorRT-LLM engine (tensorrtllm_backend layout).")
    add_source_args(p, engine_help="engine dir, merged checkpoint or TensorRT-LLM engine")
    p.add_argument("--out", required=True, type=Path, help="model repository dir to write")
    p.add_argument("--model-name", default="medusa", help="Python-backend model name (default: medusa)")
    p.add_argument("--max-batch-size", type=int_up_to(MAX_BATCH_SIZE),
                   help="largest dynamic batch (default: the engine's limit, or 8)")
    add_tree_arg(p, context=False, help="default tree: preset name, list, JSON/YAML file or brace form (default: the tree the "
                 "engine records, medusa-build --tree)")
    p.add_argument("--decoupled", action="store_true", help="decoupled model: needed for streaming responses")
    p.add_argument("--acceptance", choices=list(ACCEPTANCE), default="greedy",
                   help="default acceptance (default greedy; sample: lossless sampling, requests may send a seed)")
    p.add_argument("--max-input-len", type=positive_int,
                   help="longest prompt in tokens (default: all the engine allows)")
    p.add_argument("--max-output-len", type=positive_int, help="largest max_tokens (default: all the engine allows)")
    p.add_argument("--max-queue-delay-us", type=queue_delay_us, default=1000,
                   help="dynamic batcher delay (default 1000)")
    add_device_arg(p, help="device for the engine: cpu or cuda (default: the engine's own)")
    add_threads_arg(p, default=0, help="ONNX Runtime intra-op threads per model instance (the PyTorch reference's "
                    "torch threads for a merged checkpoint; default 0: one per core)", old=["--intra-op-threads"],
                    zero=True)
    p.add_argument("--tokenizer-dir", type=Path, help="tokenizer for a TensorRT-LLM engine (default: --engine)")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    return p


def _main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    out = write_triton_repo(
        args.engine, args.out, model_name=args.model_name, max_batch_size=args.max_batch_size,
        medusa_choices=args.medusa_choices, decoupled=args.decoupled, acceptance=args.acceptance,
        max_input_len=args.max_input_len, max_output_len=args.max_output_len,
        max_queue_delay_us=args.max_queue_delay_us, device=args.device,
        intra_op_threads=args.threads, tokenizer_dir=args.tokenizer_dir, force=args.force,
    )
    models = sorted(p.parent.name for p in out.glob("*/config.pbtxt"))
    info = read_engine_info(args.engine)
    if info.kind != "tensorrt-llm":
        tree, source = default_tree(args.medusa_choices, info)
        nodes = "trees chosen per step" if isinstance(tree, str) else f"{len(tree)} nodes"  # str: "dynamic:N"
        print(f"{PROG}: default tree {source} ({nodes}; a request's medusa_choices replaces it)")
    print(f"{PROG}: wrote {out} (models: {', '.join(models)}); serve it with: medusa-serve --repo {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(PROG, lambda: _main(argv))


if __name__ == "__main__":
    sys.exit(main())
