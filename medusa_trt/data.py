"""Text sample files (.txt one sample per line, .jsonl objects with a `text` field): the one reader
used by head training, FP8 calibration, tree tuning, benchmarks and the prompt flags of every CLI."""

from __future__ import annotations

import json
from pathlib import Path

from medusa_trt.errors import MedusaTrtError

DATA_SUFFIXES = (".txt", ".jsonl")


class DataError(MedusaTrtError):
    """A data file that cannot be used; the message names the file, the line and what was expected."""


def read_samples(path: str | Path, *, any_suffix_is_text: bool = False, what: str = "samples") -> list[str]:
    """Text samples from a .txt file (one sample per non-empty line) or a .jsonl file (one JSON
    object per line with a string `text`, which may hold newlines: the form for code).
    `any_suffix_is_text`: a file of any other suffix is read as .txt instead of refused."""
    path = Path(path)
    jsonl = path.suffix == ".jsonl"
    if path.suffix not in DATA_SUFFIXES and not any_suffix_is_text:
        raise DataError(f"{path}: unsupported suffix {path.suffix!r}; expected .txt (one sample per line) "
                        "or .jsonl (objects with a 'text' field)")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read it as UTF-8 text ({e})") from None
    samples = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if not jsonl:
            samples.append(line)
            continue
        try:
            obj = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as e:
            raise DataError(f"{path}:{n}: not valid JSON ({getattr(e, 'msg', e)}); expected an object like {{\"text\": \"...\"}}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise DataError(f"{path}:{n}: expected an object with a string 'text' field, got {line[:60]!r}")
        if obj["text"]:
            samples.append(obj["text"])
    if not samples:
        raise DataError(f"{path}: no {what} (expected at least one non-empty line)")
    return samples


def read_prompts(path: str | Path) -> list[str]:
    """Prompts to decode, from the file of every CLI's --prompts: .jsonl objects with a `text` field,
    any other file one prompt per non-empty line (medusa-run's --batch-file took any name)."""
    return read_samples(path, any_suffix_is_text=True, what="prompts")
