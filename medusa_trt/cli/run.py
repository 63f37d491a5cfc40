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
    run_cli,
    sampling_options,
)
from medusa_trt.errors import MedusaTrtError, check_utf8
from medusa_trt.runtime.decoding import GenerationConfig, SequenceStats, generate
from medusa_trt.runtime.loading import load_backend, load_tokenizer, stop_tokens


def parser() -> argparse.ArgumentParser:
    p = new_parser("medusa-run", __doc__)
    add_source_args(p, checkpoint="alternative")
    inp = p.add_mutually_exclusive_group(required=True)
    inp.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    add_prompts_arg(inp, help="prompt file: .txt (one prompt a line) or .jsonl with 'text'", old=["--batch-file"])
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


def _main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.prompts:
            texts = read_prompts(args.prompts)
        else:
            texts = [check_utf8(t, "--prompt") for t in args.prompt]
        directory = args.engine or args.checkpoint
        backend = load_backend(directory, dtype=args.dtype, device=args.device,
                               ort_options=ort_session_options(args))
        tok = load_tokenizer(directory)
        extra = {"medusa_choices": args.medusa_choices} if args.medusa_choices is not None else {}
        cfg = GenerationConfig(
            max_new_tokens=args.max_new_tokens, use_medusa=not args.no_medusa,
            stop_token_ids=stop_tokens(directory, tok), **sampling_options(args), **extra,
        )
        prompts = [tok.encode(t) for t in texts]
        stats = [SequenceStats() for _ in prompts]
        tokens: list[list[int]] = [[] for _ in prompts]
        stream = len(prompts) == 1 and not args.json
        shown = ""
        for step in generate(backend, prompts, cfg, stats):
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
        if not stream:
            print(f"[{i}] {text}{out}")
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
