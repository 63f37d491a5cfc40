"""Held-out repetitive work for SmolLM2: requests whose answers repeat the prompt's own lines, where
context candidates (runtime/dynamic.py) should pay most. Writes
medusa_trt/assets/smollm2/prompts_repetitive.jsonl (chat-rendered, as prompts_heldout.jsonl):

- rename a variable throughout a function,
- add a keyword argument to every call of a function,
- reformat a comma-separated table as a Markdown table.

The code comes from this Python's standard library, from files on the held-out side of the split the
drafters' recipe uses (scripts/train_demo_model.is_heldout, --code-heldout-percent 8), so no drafter
was trained on it. The tables are made up from the same files (names and counts).

    .venv/bin/python scripts/make_repetitive_prompts.py --tokenizer build/gpu_eval/ckpt_amphista
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from train_demo_model import is_heldout, list_files, read_code  # noqa: E402

OUT = REPO / "medusa_trt" / "assets" / "smollm2" / "prompts_repetitive.jsonl"


def functions(files: list[Path], stdlib: Path) -> list[tuple[str, ast.FunctionDef, str]]:
    """(file, function node, its source) of every 8-24 line function of the held-out files."""
    out = []
    for f in files:
        text = read_code(f)
        if text is None:
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and 8 <= node.end_lineno - node.lineno + 1 <= 24:
                src = ast.get_source_segment(text, node)
                if src and "\t" not in src and len(src) < 1200:
                    out.append((f.relative_to(stdlib).as_posix(), node, src))
    return out


def rename_prompt(node: ast.FunctionDef, src: str) -> str | None:
    names = [a.arg for a in node.args.args if a.arg not in ("self", "cls") and len(a.arg) > 1]
    used = [n.id for n in ast.walk(node) if isinstance(n, ast.Name)]
    names = [n for n in names if used.count(n) >= 2]
    if not names:
        return None
    old = names[0]
    return (f"Rename the variable `{old}` to `{old}_value` throughout this function. Reply with the whole "
            f"function.\n\n```python\n{src}\n```")


def call_prompt(node: ast.FunctionDef, src: str) -> str | None:
    calls = [n.func.id for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    common = [c for c in dict.fromkeys(calls) if calls.count(c) >= 2 and c not in ("len", "isinstance", "str", "int")]
    if not common:
        return None
    return (f"Add the keyword argument `strict=True` to every call of `{common[0]}` in this function. Reply with "
            f"the whole function.\n\n```python\n{src}\n```")


def table_prompt(rng: random.Random, rows: list[tuple[str, int, int]]) -> str:
    picked = rng.sample(rows, 8)
    csv = "\n".join(["file,lines,functions", *(f"{name},{lines},{funcs}" for name, lines, funcs in picked)])
    return f"Reformat this table as a Markdown table with the same columns and rows.\n\n{csv}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", type=Path, required=True, help="a SmolLM2 checkpoint or engine dir (its chat template)")
    p.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    rng = random.Random(args.seed)
    files = [f for f in list_files(args.stdlib, 200_000) if is_heldout(f.relative_to(args.stdlib).as_posix(), 8.0)]
    funcs = functions(files, args.stdlib)
    rng.shuffle(funcs)
    requests: list[tuple[str, str]] = []
    for kind, make, count in (("rename", rename_prompt, 8), ("add-argument", call_prompt, 4)):
        made = [(kind, q) for q in (make(node, src) for _, node, src in funcs) if q][:count]
        requests += made
    table_rows = []
    for f in files[:200]:
        text = read_code(f) or ""
        table_rows.append((f.name, text.count("\n"), text.count("\ndef ") + text.count("\n    def ")))
    requests += [("table", table_prompt(rng, table_rows)) for _ in range(4)]
    with args.out.open("w") as fh:
        for kind, question in requests:
            text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                           add_generation_prompt=True)
            fh.write(json.dumps({"text": text, "kind": "chat", "task": kind}) + "\n")
    print(f"{args.out}: {len(requests)} prompts from {len(files)} held-out files "
          f"({', '.join(f'{k} {sum(r[0] == k for r in requests)}' for k in ('rename', 'add-argument', 'table'))})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
