"""The CLI layer (medusa_trt/cli): every console script resolves and shows the shared flag names,
old flag spellings still parse to the same options, one prompt-file reader (.txt and .jsonl) for
every command, and no library module holds a command line."""

from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path

import pytest

from medusa_trt.cli import check as check_cli
from medusa_trt.cli import run as run_cli
from medusa_trt.cli import train_heads as train_cli
from medusa_trt.cli import triton as triton_cli
from medusa_trt.cli import tune_tree as tune_cli

ROOT = Path(__file__).resolve().parents[2]


def console_scripts() -> dict[str, str]:
    section = (ROOT / "pyproject.toml").read_text().split("[project.scripts]")[1].split("\n\n")[0]
    pairs = (line.split("=", 1) for line in section.strip().splitlines())
    return {name.strip(): target.strip().strip('"') for name, target in pairs}


# Flags each command must show in --help (the shared names), and old spellings it must not show.
SHARED = {
    "medusa-run": ["--engine", "--checkpoint", "--prompts", "--medusa-choices", "--max-new-tokens", "--threads",
                   "--acceptance", "--temperature", "--top-p", "--json"],
    "medusa-check": ["--engine", "--checkpoint", "--prompts", "--max-new-tokens", "--json"],
    "medusa-bench": ["--engine", "--prompts", "--medusa-choices", "--max-new-tokens", "--threads", "--acceptance",
                     "--temperature", "--json", "--quiet"],
    "medusa-tune-tree": ["--engine", "--prompts", "--eval-prompts", "--max-new-tokens", "--threads", "--quiet"],
    "medusa-triton": ["--engine", "--medusa-choices", "--threads"],
    "medusa-serve": ["--repo"],
    "medusa-train-heads": ["--data", "--max-new-tokens", "--threads", "--quiet"],
    "medusa-convert": ["--calib-data", "--quiet"],
    "medusa-build": ["--checkpoint", "--quiet"],
}
OLD_SPELLINGS = ["--batch-file", "--intra-op-threads", "--new-tokens", "--max-tokens", "--eval-data"]


def test_every_entry_point_resolves():
    scripts = console_scripts()
    assert set(scripts) == set(SHARED)
    for name, target in scripts.items():
        module, func = target.split(":")
        assert module.startswith("medusa_trt.cli."), (name, target)
        assert callable(getattr(importlib.import_module(module), func)), (name, target)


@pytest.mark.parametrize("name", sorted(SHARED))
def test_help_shows_the_shared_flags(name, capsys):
    module, func = console_scripts()[name].split(":")
    main = getattr(importlib.import_module(module), func)
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    shown = capsys.readouterr().out
    assert shown.startswith(f"usage: {name} ")
    for flag in SHARED[name]:
        assert f"{flag} " in shown or f"{flag}\n" in shown, (name, flag)
    for old in OLD_SPELLINGS + (["--calib-data"] if name == "medusa-tune-tree" else []):
        assert old not in shown, (name, old)


ENGINE = ["--engine", "e"]

# (parser, argv with the current spelling, the same with the old one, options they must set)
ALIASES = [
    (run_cli.parser, [*ENGINE, "--prompts", "p.txt"], [*ENGINE, "--batch-file", "p.txt"], {"prompts": Path("p.txt")}),
    (triton_cli.parser, [*ENGINE, "--out", "r", "--threads", "3"], [*ENGINE, "--out", "r", "--intra-op-threads", "3"],
     {"threads": 3}),
    (train_cli.parser, ["--base", "b", "--data", "d.txt", "--out", "o", "--max-new-tokens", "7"],
     ["--base", "b", "--data", "d.txt", "--out", "o", "--new-tokens", "7"], {"max_new_tokens": 7}),
    (tune_cli.parser, [*ENGINE, "--out", "t.json", "--prompts", "c.jsonl", "--eval-prompts", "h.jsonl"],
     [*ENGINE, "--out", "t.json", "--calib-data", "c.jsonl", "--eval-data", "h.jsonl"],
     {"prompts": Path("c.jsonl"), "eval_prompts": Path("h.jsonl")}),
]


@pytest.mark.parametrize("parser,current,old,expected", ALIASES, ids=["run", "triton", "train-heads", "tune-tree"])
def test_old_spellings_parse_to_the_same_options(parser, current, old, expected):
    new_args, old_args = vars(parser().parse_args(current)), vars(parser().parse_args(old))
    assert new_args == old_args
    assert {k: new_args[k] for k in expected} == expected


def test_old_and_new_spelling_together_are_one_option(capsys):
    """The alias is the same option: the last one given wins, as for any repeated option."""
    args = triton_cli.parser().parse_args([*ENGINE, "--out", "r", "--threads", "2", "--intra-op-threads", "5"])
    assert args.threads == 5 and not hasattr(args, "intra_op_threads")
    with pytest.raises(SystemExit) as exit_info:  # --prompts and --batch-file are one option: --prompt excludes both
        run_cli.parser().parse_args([*ENGINE, "--prompt", "x", "--batch-file", "p.txt"])
    assert exit_info.value.code == 2
    assert "not allowed with argument --prompt" in capsys.readouterr().err


TEXTS = ["def add(a, b):\n    return a + b", "Hello there"]  # the first holds a newline: .jsonl only


@pytest.fixture
def jsonl_prompts(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return path


def _run_json(argv: list[str], capsys) -> list[dict]:
    capsys.readouterr()
    assert run_cli.main(argv) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_run_reads_a_jsonl_prompt_file(ort_engine, jsonl_prompts, capsys):
    engine = ["--engine", str(ort_engine("llama")), "--max-new-tokens", "6", "--json"]
    from_file = _run_json([*engine, "--prompts", str(jsonl_prompts)], capsys)
    assert [r["prompt"] for r in from_file] == TEXTS
    given = _run_json([*engine, *(a for t in TEXTS for a in ("--prompt", t))], capsys)
    assert [r["output_ids"] for r in from_file] == [r["output_ids"] for r in given]
    assert all(len(r["output_ids"]) == 6 for r in from_file)  # max-new-tokens reached
    assert len({tuple(r["output_ids"]) for r in from_file}) > 1  # each prompt's own output, not one repeated
    old_name = _run_json([*engine, "--batch-file", str(jsonl_prompts)], capsys)  # the old flag name, same file
    assert [(r["prompt"], r["output_ids"]) for r in old_name] == [(r["prompt"], r["output_ids"]) for r in from_file]


def test_run_reads_a_prompt_file_of_any_other_name_as_text(ort_engine, tmp_path, capsys):
    """--batch-file never looked at the suffix: one prompt a line, whatever the file is called."""
    path = tmp_path / "prompts.lst"
    path.write_text("Hello there\n\nsecond prompt\n")
    rows = _run_json(["--engine", str(ort_engine("llama")), "--max-new-tokens", "2", "--json", "--batch-file",
                      str(path)], capsys)
    assert [r["prompt"] for r in rows] == ["Hello there", "second prompt"]


def test_bad_jsonl_prompt_file_is_one_line(ort_engine, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "no"}\n')
    for main, argv in ((run_cli.main, ["--engine", str(ort_engine("llama")), "--prompts", str(bad)]),
                       (check_cli.main, ["--engine", str(ort_engine("llama")), "--prompts", str(bad)])):
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "bad.jsonl:2: expected an object with a string 'text' field" in err[0], err


def test_check_reads_a_jsonl_prompt_file(ort_engine, jsonl_prompts, tmp_path):
    report_path = tmp_path / "report.json"
    assert check_cli.main(["--engine", str(ort_engine("llama")), "--prompts", str(jsonl_prompts), "--json",
                           str(report_path), "--max-new-tokens", "6", "--tree-steps", "1"]) == 0
    report = json.loads(report_path.read_text())
    stages = {r["stage"] for r in report["rows"]}
    # one greedy decode per prompt of the file (the built-in default is three prompts)
    assert {"decode 0 (plain)", "decode 1 (plain)"} <= stages and not any(s.startswith("decode 2") for s in stages)


def _imports_cli_outside_main(path: Path) -> list[str]:
    """Imports of medusa_trt.cli (or argparse) in a library module, except under `if __name__ == "__main__"`."""
    tree = ast.parse(path.read_text())
    main_blocks = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    inside = {id(x) for block in main_blocks for x in ast.walk(block)}
    found = []
    for node in ast.walk(tree):
        names = ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                 [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        if id(node) not in inside and any(n.startswith("medusa_trt.cli") or n == "argparse" for n in names):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_library_modules_hold_no_command_line():
    library = [p for p in (ROOT / "medusa_trt").rglob("*.py") if "cli" not in p.relative_to(ROOT).parts]
    assert [hit for p in library for hit in _imports_cli_outside_main(p)] == []
