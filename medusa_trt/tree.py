"""Medusa trees: parse and validate medusa_choices, and build the buffers every backend shares.

Semantics (docs/formats.md section 4): nodes sorted by (depth, path); slot 0 is the root (the
base model's own token) and sorted node j is slot j + 1.
"""

from __future__ import annotations

import ast
import functools
import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch

from medusa_trt.errors import MedusaTrtError

log = logging.getLogger(__name__)

DEFAULT_TREE = "mc_sim_7b_63"  # the tree used when none is given, and the tuner's point of comparison
# Tokens the runtime takes from each head's top-k (the FasterDecoding reference keeps 10): trees with
# ranks below it share one top-k, which the fused step graph bakes in (engine.json step_topk).
CANDIDATE_TOPK = 10
TREE_FILE_SUFFIXES = (".json", ".yaml", ".yml")
# Bounds checked before any parser runs (a 63-node tree is under 1 KB and 3 levels deep), so a tree
# file or request built to exhaust memory or the stack (a YAML alias bomb, JSON nested 50,000 deep)
# is refused in linear time.
MAX_TREE_TEXT = 256 * 1024
MAX_TREE_NESTING = 8
# TensorRT-LLM's C++ runtime packs each node's rank into 4 bits: ranks >= 16 collide or throw there.
TRTLLM_MAX_RANK = 15
# The largest tree (nodes, root excluded) an engine or checkpoint may be built for (max_draft_len): a
# step's mask is (N + 1)^2 per sequence, so a mistyped 10**12 would be an allocation of terabytes at
# the first decode. Medusa's published trees have 63 nodes, per-step trees here 4-40.
MAX_DRAFT_LEN = 1024
# A rank is an index into a head's top-k of a vocabulary of int32 token ids: one at or past 2**31
# fits no vocabulary (and past 2**63, no int64 array), whatever the engine.
MAX_RANK = 2**31


class TreeError(MedusaTrtError):
    """A medusa_choices input that cannot be used; the message names the input and the bad value."""


@functools.cache
def _presets() -> dict[str, list[list[int]]]:
    data = resources.files("medusa_trt").joinpath("presets/medusa_choices.json").read_text()
    return json.loads(data)["presets"]


def preset_names() -> list[str]:
    """The preset tree names --medusa-choices takes, sorted (listed in every command's --help)."""
    return sorted(_presets())


def __getattr__(name: str) -> Any:
    # PRESETS is loaded on first use so importing this module never touches package data.
    if name == "PRESETS":
        return _presets()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _short(obj: Any, limit: int = 60) -> str:
    text = repr(obj)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _as_path_list(obj: Any, where: str) -> list[list[Any]]:
    """Check the shape (a list of lists); values are checked by validate_and_expand."""
    if not isinstance(obj, (list, tuple)):
        raise TreeError(f"{where}: got {_short(obj)}; expected a list of paths such as [[0], [0, 1]]")
    for i, path in enumerate(obj):
        if not isinstance(path, (list, tuple)):
            raise TreeError(f"{where}: path #{i} is {_short(path)}; expected a list of ints such as [0, 1]")
    return [list(path) for path in obj]


def check_bounds(text: str, where: str, yaml_text: bool = False) -> None:
    if len(text) > MAX_TREE_TEXT:
        raise TreeError(f"{where}: {len(text)} characters; expected a tree of at most {MAX_TREE_TEXT}")
    depth = deepest = 0
    quote = None
    for ch in text:  # bracket nesting outside strings; linear, no recursion
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    if deepest > MAX_TREE_NESTING:
        raise TreeError(f"{where}: nested {deepest} levels deep; a tree is a list of paths (at most "
                        f"{MAX_TREE_NESTING} levels)")
    if yaml_text:
        import yaml

        opens = (yaml.BlockSequenceStartToken, yaml.BlockMappingStartToken, yaml.FlowSequenceStartToken,
                 yaml.FlowMappingStartToken)
        closes = (yaml.BlockEndToken, yaml.FlowSequenceEndToken, yaml.FlowMappingEndToken)
        depth = 0
        try:
            for token in yaml.scan(text):  # the scanner does not expand aliases or recurse
                if isinstance(token, (yaml.AliasToken, yaml.AnchorToken)):
                    raise TreeError(f"{where}: YAML anchors and aliases are not accepted in a tree file "
                                    "(write the paths out)")
                depth += isinstance(token, opens) - isinstance(token, closes)
                if depth > MAX_TREE_NESTING:
                    raise TreeError(f"{where}: nested more than {MAX_TREE_NESTING} levels deep; a tree is a list "
                                    "of paths")
        except yaml.YAMLError as err:
            raise TreeError(f"{where}: cannot parse it as YAML ({' '.join(str(err).split())})") from None


def _parse_brace(text: str, where: str) -> list[list[Any]]:
    # Triton's form "{0}, {0, 1}", optionally inside one more pair of braces: "{{0}, {0, 1}}".
    compact = re.sub(r"\s+", "", text)
    if not re.fullmatch(r"[{}0-9,+-]*", compact):
        raise TreeError(f"{where}: brace form may hold only braces, commas and integers")
    body = compact.replace("{", "[").replace("}", "]")
    if not compact.startswith("{{"):
        body = f"[{body}]"
    try:
        return _as_path_list(ast.literal_eval(body), where)
    except (ValueError, SyntaxError) as err:
        raise TreeError(f"{where}: malformed brace form ({err}); expected e.g. '{{0}}, {{0, 1}}'") from None


def _parse_file(path: Path) -> list[list[Any]]:
    where = f"tree file {str(path)!r}"
    suffix = path.suffix.lower()
    if suffix not in TREE_FILE_SUFFIXES:
        raise TreeError(f"{where}: unsupported suffix {suffix!r}; expected one of {TREE_FILE_SUFFIXES}")
    try:
        if path.stat().st_size > MAX_TREE_TEXT:
            raise TreeError(f"{where}: {path.stat().st_size} bytes; expected a tree file of at most {MAX_TREE_TEXT}")
        text = path.read_bytes().decode("utf-8")
    except OSError as err:
        raise TreeError(f"{where}: cannot read it ({err.strerror or err})") from None
    except UnicodeDecodeError as err:
        raise TreeError(f"{where}: not valid UTF-8 ({err.reason} at byte {err.start})") from None
    check_bounds(text, where, yaml_text=suffix != ".json")
    try:
        if suffix == ".json":
            data = json.loads(text)
        else:
            import yaml  # only needed for YAML trees

            data = yaml.safe_load(text)
    except Exception as err:  # json and yaml raise unrelated error types
        raise TreeError(f"{where}: cannot parse it as {suffix[1:].upper()} ({err})") from None
    if isinstance(data, dict):
        if "medusa_choices" not in data:
            raise TreeError(f"{where}: mapping has keys {sorted(data)}; expected a 'medusa_choices' key")
        data = data["medusa_choices"]
    return _as_path_list(data, where)


def tree_file(spec: object) -> Path | None:
    """The file a tree spec names: a path, or a string that is no preset, list or brace form and has a
    tree file's suffix or names an existing file. None for any other spec."""
    if isinstance(spec, os.PathLike):
        return Path(spec)
    if not isinstance(spec, str):
        return None
    text = spec.strip()
    if not text or text.startswith(("[", "{")) or text in _presets():
        return None
    path = Path(text)
    return path if path.suffix.lower() in TREE_FILE_SUFFIXES or path.exists() else None


def parse_medusa_choices(spec: str | os.PathLike | list | tuple) -> list[list[int]]:
    """Turn any accepted tree spelling into a list of paths (not yet validated or expanded).

    Accepts a preset name, a list of lists, a JSON or Python-literal string, a .json/.yaml/.yml file
    (a bare list or a mapping with 'medusa_choices'), or Triton's brace form "{0}, {0, 1}".
    """
    if isinstance(spec, np.ndarray):
        spec = spec.tolist()
    if isinstance(spec, (list, tuple)):
        return _as_path_list(spec, "medusa_choices")
    if (path := tree_file(spec)) is not None:
        return _parse_file(path)
    if not isinstance(spec, str):
        raise TreeError(f"medusa_choices: got {type(spec).__name__} {_short(spec)}; expected a preset "
                        "name, a list of paths, a string or a file path")
    text = spec.strip()
    where = f"medusa_choices {_short(spec)}"
    if not text:
        raise TreeError(f"{where}: empty; expected a preset name ({', '.join(sorted(_presets()))}), a list such "
                        "as '[[0], [0, 1]]', a brace form '{0}, {0, 1}' or a .json/.yaml file")
    if text.startswith(("[", "{")):
        check_bounds(text, where)
    if text in _presets():
        return [list(path) for path in _presets()[text]]
    if text.startswith("["):
        try:
            data = json.loads(text)
        except ValueError:
            try:
                data = ast.literal_eval(text)  # Python literals: tuples, trailing commas
            except (ValueError, SyntaxError) as err:
                raise TreeError(f"{where}: malformed list ({err.__class__.__name__}: {err}); "
                                "expected e.g. '[[0], [0, 1]]'") from None
        return _as_path_list(data, where)
    if text.startswith("{"):
        return _parse_brace(text, where)
    raise TreeError(f"{where}: unknown preset name; expected one of {sorted(_presets())}, "
                    "a list such as '[[0], [0, 1]]', a brace form '{0}, {0, 1}' or a .json/.yaml file")


def check_trtllm_ranks(nodes: list[list[int]], where: str = "medusa_choices") -> None:
    """Refuses a tree TensorRT-LLM cannot hold (see TRTLLM_MAX_RANK)."""
    bad = next((p for p in nodes if max(p) > TRTLLM_MAX_RANK), None)
    if bad is not None:
        raise TreeError(f"{where}: path {list(bad)} has rank {max(bad)}; TensorRT-LLM encodes tree ranks in 4 bits, "
                        f"expected ranks <= {TRTLLM_MAX_RANK}")


def validate_and_expand(choices: list, num_heads: int, max_draft_len: int | None = None,
                        vocab_size: int | None = None) -> list[list[int]]:
    """Check paths (ranks below `vocab_size` when given, and below MAX_RANK always), add missing
    prefixes, and return the nodes sorted by (depth, path)."""
    bound = min(vocab_size, MAX_RANK) if vocab_size is not None else MAX_RANK
    if not isinstance(choices, (list, tuple)) or not choices:
        raise TreeError(f"medusa_choices: got {_short(choices)}; expected a non-empty list of paths")
    given: set[tuple[int, ...]] = set()
    for i, path in enumerate(choices):
        where = f"medusa_choices[{i}] = {_short(path)}"
        if not isinstance(path, (list, tuple)) or not path:
            raise TreeError(f"{where}: expected a non-empty list of ranks such as [0, 1]")
        for r in path:
            # bool is a subclass of int, but True as a rank is almost surely a mistake.
            if isinstance(r, bool) or not isinstance(r, (int, np.integer)):
                raise TreeError(f"{where}: rank {r!r} ({type(r).__name__}) is not an integer")
            if r < 0:
                raise TreeError(f"{where}: rank {r} is negative; expected ranks >= 0")
            if r >= bound:
                vocab = f"the vocabulary ({vocab_size} tokens)" if bound == vocab_size else "any vocabulary"
                raise TreeError(f"{where}: rank {r} is beyond {vocab}; expected ranks < {bound}")
        if len(path) > num_heads:
            raise TreeError(f"{where}: depth {len(path)} exceeds num_heads={num_heads}; "
                            "expected depth <= number of Medusa heads")
        key = tuple(int(r) for r in path)
        if key in given:
            raise TreeError(f"{where}: duplicate path {list(key)}; expected each path once")
        given.add(key)
    nodes = {key[:d] for key in given for d in range(1, len(key) + 1)}
    if len(nodes) > len(given):
        _warn_prefixes(tuple(sorted(nodes - given)), len(given))
    if max_draft_len is not None and len(nodes) > max_draft_len:
        raise TreeError(f"medusa_choices: tree has {len(nodes)} nodes after adding prefixes; "
                        f"expected at most max_draft_len={max_draft_len}")
    return [list(p) for p in sorted(nodes, key=lambda p: (len(p), p))]


def read_tree(spec: Any, num_heads: int | None, max_draft_len: int | None = None,
              vocab_size: int | None = None) -> list[list[int]]:
    """parse_medusa_choices, then validate_and_expand: the nodes of any tree spelling. A value found
    bad in a tree file (a duplicate path, a rank, too many nodes) names the file first. `num_heads`
    None: no depth bound (no engine known yet)."""
    paths = parse_medusa_choices(spec)
    if num_heads is None:
        num_heads = max((len(p) for p in paths), default=1)
    try:
        return validate_and_expand(paths, num_heads, max_draft_len, vocab_size)
    except TreeError as e:
        if (path := tree_file(spec)) is not None:
            raise TreeError(f"tree file {str(path)!r}: {e}") from None
        raise


@dataclass(frozen=True, eq=False)  # eq=False: numpy fields make == ambiguous
class TreeBuffers:
    """Everything a backend needs about one tree. Arrays are read-only (they are shared via a cache)."""

    nodes: tuple[tuple[int, ...], ...]  # sorted paths; node j lives in slot j + 1
    num_slots: int  # T = nodes + root
    depth: np.ndarray  # [T] root 0
    parent: np.ndarray  # [T] slot of the parent; root -1
    head: np.ndarray  # [T] head whose top-k gives this slot's token (depth - 1); root -1
    rank: np.ndarray  # [T] last rank of the path; root 0
    position_offsets: np.ndarray  # [T] = depth
    topk_per_depth: np.ndarray  # [max_depth] 1 + max rank at each depth (TensorRT-LLM's top-k)
    attention_mask: np.ndarray  # [T, T] bool: root, ancestors and self
    packed_mask: np.ndarray  # [T, W] int32, bit j % 32 of word j // 32
    retrieve_indices: np.ndarray  # [num_leaves, max_depth + 1] root..leaf slots, -1 padded
    max_depth: int
    num_leaves: int


def pack_mask(mask: np.ndarray, num_words: int) -> np.ndarray:
    """Pack a [R, T] bool mask into [R, num_words] int32 words, little-endian bit order."""
    rows, cols = mask.shape
    if cols > 32 * num_words:
        raise TreeError(f"packed mask: {cols} columns do not fit in {num_words} 32-bit words")
    padded = np.zeros((rows, 32 * num_words), dtype=bool)
    padded[:, :cols] = mask
    # Bytes in little-endian bit order read as little-endian uint32 give bit j%32 of word j//32;
    # viewing as int32 keeps bit 31 as the sign bit, which is what TensorRT-LLM stores.
    return np.packbits(padded, axis=1, bitorder="little").view("<u4").view("<i4").astype(np.int32)


def unpack_mask(packed: np.ndarray, num_slots: int) -> np.ndarray:
    """Inverse of the packed mask: [..., W] int32 words -> [..., num_slots] bool."""
    words = np.ascontiguousarray(packed, dtype="<i4")
    bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")
    return bits[..., :num_slots].astype(bool)


@functools.lru_cache(maxsize=64)
def _build(nodes: tuple[tuple[int, ...], ...], max_draft_len: int | None) -> TreeBuffers:
    T = len(nodes) + 1
    slot_of = {path: j + 1 for j, path in enumerate(nodes)}
    depth = np.array([0] + [len(p) for p in nodes], dtype=np.int64)
    rank = np.array([0] + [p[-1] for p in nodes], dtype=np.int64)
    parent = np.array([-1] + [slot_of.get(p[:-1], 0) for p in nodes], dtype=np.int64)
    max_depth = int(depth.max())
    topk = np.zeros(max_depth, dtype=np.int64)
    np.maximum.at(topk, depth[1:] - 1, rank[1:] + 1)

    # Parents come before children in (depth, path) order, so one pass copies each parent's row.
    mask = np.zeros((T, T), dtype=bool)
    mask[0, 0] = True
    for s in range(1, T):
        mask[s] = mask[parent[s]]
        mask[s, s] = True
    num_words = math.ceil(((max_draft_len if max_draft_len is not None else T - 1) + 1) / 32)

    is_parent = np.zeros(T, dtype=bool)
    is_parent[parent[1:]] = True
    leaves = np.flatnonzero(~is_parent)
    retrieve = np.full((len(leaves), max_depth + 1), -1, dtype=np.int64)
    for row, leaf in enumerate(leaves):
        chain = [int(leaf)]
        while chain[-1] != 0:
            chain.append(int(parent[chain[-1]]))
        retrieve[row, : len(chain)] = chain[::-1]

    arrays = dict(depth=depth, parent=parent, head=np.where(depth > 0, depth - 1, -1), rank=rank,
                  position_offsets=depth.copy(), topk_per_depth=topk,
                  attention_mask=mask, packed_mask=pack_mask(mask, num_words), retrieve_indices=retrieve)
    for a in arrays.values():
        a.flags.writeable = False
    return TreeBuffers(nodes=nodes, num_slots=T, max_depth=max_depth, num_leaves=len(leaves), **arrays)


def main_chain(nodes: list[list[int]]) -> list[list[int]]:
    """A tree's main chain: from the root, the lowest-ranked child at each depth ([0], [0, 0], ...
    in the usual trees). What an engine exact for chains only verifies (engine.json
    onnx.chains_only); a chain is its own main chain."""
    have = sorted(tuple(p) for p in nodes)
    chain: list[list[int]] = []
    path: tuple[int, ...] = ()
    while child := next((p for p in have if len(p) == len(path) + 1 and p[: len(path)] == path), None):
        chain.append(list(child))
        path = child
    return chain


@functools.cache
def _warn_prefixes(added: tuple[tuple[int, ...], ...], given: int) -> None:
    """Once per tree and process: a node is verified only after its parent, so a path given without
    its prefixes (such as [[0, 0]]) runs with them added; said, not done silently."""
    log.warning("medusa_choices: %d of the paths' parents were not given and are added, %s (a node is verified "
                "only after its parent): the tree runs with %d nodes, not %d", len(added), [list(p) for p in added],
                given + len(added), given)


@functools.cache
def _warn_chain(nodes: int, chain: tuple[tuple[int, ...], ...]) -> None:
    """Once per tree and process: a server would otherwise log it for every request."""
    log.warning("medusa_choices: this engine verifies chain trees only (engine.json onnx.chains_only: its "
                "attention is exact for them alone); the %d-node tree runs as its main chain %s", nodes,
                [list(p) for p in chain])


def build_tree(spec: Any, num_heads: int, max_draft_len: int | None = None,
               chains_only: bool = False) -> TreeBuffers:
    """Parse, validate and expand a tree, then build (or fetch from cache) its buffers.
    `chains_only`: the tree's main chain, with a warning when that drops nodes."""
    nodes = read_tree(spec, num_heads, max_draft_len)
    if chains_only and len(chain := main_chain(nodes)) < len(nodes):
        _warn_chain(len(nodes), tuple(tuple(p) for p in chain))
        nodes = chain
    # num_heads only bounds the depth, which validation has checked; the buffers do not depend on it.
    return _build(tuple(tuple(p) for p in nodes), max_draft_len)


def tree_for_engine(num_heads: int, max_draft_len: int) -> TreeBuffers:
    """The default tree cut to what an engine supports: depth <= num_heads, nodes <= max_draft_len
    ((depth, path) order is prefix-closed, so a cut keeps every node's ancestors)."""
    shallow = [p for p in parse_medusa_choices(DEFAULT_TREE) if len(p) <= num_heads]
    return build_tree(validate_and_expand(shallow, num_heads)[:max_draft_len], num_heads, max_draft_len)


def candidate_topk(vocab_size: int, tree: TreeBuffers | None = None) -> int:
    """k of the top-k the runtime takes of every head's logits: CANDIDATE_TOPK (at most the
    vocabulary), or more when `tree` uses a rank at or above it. Without a tree: the k of every tree
    whose ranks are below CANDIDATE_TOPK, the one the fused step graph bakes in."""
    k = min(CANDIDATE_TOPK, vocab_size)
    if tree is None:
        return k
    need = int(tree.topk_per_depth.max())  # a rank r needs the top r + 1
    if need > vocab_size:
        raise TreeError(f"medusa_choices: rank {need - 1} is beyond the vocabulary ({vocab_size} tokens); "
                        f"expected ranks < {vocab_size}")
    return max(need, k)


def candidate_index(tree: TreeBuffers, k: int) -> np.ndarray:
    """[T - 1] where each non-root slot's token sits in the heads' top-k laid out flat, [H * k] per
    sequence: head * k + rank (acceptance.tree_candidates gathers the tokens with it)."""
    return tree.head[1:] * k + tree.rank[1:]


def tree_to_brace(choices: list) -> str:
    """Triton's brace spelling, e.g. "{0}, {0, 0}"; parse_medusa_choices reads it back."""
    return ", ".join("{" + ", ".join(str(int(r)) for r in path) + "}" for path in choices)


@dataclass(frozen=True)
class StepTree:
    """The tree buffers the decoding loop reads every step, as torch tensors (converted once per
    request; runtime/decoding.py)."""

    num_slots: int
    max_depth: int
    topk: int  # top-k taken of each head's logits (candidate_topk)
    candidate_index: torch.Tensor  # [T-1] each non-root slot's token in the heads' flat top-k (candidate_index)
    position_offsets: torch.Tensor  # [T]
    mask: torch.Tensor  # [T, T] bool
    retrieve: torch.Tensor  # [N, D+1] -1 padded
    # within_block's and within_room's cut trees by slot count, made once per request (at most one per size).
    _cuts: dict[int, StepTree] = field(default_factory=dict, init=False, compare=False, repr=False)

    @classmethod
    def of(cls, t: TreeBuffers, vocab_size: int) -> StepTree:
        k = candidate_topk(vocab_size, t)
        return cls(t.num_slots, t.max_depth, k, torch.tensor(candidate_index(t, k)), torch.tensor(t.position_offsets),
                   torch.tensor(t.attention_mask), torch.tensor(t.retrieve_indices))

    row_slots = None  # every row verifies the same tree (BatchTree.row_slots: rows of their own widths)

    @functools.cached_property
    def paths(self) -> list[list[int]]:
        """retrieve's rows as lists, -1 padding as slot 0 (commit reads only the accepted part)."""
        return [[max(i, 0) for i in row] for row in self.retrieve.tolist()]

    @functools.cached_property
    def is_chain(self) -> bool:
        """Every slot at the offset of its depth: its ancestors are the slots before it. Computed
        once: within_block asks every step."""
        return bool((self.position_offsets == torch.arange(self.num_slots)).all())

    def cut(self, slots: int) -> StepTree:
        """The tree of the first `slots` slots (parents come before children, so it is a tree). The
        paths keep the full depth (-1 padded): the fused step drafts the next full tree with as many
        heads as retrieve is deep, from the full candidate_index."""
        paths = [tuple(i for i in row if 0 <= i < slots) for row in self.retrieve.tolist()]
        leaves = [p for p in dict.fromkeys(paths) if not any(q != p and q[: len(p)] == p for q in paths)]
        retrieve = torch.full((len(leaves), self.retrieve.shape[1]), -1, dtype=self.retrieve.dtype)
        for row, path in zip(retrieve, leaves, strict=True):
            row[: len(path)] = torch.tensor(path)
        return StepTree(slots, int(self.position_offsets[:slots].max()), self.topk, self.candidate_index,
                        self.position_offsets[:slots], self.mask[:slots, :slots], retrieve)

    def within_block(self, lengths: torch.Tensor, block: int | None) -> StepTree:
        """This step's tree on an engine whose attention is exact only while a tree's slots share
        one `block`-aligned block of the cache with the committed prefix (row_exact_f32,
        engines/onnx/attention.py): a branching tree that would cross a block edge after any
        sequence's prefix is cut to the slots before it (the root at least). Chains never need a
        cut: each slot sits at its own position, as in plain decoding. About one step in
        `block / tree width` is cut per sequence."""
        if block is None or self.num_slots == 1 or self.is_chain:
            return self
        room = min(block - n % block for n in lengths.tolist())
        return self if room >= self.num_slots else self._cut_once(room)

    def within_room(self, lengths: torch.Tensor, max_seq_len: int) -> StepTree:
        """This step's tree near the engine's last position: the slots at positions below
        `max_seq_len` after every sequence's committed `lengths` (its root at least, which the loop
        guarantees: a sequence stops at max_new_tokens, and prompt + max_new_tokens fit). So a
        decode that plain decoding fits runs with Medusa too, its last steps on shallower trees."""
        room = max_seq_len - int(lengths.max())  # positions left, the root's included
        if room > self.max_depth:
            return self
        return self._cut_once(int((self.position_offsets < room).sum()))

    def _cut_once(self, slots: int) -> StepTree:
        if slots not in self._cuts:
            self._cuts[slots] = self.cut(slots)
        return self._cuts[slots]
