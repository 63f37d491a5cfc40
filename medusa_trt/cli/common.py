"""What every console script shares: one error line, exit 2, clean interruption, and the flags.

`run_cli(prog, body)` runs a CLI's body with a `prog: level: message` log handler and turns
- a MedusaTrtError (bad input, already explained) and an OSError (permission denied, no space
  left, not a directory, ...) into ONE line `prog: error: <message>` on stderr and exit code 2;
- SIGINT and SIGTERM into one line and exit code 130 / 143. SIGTERM (what schedulers and `kill`
  send) is turned into a KeyboardInterrupt subclass, so the `except BaseException` blocks that
  remove temporary output run exactly as they do for Ctrl-C.
Anything else is a bug and keeps its traceback.

Numeric flags take their range from one validator here (`positive_int`, `nonnegative_float`, ...), given
as argparse's `type=`, so a flag is refused the same way in every command that has it, before any
work; `new_parser`'s parser reports that (and every other usage error) as one line and exit code 2.

The flag groups (`add_*`) give one concept one flag name in every command: `--engine`/`--checkpoint`,
`--medusa-choices`, `--max-new-tokens`, the sampling flags, `--threads`, `--prompts`, `--quiet`.
Spellings a command used before (`--batch-file`, `--intra-op-threads`, `--new-tokens`, ...) stay
accepted as aliases of the same option and are hidden from --help (`old=`). Prompt files are read by
`read_prompts` (medusa_trt.data: .txt or .jsonl). Calibration text for FP8 (medusa-convert
--calib-data) and training text (medusa-train-heads --data) are not prompts to decode: they keep
their own names, and are read by the same sample reader.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import signal
import sys
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from medusa_trt.errors import MedusaTrtError
from medusa_trt.outputs import check_creatable, replaced_input

if TYPE_CHECKING:
    from medusa_trt.runtime.ort.session import OrtSessionOptions

EXIT_BAD_INPUT = 2


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so cleanup code runs."""


def _on_sigterm(signum, frame):
    raise Terminated()


class _Formatter(logging.Formatter):
    def __init__(self, prog: str):
        super().__init__()
        self.prog = prog

    def format(self, record: logging.LogRecord) -> str:  # "medusa-build: warning: ..."
        return f"{self.prog}: {record.levelname.lower()}: {record.getMessage()}"


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def describe_os_error(e: OSError) -> str:
    """`path: reason` (both paths for a rename), e.g. 'out/x: Permission denied'."""
    reason = e.strerror or str(e)
    paths = [str(p) for p in (e.filename, e.filename2) if p is not None]
    return f"{' -> '.join(paths)}: {reason}" if paths else reason


def error_line(prog: str, message: str) -> str:
    return f"{prog}: error: {one_line(message)}"


def run_cli(prog: str, body: Callable[[], int | None], *, handle_sigterm: bool = True) -> int:
    """Runs body() and returns its exit code (0 for None); see the module docstring."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(prog))
    logger = logging.getLogger("medusa_trt")
    logger.addHandler(handler)
    previous = None
    if handle_sigterm:
        try:
            previous = signal.signal(signal.SIGTERM, _on_sigterm)
        except ValueError:  # not the main thread (a CLI called from a worker thread): leave signals alone
            previous = None
    try:
        return body() or 0
    except MedusaTrtError as e:
        print(error_line(prog, str(e)), file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:
        print(error_line(prog, describe_os_error(e)), file=sys.stderr)
        return EXIT_BAD_INPUT
    except Terminated:
        print(f"{prog}: error: terminated (SIGTERM)", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print(f"{prog}: error: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        logger.removeHandler(handler)


# -- flag groups --------------------------------------------------------------------------------


class HelpFormatter(argparse.HelpFormatter):
    """--help lists an option by its current names only; its old spellings (`old=` of the add_*
    functions, kept in `action.old_spellings`) are still parsed."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        old = getattr(action, "old_spellings", ())
        if not old:
            return super()._format_action_invocation(action)
        saved = action.option_strings
        action.option_strings = [s for s in saved if s not in old]
        try:
            return super()._format_action_invocation(action)
        finally:
            action.option_strings = saved


class RawHelpFormatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The same, keeping the description's line breaks (module docstrings)."""


class Parser(argparse.ArgumentParser):
    """A usage error is one line `prog: error: ...` and exit code 2, as every other bad input is
    (argparse would print the whole usage first); --help still shows it."""

    def error(self, message: str):
        # A validator's "argument --threads/--intra-op-threads: -1: expected ..." reads as "--threads -1: expected ...".
        m = re.fullmatch(r"argument ([^/: ]+)(?:/\S+)?: (.*?): (expected .*)", message, re.S)
        if m:
            message = f"{m[1]} {m[2]}: {m[3]}"
        self.exit(EXIT_BAD_INPUT, error_line(self.prog, message) + "\n")


def new_parser(prog: str, description: str | None, *, raw: bool = False) -> argparse.ArgumentParser:
    """Every command's parser: the shared help formatter, one-line usage errors (Parser) and
    --version (one place for all three)."""
    from medusa_trt import __version__

    p = Parser(prog=prog, description=description, formatter_class=RawHelpFormatter if raw else HelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s (medusa-trt) {__version__}")
    return p


# -- numeric flag validators (argparse `type=`): one range per kind of value, the same in every command --


def _number(kind: type, expected: str, ok: Callable[[float], bool]) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text}: expected {expected}") from None
        if not (math.isfinite(value) and ok(value)):  # float("inf") and float("nan") parse; they are no count
            raise argparse.ArgumentTypeError(f"{text}: expected {expected}")
        return value

    parse.__name__ = expected  # argparse names the type by it in its own messages
    return parse


positive_int = _number(int, "a positive integer", lambda v: v > 0)


def int_up_to(most: int) -> Callable[[str], int]:
    """A count with a ceiling (an engine's max_batch_size, max_draft_len: tree.MAX_DRAFT_LEN,
    engine_dir.MAX_BATCH_SIZE), refused at the flag rather than as an allocation at the first step."""
    return _number(int, f"an integer in 1..{most}", lambda v: 0 < v <= most)

nonnegative_int = _number(int, "a non-negative integer", lambda v: v >= 0)
positive_float = _number(float, "a positive finite number", lambda v: v > 0)
nonnegative_float = _number(float, "a non-negative finite number", lambda v: v >= 0)
probability = _number(float, "a number in (0, 1]", lambda v: 0 < v <= 1)
fraction = _number(float, "a fraction in [0, 1)", lambda v: 0 <= v < 1)
seed_int = _number(int, "an integer in [0, 2**63)", lambda v: 0 <= v < 2**63)
port = _number(int, "a TCP port 1..65535 (0: pick a free one)", lambda v: 0 <= v <= 65535)
MAX_THREADS = 1024  # past any CPU these engines run on; a larger count fails inside ONNX Runtime or Triton
thread_count = _number(int, f"a positive integer (at most {MAX_THREADS})", lambda v: 0 < v <= MAX_THREADS)
thread_count_or_zero = _number(int, f"a non-negative integer (at most {MAX_THREADS})", lambda v: 0 <= v <= MAX_THREADS)
queue_delay_us = _number(int, "a non-negative integer (at most 10**9 microseconds)", lambda v: 0 <= v <= 10**9)


def _add(group, name: str, old: Sequence[str] = (), **kwargs) -> argparse.Action:
    """One option under its current name, with `old` spellings as hidden aliases (same dest)."""
    dest = name.lstrip("-").replace("-", "_")
    action = group.add_argument(name, *old, dest=dest, **kwargs)
    action.old_spellings = tuple(old)
    return action


ENGINE_HELP = "engine dir written by medusa-build"
ENGINE_OR_CHECKPOINT_HELP = "engine dir (medusa-build) or merged checkpoint"


def add_source_args(p: argparse.ArgumentParser, *, checkpoint: str | None = None,
                    engine_help: str = ENGINE_HELP) -> None:
    """--engine DIR (required). checkpoint="alternative": --checkpoint DIR instead of --engine (runs
    the PyTorch reference); "reference": an optional --checkpoint DIR to compare the engine with."""
    if checkpoint == "alternative":
        src = p.add_mutually_exclusive_group(required=True)
        src.add_argument("--checkpoint", type=Path, help="merged checkpoint dir (runs the PyTorch reference)")
        src.add_argument("--engine", type=Path, help=engine_help)
        return
    p.add_argument("--engine", required=True, type=Path, help=engine_help)
    if checkpoint == "reference":
        p.add_argument("--checkpoint", type=Path, help="merged checkpoint (default: the one recorded in engine.json)")
    elif checkpoint is not None:
        raise ValueError(f"checkpoint={checkpoint!r}: expected 'alternative', 'reference' or None")


def add_tree_arg(p: argparse.ArgumentParser, *, default: str | None = None,
                 help: str = "tree: preset name, list of paths, file or brace form, or dynamic:N[,cost=C] (the "
                             "N most probable nodes chosen each step, kept while worth C plain steps a slot; default: "
                             "the tree the engine records, medusa-build --tree)", context: bool = True) -> None:
    """--medusa-choices; its help names the presets, which are otherwise listed only in an error. With
    `context`, --no-context-candidates and --no-datastore too (per-step trees' chains from the context
    and from the engine's datastore)."""
    from medusa_trt.tree import preset_names

    p.add_argument("--medusa-choices", default=default, help=f"{help}; presets: {', '.join(preset_names())}")
    if context:
        p.add_argument("--no-context-candidates", dest="context_candidates", action="store_false",
                       help="dynamic:N trees: do not offer continuations found in the prompt and generated text "
                            "(prompt lookup) as candidates")
        p.add_argument("--no-datastore", dest="datastore", action="store_false",
                       help="dynamic:N trees: do not offer continuations from the engine's datastore "
                            "(medusa-build --datastore)")


def add_max_new_tokens_arg(p: argparse.ArgumentParser, *, default: int, help: str | None = None,
                           old: Sequence[str] = ()) -> None:
    _add(p, "--max-new-tokens", old, type=positive_int, default=default,
         help=help or f"tokens to generate per prompt at most (default {default})")


def add_sampling_args(p: argparse.ArgumentParser, *, typical: bool = True, seed: int | None = None,
                      seed_help: str = "sample: prompt i draws from seed + i (default: random)",
                      acceptance_help: str = "sample: lossless sampling (output follows the base model's "
                                             "sampling exactly)") -> None:
    """--acceptance, --temperature, --top-k, --top-p, --seed; with `typical`, the typical acceptance
    epsilon and delta too."""
    from medusa_trt.runtime.config import ACCEPTANCE

    p.add_argument("--acceptance", choices=list(ACCEPTANCE), default="greedy", help=acceptance_help)
    # Defaults are None here and filled in by sampling_options, so a flag that cannot apply to the
    # chosen acceptance is told apart from one left alone (refuse_inapplicable_sampling).
    p.add_argument("--temperature", type=nonnegative_float, default=None,
                   help=f"typical and sample acceptance temperature (default {SAMPLING_DEFAULTS['temperature']})")
    p.add_argument("--top-k", type=positive_int, default=None,
                   help="sample: keep the k most likely tokens (default: all)")
    p.add_argument("--top-p", type=probability, default=None, help="sample: nucleus mass in (0, 1] (default 1)")
    p.add_argument("--seed", type=seed_int, default=None, help=seed_help)
    p.set_defaults(seed_default=seed)
    if typical:
        p.add_argument("--posterior-threshold", type=probability, default=0.09, help="typical acceptance epsilon, in (0, 1]")
        p.add_argument("--posterior-alpha", type=positive_float, default=0.3, help="typical acceptance delta")


SAMPLING_DEFAULTS = {"temperature": 0.7, "top_p": 1.0}


def sampling_options(args: argparse.Namespace) -> dict:
    """The GenerationConfig fields add_sampling_args set (defaults for the flags not given)."""
    keys = ("acceptance", "temperature", "top_k", "top_p", "seed", "posterior_threshold", "posterior_alpha")
    options = {k: getattr(args, k) for k in keys if hasattr(args, k)}
    for key, default in SAMPLING_DEFAULTS.items():
        if options.get(key) is None:
            options[key] = default
    if options.get("seed") is None:
        options["seed"] = getattr(args, "seed_default", None)
    return options


def refuse_inapplicable_sampling(args: argparse.Namespace) -> None:
    """A sampling flag the chosen --acceptance ignores is bad input (it would decode otherwise than
    asked without a word): --top-k, --top-p and --seed need sample, --temperature typical or sample."""
    needs = {"top_k": ("sample",), "top_p": ("sample",), "seed": ("sample",), "temperature": ("typical", "sample")}
    for key, modes in needs.items():
        value = getattr(args, key, None)
        if value is not None and args.acceptance not in modes:
            flag = "--" + key.replace("_", "-")
            raise MedusaTrtError(f"{flag} {value}: applies to --acceptance {' or '.join(modes)} only, and this decode "
                                 f"is {args.acceptance}; add --acceptance {modes[-1]} or drop {flag}")


def add_threads_arg(p: argparse.ArgumentParser, *, default: int | None = None,
                    help: str = "engine intra-op threads (default: one per core)", old: Sequence[str] = (),
                    zero: bool = False) -> None:
    """--threads N >= 1 (`zero`: 0 also, for "the library's default")."""
    _add(p, "--threads", old, type=thread_count_or_zero if zero else thread_count, default=default, help=help)


def add_device_arg(p: argparse.ArgumentParser, *,
                   help: str = "cpu or cuda (default: the engine's own; a merged checkpoint runs the PyTorch "
                               "reference, on the CPU unless cuda is named)") -> None:
    """For commands that open an engine or checkpoint with load_backend (its `device`); a name beyond
    these is refused here, before medusa-triton writes it into a repository that could not load it."""
    p.add_argument("--device", default=None, choices=("cpu", "cuda"), help=help)


def add_spin_arg(p: argparse.ArgumentParser) -> None:
    """For commands that decode on an ONNX Runtime engine (ort_session_options)."""
    p.add_argument("--spin", action="store_true", help="ONNX Runtime worker threads spin between ops instead of "
                   "sleeping: faster with 2+ threads on cores the engine has to itself, much slower on a "
                   "shared machine (default: off)")


def ort_session_options(args: argparse.Namespace) -> OrtSessionOptions:
    """--threads and --spin as the one value load_backend hands every session of an ONNX Runtime engine."""
    from medusa_trt.runtime.ort.session import OrtSessionOptions

    return OrtSessionOptions(threads=args.threads, spin=args.spin)


PROMPTS_HELP = ".txt (one prompt a line) or .jsonl with 'text'"


def add_prompts_arg(p, *, required: bool = False, default: Path | None = None, help: str = PROMPTS_HELP,
                    old: Sequence[str] = (), name: str = "--prompts") -> None:
    """A prompt file (read it with read_prompts). `p` may be a mutually exclusive group."""
    _add(p, name, old, type=Path, required=required, default=default, help=help)


def read_prompts(path: str | Path) -> list[str]:
    """The prompts of a --prompts file (medusa_trt.data.read_prompts: .txt or .jsonl); a bad file is
    a DataError, one line and exit 2 under run_cli."""
    from medusa_trt.data import read_prompts as read

    return read(path)


def add_quiet_arg(p: argparse.ArgumentParser, *, help: str = "no progress bars") -> None:
    p.add_argument("--quiet", action="store_true", help=help)


def add_json_report_arg(p: argparse.ArgumentParser, *, help: str = "also write the report as JSON to this file") -> None:
    """--json FILE: the commands whose report is a document (check, bench). medusa-run's --json is a
    switch instead (one JSON object per prompt on stdout), as it always was."""
    p.add_argument("--json", type=Path, help=help)


def add_force_arg(p: argparse.ArgumentParser, *, help: str = "replace an existing output file") -> None:
    p.add_argument("--force", action="store_true", help=help)


# -- output files: the rule of output directories (medusa_trt/outputs.py) for single files -----------


INPUT_FLAGS = ("engine", "checkpoint", "prompts", "eval_prompts", "hf_model", "base", "heads", "data", "datastore",
               "calib_data", "cache", "tokenizer_dir")


def input_paths(args: argparse.Namespace) -> list[Path]:
    """The files and directories a command's flags name for it to read (INPUT_FLAGS): what its
    outputs must never replace (check_output_file)."""
    return [Path(v) for name in INPUT_FLAGS if isinstance(v := getattr(args, name, None), (str, Path))]


def check_output_file(path: Path | None, force: bool, flag: str = "--out", inputs: Iterable[Path | None] = ()) -> None:
    """Refuses, before any work, what write_output_file would refuse: an existing file without
    --force (never silently replaced), a directory, a parent that is a file, or, even with --force,
    one of `inputs` or a file directly in an input directory (an engine's engine.json)."""
    if path is None:
        return
    if (src := replaced_input(path, inputs, directory=False)) is not None:
        where = "is the input" if path.resolve() == src.resolve() else "is in the input directory"
        raise MedusaTrtError(f"{path}: {flag} {where} {src}; write it elsewhere")
    if path.is_dir():
        raise MedusaTrtError(f"{path}: {flag} is a directory; expected a file path")
    if (path.exists() or path.is_symlink()) and not force:
        raise MedusaTrtError(f"{path}: {flag} exists; pass --force to replace it")
    check_creatable(path)


def write_output_file(path: Path, text: str, force: bool, flag: str = "--out", inputs: Iterable[Path | None] = ()) -> None:
    """Writes `text` to a temp file beside `path` and renames it into place: a failed or interrupted
    write leaves no half file, and `path` is whole or as it was. An OSError names `path`."""
    check_output_file(path, force, flag, inputs)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None
    finally:
        tmp.unlink(missing_ok=True)
