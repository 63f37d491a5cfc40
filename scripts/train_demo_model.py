"""Train the demo model: a small Llama on Python's standard library, then Medusa-1 heads on it.

Everything comes from the machine itself: the corpus is this Python's own standard-library source
(`sysconfig.get_paths()["stdlib"]`, *.py), the tokenizer is a byte-level BPE trained here by the
`tokenizers` library, the base is a transformers LlamaForCausalLM trained from scratch, and the
heads are fitted by self-distillation (the base's own greedy continuations, medusa_trt.tools.train_heads).
Outputs are in the formats a user's model comes in, so the demo and benchmarks go through
medusa-convert like anyone's model:

    OUT/base/                  HF model dir: config.json, model.safetensors (float16),
                               generation_config.json (eos), tokenizer.json, tokenizer_config.json
    OUT/heads/                 FasterDecoding v2: medusa_lm_head.safetensors + config.json
                               (version "2"); or v1 with --own-lm-heads: medusa_lm_head.pt
    OUT/prompts_heldout.jsonl  code prompts from held-out files, one JSON object {"text", "file"} a line
    OUT/prompts_calib.jsonl    the same from training files (for medusa-tune-tree)
    OUT/summary.json           sizes, losses, accuracies, timings; OUT/README.md says the same in prose

Determinism: fixed seeds, files split by a hash of their path (not by listing order), the same
corpus, tokenizer, batches and prompts on every run with the same Python version. The weights are
not bit-identical between runs (multithreaded bf16 reductions and torch.compile's kernels round
differently), so losses and head accuracies move by a few hundredths from run to run.

    nice -n 10 .venv/bin/python scripts/train_demo_model.py --compile [--out assets/demo_model]

About 20 minutes on two otherwise idle cores of this kind (AMD EPYC, AVX512-BF16); --compile
needs a C compiler (torch.compile), and without it base steps take about 1.5x longer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import re
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from medusa_trt.tools.train_heads import (  # noqa: E402
    LOSS_DECAY,
    greedy_continuations,
    head_accuracy,
    head_pairs,
    load_head_file,
    save_heads,
    train_heads,
)

EOS_TEXT = "<|endoftext|>"  # id 0: end of a file; also bos and pad (the model never sees padding)
# Generated tables and prose, not code a user would write: charmap codecs, pydoc's topic strings.
EXCLUDED_DIRS = {"encodings", "pydoc_data", "site-packages", "dist-packages", "__pycache__"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "assets" / "demo_model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--no-bf16", dest="bf16", action="store_false",
                   help="train in float32 (default: bf16 autocast matmuls, float32 master weights)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the base for training (about 1.5x faster steps after ~1 min of compiling)")
    g = p.add_argument_group("corpus")
    g.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    g.add_argument("--heldout-percent", type=float, default=5.0, help="files held out, by path hash")
    g.add_argument("--max-file-kb", type=int, default=256, help="skip larger files (generated tables)")
    g = p.add_argument_group("tokenizer and base model")
    g.add_argument("--vocab", type=int, default=2048)
    g.add_argument("--hidden", type=int, default=256)
    g.add_argument("--layers", type=int, default=6)
    g.add_argument("--attn-heads", type=int, default=4)
    g.add_argument("--kv-heads", type=int, default=2)
    g.add_argument("--intermediate", type=int, default=704)
    g.add_argument("--max-positions", type=int, default=512)
    g.add_argument("--seq-len", type=int, default=256, help="training context")
    g.add_argument("--batch", type=int, default=16, help="sequences per step")
    g.add_argument("--steps", type=int, default=2000)
    g.add_argument("--lr", type=float, default=3e-3)
    g = p.add_argument_group("Medusa heads")
    g.add_argument("--medusa-heads", type=int, default=4)
    g.add_argument("--medusa-layers", type=int, default=2, help="ResBlocks per head (default 2: they make up "
                   "for the shared lm_head; 1 layer lost ~0.07 top-1 on head 1)")
    g.add_argument("--own-lm-heads", dest="shared_lm_head", action="store_false",
                   help="v1 heads with their own lm_heads (default: v2, logits through the base's lm_head, which "
                        "a CPU step runs ~0.4 ms faster: 4 extra 2 MB output matrices no longer evict the base "
                        "from cache)")
    g.add_argument("--distill-prompts", type=int, default=12288, help="training snippets to continue")
    g.add_argument("--prompt-tokens", type=int, default=48)
    g.add_argument("--new-tokens", type=int, default=128, help="greedy tokens per snippet")
    g.add_argument("--head-steps", type=int, default=1200)
    g.add_argument("--head-lr", type=float, default=3e-3)
    g.add_argument("--head-batch-tokens", type=int, default=4096)
    g = p.add_argument_group("prompts")
    g.add_argument("--num-prompts", type=int, default=32, help="held-out (and calibration) prompts to write")
    g.add_argument("--skip-base", action="store_true", help="reuse OUT/base and its summary (heads only)")
    p.add_argument("--readme-only", action="store_true", help="rewrite OUT/README.md from OUT/summary.json")
    p.add_argument("--prompts-only", action="store_true", help="rewrite OUT's prompt files with OUT/base's tokenizer")
    return p.parse_args(argv)


# -- corpus ------------------------------------------------------------------------------------


def list_files(stdlib: Path, max_bytes: int) -> list[Path]:
    if not stdlib.is_dir():
        raise SystemExit(f"error: {stdlib}: standard-library directory not found (pass --stdlib)")
    files = [f for f in stdlib.rglob("*.py") if not EXCLUDED_DIRS & set(f.relative_to(stdlib).parts)
             and f.is_file() and f.stat().st_size <= max_bytes]
    return sorted(files, key=lambda f: f.relative_to(stdlib).as_posix())


def is_heldout(rel: str, percent: float) -> bool:
    """A stable split: the same file lands on the same side on every machine and Python version."""
    return int(hashlib.sha1(rel.encode()).hexdigest()[:8], 16) % 10000 < percent * 100


def read_code(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):  # a few test files are deliberately mis-encoded
        return None


# -- tokenizer ---------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab: int):
    """Byte-level BPE (every byte is a token, so any text encodes), wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, special_tokens=[EOS_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TEXT, bos_token=EOS_TEXT, pad_token=EOS_TEXT,
                                   model_max_length=1 << 30)


def encode_stream(tok, texts: list[str]) -> torch.Tensor:
    """All files as one token stream, each followed by EOS (GPT-style packing) [N] int64."""
    eos = tok.eos_token_id
    ids: list[int] = []
    for enc in tok._tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


# -- base model --------------------------------------------------------------------------------


def make_model(args, tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.attn_heads, num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate, max_position_embeddings=args.max_positions,
        tie_word_embeddings=False, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id, rms_norm_eps=1e-5,
    )
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config)


def windows(stream: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    return torch.stack([stream[s : s + length] for s in starts.tolist()])  # [B, length]


@torch.no_grad()
def eval_loss(model, batches: torch.Tensor) -> float:
    model.eval()
    losses = [model(input_ids=b, labels=b).loss.item() for b in batches.split(16)]
    model.train()
    return sum(losses) / len(losses)


def train_base(args, model, train: torch.Tensor, heldout_batches: torch.Tensor) -> dict:
    g = torch.Generator().manual_seed(args.seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 25)
    # Linear warm-up, cosine to 10%: the usual small-LM schedule.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(i, args.steps) / args.steps))))
    model.train()
    log = []
    ema = None
    run = torch.compile(model) if args.compile else model
    bar = tqdm(range(args.steps), desc="base model", file=sys.stderr)
    for step in bar:
        starts = torch.randint(0, len(train) - args.seq_len - 1, (args.batch,), generator=g)
        batch = windows(train, starts, args.seq_len)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = run(input_ids=batch).logits
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}")
        if (step + 1) % 400 == 0 or step + 1 == args.steps:
            log.append({"step": step + 1, "train_loss_ema": round(ema, 4),
                        "heldout_loss": round(eval_loss(model, heldout_batches), 4)})
            bar.write(f"  step {step + 1}: train loss {ema:.3f}, held-out loss {log[-1]['heldout_loss']:.3f}")
    bar.close()
    model.eval()
    return {"train_loss_ema": round(ema, 4), "heldout_loss": log[-1]["heldout_loss"], "log": log,
            "tokens_seen": args.steps * args.batch * args.seq_len}


def save_base(model, tok, directory: Path) -> None:
    """float16 safetensors (half the bytes; the engine computes in float32 anyway) + tokenizer."""
    if directory.exists():
        shutil.rmtree(directory)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.eos_token_id
    model.generation_config.do_sample = False
    model.to(torch.float16).save_pretrained(directory)
    tok.save_pretrained(directory)
    model.to(torch.float32)


# -- prompts -----------------------------------------------------------------------------------


FIRST_WORD = re.compile(r"[ \t]*(?:\w+|\S)")  # a line's indentation and its first word (or symbol)


def code_prompts(rng: random.Random, files: list[tuple[str, str]], tok, n: int,
                 min_tokens: int = 40, max_tokens: int = 96) -> list[dict]:
    """Snippets that start at a line start and end after the first word of a line, the way a cursor
    sits in an editor, drawn from files in a seeded order, at most one per file.

    Not at a line end: byte-level BPE joins a newline with the next line's indentation into one
    token, so a prompt ending in a bare newline is a token sequence the model only saw before
    unindented lines, and it dutifully continues at column 0."""
    order = list(range(len(files)))
    rng.shuffle(order)
    out = []
    for i in order:
        rel, text = files[i]
        lines = text.splitlines(keepends=True)
        if len(lines) < 20:
            continue
        start = rng.randrange(0, len(lines) - 10)
        if not lines[start].strip():
            continue
        prompt, end = "", start
        for end in range(start, len(lines)):
            prompt += lines[end]
            if len(tok.encode(prompt)) >= min_tokens:
                break
        rest = next((line for line in lines[end + 1 :] if line.strip()), None)
        if rest is None:
            continue
        prompt += "".join(lines[end + 1 : lines.index(rest, end + 1)]) + FIRST_WORD.match(rest).group(0)
        if not min_tokens <= len(tok.encode(prompt)) <= max_tokens:
            continue
        out.append({"text": prompt, "file": rel, "line": start + 1})
        if len(out) == n:
            break
    return out


def write_prompts(out: Path, tok, seed: int, held_files, train_files, n: int) -> None:
    rng = random.Random(seed)
    write_jsonl(out / "prompts_heldout.jsonl", code_prompts(rng, held_files, tok, n))
    write_jsonl(out / "prompts_calib.jsonl", code_prompts(rng, train_files, tok, n))


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


# -- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.readme_only:
        write_readme(args.out, json.loads((args.out / "summary.json").read_text()))
        return 0
    torch.set_num_threads(args.threads)
    t_start, cpu_start = time.perf_counter(), time.process_time()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    base_dir, heads_dir = out / "base", out / "heads"
    timings: dict[str, float] = {}

    # 1. corpus, split by file
    t0 = time.perf_counter()
    files = list_files(args.stdlib, args.max_file_kb * 1024)
    train_files, held_files = [], []
    for f in files:
        rel = f.relative_to(args.stdlib).as_posix()
        text = read_code(f)
        if text:
            (held_files if is_heldout(rel, args.heldout_percent) else train_files).append((rel, text))
    corpus = {"stdlib": args.stdlib.name,  # the folder name only: no machine path in committed files
              "python": sys.version.split()[0], "files_train": len(train_files),
              "files_heldout": len(held_files), "bytes_train": sum(len(t) for _, t in train_files),
              "bytes_heldout": sum(len(t) for _, t in held_files)}
    print(f"corpus: {corpus['files_train']} training files ({corpus['bytes_train'] / 1e6:.1f} MB), "
          f"{corpus['files_heldout']} held-out files ({corpus['bytes_heldout'] / 1e6:.1f} MB) from {args.stdlib}")

    # 2. tokenizer + base
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.prompts_only:
        write_prompts(out, AutoTokenizer.from_pretrained(base_dir), args.seed, held_files, train_files, args.num_prompts)
        return 0

    summary_path = out / "summary.json"
    if args.skip_base:
        if not (base_dir / "config.json").is_file() or not summary_path.is_file():
            raise SystemExit(f"error: --skip-base needs {base_dir} and {summary_path} from an earlier run")
        summary = json.loads(summary_path.read_text())
        tok = AutoTokenizer.from_pretrained(base_dir)
        train_stream = encode_stream(tok, [t for _, t in train_files])
        held_stream = encode_stream(tok, [t for _, t in held_files])
        print(f"reusing {base_dir}")
    else:
        tok = train_tokenizer([t for _, t in train_files], args.vocab)
        train_stream = encode_stream(tok, [t for _, t in train_files])
        held_stream = encode_stream(tok, [t for _, t in held_files])
        corpus.update(tokens_train=len(train_stream), tokens_heldout=len(held_stream),
                      bytes_per_token=round(corpus["bytes_train"] / len(train_stream), 3))
        timings["tokenizer_s"] = time.perf_counter() - t0
        print(f"tokenizer: byte-level BPE, {len(tok)} tokens; {len(train_stream) / 1e6:.2f}M training tokens, "
              f"{corpus['bytes_per_token']} bytes/token ({timings['tokenizer_s']:.0f} s)")

        t0 = time.perf_counter()
        model = make_model(args, tok)
        params = sum(p.numel() for p in model.parameters())
        print(f"base: Llama, hidden {args.hidden}, {args.layers} layers, {args.attn_heads} heads "
              f"({args.kv_heads} KV), MLP {args.intermediate}, {params / 1e6:.2f}M parameters; "
              f"{args.steps} steps x {args.batch} x {args.seq_len} tokens")
        g = torch.Generator().manual_seed(args.seed + 1)
        held_batches = windows(held_stream, torch.randint(0, len(held_stream) - args.seq_len - 1, (64,), generator=g),
                               args.seq_len)
        base_result = train_base(args, model, train_stream, held_batches)
        save_base(model, tok, base_dir)
        timings["base_s"] = time.perf_counter() - t0
        cpu_base = time.process_time() - cpu_start
        summary = {"corpus": corpus, "base": {"parameters": params, "hidden_size": args.hidden, "layers": args.layers,
                                              "attention_heads": args.attn_heads, "kv_heads": args.kv_heads,
                                              "intermediate_size": args.intermediate, "vocab_size": len(tok),
                                              "seq_len": args.seq_len, "steps": args.steps, "batch": args.batch,
                                              "lr": args.lr, **base_result}}

    # The saved float16 weights, computed in float32, are what the engine runs: distil from them.
    hf = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()

    # 3. prompts
    write_prompts(out, tok, args.seed, held_files, train_files, args.num_prompts)

    # 4. heads: self-distillation on training snippets; accuracy on held-out snippets
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(args.seed + 2)
    starts = torch.randint(0, len(train_stream) - args.prompt_tokens, (args.distill_prompts,), generator=g)
    prompts = windows(train_stream, starts, args.prompt_tokens).tolist()
    seqs = greedy_continuations(hf, prompts, args.new_tokens, progress=True)
    held_starts = torch.randint(0, len(held_stream) - args.prompt_tokens, (128,), generator=g)
    held_seqs = greedy_continuations(hf, windows(held_stream, held_starts, args.prompt_tokens).tolist(),
                                     args.new_tokens, progress=True)
    timings["distill_data_s"] = time.perf_counter() - t0
    print(f"distillation data: {len(seqs)} snippets x {args.new_tokens} greedy tokens "
          f"({timings['distill_data_s']:.0f} s)")

    t0 = time.perf_counter()
    first = [args.prompt_tokens - 1] * len(seqs)  # train on continuation positions only
    pairs = head_pairs(hf, seqs, args.medusa_heads, first)
    held_pairs = head_pairs(hf, held_seqs, args.medusa_heads, [args.prompt_tokens - 1] * len(held_seqs))
    history: list[float] = []
    state = train_heads(hf, seqs, num_heads=args.medusa_heads, num_layers=args.medusa_layers, steps=args.head_steps,
                        lr=args.head_lr, batch_tokens=args.head_batch_tokens, seed=args.seed, bf16=args.bf16,
                        history=history, pairs=pairs, shared_lm_head=args.shared_lm_head)
    for old in heads_dir.glob("medusa_lm_head.*"):  # a head file of the other format would shadow the new one
        old.unlink()
    path = save_heads(state, heads_dir, "../base", args.medusa_heads, args.medusa_layers, dtype=torch.float16)
    # Accuracy of the heads as saved (float16), on held-out snippets' greedy continuations.
    acc = head_accuracy(load_head_file(path), *held_pairs, args.medusa_heads, args.medusa_layers, topk=10,
                        lm_head=hf.get_output_embeddings().weight.detach())
    timings["heads_s"] = time.perf_counter() - t0
    tail = history[-50:]
    summary["heads"] = {
        "num_heads": args.medusa_heads, "num_layers": args.medusa_layers, "loss_weights": f"{LOSS_DECAY}^k",
        "format": "medusa_v2" if args.shared_lm_head else "medusa_v1", "file": path.name,
        "distill_prompts": args.distill_prompts, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
        "training_positions": len(pairs[0]), "steps": args.head_steps, "lr": args.head_lr,
        "batch_tokens": args.head_batch_tokens, "final_loss": round(sum(tail) / len(tail), 4),
        "heldout_positions": len(held_pairs[0]),
        "heldout_top1": [round(float(a), 4) for a in acc[:, 0]],
        "heldout_top5": [round(float(a), 4) for a in acc[:, :5].sum(1)],
        "heldout_rank_accuracy": [[round(float(v), 4) for v in row] for row in acc],
    }
    previous = summary.get("timings", {}) if args.skip_base else {}
    timings["total_s"] = time.perf_counter() - t_start + previous.get("tokenizer_s", 0) + previous.get("base_s", 0)
    # CPU seconds of this process: on a shared machine wall time mostly measures the neighbours.
    timings["cpu_s"] = time.process_time() - cpu_start + previous.get("cpu_base_s", 0)
    if not args.skip_base:
        timings["cpu_base_s"] = cpu_base
    summary["timings"] = {**previous, **{k: round(v, 1) for k, v in timings.items()}}
    summary["sizes_bytes"] = {p.relative_to(out).as_posix(): p.stat().st_size for p in sorted(out.rglob("*"))
                              if p.is_file() and p.parent.name in ("base", "heads")}
    summary["seed"] = args.seed
    summary["threads"] = args.threads
    # The command without --out (the committed model is written to the default, assets/demo_model).
    given = list(argv if argv is not None else sys.argv[1:])
    if "--out" in given:
        i = given.index("--out")
        del given[i : i + 2]
    summary["command"] = " ".join(["nice -n 10 .venv/bin/python scripts/train_demo_model.py", *given])
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    write_readme(out, summary)

    h = summary["heads"]
    total = sum(summary["sizes_bytes"].values())
    print("\nsummary")
    print(f"  base      {summary['base']['parameters'] / 1e6:.2f}M params, held-out loss "
          f"{summary['base']['heldout_loss']:.3f} nats/token, train loss {summary['base']['train_loss_ema']:.3f}")
    print(f"  heads     {h['num_heads']} x {h['num_layers']} layer, final loss {h['final_loss']:.3f}, held-out top-1 "
          + " ".join(f"{a:.3f}" for a in h["heldout_top1"]) + ", top-5 " + " ".join(f"{a:.3f}" for a in h["heldout_top5"]))
    print(f"  artifacts {total / 2**20:.1f} MiB in {out}")
    print(f"  time      {timings['total_s'] / 60:.1f} min wall, {timings['cpu_s'] / 60:.1f} min CPU "
          f"({', '.join(f'{k} {v:.0f}s' for k, v in timings.items())})")
    return 0


def write_readme(out: Path, s: dict) -> None:
    b, h, c, t = s["base"], s["heads"], s["corpus"], s["timings"]
    sizes = s["sizes_bytes"]
    rows = "\n".join(f"| `{name}` | {_size(size)} |" for name, size in sizes.items())
    top1 = ", ".join(f"{a:.3f}" for a in h["heldout_top1"])
    top5 = ", ".join(f"{a:.3f}" for a in h["heldout_top5"])
    v2 = h.get("format") == "medusa_v2"
    heads_format = (f"FasterDecoding v2 `{h['file']}` + `config.json` (version 2)" if v2
                    else "FasterDecoding v1 `medusa_lm_head.pt` + `config.json`")
    heads_lm = "logits through the base's lm_head (shared, frozen)" if v2 else "each with its own lm_head"
    heads_note = (f"\nThe heads were then retrained on that base with the script's current defaults:\n\n"
                  f"    {s['heads_command']}\n") if s.get("heads_command") else ""
    text = f"""# Demo model: a small Llama for Python code, with Medusa-1 heads

Written by `scripts/train_demo_model.py` (do not edit by hand; rerun the script). Used by
`make demo`, `medusa-bench` and `medusa-tune-tree` examples, and one test.

## How it was made

    {s['command']}
{heads_note}
Seed {s['seed']} (torch and Python's `random`), {s.get('threads', 2)} torch threads,
bf16 autocast matmuls with float32 master weights.

- **Corpus**: this machine's Python {c['python']} standard library, `*.py` (without `encodings/`,
  `pydoc_data/` and files over 256 KB). Files are split by a hash of their relative path: {c['files_train']}
  training files ({c['bytes_train'] / 1e6:.1f} MB), {c['files_heldout']} held-out files
  ({c['bytes_heldout'] / 1e6:.1f} MB). Files are packed into one stream, each followed by `<|endoftext|>`.
- **Tokenizer**: byte-level BPE trained with `tokenizers` on the training files, {b['vocab_size']} tokens
  (`<|endoftext|>` = id 0 is EOS, BOS and pad; nothing is added on encode).{f" {c['bytes_per_token']} bytes per token." if 'bytes_per_token' in c else ''}
- **Base** (`base/`): transformers `LlamaForCausalLM`, hidden {b['hidden_size']}, {b['layers']} layers,
  {b['attention_heads']} attention heads ({b['kv_heads']} KV heads), MLP {b['intermediate_size']}, untied
  embeddings, {b['parameters'] / 1e6:.2f}M parameters. {b['steps']} AdamW steps of {b['batch']} x {b['seq_len']}
  tokens ({b['tokens_seen'] / 1e6:.1f}M tokens), lr {b['lr']} cosine. Saved as float16 safetensors.
  Final training loss {b['train_loss_ema']:.3f}, held-out loss {b['heldout_loss']:.3f} nats/token.
  Trained on {b['seq_len']}-token windows: keep prompt + generation within that for sensible text.
- **Heads** (`heads/`, {heads_format}, float16): Medusa-1,
  {h['num_heads']} heads of {h['num_layers']} ResBlock(s) each, {heads_lm}, frozen base, loss weight
  {h['loss_weights']}. Self-distillation: {h['distill_prompts']} training snippets of {h['prompt_tokens']} tokens, each
  continued by the base's own greedy decoding for {h['new_tokens']} tokens ({h['training_positions']} training
  positions, continuation only). {h['steps']} AdamW steps of {h['batch_tokens']} positions, lr {h['lr']}.
  Final loss {h['final_loss']:.3f} (the 0.8^k-weighted sum of the heads' cross-entropies).
- **Head accuracy** on the greedy continuations of 128 held-out snippets ({h['heldout_positions']} positions),
  heads 1..{h['num_heads']}: top-1 {top1}; top-5 {top5}.

Time on the machine that made it (2-core AMD EPYC VM, shared with other jobs, run at `nice -n 10`):
{t.get('total_s', 0) / 60:.1f} min wall in total ({', '.join(f'{k[:-2]} {v:.0f} s' for k, v in t.items()
if k not in ('total_s', 'cpu_s', 'cpu_base_s'))}), {t.get('cpu_s', 0) / 60:.1f} min of CPU time. Wall time
on a shared machine mostly measures the neighbours; the steps themselves are fixed by the command.

## Files

| file | size |
|---|---|
{rows}

`prompts_heldout.jsonl` / `prompts_calib.jsonl`: one JSON object per line, `{{"text": ..., "file": ...,
"line": ...}}`; `text` is a code snippet (newlines included) from a held-out / training file, starting
at a line start and ending after the first word of a later line, where a cursor would be (a prompt
ending in a bare newline is a token sequence the byte-level BPE model only saw before unindented
lines). `summary.json` holds every figure above.

`tree.json` (when present) is the Medusa tree `medusa-tune-tree` chose for this model on the same
machine (see Use); tree choice depends on the hardware, so retune on yours.

## Use

    medusa-convert --base assets/demo_model/base --heads assets/demo_model/heads --out build/demo_ckpt --dtype float32
    medusa-build --checkpoint build/demo_ckpt --out build/demo_engine
    medusa-tune-tree --engine build/demo_engine --calib-data assets/demo_model/prompts_calib.jsonl \\
        --eval-data assets/demo_model/prompts_heldout.jsonl --out assets/demo_model/tree.json
    medusa-bench --engine build/demo_engine --prompts assets/demo_model/prompts_heldout.jsonl \\
        --medusa-choices assets/demo_model/tree.json

or just `make demo`.
"""
    (out / "README.md").write_text(text)


def _size(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


if __name__ == "__main__":
    sys.exit(main())
