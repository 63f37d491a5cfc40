"""`make demo` (python -m medusa_trt.cli.demo): the command line of medusa_trt.tools.demo."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from medusa_trt.cli.common import (
    add_max_new_tokens_arg,
    add_prompts_arg,
    add_spin_arg,
    add_threads_arg,
    add_tree_arg,
    new_parser,
    positive_int,
    run_cli,
)
from medusa_trt.tools import demo


def parser() -> argparse.ArgumentParser:
    p = new_parser("python -m medusa_trt.cli.demo", demo.__doc__, raw=True)
    p.add_argument("--workdir", type=Path, default=Path("build/demo"),
                   help="the model download, checkpoint, engine and Triton repository (default build/demo)")
    p.add_argument("--gguf", type=Path, help="a GGUF base instead of SmolLM2 (its drafters via --heads, --amphista)")
    p.add_argument("--amphista", type=Path,
                   help="the Amphista drafter to compare (streamed); default the shipped one (none with --gguf)")
    p.add_argument("--heads", type=Path, default=demo.ASSETS / "heads",
                   help="the Medusa heads to compare; default the shipped ones")
    add_prompts_arg(p, default=demo.ASSETS / "prompts_heldout.jsonl",
                    help=".jsonl with 'text' and 'kind' (chat or code) (default: the held-out SmolLM2 prompts)")
    p.add_argument("--num-prompts", type=positive_int, default=4, help="prompts to answer, chat and code in turn (default 4)")
    add_max_new_tokens_arg(p, default=128)
    add_tree_arg(p, help="tree (default: the one the engine records, the tuned tree beside the heads)")
    add_threads_arg(p, help="ONNX Runtime intra-op threads")
    add_spin_arg(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # run_cli: ConvertError, BuildError, DataError and OS errors as one line (exit 2), and Ctrl-C or
    # SIGTERM as one line, a build's temp dir removed
    return run_cli("demo", lambda: demo.run_demo(args))


if __name__ == "__main__":
    sys.exit(main())
