"""medusa-build: build an inference engine from a merged checkpoint."""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from medusa_trt.cli.common import add_quiet_arg, int_up_to, new_parser, positive_int, run_cli
from medusa_trt.engine_dir import DEVICES, DTYPES, MAX_BATCH_SIZE
from medusa_trt.engines.build import BUILDERS, build_engine
from medusa_trt.engines.onnx.attention import ATTENTION_FORMS
from medusa_trt.engines.options import BackendOptions, BuildError, BuildOptions
from medusa_trt.engines.ort.build import (
    INT4_DEFAULT_ACCURACY_LEVEL,
    INT4_DEFAULT_BLOCK_SIZE,
    INT4_ROUNDINGS,
    INT8_DEFAULT_FLOAT_CHANNELS,
    OrtOptions,
)
from medusa_trt.engines.trt.build import TrtOptions
from medusa_trt.engines.trtllm.build import TrtllmOptions
from medusa_trt.outputs import check_output_dir
from medusa_trt.tree import MAX_DRAFT_LEN

PROG = "medusa-build"


def parser() -> argparse.ArgumentParser:
    p = new_parser(PROG, "Build an engine directory (engine.json, backend artifacts, tokenizer) from a merged "
                   "checkpoint written by medusa-convert.")
    p.add_argument("--checkpoint", required=True, type=Path, help="merged checkpoint directory")
    p.add_argument("--out", required=True, type=Path, help="engine directory to write")
    p.add_argument("--backend", default="onnxruntime", choices=list(BUILDERS), help="default: onnxruntime")
    p.add_argument("--dtype", choices=list(DTYPES),
                   help="compute dtype (default: float32 for --device cpu, the checkpoint's for cuda)")
    p.add_argument("--max-batch-size", type=int_up_to(MAX_BATCH_SIZE), default=8, help="largest batch the engine runs (default 8)")
    p.add_argument("--max-seq-len", type=positive_int, help="prompt + generated tokens (default: the model's "
                   "max_position_embeddings)")
    p.add_argument("--max-draft-len", type=int_up_to(MAX_DRAFT_LEN), help="largest Medusa tree, root excluded (default: the "
                   "checkpoint's max_draft_len)")
    p.add_argument("--opset", type=positive_int, help="ONNX opset (default 23)")
    p.add_argument("--attention", choices=list(ATTENTION_FORMS),
                   help="ONNX attention form (default: chain_f32 for --weights int8 and for int4 at accuracy level 4, whose "
                        "Medusa greedy then "
                        "equals its plain greedy for chain trees, the runtime running any other tree as its main "
                        "chain; row_exact_f32 keeps branching trees exact too, at a slower step; row_exact does "
                        "it in float64, slower still; otherwise attention23, the fastest measured on CPU; split "
                        "below opset 23; BENCHMARKS.md has the step costs)")
    p.add_argument("--trt-attention", choices=["plugin", "native"],
                   help="--backend tensorrt: the tree-attention plugin (default) or TensorRT's own attention "
                   "with a dense mask, for comparison")
    p.add_argument("--keep-onnx", action="store_true",
                   help="--backend tensorrt: keep the exported (and rewritten) ONNX graphs in <out>/onnx")
    p.add_argument("--max-input-len", type=positive_int,
                   help="--backend tensorrt-llm: longest prompt (default: max-seq-len minus one tree)")
    p.add_argument("--no-prepack", dest="prepack_weights", action="store_false",
                   help="onnxruntime: sessions compute from one shared mapping of the weights instead of "
                        "each prepacking its own copy (less memory, slower steps; BENCHMARKS.md)")
    p.add_argument("--no-fused-step", dest="fused_step", action="store_false",
                   help="onnxruntime: skip the fused greedy step graph (its session's packed copy of the "
                        "weights in memory; greedy decoding then takes two engine calls and host work per step)")
    p.add_argument("--no-cache-in-place", dest="cache_in_place", action="store_false",
                   help="onnxruntime, chain_f32 and row_exact_f32 engines (int4 and int8 by default): the graphs "
                        "return new K/V for the runtime to scatter instead of "
                        "writing them into the cache it binds (slower; for comparison, docs/formats.md)")
    p.add_argument("--weights", default="float", choices=["float", "int4", "int8"],
                   help="onnxruntime: int4 = 4-bit weight-only MatMulNBits for the decoder linears and the "
                        "lm_head; int8 = int8 weights (per channel) and int8 activations (per row) through "
                        "MatMulIntegerToFloat, the form whose verified rows cost least on a CPU with int8 dot "
                        "products (VNNI); the drafter's matrices are quantized too (default: float, the "
                        "engine dtype)")
    p.add_argument("--int4-block-size", type=positive_int, default=INT4_DEFAULT_BLOCK_SIZE,
                   help=f"--weights int4: weights per scale/zero point along K (default {INT4_DEFAULT_BLOCK_SIZE})")
    p.add_argument("--int4-accuracy-level", type=int, default=INT4_DEFAULT_ACCURACY_LEVEL, choices=[0, 4],
                   help="--weights int4: MatMulNBits accuracy_level, 4 = int8 activations per block (default), "
                        "0 = float compute")
    p.add_argument("--int4-offsets", action=argparse.BooleanOptionalAction, default=None,
                   help="--weights int4: a float offset per block instead of a 4-bit zero point (exact on a "
                        "GGUF's Q4_1 weights, at a slower step; BENCHMARKS.md, int4 engines). Default: on for a "
                        "base converted from a GGUF of Q4_1 blocks, else off")
    p.add_argument("--int4-lm-head-bits", type=int, default=None, choices=[4, 8],
                   help="--weights int4: the lm_head's bits (8: exact on a GGUF's Q8_0 embedding). Default: 8 "
                        "for a base converted from a GGUF with Q8_0 tensors, else 4")
    p.add_argument("--int4-rounding", default="calibrated", choices=list(INT4_ROUNDINGS),
                   help="--weights int4: calibrated = each block's grid searched for the least error weighted "
                        "by its inputs' mean squares on calibration text (default; same format and speed, closer "
                        "to float32: BENCHMARKS.md, int4 engines); nearest = each block's own range, rounded")
    p.add_argument("--int8-float-channels", type=int, default=INT8_DEFAULT_FLOAT_CHANNELS, metavar="N",
                   help="--weights int8: input channels of each base Linear kept in float32, those with the "
                        "largest values on calibration text (they would otherwise set every row's int8 scale; "
                        f"default {INT8_DEFAULT_FLOAT_CHANNELS}, 0 for none; BENCHMARKS.md, int8)")
    p.add_argument("--calibration", "--int8-calibration", type=Path, metavar="FILE",
                   help="--weights int8 and int4: texts (.jsonl with a 'text' field, or one per line) to pick the "
                        "float channels (int8) or weigh the int4 rounding on, read with the checkpoint's tokenizer "
                        "(default: text the model samples itself)")
    p.add_argument("--device", default="cpu", choices=list(DEVICES), help="device the engine runs on by default")
    p.add_argument("--tree", help="the tree the engine records, which medusa-run, the Python API, medusa-triton "
                   "and medusa-bench then decode with by default: the tree.json medusa-tune-tree writes, a preset, "
                   "a list of paths or the brace form (default: none; they then use mc_sim_7b_63 cut to the engine)")
    p.add_argument("--datastore", type=Path, help="the base model's own text to draft from beside the drafter "
                   "(per-step trees): a directory of drafter corpus parts (its held-out continuations are left out) "
                   "or a .jsonl/.txt file of texts; indexed into the engine's datastore.npz "
                   "(docs/design.md, datastore)")
    p.add_argument("--triton-repo", type=Path, help="also write a Triton Inference Server model repository "
                   "for the engine here (same as medusa-triton --engine OUT --out DIR)")
    p.add_argument("--force", action="store_true", help="replace an existing --out (and --triton-repo)")
    add_quiet_arg(p, help="no progress bar or summary")
    return p


# Flags of one backend or weight format, refused anywhere else (as medusa-run refuses its sampling
# flags with greedy acceptance): dropped without a word, they would build another engine than asked.
FLAG_SCOPES = (
    (("int4_block_size", "int4_accuracy_level", "int4_offsets", "int4_lm_head_bits", "int4_rounding"),
     "--weights int4", lambda a: a.backend == "onnxruntime" and a.weights == "int4"),
    (("int8_float_channels",), "--weights int8", lambda a: a.backend == "onnxruntime" and a.weights == "int8"),
    (("prepack_weights", "fused_step", "cache_in_place"), "--backend onnxruntime", lambda a: a.backend == "onnxruntime"),
    (("trt_attention", "keep_onnx"), "--backend tensorrt", lambda a: a.backend == "tensorrt"),
    (("max_input_len",), "--backend tensorrt-llm", lambda a: a.backend == "tensorrt-llm"),
)


def refuse_flags_that_cannot_apply(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """BuildError for a flag given (away from its default) where FLAG_SCOPES says it does nothing."""
    actions = {a.dest: a for a in p._actions}
    for dests, scope, applies in FLAG_SCOPES:
        if applies(args):
            continue
        for dest in dests:
            value, action = getattr(args, dest), actions[dest]
            if value == action.default:
                continue
            if isinstance(value, bool):  # the spelling given: --no-prepack, --keep-onnx, --no-int4-offsets
                flag = next(o for o in action.option_strings if o.startswith("--no-") != value)
            else:
                flag = f"{action.option_strings[0]} {value}"
            raise BuildError(f"{flag}: applies to {scope} only")


def backend_options(args: argparse.Namespace) -> BackendOptions:
    """The options dataclass of args.backend, from the flags that belong to it."""
    if args.backend == "onnxruntime":
        return OrtOptions(weights=args.weights, int4_block_size=args.int4_block_size,
                          int4_accuracy_level=args.int4_accuracy_level, int4_offsets=args.int4_offsets,
                          int4_lm_head_bits=args.int4_lm_head_bits, int8_float_channels=args.int8_float_channels,
                          int4_rounding=args.int4_rounding, calibration=args.calibration, cache_in_place=args.cache_in_place,
                          fused_step=args.fused_step, prepack_weights=args.prepack_weights)
    if args.weights != "float":
        raise BuildError(f"--weights {args.weights}: only --backend onnxruntime builds int4 engines")
    if args.backend == "tensorrt":
        return TrtOptions(trt_attention=args.trt_attention, keep_onnx=args.keep_onnx)
    return TrtllmOptions(max_input_len=args.max_input_len or None)


def _main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    refuse_flags_that_cannot_apply(p, args)
    opts = BuildOptions(
        checkpoint=args.checkpoint, out=args.out, backend=args.backend, dtype=args.dtype,
        max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len, max_draft_len=args.max_draft_len,
        opset=args.opset, device=args.device, attention=args.attention, force=args.force,
        progress=not args.quiet, backend_options=backend_options(args), tree=args.tree,
        datastore=args.datastore,
    )
    also, repo_written = None, []
    if args.triton_repo:
        from medusa_trt.serving.triton_repo import RepoError, write_triton_repo

        # before the build; a repository inside --out would go with the directory the engine's rename replaces
        check_output_dir(args.triton_repo, args.force, RepoError, (args.checkpoint, args.out), flag="--triton-repo")
        if Path(args.triton_repo).resolve().is_relative_to(Path(args.out).resolve()):
            raise RepoError(f"{args.triton_repo}: --triton-repo inside --out {args.out}, which the engine replaces; "
                            "expected a directory outside the engine's")

        def also(engine_tmp: Path) -> None:  # the repository, from the engine still in its temp dir
            try:
                write_triton_repo(engine_tmp, args.triton_repo, max_batch_size=args.max_batch_size, force=args.force,
                                  engine_dir_as=args.out)
                repo_written.append(args.triton_repo)
            except RepoError as e:
                why = str(e).replace(str(engine_tmp.resolve()), str(args.out))  # the temp dir is ours, not the user's
                raise RepoError(f"--triton-repo {args.triton_repo}: {why}; no engine written either") from None
    try:
        result = build_engine(opts, also=also)
    except BaseException:
        # The engine's rename failed after the repository's (rare: the same filesystem): no half pair.
        for repo in repo_written:
            shutil.rmtree(repo, ignore_errors=True)
        raise
    if args.triton_repo and not args.quiet:
        print(f"{PROG}: wrote Triton model repository {args.triton_repo} (serve it: medusa-serve --repo "
              f"{args.triton_repo})")
    if not args.quiet:
        e = result.engine
        size = sum(a["bytes"] for a in e["artifacts"].values())
        tree = e["medusa"].get("tree")
        recorded = f", tree {e['medusa']['tree_source']} ({len(tree)} nodes)" if tree else ""
        if "datastore.npz" in e["artifacts"]:
            recorded += f", datastore {e['artifacts']['datastore.npz']['bytes'] / 2**20:.1f} MiB"
        print(f"{PROG}: wrote {result.out} ({e['backend']}, {e['dtype']}, {e['device']}, "
              f"{size / 2**20:.1f} MiB, {result.seconds:.1f} s{recorded})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(PROG, lambda: _main(argv))


if __name__ == "__main__":
    sys.exit(main())
