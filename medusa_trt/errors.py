"""The project's one error type and the typed readers that validate what files give us.

Every error raised for bad input (a file, an option, a request) is a `MedusaTrtError` (CheckpointError,
here too, is the one the checkpoint, safetensors and converter modules share); the CLIs turn
it into one line `prog: error: <message>` and exit 2 (medusa_trt/cli/common.py). It subclasses
ValueError so callers that caught ValueError keep working. The messages name the file, the key,
the value and what was expected; `require` and its helpers write such messages for JSON fields.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from pathlib import Path
from typing import Any

_MISSING = object()
MAX_JSON_BYTES = 64 << 20  # configs, indexes and engine.json are KiB to a few MiB; larger is not one


class MedusaTrtError(ValueError):
    """Bad input to medusa-trt; the message says what, where and what was expected."""


class CheckpointError(MedusaTrtError):
    """A checkpoint file or directory is missing, corrupt, or does not match its config."""


def _where(file: str | Path | None, key: str) -> str:
    return f"{file}: {key}" if file else key


def require(obj: Any, key: str, kind: type | tuple[type, ...], *, file: str | Path | None = None,
            default: Any = _MISSING, positive: bool = False, nonnegative: bool = False, maximum: float | None = None,
            choices: Collection | None = None, prefix: str = "", error: type[MedusaTrtError] = MedusaTrtError) -> Any:
    """obj[key] checked to be of `kind` (bool is never an int; an int is a float), finite when a number,
    > 0 with positive, >= 0 with nonnegative, <= maximum, in `choices`; `default` when absent or null (if given).
    `prefix` is the dotted path of obj within the file, for the message ("model.")."""
    name = f"{prefix}{key}"
    if not isinstance(obj, dict):
        raise error(f"{_where(file, prefix.rstrip('.') or 'top level')}: expected a JSON object, got "
                    f"{type(obj).__name__} {_short(obj)}")
    value = obj.get(key)
    if value is None:
        if default is not _MISSING:
            return default
        raise error(f"{_where(file, name)}: missing; expected {_kind_name(kind)}")
    kinds = kind if isinstance(kind, tuple) else (kind,)
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if not ok and float in kinds and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        raise error(f"{_where(file, name)}: {_short(value)} is {_a(_json_type(value))}; expected {_kind_name(kind)}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            raise error(f"{_where(file, name)}: {value}; expected a finite number")
        if positive and value <= 0:
            raise error(f"{_where(file, name)}: {value}; expected a positive {_kind_name(kind)}")
        if nonnegative and value < 0:
            raise error(f"{_where(file, name)}: {value}; expected a non-negative {_kind_name(kind)}")
        if maximum is not None and value > maximum:
            raise error(f"{_where(file, name)}: {_short(value)}; expected at most {maximum}")
    if choices is not None and value not in choices:
        raise error(f"{_where(file, name)}: {_short(value)}; expected one of {', '.join(map(repr, choices))}")
    return value


def require_section(obj: Any, key: str, *, file: str | Path | None = None, prefix: str = "",
                    optional: bool = False, error: type[MedusaTrtError] = MedusaTrtError) -> dict:
    """obj[key] that must be a JSON object ({} when optional and absent)."""
    return require(obj, key, dict, file=file, prefix=prefix, error=error, **({"default": {}} if optional else {}))


def check_number(value: float | int | None, name: str, *, positive: bool = False, nonnegative: bool = False,
                 error: type[MedusaTrtError] = MedusaTrtError) -> None:
    """A run-time option (`--temperature`, `threads`): finite and in range, or an error naming it."""
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise error(f"{name} {value}: expected a finite number")
    if positive and value <= 0:
        raise error(f"{name} {value}: expected a positive number")
    if nonnegative and value < 0:
        raise error(f"{name} {value}: expected a non-negative number")


def read_json_object(path: Path, error: type[MedusaTrtError] = MedusaTrtError, what: str = "JSON file",
                     max_bytes: int = MAX_JSON_BYTES) -> dict:
    """A JSON object from `path`; every failure (missing, unreadable, too large, not UTF-8, not JSON,
    not an object) is one `error` naming the file."""
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise error(f"{path}: {size} bytes; expected a {what} of at most {max_bytes} bytes")
        data = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise error(f"{path}: not found; expected a {what}") from None
    except IsADirectoryError:
        raise error(f"{path}: is a directory; expected a {what}") from None
    except UnicodeDecodeError as e:
        raise error(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    except (json.JSONDecodeError, RecursionError) as e:
        raise error(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object, got a {type(data).__name__}")
    return data


def read_text_lines(path: Path, error: type[MedusaTrtError] = MedusaTrtError, what: str = "prompt file") -> list[str]:
    """Non-empty lines of a UTF-8 text file; missing, unreadable, not UTF-8 or empty is one `error`."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise error(f"{path}: {what} not found") from None
    except IsADirectoryError:
        raise error(f"{path}: is a directory; expected a {what}") from None
    except UnicodeDecodeError as e:
        raise error(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start}); expected a UTF-8 {what}") from None
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise error(f"{path}: no prompts (expected a {what} with one per line)")
    return lines


def check_utf8(text: str, name: str, error: type[MedusaTrtError] = MedusaTrtError) -> str:
    """A command-line string that came from bytes that are not UTF-8 (Python keeps them as lone
    surrogates) is refused here, naming the option, instead of failing inside a tokenizer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise error(f"{name} {text[:40]!r}: not valid UTF-8 (at character {e.start})") from None
    return text


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {int: "integer", float: "number", str: "string", bool: "boolean", list: "list", dict: "JSON object"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _json_type(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "JSON object",
            type(None): "null"}.get(type(value), type(value).__name__)


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
