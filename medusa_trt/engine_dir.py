"""The engine directory contract: what medusa-build writes and every reader reads.

One place for the engine.json schema (format version, sections, limits), its validation, the graph
input/output names the runtime binds, and the artifact digests. Writers: engines/build.py (and
its backends); readers: the runtime backends, runtime/loading.py, medusa-check, medusa-triton,
medusa-bench. Every field read is validated here, with a message naming engine.json, the key, the
value and what was expected, so a hand-edited or truncated engine.json is an EngineError, never a
KeyError or a run with a wrong size.

Digests: engine.json records sha256 and size of every artifact. Hashing costs about as much as
loading (docs/benchmarks/gpu-h100.md, "Integrity checks"), so
at load every size is checked and files up to LOAD_DIGEST_BYTES are hashed; medusa-check hashes
everything and refuses a mismatch.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path, PurePosixPath
from typing import Any

from medusa_trt.dynamic_spec import dynamic_from_text
from medusa_trt.errors import MedusaTrtError, read_json_object, require, require_section
from medusa_trt.tree import MAX_DRAFT_LEN, TreeError, candidate_topk, validate_and_expand

# The format's history, and what each optional feature means: docs/formats.md, section 3.
ENGINE_FORMAT_VERSION = 8
# The optional features a reader of this version knows (engine.json "requires"). An engine lists
# those it uses, and a reader refuses one that requires a feature it does not know, rather than
# ignoring its keys and running it wrong. A new optional feature is a new name here, not a new
# ENGINE_FORMAT_VERSION.
KNOWN_FEATURES = ("key_block", "cache_in_place", "chains_only", "int4_offsets", "lm_head_bits", "drafter_graph",
                  "step_dynamic", "hidden_all_rows", "int8_float_channels")
ENGINE_JSON = "engine.json"
# The largest max_batch_size an engine may be built for: well past any one engine's batch, and inside
# the int32 that Triton's config.pbtxt max_batch_size and TensorRT's dimensions hold.
MAX_BATCH_SIZE = 65536
BACKENDS = ("onnxruntime", "tensorrt", "tensorrt-llm")
SECTIONS = {"onnxruntime": "onnx", "tensorrt": "tensorrt", "tensorrt-llm": "tensorrt_llm"}
DTYPES = ("float32", "float16", "bfloat16")
DEVICES = ("cpu", "cuda")
# onnxruntime engines: int4 = MatMulNBits decoder linears and lm_head; int8 = MatMulIntegerToFloat over int8 rows
WEIGHT_FORMATS = ("float", "int4", "int8")
LOAD_DIGEST_BYTES = 64 << 20  # files up to this size are hashed at every load (see module docstring)


# Graph interface (engines/onnx/export.py writes it; the runtime backends bind it).
INPUT_NAMES = ("input_ids", "position_ids", "past_lengths", "new_mask", "logit_positions")
OUTPUT_NAMES = ("logits", "hidden", "present_keys", "present_values")
HEADS_INPUT, HEADS_OUTPUT = "hidden", "medusa_logits"
STEP_INPUT_NAMES = ("input_ids", "position_ids", "past_lengths", "new_mask", "retrieve", "candidate_index")
STEP_OUTPUT_NAMES = ("best_path", "accepted", "next_tokens", "next_topk", "next_logp", "present_keys", "present_values")
# A step graph built before trees chosen per step (engine.json without onnx.step_dynamic): retrieve
# [paths, depth + 1] for the whole batch, and no top-k outputs.
STATIC_STEP_OUTPUT_NAMES = ("best_path", "accepted", "next_tokens", "present_keys", "present_values")
# A drafter with a cache of its own (Amphista): its graph appends committed rows and drafts at the
# last (engines/onnx/export.py, drafter graph); its past inputs are past_names(2) (two layers).
DRAFTER_INPUT_NAMES = ("hidden", "next_tokens", "position_ids", "past_lengths", "new_mask", "last")
DRAFTER_OUTPUT_NAMES = ("medusa_logits", "present_keys", "present_values")
# The fused step of such an engine also takes the drafter's cache, and returns the accepted path's
# drafter K/V (before the base's: the cache modes read the base's K/V last).
DRAFTER_STEP_INPUTS = ("drafter_past_lengths", *(f"drafter_{n}" for n in ("past_key_0", "past_value_0",
                                                                             "past_key_1", "past_value_1")))
DRAFTER_STEP_OUTPUTS = ("drafter_present_keys", "drafter_present_values")


def step_outputs(cached_drafter: bool, dynamic: bool = True) -> tuple[str, ...]:
    """The fused step graph's outputs (STEP_OUTPUT_NAMES, or STATIC_STEP_OUTPUT_NAMES of an engine
    without onnx.step_dynamic; with the drafter's K/V for a drafter with its own cache)."""
    names = STEP_OUTPUT_NAMES if dynamic else STATIC_STEP_OUTPUT_NAMES
    if not cached_drafter:
        return names
    return (*names[:-2], *DRAFTER_STEP_OUTPUTS, *names[-2:])
_SHA256 = re.compile(r"[0-9a-f]{64}")


class EngineError(MedusaTrtError):
    """An engine directory that cannot be run here; the message names the file and the problem."""


def past_names(num_layers: int) -> list[str]:
    """Per-layer cache inputs in graph order: past_key_0, past_value_0, past_key_1, ..."""
    return [f"past_{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]


def present_names(num_layers: int) -> list[str]:
    """An in-place engine's per-layer cache outputs (engine.json onnx.cache_in_place), in past_names'
    order: each is its past input's buffer with the new tokens' K/V written in."""
    return [f"present_{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]


def graph_outputs(names: tuple[str, ...], num_layers: int, in_place: bool) -> list[str]:
    """A decoder or step graph's outputs: `names` (OUTPUT_NAMES, STEP_OUTPUT_NAMES: the stacked new
    K/V last), or in an in-place engine the per-layer caches in place of the stacked K/V."""
    return [*names[:-2], *present_names(num_layers)] if in_place else list(names)


def required_features(engine: dict) -> list[str]:
    """The KNOWN_FEATURES an engine.json (or a builder's part of it) uses, for its "requires" list."""
    onnx, weights, trt = engine.get("onnx") or {}, engine.get("weights") or {}, engine.get("tensorrt") or {}
    used = {
        "key_block": onnx.get("key_block") is not None,  # tree steps kept inside one key block
        "cache_in_place": bool(onnx.get("cache_in_place")),  # graphs that write the cache they are bound to
        "chains_only": bool(onnx.get("chains_only")),  # only a tree's main chain is verified
        "int4_offsets": bool(weights.get("offsets")),  # int4 blocks with float offsets, no zero points
        "lm_head_bits": weights.get("lm_head_bits", 4) != 4,  # an lm_head of other than 4 bits
        # a drafter with its own cache and graph (Amphista), on ONNX Runtime or TensorRT
        "drafter_graph": bool(onnx.get("drafter_file") or trt.get("drafter_engine")),
        "step_dynamic": bool(onnx.get("step_dynamic")),  # a step graph with a tree per sequence and top-k outputs
        "hidden_all_rows": bool(onnx.get("hidden_all_rows") or trt.get("hidden_all_rows")),  # hidden at every new row
        "int8_float_channels": bool(weights.get("float_channels")),  # int8 Linears with float input channels
    }
    return [name for name in KNOWN_FEATURES if used[name]]


def _relative_file(section: dict, key: str, path: Path, prefix: str, optional: bool = False) -> str | None:
    name = require(section, key, str, file=path, prefix=prefix, error=EngineError,
                   **({"default": None} if optional else {}))
    if name is not None and (PurePosixPath(name).is_absolute() or ".." in PurePosixPath(name).parts or not name):
        raise EngineError(f"{path}: {prefix}{key}: {name!r}; expected a file name inside the engine directory")
    return name


def validate_engine(engine: Any, path: Path, backend: str | None = None) -> dict:
    """Checks every field the readers use; returns `engine` (a dict) unchanged."""
    def req(obj, key, kind, prefix="", **kw):
        return require(obj, key, kind, file=path, prefix=prefix, error=EngineError, **kw)

    if not isinstance(engine, dict):
        raise EngineError(f"{path}: expected a JSON object, got a {type(engine).__name__}")
    if backend is not None and engine.get("backend") != backend:
        raise EngineError(f"{path}: backend {engine.get('backend')!r}, expected {backend!r}")
    kind = req(engine, "backend", str, choices=BACKENDS)
    version = engine.get("format_version")
    if version != ENGINE_FORMAT_VERSION:
        raise EngineError(f"{path}: engine format {version!r}, this runtime reads format {ENGINE_FORMAT_VERSION}; "
                          "rebuild it with medusa-build")
    requires = req(engine, "requires", list, default=[])
    for feature in requires:
        if feature not in KNOWN_FEATURES:
            raise EngineError(f"{path}: requires {feature!r}, a feature this medusa-trt does not know (it knows "
                              f"{', '.join(KNOWN_FEATURES)}); upgrade medusa-trt or rebuild the engine with this one")
    req(engine, "device", str, choices=DEVICES)
    req(engine, "dtype", str, choices=DTYPES)
    model = require_section(engine, "model", file=path, error=EngineError)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "max_position_embeddings"):
        req(model, key, int, "model.", positive=True)
    req(model, "model_type", str, "model.", default=None)
    req(model, "sliding_window", int, "model.", positive=True, default=None)
    medusa = require_section(engine, "medusa", file=path, error=EngineError)
    req(medusa, "num_heads", int, "medusa.", nonnegative=True)
    req(medusa, "num_layers", int, "medusa.", nonnegative=True)
    # medusa-build --tree: the default tree, or "dynamic:N[,cost=C]" (trees chosen per step, with the slot
    # cost medusa-tune-tree measured on the engine), read by the runtime's own grammar (tree.py)
    tree, spec = medusa.get("tree"), None
    if isinstance(tree, str):
        try:
            spec = dynamic_from_text(tree)
        except TreeError:
            spec = None
        if spec is None:
            raise EngineError(f"{path}: medusa.tree {tree[:60]!r}; expected a list of paths or 'dynamic:N' (N >= 1) "
                              "or 'dynamic:N,cost=C' (C >= 0)")
    elif tree is not None and not (isinstance(tree, list) and tree and all(
            isinstance(p, list) and p and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in p)
            for p in tree)):
        raise EngineError(f"{path}: medusa.tree {str(tree)[:60]}; expected a non-empty list of paths such as [[0], [0, 0]]")
    req(medusa, "tree_source", str, "medusa.", default=None)
    limits = require_section(engine, "limits", file=path, error=EngineError)
    for key, most in (("max_batch_size", MAX_BATCH_SIZE), ("max_seq_len", None), ("max_draft_len", MAX_DRAFT_LEN)):
        req(limits, key, int, "limits.", positive=True, maximum=most)
    try:  # the recorded tree runs on this engine and drafter, for every reader (medusa-check too)
        heads, vocab = medusa["num_heads"], model["vocab_size"]
        if spec is not None:
            spec.check_fits(heads, candidate_topk(vocab), limits["max_draft_len"])
        elif tree is not None:
            validate_and_expand(tree, heads, limits["max_draft_len"], vocab)
    except TreeError as e:
        raise EngineError(f"{path}: medusa.tree: {e}; rebuild the engine with a --tree that fits it") from None
    eos = engine.get("eos_token_id")
    if eos is not None and not (isinstance(eos, int) and not isinstance(eos, bool) and eos >= 0) and not (
            isinstance(eos, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in eos)):
        raise EngineError(f"{path}: eos_token_id {eos!r}; expected a token id, a list of token ids or null")
    tokenizer = require_section(engine, "tokenizer", file=path, optional=True, error=EngineError)
    req(tokenizer, "model_type", str, "tokenizer.", default=None)  # the HF config class it tokenizes with
    checkpoint = require_section(engine, "checkpoint", file=path, optional=True, error=EngineError)
    req(checkpoint, "path", str, "checkpoint.", default=None)
    req(checkpoint, "config_sha256", str, "checkpoint.", default=None)
    artifacts = require_section(engine, "artifacts", file=path, error=EngineError)
    for name, info in artifacts.items():
        _relative_file({name: name}, name, path, "artifacts.")
        digest = req(info, "sha256", str, f"artifacts.{name}.")
        if not _SHA256.fullmatch(digest):
            raise EngineError(f"{path}: artifacts.{name}.sha256 {digest!r}; expected 64 lowercase hex digits")
        req(info, "bytes", int, f"artifacts.{name}.", nonnegative=True)
    section = require_section(engine, SECTIONS[kind], file=path, error=EngineError)
    p = SECTIONS[kind] + "."

    def read_file_key(section: dict, key: str, prefix: str, optional: bool = False) -> None:
        """A file the backend reads: a name inside the directory, and listed in artifacts (so its size
        and digest are checked at load; an unlisted one would load unchecked)."""
        name = _relative_file(section, key, path, prefix, optional)
        if name is not None and name not in artifacts:
            raise EngineError(f"{path}: {prefix}{key} {name!r} is not in artifacts; expected every file the engine "
                              "reads listed with its sha256 (engine.json was edited: rebuild the engine)")

    if kind == "onnxruntime":
        read_file_key(section, "file", p)
        read_file_key(section, "heads_file", p, optional=True)
        read_file_key(section, "step_file", p, optional=True)
        read_file_key(section, "drafter_file", p, optional=True)  # a drafter with its own cache
        read_file_key(section, "weights_file", p, optional=True)  # shared by the graphs (absent: inline)
        req(section, "prepack_weights", bool, p, default=True)
        req(section, "key_block", int, p, positive=True, default=None)
        req(section, "cache_in_place", bool, p, default=False)
        req(section, "chains_only", bool, p, default=False)
        req(section, "step_dynamic", bool, p, default=False)
        req(section, "hidden_all_rows", bool, p, default=False)
        if section.get("step_file"):
            req(section, "step_topk", int, p, positive=True)
        weights = require_section(engine, "weights", file=path, error=EngineError)
        req(weights, "format", str, "weights.", choices=WEIGHT_FORMATS)
        if weights["format"] == "int4":
            req(weights, "block_size", int, "weights.", positive=True)
            req(weights, "accuracy_level", int, "weights.", nonnegative=True)
            req(weights, "offsets", bool, "weights.", default=False)
            req(weights, "lm_head_bits", int, "weights.", choices=(4, 8), default=4)
    elif kind == "tensorrt":
        read_file_key(section, "engine", p)
        read_file_key(section, "heads_engine", p, optional=True)
        read_file_key(section, "drafter_engine", p, optional=True)  # a drafter with its own cache
        req(section, "hidden_all_rows", bool, p, default=False)
        req(section, "attention", str, p, choices=("plugin", "native"))
    else:
        engines = req(section, "engines", list, p)
        for i, _ in enumerate(engines):
            read_file_key({str(i): engines[i]}, str(i), f"{p}engines.")
    return engine


def read_engine(engine_dir: str | Path, backend: str | None = None) -> dict:
    """engine.json of an engine dir written by medusa-build, validated (for `backend` if given)."""
    path = Path(engine_dir) / ENGINE_JSON
    if not path.exists():
        raise EngineError(f"{path}: not found; expected an engine directory written by medusa-build")
    return validate_engine(read_json_object(path, EngineError, "medusa-build engine.json"), path, backend)


def read_engine_json(engine_dir: str | Path, backend: str = "onnxruntime", section: str | None = None) -> dict:
    """read_engine for one backend (the signature the runtime backends use)."""
    return read_engine(engine_dir, backend)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def artifact_checksums(directory: Path) -> dict[str, dict]:
    """sha256 and size of every file in the engine dir except engine.json (which holds them)."""
    out = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != ENGINE_JSON):
        out[path.relative_to(directory).as_posix()] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    return out


def verify_artifacts(engine_dir: str | Path, engine: dict, max_bytes: int | None = None) -> list[str]:
    """Artifacts that are missing, whose size differs, or (for files up to max_bytes; None: all) whose
    sha256 differs from engine.json."""
    engine_dir = Path(engine_dir)
    problems = []
    for name, info in (engine.get("artifacts") or {}).items():
        path = engine_dir / name
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.stat().st_size != info.get("bytes"):
            problems.append(f"{path}: {path.stat().st_size} bytes, engine.json records {info.get('bytes')} "
                            "(modified after the build)")
        elif (max_bytes is None or info["bytes"] <= max_bytes) and sha256_file(path) != info.get("sha256"):
            problems.append(f"{path}: sha256 differs from engine.json (modified after the build)")
    return problems


def check_artifacts(engine_dir: str | Path, engine: dict, max_bytes: int | None = LOAD_DIGEST_BYTES) -> None:
    """verify_artifacts as an EngineError: a modified engine never loads silently."""
    problems = verify_artifacts(engine_dir, engine, max_bytes)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise EngineError(f"{problems[0]}{more}; rebuild the engine with medusa-build")


def check_graph(engine: dict, graph: str | Path, inputs: dict[str, list], outputs: dict[str, list],
                expect_inputs: list[str], expect_outputs: list[str], vocab_outputs: tuple[str, ...] = ()) -> None:
    """A loaded graph's inputs/outputs (name -> shape, dims int or symbolic) against engine.json: the
    names the runtime binds (which carry the layer count) and the vocabulary dim of `vocab_outputs`."""
    missing = [n for n in expect_inputs if n not in inputs] + [n for n in expect_outputs if n not in outputs]
    extra = [n for n in inputs if n not in expect_inputs]
    if missing or extra:
        what = ", ".join([f"lacks {missing[:4]}"] * bool(missing) + [f"has unexpected inputs {extra[:4]}"] * bool(extra))
        raise EngineError(f"{graph}: {what}; engine.json records {engine['model']['num_layers']} layers "
                          "(engine.json and the graph disagree: rebuild the engine)")
    past = inputs.get("past_key_0") or []
    for axis, key in ((1, "num_kv_heads"), (3, "head_dim")):  # the cache is [batch, kv heads, positions, head dim]
        if len(past) == 4 and isinstance(past[axis], int) and past[axis] != engine["model"][key]:
            raise EngineError(f"{graph}: input 'past_key_0' has {key} {past[axis]}, engine.json records model.{key} "
                              f"{engine['model'][key]} (engine.json and the graph disagree: rebuild the engine)")
    heads = engine["medusa"]["num_heads"]
    first = (outputs.get(HEADS_OUTPUT) or [None])[0]
    if isinstance(first, int) and first != heads:
        raise EngineError(f"{graph}: output {HEADS_OUTPUT!r} has {first} heads, engine.json records "
                          f"medusa.num_heads {heads} (engine.json and the graph disagree: rebuild the engine)")
    # The runtime sizes its output buffers and the drafter's inputs from these keys: a graph of another
    # size would fail inside ONNX Runtime mid-decode rather than at load.
    sized = (("hidden", "model.hidden_size", engine["model"]["hidden_size"]),
             ("next_topk", "onnx.step_topk", (engine.get("onnx") or {}).get("step_topk")))
    for name, key, want in sized:
        for kind, values in (("input", inputs), ("output", outputs)):
            last = (values.get(name) or [None])[-1]
            if want is not None and isinstance(last, int) and last != want:
                raise EngineError(f"{graph}: {kind} {name!r} has last dim {last}, engine.json records {key} {want} "
                                  "(engine.json and the graph disagree: rebuild the engine)")
    vocab = engine["model"]["vocab_size"]
    for name in vocab_outputs:
        last = (outputs.get(name) or [None])[-1]
        if isinstance(last, int) and last != vocab:
            raise EngineError(f"{graph}: output {name!r} has vocabulary dim {last}, engine.json records "
                              f"model.vocab_size {vocab} (engine.json and the graph disagree: rebuild the engine)")


def check_positions(engine: dict, graph: str | Path, proto_graph) -> None:
    """engine.json's limits.max_seq_len against the rotary tables the graph holds (`proto_graph`, an
    onnx GraphProto): a position past a table's end fails inside ONNX Runtime mid-decode."""
    limit = engine["limits"]["max_seq_len"]
    tables = {t.name: t.dims[0] for t in proto_graph.initializer if len(t.dims) == 2}
    for node in proto_graph.node:
        if node.op_type == "RotaryEmbedding" and len(node.input) > 2 and tables.get(node.input[2], limit) < limit:
            raise EngineError(f"{graph}: its rotary tables hold {tables[node.input[2]]} positions, engine.json records "
                              f"limits.max_seq_len {limit} (engine.json and the graph disagree: rebuild the engine)")


def check_weight_format(engine: dict, graph: str | Path, ops: set[str]) -> None:
    """engine.json's weights.format against the decoder graph's op types `ops`: an int4 graph has
    MatMulNBits nodes, an int8 one MatMulIntegerToFloat nodes (MatMulInteger in engines built before
    2026-11-28), a float one neither (a mislabelled engine would be verified against the wrong
    reference)."""
    fmt = (engine.get("weights") or {}).get("format", "float")
    old_int8 = "MatMulInteger" in ops and "MatMulIntegerToFloat" not in ops  # named as the graph has it
    for op, want in (("MatMulNBits", "int4"), ("MatMulInteger" if old_int8 else "MatMulIntegerToFloat", "int8")):
        if (fmt == want) != (op in ops):
            has = "has" if op in ops else "has no"
            raise EngineError(f"{graph}: the graph {has} {op} nodes, engine.json records weights.format "
                              f"{fmt!r} (engine.json and the graph disagree: rebuild the engine)")
