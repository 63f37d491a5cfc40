"""medusa-run: generate text from a merged checkpoint (PyTorch) or a built engine."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from medusa_trt.cli.common import run_cli
from medusa_trt.errors import MedusaTrtError, check_number, check_utf8, read_text_lines
from medusa_trt.runtime.decoding import ACCEPTANCE, GenerationConfig, SequenceStats, generate
from medusa_trt.runtime.loading import load_backend, load_tokenizer, stop_tokens


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="medusa-run", description=__doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", type=Path, help="merged checkpoint dir (runs the PyTorch reference)")
    src.add_argument("--engine", type=Path, help="engine dir written by medusa-build")
    inp = p.add_mutually_exclusive_group(required=True)
    inp.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    inp.add_argument("--batch-file", type=Path, help="a text file with one prompt per line")
    p.add_argument("--medusa-choices", default=None, help="preset name, list of paths, file or brace form")
    p.add_argument("--no-medusa", action="store_true", help="plain decoding on the same backend")
    p.add_argument("--acceptance", choices=list(ACCEPTANCE), default="greedy",
                   help="sample: lossless sampling (output follows the base model's sampling exactly)")
    p.add_argument("--temperature", type=float, default=0.7, help="typical and sample acceptance temperature")
    p.add_argument("--top-k", type=int, default=None, help="sample: keep the k most likely tokens")
    p.add_argument("--top-p", type=float, default=1.0, help="sample: nucleus mass in (0, 1]")
    p.add_argument("--seed", type=int, default=None, help="sample: prompt i draws from seed + i (default: random)")
    p.add_argument("--posterior-threshold", type=float, default=0.09, help="typical acceptance epsilon")
    p.add_argument("--posterior-alpha", type=float, default=0.3, help="typical acceptance delta")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="checkpoint dtype override")
    p.add_argument("--device", default=None, help="engine device (cpu, cuda)")
    p.add_argument("--threads", type=int, help="engine intra-op threads (default: one per core)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of text")
    return p.parse_args(argv)


def _main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.batch_file:
            texts = read_text_lines(args.batch_file, what="prompt file (--batch-file)")
        else:
            texts = [check_utf8(t, "--prompt") for t in args.prompt]
        check_number(args.temperature, "--temperature", nonnegative=True)
        check_number(args.posterior_threshold, "--posterior-threshold", nonnegative=True)
        check_number(args.posterior_alpha, "--posterior-alpha", nonnegative=True)
        check_number(args.max_new_tokens, "--max-new-tokens", positive=True)
        check_number(args.threads, "--threads", positive=True)
        directory = args.engine or args.checkpoint
        backend = load_backend(directory, dtype=args.dtype, device=args.device, threads=args.threads)
        tok = load_tokenizer(directory)
        extra = {"medusa_choices": args.medusa_choices} if args.medusa_choices is not None else {}
        cfg = GenerationConfig(
            max_new_tokens=args.max_new_tokens, use_medusa=not args.no_medusa, acceptance=args.acceptance,
            temperature=args.temperature, posterior_threshold=args.posterior_threshold,
            posterior_alpha=args.posterior_alpha, stop_token_ids=stop_tokens(directory, tok), top_k=args.top_k,
            top_p=args.top_p, seed=args.seed, **extra,
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
