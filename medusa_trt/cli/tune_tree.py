"""medusa-tune-tree: the Medusa tree that is fastest on this engine and this machine
(medusa_trt.tools.tune_tree)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from medusa_trt.cli.common import (
    ENGINE_OR_CHECKPOINT_HELP,
    add_device_arg,
    add_force_arg,
    add_max_new_tokens_arg,
    add_prompts_arg,
    add_quiet_arg,
    add_source_args,
    add_spin_arg,
    add_threads_arg,
    check_output_file,
    input_paths,
    new_parser,
    ort_session_options,
    positive_int,
    run_cli,
    write_output_file,
)
from medusa_trt.tools import tree_choice as tc
from medusa_trt.tools import tune_tree as tt
from medusa_trt.tools.tree_measure import BLOCK
from medusa_trt.tree import CANDIDATE_TOPK, DEFAULT_TREE, TREE_FILE_SUFFIXES

PROG = "medusa-tune-tree"


def parser() -> argparse.ArgumentParser:
    p = new_parser(PROG, tt.__doc__, raw=True)
    add_source_args(p, engine_help=ENGINE_OR_CHECKPOINT_HELP)
    # The calibration prompts are prompts the engine decodes (greedily), hence --prompts; --calib-data,
    # its old name, is kept as an alias (medusa-convert's --calib-data is FP8 calibration text instead).
    add_prompts_arg(p, required=True, help="calibration prompts: .txt (one prompt a line) or .jsonl with 'text'",
                    old=["--calib-data"])
    p.add_argument("--out", required=True, type=Path, help="tree file to write: .json (or .yaml/.yml; loadable by "
                   "--medusa-choices)")
    p.add_argument("--max-nodes", type=positive_int, default=64, help="largest tree considered (default 64, at most the "
                   "engine's max_draft_len)")
    add_max_new_tokens_arg(p, default=128, help="greedy tokens per calibration prompt (default 128)")
    p.add_argument("--limit", type=positive_int, default=32, help="calibration prompts used (default 32)")
    p.add_argument("--topk", type=positive_int, default=CANDIDATE_TOPK,
                   help=f"ranks measured per head (default {CANDIDATE_TOPK})")
    p.add_argument("--reps", type=positive_int, default=5,
                   help=f"step-time repetitions per tree size, blocks of {BLOCK} steps (default 5)")
    add_prompts_arg(p, name="--eval-prompts", old=["--eval-data"],
                    help="prompts for the measured comparison, which also chooses between the static tree and "
                         "per-step trees (default: --prompts); tuning data, so never held-out text (.jsonl rows of held-out "
                         "ShareGPT conversations are refused, in --prompts too)")
    p.add_argument("--eval-limit", type=positive_int, default=8, help="prompts for the measured comparison (default 8)")
    p.add_argument("--no-measure", action="store_true", help="predict only; skip the measured comparison (and so "
                   "the choice between the static tree and per-step trees)")
    p.add_argument("--budgets", type=_budgets, default=None, metavar="N[,N...]",
                   help="per-step tree budgets (dynamic:N) measured against the tuned static tree; the faster is "
                        "written to --out (default: half, once and twice the tuned tree's nodes, at most --max-nodes; "
                        "0: none)")
    add_threads_arg(p, help="engine intra-op threads (default: one per core); tune with the setting you will "
                    "decode with")
    add_spin_arg(p)
    add_device_arg(p)
    add_force_arg(p, help="replace an existing --out file")
    add_quiet_arg(p)
    return p


def _main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from medusa_trt.runtime.loading import load_backend, load_tokenizer, stop_tokens
    from medusa_trt.tools.bench import BenchError, compare, load_prompts

    check_output_file(args.out, args.force, inputs=input_paths(args))  # before the minutes of tuning, not after
    if args.out.suffix.lower() not in TREE_FILE_SUFFIXES:  # what --medusa-choices could not read back
        raise BenchError(f"{args.out}: --out has suffix {args.out.suffix!r}; expected one of "
                         f"{', '.join(TREE_FILE_SUFFIXES)} (a tree file --medusa-choices reads)")
    try:
        if not args.engine.is_dir():
            raise BenchError(f"{args.engine}: --engine directory not found")
        backend = load_backend(args.engine, device=args.device, ort_options=ort_session_options(args))
        tok = load_tokenizer(args.engine)
        room = (args.max_new_tokens, backend.info.max_seq_len)
        tc.check_budgets(args.budgets, backend.info)  # before the minutes of tuning
        # Room for each prompt's new tokens, as the decoder counts it (check_room); the comparison's
        # prompts are read now too, not after the tuning.
        _, calib = load_prompts(args.prompts, tok, args.limit, room)
        _refuse_heldout(args.prompts, "--prompts")
        if not args.no_measure:
            data = args.eval_prompts or args.prompts
            _, prompts = load_prompts(data, tok, args.eval_limit, room)
            _refuse_heldout(data, "--eval-prompts")
        stops = stop_tokens(args.engine, tok)
        result = tt.tune(backend, calib, max_nodes=args.max_nodes, max_new_tokens=args.max_new_tokens,
                         stop_token_ids=stops, topk=args.topk, reps=args.reps, progress=not args.quiet)
        result.update(engine=str(args.engine), calib_data=str(args.prompts), num_calib_prompts=len(calib),
                      threads=args.threads or len(os.sched_getaffinity(0)))
        if not args.no_measure:
            ref_tree = DEFAULT_TREE
            extra = {ref_tree: ref_tree} if ref_tree in result["predicted"] else {}
            budgets = tc.budgets_for(len(result["medusa_choices"]), backend.info, args.budgets, args.max_nodes)
            result["slot_cost"] = tc.slot_cost(result, max(budgets, default=0) + 1)
            specs = tc.dynamic_specs(budgets, result["slot_cost"])
            extra.update({spec: spec for spec in specs})
            measured = compare(backend, prompts, result["medusa_choices"], args.max_new_tokens, stops,
                               progress=not args.quiet, extra_modes=extra)
            result["measured"] = {"data": str(data), "num_prompts": len(prompts),
                                  "plain_tokens_per_s": measured["modes"]["plain"]["tokens_per_s"],
                                  "tuned": {**measured["medusa"], "tokens_per_s": measured["modes"]["medusa"]["tokens_per_s"]}}
            if ref_tree in extra:
                ref = measured[ref_tree]
                result["measured"][ref_tree] = {**ref, "tokens_per_s": measured["modes"][ref_tree]["tokens_per_s"]}
                result["measured"]["tuned_vs_" + ref_tree] = round(
                    result["measured"]["tuned"]["tokens_per_s"] / result["measured"][ref_tree]["tokens_per_s"], 4)
            for spec in specs:
                result["measured"][spec] = {**measured[spec], "tokens_per_s": measured["modes"][spec]["tokens_per_s"]}
            tc.choose_static_or_dynamic(result, specs)
    except ValueError as e:  # BenchError, TreeError, EngineError, DataError: bad input, explained
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    write_output_file(args.out, tt.dump_json(result), args.force, inputs=input_paths(args))
    print(tt.format_report(result))
    chosen = result["medusa_choices"]
    what = chosen if isinstance(chosen, str) else f"{len(chosen)} nodes"
    print(f"{PROG}: wrote {args.out} ({what}; use --medusa-choices {args.out}, or record it: medusa-build --tree "
          f"{args.out})")
    return 0


def _refuse_heldout(path: Path, flag: str) -> None:
    """Both prompt sets pick the tree (the calibration tunes it, the measurement chooses static or
    per-step), so neither may hold the held-out ShareGPT conversations that only measure
    (data.is_heldout; rows of the project's prompt files name their conversation in `source`)."""
    from medusa_trt.data import heldout_rows
    from medusa_trt.tools.bench import BenchError

    rows = heldout_rows(path)
    if rows:
        line, source = rows[0]
        raise BenchError(f"{path}:{line}: {flag} row of source {source!r} is a held-out ShareGPT conversation "
                         f"({len(rows)} such rows; sha1 of the id % 10 == 0): held-out prompts only measure, "
                         "they never tune or pick a tree; expected tuning prompts such as prompts_calib.jsonl")


def _budgets(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected node counts such as 4,8,16 (0: none)") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected node counts >= 0")
    return [v for v in values if v > 0]


def main(argv: list[str] | None = None) -> int:
    return run_cli(PROG, lambda: _main(argv))


if __name__ == "__main__":
    sys.exit(main())
