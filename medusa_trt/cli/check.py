"""medusa-check: compare an engine with the PyTorch reference (medusa_trt.tools.parity)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from medusa_trt.cli.common import (
    add_device_arg,
    add_force_arg,
    add_json_report_arg,
    add_max_new_tokens_arg,
    add_prompts_arg,
    add_quiet_arg,
    add_source_args,
    check_output_file,
    input_paths,
    new_parser,
    nonnegative_float,
    nonnegative_int,
    read_prompts,
    run_cli,
    write_output_file,
)
from medusa_trt.tools.parity import run_check

PROG = "medusa-check"


def parser() -> argparse.ArgumentParser:
    p = new_parser(PROG, "Compare an engine with the PyTorch reference on the same inputs: prefill, tree-verify "
                   "steps and whole greedy decodes. Exit 0: parity; 1: a parity failure; 2: bad input.")
    add_source_args(p, checkpoint="reference")
    add_prompts_arg(p, help=".txt (one prompt a line) or .jsonl with 'text' (default: three built-in prompts)")
    add_json_report_arg(p)
    add_force_arg(p, help="replace an existing --json file")
    add_max_new_tokens_arg(p, default=32, help="tokens per greedy decode (default 32)")
    p.add_argument("--tree-steps", type=nonnegative_int, default=4, help="tree-verify steps to compare (default 4)")
    add_device_arg(p, help="the engine's device: cpu or cuda (default: the engine's own)")
    p.add_argument("--atol", type=nonnegative_float, help="override the dtype's logits tolerance")
    add_quiet_arg(p, help="no progress bar")
    return p


def _main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    check_output_file(args.json, args.force, "--json", input_paths(args))
    prompts = None
    if args.prompts is not None:
        prompts = read_prompts(args.prompts)
    report = run_check(args.engine, args.checkpoint, prompts, max_new_tokens=args.max_new_tokens,
                       tree_steps=args.tree_steps, device=args.device, atol=args.atol, progress=not args.quiet)
    print(f"{PROG}: {report.engine} ({report.backend}, {report.dtype}) vs {report.checkpoint} (PyTorch float32)")
    for w in report.warnings:
        print(f"{PROG}: warning: {w}")
    print(f"{PROG}: logits rule: {report.rule}")
    print(report.table())
    failed = sum(not r.passed for r in report.rows)
    diverged = sum(r.diverged for r in report.rows)
    note = f"; {diverged} plain decode(s) diverge from the reference at a near-tie, allowed for int4" if diverged else ""
    print(f"{PROG}: {'PASS' if report.passed else 'FAIL'} ({len(report.rows) - failed}/{len(report.rows)} checks "
          f"passed{note})")
    if args.json:
        write_output_file(args.json, json.dumps(report.as_dict(), indent=2) + "\n", args.force, "--json",
                          input_paths(args))
    return 0 if report.passed else 1


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(PROG, lambda: _main(argv))


if __name__ == "__main__":
    sys.exit(main())
