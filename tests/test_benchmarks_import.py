"""The benchmarks and scripts outside the package import what exists. They run by hand, not in the
suite, so a module moved or renamed breaks them silently (bench_drafter_features.py imported a
`drafter_corpus` that had moved into the package). Every module a file imports must be found (the
peers of the `bench` extra aside), and every name taken from this project's own modules (the
package, and the modules beside the files in scripts/, benchmarks/ and tests/) must be there."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("scripts", "benchmarks", "benchmarks/investigations", "tests")
FILES = sorted(p for d in ("scripts", "benchmarks") for p in (REPO / d).rglob("*.py"))
OURS = {p.stem for d in FOLDERS for p in (REPO / d).glob("*.py")} | {"medusa_trt"}
BENCH_EXTRA = {"llama_cpp", "onnxruntime_genai"}  # pyproject.toml's bench extra: bench_peers.py's peers


def imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names taken from it) for every absolute import in `path`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            out.append((node.lineno, node.module, [a.name for a in node.names if a.name != "*"]))
    return out


def missing(path: Path) -> list[str]:
    """What `path` imports that is not there, one line each (its file and line first)."""
    where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    out = []
    for line, module, names in imports(path):
        top = module.split(".")[0]
        if top in BENCH_EXTRA:
            continue
        if importlib.util.find_spec(top) is None:
            out.append(f"{where}:{line}: no module {top}")
            continue
        if top not in OURS:
            continue
        try:
            m = importlib.import_module(module)
        except ImportError as e:
            out.append(f"{where}:{line}: import {module}: {e}")
            continue
        for name in names:
            if not hasattr(m, name):  # a submodule not imported yet is there too
                try:
                    importlib.import_module(f"{module}.{name}")
                except ImportError:
                    out.append(f"{where}:{line}: {module} has no {name}")
    return out


@pytest.fixture(autouse=True)
def _beside(monkeypatch):
    """The folders the files put on sys.path themselves (or are run from)."""
    for folder in FOLDERS:
        monkeypatch.syspath_prepend(str(REPO / folder))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_a_benchmark_or_script_imports_what_exists(path):
    assert missing(path) == []


def test_the_check_finds_a_module_that_moved_and_a_name_that_did(tmp_path):
    script = tmp_path / "old.py"
    script.write_text("import drafter_corpus\nfrom medusa_trt.tools.tune_tree import no_such_name\nimport llama_cpp\n")
    assert missing(script) == [f"{script}:1: no module drafter_corpus",
                               f"{script}:2: medusa_trt.tools.tune_tree has no no_such_name"]
