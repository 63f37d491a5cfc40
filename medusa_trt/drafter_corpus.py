"""The drafter recipe's decoded corpus: the base's greedy continuations of the pack's prompts, kept in
the repository (data/drafter_corpus/) as xz-compressed parts, so that text decoded in one session, on
a GPU or on a CPU, is never decoded again. A session starts from a clean checkout: what is not
committed is lost (docs/benchmarks/issue-35-amphista.md, section n).

A part holds continuations only, each keyed by a hash of its prompt's tokens. The prompts are the
pack's (`--stage pack` rebuilds them from the registry's wheels), so a part stays a fraction of the
text it stands for (a later turn's prompt averages 458 tokens), and a prompt matches its continuation
whatever order or pack it comes from. Arrays of a part (np.savez, then xz):

    keys     uint64 [n]    prompt_key(prompt tokens)
    split    uint8  [n]    0 held-out eval prompt, 1 first human turn or code, 2 later human turn
    tokens   uint16 [sum]  the continuations, end to end (EOS included where the base wrote it);
                           uint32 in a part holding a token id past 65,535 (a larger vocabulary)
    offsets  int64  [n+1]
    meta     str           JSON: decoder, device, arithmetic, new-token limits, when

A writer rewrites its open part atomically every `every_s` seconds, so a run killed midway keeps all
but its last minutes, and starts a new part past `part_tokens` tokens (a part stays far below the
16 MiB a file that a GPU session can send back).
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import secrets
import time
from pathlib import Path

import numpy as np

SPLITS = ("eval", "first", "later")
SUFFIX = ".npz.xz"


def prompt_key(prompt: list[int]) -> int:
    """A 64-bit key for a prompt's tokens, hashed as uint16 (the pack stores them so), or as uint32
    when an id does not fit, under a personalization of its own so the two forms never collide."""
    ids = np.asarray(prompt, dtype=np.int64)
    dtype = _id_dtype(ids)
    person = b"" if dtype is np.uint16 else b"uint32"
    return int.from_bytes(hashlib.blake2b(ids.astype(dtype).tobytes(), digest_size=8, person=person).digest(), "little")


def _id_dtype(ids: np.ndarray) -> type:
    """uint16 for token ids that fit it (every SmolLM2 part), else uint32."""
    return np.uint16 if ids.size == 0 or int(ids.max()) < 2**16 else np.uint32


class CorpusError(ValueError):
    """A part that cannot be read, with its path and what was expected."""


def read(directories: list[Path], splits: tuple[str, ...] = SPLITS) -> tuple[dict[int, list[int]], list[dict]]:
    """Every continuation of the `splits` in the parts of `directories` (or in parts named by their
    file) by its prompt's key (the first part read wins a key two parts hold), and each part's meta
    with its name and size."""
    conts: dict[int, list[int]] = {}
    metas = []
    paths = {p for d in directories if d.is_dir() for p in d.glob("*" + SUFFIX)}
    for path in sorted(paths | {d for d in directories if d.is_file()}):
        try:
            z = np.load(io.BytesIO(lzma.decompress(path.read_bytes())))
            keys, split, tokens, offsets = z["keys"], z["split"], z["tokens"], z["offsets"]
            meta = json.loads(str(z["meta"]))
            if not isinstance(meta, dict):
                raise ValueError(f"meta is a {type(meta).__name__}, not an object")
        except (lzma.LZMAError, OSError, KeyError, ValueError) as e:
            raise CorpusError(f"{path}: not a drafter corpus part ({e}); expected {SUFFIX} as medusa_trt/drafter_corpus.py "
                             "writes it") from None
        if len(offsets) != len(keys) + 1 or len(split) != len(keys) or offsets[-1] != len(tokens):
            raise CorpusError(f"{path}: {len(keys)} keys and {len(split)} splits against {len(offsets)} offsets ending at {offsets[-1]}, "
                             f"{len(tokens)} tokens; expected n splits and n + 1 offsets ending at the token count")
        wanted = [SPLITS.index(name) for name in splits]
        for k, sp, a, b in zip(keys.tolist(), split.tolist(), offsets[:-1].tolist(), offsets[1:].tolist(), strict=True):
            if sp in wanted:
                conts.setdefault(k, tokens[a:b].astype(np.int64).tolist())
        metas.append({"part": path.name, "sequences": len(keys), "tokens": len(tokens), **meta})
    return conts, metas


class Writer:
    """Appends continuations to parts in `directory`, named after the run (part-<start>-<tag>-<n>.npz.xz)."""

    def __init__(self, directory: Path, meta: dict, part_tokens: int = 4_000_000, every_s: float = 600.0):
        directory.mkdir(parents=True, exist_ok=True)
        self.directory, self.meta, self.part_tokens, self.every_s = directory, meta, part_tokens, every_s
        # the start time, and a random tag: runs on two machines started in the same second
        self.run = time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(2)
        self.part, self.written, self.tokens = 0, time.monotonic(), 0
        self.keys: list[int] = []
        self.splits: list[int] = []
        self.conts: list[list[int]] = []
        self.parts: list[str] = []

    def add(self, prompt: list[int], split: str, cont: list[int]) -> int:
        """Adds one continuation; returns its prompt's key (what `read` files it under)."""
        key = prompt_key(prompt)
        self.keys.append(key)
        self.splits.append(SPLITS.index(split))
        self.conts.append(cont)
        self.tokens += len(cont)
        if self.tokens >= self.part_tokens:
            self._write()
            self.part, self.keys, self.splits, self.conts, self.tokens = self.part + 1, [], [], [], 0
        elif time.monotonic() - self.written >= self.every_s:
            self._write()
        return key

    def close(self) -> list[str]:
        """Writes the open part; the names of the parts this run wrote."""
        if self.conts:
            self._write()
        return self.parts

    def _write(self) -> None:
        buf = io.BytesIO()
        np.savez(buf, keys=np.array(self.keys, dtype=np.uint64), split=np.array(self.splits, dtype=np.uint8),
                 tokens=(flat := np.array([t for c in self.conts for t in c], dtype=np.int64)).astype(_id_dtype(flat)),
                 offsets=np.cumsum([0] + [len(c) for c in self.conts]).astype(np.int64),
                 meta=json.dumps({**self.meta, "written": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}))
        name = f"part-{self.run}-{self.part:02d}{SUFFIX}"
        tmp = self.directory / (name + ".tmp")
        tmp.write_bytes(lzma.compress(buf.getvalue(), preset=9))
        tmp.replace(self.directory / name)  # a reader never sees half a part
        if name not in self.parts:
            self.parts.append(name)
        self.written = time.monotonic()
