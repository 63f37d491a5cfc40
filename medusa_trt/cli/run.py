"""medusa-run: generate text from a merged checkpoint (PyTorch) or a built engine."""

from __future__ import annotations

import argparse
import json
import sys

from medusa_trt.cli.common import (
    add_device_arg,
    add_max_new_tokens_arg,
    add_prompts_arg,
    add_sampling_args,
    add_source_args,
    add_spin_arg,
    add_threads_arg,
    add_tree_arg,
    new_parser,
    ort_session_options,
    read_prompts,
    refuse_inapplicable_sampling,
    run_cli,
    sampling_options,
)
from medusa_trt.errors import MedusaTrtError, check_utf8
from medusa_trt.runtime.chat import encode_chat, has_chat_template, is_rendered, messages_for
from medusa_trt.runtime.decoding import (
    GenerationConfig,
    SequenceStats,
    generate,
    resolve_tree,
)
from medusa_trt.runtime.loading import load_backend, load_tokenizer, stop_tokens


def parser() -> argparse.ArgumentParser:
    p = new_parser("medusa-run", __doc__)
    add_source_args(p, checkpoint="alternative")
    inp = p.add_mutually_exclusive_group(required=True)
    inp.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    add_prompts_arg(inp, help="prompt file: .txt (one prompt a line) or .jsonl with 'text'", old=["--batch-file"])
    chat = p.add_mutually_exclusive_group()
    chat.add_argument("--chat", action="store_true", help="send each prompt as a user turn through the tokenizer's "
                      "chat template (the default where the tokenizer has one and the prompt is plain text)")
    chat.add_argument("--raw", action="store_true", help="send each prompt as it is, never as a chat turn")
    p.add_argument("--system", help="chat: a system turn before each prompt")
    add_tree_arg(p)
    p.add_argument("--no-medusa", action="store_true", help="plain decoding on the same backend")
    add_sampling_args(p)
    add_max_new_tokens_arg(p, default=64)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="checkpoint dtype override")
    add_device_arg(p)
    add_threads_arg(p)
    add_spin_arg(p)
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of text")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return parser().parse_args(argv)


def encode_prompts(tok, texts: list[str], args: argparse.Namespace) -> list[list[int]]:
    """Each prompt as chat (a user turn through the chat template) or as raw text: --chat, --raw, or
    by default chat where the tokenizer has a template and the prompt is plain text, said once."""
    template = has_chat_template(tok)
    if args.chat and not template:
        raise MedusaTrtError("--chat: this engine's tokenizer has no chat template; drop --chat to send the "
                             "prompt as raw text")
    if args.system is not None and (args.raw or not template):
        why = "--raw sends the prompt as it is" if args.raw else "this engine's tokenizer has no chat template"
        raise MedusaTrtError(f"--system: applies to chat prompts only, and {why}; drop --system")
    chat = [not args.raw and template and (args.chat or not is_rendered(tok, t)) for t in texts]
    if any(chat) and not args.chat:
        print("medusa-run: the engine's tokenizer has a chat template: each prompt is sent as a user turn "
              "(--raw sends it as it is)", file=sys.stderr)
    return [encode_chat(tok, messages_for(t, args.system)) if c else tok.encode(t) for t, c in zip(texts, chat, strict=True)]


def _main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.prompts:
            texts = read_prompts(args.prompts)
        else:
            texts = [check_utf8(t, "--prompt") for t in args.prompt]
        if args.no_medusa and args.medusa_choices is not None:
            raise MedusaTrtError(f"--medusa-choices {args.medusa_choices}: --no-medusa decodes without a tree; "
                                 "drop one of them")
        refuse_inapplicable_sampling(args)  # after the values' own checks (the parser's): a bad value is named
        directory = args.engine or args.checkpoint
        backend = load_backend(directory, dtype=args.dtype, device=args.device,
                               ort_options=ort_session_options(args))
        tok = load_tokenizer(directory)
        tree, described = resolve_tree(backend.info, args.medusa_choices)
        cfg = GenerationConfig(
            max_new_tokens=args.max_new_tokens, use_medusa=not args.no_medusa, medusa_choices=tree,
            context_candidates=args.context_candidates, datastore=args.datastore,
            stop_token_ids=stop_tokens(directory, tok), **sampling_options(args),
        )
        prompts = encode_prompts(tok, texts, args)
        stats = [SequenceStats() for _ in prompts]
        tokens: list[list[int]] = [[] for _ in prompts]
        stream = len(prompts) == 1 and not args.json
        shown = ""
        untold = not args.no_medusa
        for step in generate(backend, prompts, cfg, stats):
            if untold:  # once generate's checks (tree, lengths, batch) have passed: bad input stays one line
                print(f"medusa-run: tree {described}", file=sys.stderr, flush=True)
                untold = False
            for i, new in enumerate(step.new_tokens):
                tokens[i].extend(new)
            if stream:
                text = tok.decode(tokens[0], skip_special_tokens=True)
                sys.stdout.write(text[len(shown):] if text.startswith(shown) else "\n" + text)
                sys.stdout.flush()
                shown = text
    except MedusaTrtError:
        raise
    except ValueError as e:  # the runtime's own checks (limits, tree sizes): bad input, explained
        raise MedusaTrtError(str(e)) from None
    for i, text in enumerate(texts):
        out = tok.decode(tokens[i], skip_special_tokens=True)
        if args.json:
            print(json.dumps({"prompt": text, "text": out, "output_ids": tokens[i], **stats[i].as_dict()}))
            continue
        if not stream:  # the continuation alone, as a streamed single prompt shows it
            print(f"[{i}] {out}")
        s = stats[i]
        print(
            f"\n-- {s.new_tokens} tokens in {s.steps} steps ({s.tokens_per_step:.2f} tokens/step), "
            f"accepted {s.accepted_draft_tokens}/{s.draft_tokens} draft tokens "
            f"({100 * s.acceptance_rate:.1f}%), prefill {1000 * s.prefill_s:.1f} ms, "
            f"decode {s.new_tokens / max(s.decode_s, 1e-9):.1f} tokens/s",
            file=sys.stderr if args.json else sys.stdout,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli("medusa-run", lambda: _main(argv))


if __name__ == "__main__":
    sys.exit(main())
