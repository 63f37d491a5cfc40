"""Output directories written atomically: a temp dir beside --out, renamed into place at the end.

Used by medusa-convert, medusa-build and medusa-triton (and, file by file, medusa-train-heads), so
a failed, interrupted (SIGINT, SIGTERM) or refused write leaves --out as it was and nothing else
behind: no temp dir, no `.old` copy, no parent directories it created. The temp dir is made with mkdir (not mkdtemp, which makes it 0700),
so the output keeps the usual umask permissions.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from medusa_trt.errors import MedusaTrtError


def replaced_input(out: Path, inputs: Iterable[Path | str | None], *, directory: bool) -> Path | None:
    """The first of `inputs` (files or directories the command reads) that writing `out` would
    replace or delete, whatever --force says: the same path; for a directory `out`, an input inside
    it (replacing the directory deletes what it holds); for a file `out`, an input directory holding
    it directly (an engine's engine.json, a checkpoint's config.json)."""
    target = out.resolve()
    for src in inputs:
        if src is None:
            continue
        source = Path(src).resolve()
        if target == source or (directory and source.is_relative_to(target)) or \
                (not directory and source.is_dir() and target.parent == source):
            return Path(src)
    return None


def check_output_dir(out: Path, force: bool, error: type[MedusaTrtError] = MedusaTrtError,
                     inputs: Iterable[Path | str | None] = (), flag: str = "--out") -> None:
    """Refuses what atomic_output_dir would refuse, before any work is done; `inputs`: what the
    command reads, which --out must not be or hold (replaced_input); `flag`: the option that named
    `out`, for the messages."""
    if (src := replaced_input(out, inputs, directory=True)) is not None:
        raise error(f"{out}: {flag} must not be or contain the input {src}")
    if out.is_symlink():  # the atomic rename would replace the link, not write where it points
        raise error(f"{out}: {flag} is a symbolic link; expected a directory path (give the link's target)")
    if out.exists() and not out.is_dir():
        raise error(f"{out}: {flag} exists and is not a directory (a file is never replaced, even with --force)")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise error(f"{out}: {flag} exists and is not empty; pass --force to replace it")
    check_creatable(out, error)


def check_creatable(path: Path, error: type[MedusaTrtError] = MedusaTrtError) -> None:
    """Refuses, before any work, a path whose nearest existing ancestor is a file (it cannot be made)."""
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise error(f"{path}: cannot create it: {ancestor} is not a directory")


def missing_parents(path: Path) -> list[Path]:
    """The parents of `path` that do not exist yet, innermost first: what a write makes, and removes
    again when it fails."""
    missing, parent = [], path.parent
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    return missing


def _remove_empty(directories: list[Path]) -> None:
    for d in directories:  # innermost first; rmdir removes only what is still empty
        with suppress(OSError):
            d.rmdir()


@contextmanager
def atomic_output_dir(out: str | Path, force: bool = False, error: type[MedusaTrtError] = MedusaTrtError,
                      inputs: Iterable[Path | str | None] = ()) -> Iterator[Path]:
    """with atomic_output_dir(out, force) as tmp: write into tmp; on a normal exit tmp becomes `out`
    (an existing `out` is replaced only with force, and never when it is or holds one of `inputs`);
    on any exception nothing is left behind."""
    out = Path(out)
    check_output_dir(out, force, error, inputs)
    created = missing_parents(out)  # made here, removed again on failure
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        for d in reversed(created):
            d.mkdir()
        tmp.mkdir()  # beside --out so the final rename stays on one filesystem
        yield tmp
        if out.exists():
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:12]}"
            out.rename(old)
            try:
                tmp.rename(out)
            except BaseException:
                old.rename(out)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(created)
        if isinstance(e, OSError):
            _name_out(e, tmp, out)
        raise


@contextmanager
def staged_files(out: str | Path, supersedes: tuple[str, ...] = ()) -> Iterator[Path]:
    """with staged_files(out) as tmp: write files into tmp; on a normal exit each moves into `out`
    (made if missing; other files there stay) and the files named in `supersedes` that the new ones
    do not replace go; on any exception `out` is as it was and tmp is gone. For tools whose --out may
    hold other files (medusa-train-heads), where atomic_output_dir would replace the whole dir."""
    out = Path(out)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:12]}"
    made = [out] * (not out.exists()) + missing_parents(out)  # removed again on failure, if left empty
    try:
        tmp.mkdir(parents=True)
        yield tmp
        out.mkdir(parents=True, exist_ok=True)
        for name in supersedes:
            if not (tmp / name).exists():
                (out / name).unlink(missing_ok=True)
        for f in sorted(tmp.iterdir()):
            f.replace(out / f.name)
        tmp.rmdir()
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(made)
        if isinstance(e, OSError):
            _name_out(e, tmp, out)
        raise


def _name_out(e: OSError, tmp: Path, out: Path) -> None:
    """An OSError on the temp dir or a file in it names the --out the user gave instead: the hidden
    `.out.tmp-*` dir is ours, and gone by the time the message is read."""
    for attr in ("filename", "filename2"):
        name = getattr(e, attr)
        if isinstance(name, (str, Path)) and (str(name) == str(tmp) or str(name).startswith(f"{tmp}/")):
            setattr(e, attr, str(out) + str(name)[len(str(tmp)):])
