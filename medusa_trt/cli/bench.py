"""medusa-bench: plain vs Medusa decoding on the same engine, measured side by side
(medusa_trt.tools.bench).

    medusa-bench --engine DIR --prompts FILE [--medusa-choices TREE] [--max-new-tokens N] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from medusa_trt.cli.common import (
    ENGINE_OR_CHECKPOINT_HELP,
    add_force_arg,
    add_json_report_arg,
    add_max_new_tokens_arg,
    add_prompts_arg,
    add_quiet_arg,
    add_sampling_args,
    add_source_args,
    add_spin_arg,
    add_threads_arg,
    add_tree_arg,
    check_output_file,
    input_paths,
    new_parser,
    ort_session_options,
    positive_int,
    refuse_inapplicable_sampling,
    run_cli,
    sampling_options,
    write_output_file,
)
from medusa_trt.tools import bench
from medusa_trt.tools.bench import (
    PROG,
    BenchError,
    also_mode,
    compare,
    format_report,
    hf_generate,
    hf_model_dir,
    load_prompts,
)


def parser() -> argparse.ArgumentParser:
    p = new_parser(PROG, bench.__doc__, raw=True)
    add_source_args(p, engine_help=ENGINE_OR_CHECKPOINT_HELP)
    add_prompts_arg(p, required=True)
    add_tree_arg(p)
    p.add_argument("--also", action="append", default=[], metavar="TREE",
                   help="another tree measured in the same run, side by side (repeatable); dynamic:N/no-context: "
                        "without context candidates; dynamic:N/no-datastore: without the engine's datastore; dynamic:N/fill: the whole budget every step; "
                        "dynamic:N/cost=X: a slot costs X plain steps (default 0.08)")
    add_max_new_tokens_arg(p, default=128)
    p.add_argument("--limit", type=positive_int, help="use the first N prompts")
    p.add_argument("--repeat", type=positive_int, default=1, help="measure each prompt N times (default 1)")
    hf = p.add_mutually_exclusive_group()  # both at once: the baseline ran, --no-hf notwithstanding
    hf.add_argument("--hf-model", type=Path, help="HF model dir for the transformers baseline "
                    "(default: the base recorded in the engine's checkpoint)")
    hf.add_argument("--no-hf", action="store_true", help="skip the transformers generate baseline")
    add_threads_arg(p, help="engine intra-op threads (default: one per core); small models often decode fastest on one")
    add_spin_arg(p)
    add_sampling_args(p, typical=False, seed=0, seed_help="sample: generator seed of every run",
                      acceptance_help="Medusa acceptance; typical and sample are compared with plain sampling")
    add_json_report_arg(p, help="write all figures to this file")
    add_force_arg(p, help="replace an existing --json file")
    add_quiet_arg(p)
    return p


def _main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from medusa_trt.runtime.decoding import GenerationConfig, decode, resolve_tree, step_tree
    from medusa_trt.runtime.loading import load_backend, load_tokenizer, stop_tokens

    if args.quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()

    check_output_file(args.json, args.force, "--json", input_paths(args))  # before the run, not after it
    try:
        if not args.engine.is_dir():
            raise BenchError(f"{args.engine}: --engine directory not found")
        hf_dir, hf_note = None, None
        if args.hf_model is not None:
            if not (args.hf_model / "config.json").is_file():
                raise BenchError(f"{args.hf_model}: --hf-model has no config.json (expected a Hugging Face model dir)")
            hf_dir = args.hf_model
        elif not args.no_hf:
            try:
                hf_dir = hf_model_dir(args.engine)
            except BenchError as e:  # the engine still benchmarks; only the baseline is missing
                hf_note = str(e)
                print(f"{PROG}: warning: skipping the transformers baseline: {e}", file=sys.stderr)
        refuse_inapplicable_sampling(args)
        backend = load_backend(args.engine, ort_options=ort_session_options(args))
        tree, described = resolve_tree(backend.info, args.medusa_choices)
        extra = {spec: also_mode(spec) for spec in args.also}
        # Every tree that will run, checked before any work (a bad tree: one line, exit 2).
        for m in [{"medusa_choices": tree, "context_candidates": args.context_candidates}, *extra.values()]:
            step_tree(backend.info, m["medusa_choices"], m["context_candidates"], m.get("slot_cost"))
        tok = load_tokenizer(args.engine)
        _, prompts = load_prompts(args.prompts, tok, args.limit, (args.max_new_tokens, backend.info.max_seq_len))
        stops = stop_tokens(args.engine, tok)
        sampling = sampling_options(args)
        GenerationConfig(**sampling)  # bad values: one line, exit 2, before any work
        result = compare(backend, prompts, tree, args.max_new_tokens, stops, args.repeat, progress=not args.quiet,
                         extra_modes=extra, sampling=sampling, context_candidates=args.context_candidates,
                         datastore=args.datastore)
        hf = {"skipped": hf_note} if hf_note else None
        if hf_dir is not None:
            plain_tokens = None
            if args.repeat == 1:  # plain outputs per prompt, to check transformers agrees
                plain_tokens = [decode(backend, [p], GenerationConfig(max_new_tokens=args.max_new_tokens,
                                use_medusa=False, stop_token_ids=stops)).tokens[0] for p in prompts]
            hf = hf_generate(hf_dir, prompts, args.max_new_tokens, stops, plain_tokens, progress=not args.quiet,
                             threads=args.threads)
    except ValueError as e:  # BenchError, TreeError, EngineError, load errors: bad input, explained
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    report = {
        "engine": str(args.engine), "backend": type(backend).__name__, "prompts": str(args.prompts),
        "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "repeat": args.repeat,
        "medusa_choices": described, "threads": args.threads or len(os.sched_getaffinity(0)),
        "fused_step": backend.fused_step_topk is not None and args.acceptance == "greedy",
        "acceptance": args.acceptance, "temperature": sampling["temperature"] if args.acceptance != "greedy" else None,
        "plain": result["modes"]["plain"], "medusa": {**result["modes"]["medusa"], **result["medusa"]},
        "hf_generate": hf, "per_prompt": result["per_prompt"],
        "also": {spec: {**result["modes"][spec], **result[spec]} for spec in extra},
    }
    if hf and "tokens_per_s" in hf:
        report["medusa"]["speedup_vs_hf_generate"] = round(report["medusa"]["tokens_per_s"] / hf["tokens_per_s"], 4)
        report["plain"]["speedup_vs_hf_generate"] = round(report["plain"]["tokens_per_s"] / hf["tokens_per_s"], 4)
    print(format_report(report))
    if args.json:
        write_output_file(args.json, json.dumps(report, indent=2) + "\n", args.force, "--json", input_paths(args))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(PROG, lambda: _main(argv))


if __name__ == "__main__":
    sys.exit(main())
