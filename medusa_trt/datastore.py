"""A datastore of the base model's own text as a source of draft chains (retrieval drafting, after
REST): the longest suffix of the sequence so far that the datastore holds, and the continuation its
occurrences agree on, offered to the per-step tree beside the drafter's paths and the prompt's own
n-grams (runtime/dynamic.py).

The text is the base model's greedy continuations of training prompts (the drafter recipe's corpus),
so the datastore holds what this model says, not what people wrote: set phrases, code idioms, the
shapes of its answers. It is stored reversed, with a suffix order over its first WINDOW tokens: the
reversed sequence so far is then a prefix to look up, and each further token of match narrows the
range found for the token before (one binary search per token, no rescans).

A chain's nodes are scored by how often such chains were right (`calibration`): measured when the
datastore is built, on sequences held aside from it (one in CALIBRATION_EVERY), by the match length,
the chain's cumulative agreement and the depth. A long match whose occurrences agree is right deep
into the chain; a two-token match rarely past its first token (docs/design.md, datastore).

File (`datastore.npz`, written by `medusa-build --datastore`): `tokens` (the reversed stream, int32,
SEPARATOR between sequences), `order` (int32 or int64 positions of `tokens` sorted by their next
WINDOW tokens), `starts` (int64: each first token's range of `order`), `calibration` (float32
[match buckets, agreement bins, depths]: the share of chains right through that depth), `meta`
(JSON: sequences, tokens, window, source, calibration counts). The arrays are stored uncompressed,
and `load` maps them read-only instead of reading them: a lookup touches a few pages, and every
process serving the engine (Triton instances, medusa-serve workers) shares one copy in the page
cache, however large the datastore.
"""

from __future__ import annotations

import json
import math
import struct
import zipfile
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from medusa_trt.errors import MedusaTrtError

WINDOW = 16  # the longest suffix matched; the order sorts this many tokens
MIN_MATCH = 2  # a shorter match says too little about what follows
MAX_OCCURRENCES = 64  # occurrences a chain is voted from (evenly spaced over the match's range)
SEPARATOR = -1
FILE = "datastore.npz"
MATCH_BUCKETS = (2, 4, 8, 12)  # calibration rows: the match length's bucket
AGREEMENT_BINS = 10  # calibration columns: the chain's cumulative agreement, in tenths
DEPTHS = 8  # calibration depths; deeper nodes share the last
CALIBRATION_EVERY = 50  # one source sequence in this many is held aside to calibrate on
CALIBRATION_STRIDE = 4  # ... at every this-many-th position
CALIBRATION_SEQUENCES = 400  # at most
# Below this many tokens a datastore measured no gain (SmolLM2, float32, dynamic:16: 0.99x with
# 0.09M and 0.86M tokens, 1.01-1.04x with 8.2M; docs/benchmarks/issue-35-amphista.md, s and t): its chains
# rarely reach past what the drafter and the prompt's n-grams already propose, and cost their slots.
PAYS_FROM = 1_000_000


class DatastoreError(MedusaTrtError):
    """A datastore file or source that cannot be read, with the path and what was expected."""


@dataclass(frozen=True)
class Chain:
    """What the datastore offers after a sequence: `match` tokens of suffix matched, the chain, and
    at each depth the share of the occurrences (agreeing so far) that continue with its token."""

    match: int
    tokens: list[int]
    agreement: list[float]


@dataclass(frozen=True)
class Datastore:
    tokens: np.ndarray  # reversed token stream, SEPARATOR between sequences
    order: np.ndarray  # positions of `tokens`, sorted by their next WINDOW tokens
    sequences: int
    calibration: np.ndarray | None = None  # [buckets, bins, depths] share right; None: uncalibrated
    # order's range of each first token (token - SEPARATOR): a lookup's first step, its widest, is a
    # read. Computed from tokens and order unless given (a file holds it).
    starts: np.ndarray | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.starts is None:
            first = self.tokens[self.order]
            values = np.arange(SEPARATOR, int(first.max(initial=SEPARATOR)) + 2)
            object.__setattr__(self, "starts", np.searchsorted(first, values))

    def __len__(self) -> int:
        return len(self.tokens) - self.sequences

    def _range(self, lo: int, hi: int, j: int, token: int) -> tuple[int, int]:
        """The sub-range of order[lo:hi] (positions that agree on tokens 0..j-1) whose token j is
        `token`; they are sorted by it."""
        t, o, n = self.tokens, self.order, len(self.tokens)
        if hi - lo <= 64:  # a short range: one gather and numpy's search beat Python's
            p = o[lo:hi].astype(np.int64) + j
            column = np.where(p < n, t[np.minimum(p, n - 1)], SEPARATOR - 1)
            return lo + int(np.searchsorted(column, token, "left")), lo + int(np.searchsorted(column, token, "right"))

        def at(m: int) -> int:
            p = int(o[m]) + j
            return int(t[p]) if p < n else SEPARATOR - 1  # past the end sorts first, as in build

        a, b = lo, hi
        while a < b:  # first with at() >= token
            m = (a + b) // 2
            if at(m) < token:
                a = m + 1
            else:
                b = m
        c, d = a, hi
        while c < d:  # first with at() > token
            m = (c + d) // 2
            if at(m) <= token:
                c = m + 1
            else:
                d = m
        return a, c

    def chain(self, history: list[int], depth: int) -> Chain:
        """The continuation of the longest suffix of `history` (WINDOW tokens at most, MIN_MATCH at
        least) the datastore holds: at each depth the token most of the agreeing occurrences have
        next, until they run out or reach a sequence's end."""
        lo, hi, match = 0, len(self.order), 0
        for j in range(min(WINDOW, len(history))):
            if j == 0:
                i = history[-1] - SEPARATOR
                a, b = (int(self.starts[i]), int(self.starts[i + 1])) if 0 <= i < len(self.starts) - 1 else (0, 0)
            else:
                a, b = self._range(lo, hi, j, history[-1 - j])
            if a == b:
                break
            lo, hi, match = a, b, j + 1
        if match < MIN_MATCH or depth < 1:
            return Chain(match, [], [])
        picks = np.unique(np.linspace(lo, hi - 1, num=min(hi - lo, MAX_OCCURRENCES)).round().astype(np.int64))
        # An occurrence at reversed position s continues (forward) at s - 1, s - 2, ...; the stream
        # begins (reversed) with a separator, so no chain reads before it.
        at = self.order[picks].astype(np.int64)[:, None] - 1 - np.arange(depth)[None, :]
        alive = self.tokens[np.maximum(at, 0)].tolist()
        tokens, agreement = [], []
        for d in range(depth):
            counts = Counter(row[d] for row in alive)
            token, count = min(counts.items(), key=lambda kv: (-kv[1], kv[0]))  # ties: the smaller token
            if token == SEPARATOR:
                break
            tokens.append(token)
            agreement.append(count / len(alive))
            alive = [row for row in alive if row[d] == token]
        return Chain(match, tokens, agreement)


    def scores(self, chain: Chain) -> list[float]:
        """Log-probability that `chain` is right through each depth, non-increasing: its calibration
        cell (match bucket, cumulative agreement, depth); uncalibrated, half its cumulative agreement."""
        out, best, agree = [], 0.0, 1.0
        for j, a in enumerate(chain.agreement):
            agree *= a
            p = 0.5 * agree if self.calibration is None else float(self.calibration[_cell(chain.match, agree, j)])
            best = min(best, math.log(max(p, 1e-9)))
            out.append(best)
        return out


def _cell(match: int, agree: float, depth: int) -> tuple[int, int, int]:
    """The calibration cell of a chain node: match bucket, cumulative agreement bin, depth (0-based)."""
    bucket = sum(match >= b for b in MATCH_BUCKETS) - 1
    return bucket, min(int(agree * AGREEMENT_BINS), AGREEMENT_BINS - 1), min(depth, DEPTHS - 1)


def build(sequences: list[list[int]]) -> Datastore:
    """The datastore of `sequences` (token ids), calibrated on one in CALIBRATION_EVERY of them held
    aside (none held aside from fewer than 2 x CALIBRATION_EVERY: uncalibrated)."""
    if len(sequences) < 2 * CALIBRATION_EVERY:
        return _index(sequences)
    held = [s for i, s in enumerate(sequences) if i % CALIBRATION_EVERY == 0][:CALIBRATION_SEQUENCES]
    store = _index([s for i, s in enumerate(sequences) if i % CALIBRATION_EVERY])
    return replace(store, calibration=_calibrate(store, held))


def _calibrate(store: Datastore, held: list[list[int]]) -> np.ndarray:
    """The share of `store`'s chains right through each depth, by match bucket and cumulative
    agreement, after positions of `held` (sequences it does not hold); a sparse cell leans to 0.1."""
    right = np.zeros((len(MATCH_BUCKETS), AGREEMENT_BINS, DEPTHS))
    total = np.zeros_like(right)
    for seq in held:
        for t in range(1, len(seq) - 1, CALIBRATION_STRIDE):
            chain = store.chain(seq[: t + 1], WINDOW)
            agree, ok = 1.0, True
            for j, (token, a) in enumerate(zip(chain.tokens, chain.agreement, strict=True)):
                if t + 1 + j >= len(seq):
                    break
                agree *= a
                ok = ok and token == seq[t + 1 + j]
                cell = _cell(chain.match, agree, j)
                right[cell] += ok
                total[cell] += 1
    return ((right + 0.1) / (total + 1)).astype(np.float32)


def _index(sequences: list[list[int]]) -> Datastore:
    """The datastore of `sequences` (token ids), each ending at a separator so no match or chain
    crosses into the next."""
    forward = []
    for seq in sequences:
        forward.extend(seq)
        forward.append(SEPARATOR)
    tokens = np.asarray(forward[::-1], dtype=np.int32)
    n = len(tokens)
    # Prefix doubling: rank by the first 1, 2, 4, ... WINDOW tokens. Rank 0 is "past the end".
    rank = tokens.astype(np.int64) - SEPARATOR + 1
    k = 1
    while k < WINDOW:
        after = np.zeros(n, dtype=np.int64)
        after[: max(n - k, 0)] = rank[k:]  # a stream shorter than k has nothing after any token
        _, rank = np.unique(rank * (n + 2) + after, return_inverse=True)
        rank = rank.astype(np.int64) + 1
        k *= 2
    order = np.argsort(rank, kind="stable").astype(np.int32 if n < 2**31 else np.int64)
    return Datastore(tokens, order, len(sequences))


def save(store: Datastore, path: Path, source: str) -> None:
    meta = {"sequences": store.sequences, "tokens": len(store), "window": WINDOW, "source": source}
    tmp = path.with_name(path.name + ".tmp.npz")
    arrays = {} if store.calibration is None else {"calibration": store.calibration}
    # np.savez stores its members uncompressed, which is what lets `load` map them.
    np.savez(tmp, tokens=store.tokens, order=store.order, starts=store.starts, meta=np.array(json.dumps(meta)),
             **arrays)
    tmp.replace(path)


def _mapped(path: Path) -> dict[str, np.ndarray]:
    """The arrays of an .npz, each stored member memory-mapped read-only (the data starts after the
    member's local zip header and its .npy header); compressed or object members are read."""
    out = {}
    with zipfile.ZipFile(path) as z, path.open("rb") as raw:
        for info in z.infolist():
            name = info.filename.removesuffix(".npy")
            with z.open(info) as f:
                version = np.lib.format.read_magic(f)
                read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                shape, fortran, dtype = read_header(f)
                header = f.tell()
            if info.compress_type != zipfile.ZIP_STORED or dtype.hasobject or not shape:
                with z.open(info) as f:
                    out[name] = np.lib.format.read_array(f)
                continue
            raw.seek(info.header_offset)
            fixed = raw.read(30)  # the local file header; its name and extra field lengths end it
            if len(fixed) != 30 or fixed[:4] != b"PK\x03\x04":
                raise ValueError(f"member {info.filename}: no local header at offset {info.header_offset}")
            name_len, extra_len = struct.unpack("<HH", fixed[26:30])
            offset = info.header_offset + 30 + name_len + extra_len + header
            mapped = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape, order="F" if fortran else "C")
            out[name] = np.asarray(mapped)  # a plain view of the mapping: memmap's own indexing is slower
    return out


def load(path: Path) -> Datastore:
    """A datastore file as `save` writes it, its arrays memory-mapped (_mapped); a file that is not
    one is one DatastoreError line."""
    try:
        z = _mapped(Path(path))
        tokens, order, meta = z["tokens"], z["order"], json.loads(str(z["meta"]))
        calibration, starts = z.get("calibration"), z.get("starts")
        if not isinstance(meta, dict):
            raise ValueError(f"meta is a {type(meta).__name__}, not an object")
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as e:
        raise DatastoreError(f"{path}: not a datastore ({e}); expected {FILE} as medusa-build --datastore writes it") from None
    if meta.get("window") != WINDOW or len(order) != len(tokens) or tokens.ndim != 1:
        raise DatastoreError(f"{path}: window {meta.get('window')}, {len(tokens)} tokens and {len(order)} order entries; "
                             f"expected window {WINDOW} and one order entry per token")
    shape = (len(MATCH_BUCKETS), AGREEMENT_BINS, DEPTHS)
    if calibration is not None and calibration.shape != shape:
        raise DatastoreError(f"{path}: calibration of shape {calibration.shape}; expected {shape}")
    if starts is not None and (starts.ndim != 1 or len(starts) < 2 or int(starts[-1]) > len(order)):
        raise DatastoreError(f"{path}: starts of shape {starts.shape}; expected one range start per first token, "
                             f"each at most {len(order)}")
    return Datastore(tokens, order, int(meta["sequences"]), calibration, starts)


SOURCE_EXPECTED = ("expected a directory of drafter corpus parts (*.npz.xz, medusa_trt/drafter_corpus.py) or a "
                   "text file (.jsonl objects with a 'text' field, or .txt lines): the base model's own outputs")


def read_source(path: Path, tokenizer_dir: Path, vocab_size: int) -> list[list[int]]:
    """The token sequences of a datastore source: a drafter corpus directory (its training-side
    continuations; held-out ones are never read) or a text file (data.read_samples), tokenized with
    `tokenizer_dir`'s tokenizer.json. Anything else, no text, or a token id outside the model's
    `vocab_size` (another model's corpus) is one MedusaTrtError line."""
    from medusa_trt import drafter_corpus
    from medusa_trt.data import DATA_SUFFIXES, DataError, read_samples

    path = Path(path)
    if path.is_dir():
        try:
            conts, parts = drafter_corpus.read([path], splits=("first", "later"))
        except drafter_corpus.CorpusError as e:
            raise DatastoreError(f"--datastore {e}") from None
        sequences, what = [c for c in conts.values() if c], f"its {len(parts)} parts"
    else:
        if not path.exists() or path.suffix not in DATA_SUFFIXES:
            why = "no such file or directory" if not path.exists() else f"suffix {path.suffix!r}"
            raise DatastoreError(f"--datastore {path}: {why}; {SOURCE_EXPECTED}")
        try:
            texts = read_samples(path, what="texts")
        except DataError as e:
            raise DatastoreError(f"--datastore {e}") from None
        vocab = Path(tokenizer_dir) / "tokenizer.json"
        try:
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(vocab))
        except Exception as e:  # tokenizers raises its own exception type for a missing or bad file
            raise DatastoreError(f"--datastore {path}: cannot read the tokenizer {vocab} ({e}); expected the "
                                 "checkpoint's tokenizer.json") from None
        sequences, what = [enc.ids for enc in tokenizer.encode_batch(texts, add_special_tokens=False)], "its texts"
    tokens = sum(len(s) for s in sequences)
    if tokens < MIN_MATCH + 1:
        raise DatastoreError(f"--datastore {path}: {tokens} tokens in {what}; expected at least {MIN_MATCH + 1} "
                             f"(a match of {MIN_MATCH} and a token after it); {SOURCE_EXPECTED}")
    check_vocab(max(max(s) for s in sequences if s), vocab_size, f"--datastore {path}")
    return sequences


def check_vocab(largest: int, vocab_size: int, where: str) -> None:
    """Token ids a datastore holds must be the model's: another model's corpus would draft ids the
    engine's embedding cannot look up."""
    if largest >= vocab_size:
        raise DatastoreError(f"{where}: token id {largest}; expected ids below the model's vocab_size {vocab_size} "
                             "(text of another model?)")
