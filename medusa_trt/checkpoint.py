"""The merged checkpoint: TensorRT-LLM tensor names, expected tensors, tensor-parallel split rules.

This module is the format contract shared by the converter, the engines and the runtime, so it
imports nothing from them. A merged checkpoint is a directory with `config.json` and
`rank{N}.safetensors` for N in 0..tp_size-1, laid out the way TensorRT-LLM's `MedusaForCausalLM`
expects (see docs/formats.md section 2). The rank files are read and written, one tensor at a time,
by medusa_trt.safetensors_io.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from medusa_trt.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig  # noqa: F401 - re-exported
from medusa_trt.drafters import drafter_tensors
from medusa_trt.errors import CheckpointError, read_json_object, require
from medusa_trt.safetensors_io import SafetensorsFile, SafetensorsWriter, check_finite
from medusa_trt.tree import MAX_DRAFT_LEN

# ----------------------------------------------------------------------------------------------
# TensorRT-LLM names and the expected tensors of a config
# ----------------------------------------------------------------------------------------------

VOCAB_EMBEDDING = "transformer.vocab_embedding.weight"
LN_F = "transformer.ln_f.weight"
LM_HEAD = "lm_head.weight"

# The model dtypes by name: a checkpoint's config dtype, and what every other dtype name in the
# package (engine dtypes, medusa-convert/-build --dtype) maps to torch with.
CONFIG_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
}

# config.json `max_draft_len` (the largest Medusa tree an engine verifies) when nobody chose one.
DEFAULT_MAX_DRAFT_LEN = 63

REQUIRED_CONFIG_KEYS = (
    "architecture", "dtype", "logits_dtype", "model_type", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "hidden_size", "head_size", "intermediate_size", "vocab_size",
    "position_embedding_type", "max_position_embeddings", "hidden_act", "rotary_base",
    "rotary_scaling", "norm_epsilon", "attn_bias", "mlp_bias", "quantization", "mapping",
    "use_parallel_embedding", "embedding_sharding_dim", "max_draft_len", "num_medusa_heads",
    "num_medusa_layers",
)


def layer_prefix(i: int) -> str:
    return f"transformer.layers.{i}"


def medusa_linear_prefix(head: int, layer: int) -> str:
    return f"medusa_heads.{head}.medusa_layers.{layer}.linear"


def medusa_lm_head(head: int) -> str:
    return f"medusa_heads.{head}.lm_head.weight"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # unsharded; vocab rows padded to a multiple of tp_size
    dtype: torch.dtype


def tp_size_of(config: dict) -> int:
    return int(config.get("mapping", {}).get("tp_size", 1))


def padded_vocab(config: dict) -> int:
    tp = tp_size_of(config)
    return -(-int(config["vocab_size"]) // tp) * tp


def _is_quantized(module: str, config: dict) -> bool:
    quant = config.get("quantization") or {}
    excluded = quant.get("exclude_modules") or []
    return quant.get("quant_algo") == "FP8" and not any(fnmatch.fnmatchcase(module, p) for p in excluded)


def is_fp8_module(module: str, config: dict) -> bool:
    """Whether the Linear `module` (a TensorRT-LLM name such as `transformer.layers.0.mlp.fc`) holds
    FP8 weights and scales under this config: quant_algo FP8 and no exclude_modules pattern matches."""
    return _is_quantized(module, config)


def expected_tensors(config: dict) -> list[TensorSpec]:
    """Every tensor a checkpoint with this config holds, in the order the converter writes them.

    With `quantization.quant_algo == "FP8"` the decoder linears (and the Medusa linears unless
    `exclude_modules` matches them) hold float8_e4m3fn weights plus float32 (1,) scales.
    """
    d = int(config["hidden_size"])
    nq, nkv = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    hs = int(config.get("head_size") or d // nq)
    inter = int(config["intermediate_size"])
    dtype = CONFIG_DTYPES.get(config["dtype"])
    if dtype is None:
        raise CheckpointError(f"config dtype {config['dtype']!r} is not one of {', '.join(CONFIG_DTYPES)}")
    if config.get("mlp_bias"):
        raise CheckpointError("config mlp_bias true is not supported (no Llama-family base we read has it)")
    fp8_kv = (config.get("quantization") or {}).get("kv_cache_quant_algo") == "FP8"
    specs: list[TensorSpec] = []

    def linear(prefix: str, shape: tuple[int, int], bias: bool) -> None:
        quantized = _is_quantized(prefix, config)
        specs.append(TensorSpec(f"{prefix}.weight", shape, torch.float8_e4m3fn if quantized else dtype))
        if bias:
            specs.append(TensorSpec(f"{prefix}.bias", shape[:1], dtype))
        if quantized:
            specs.append(TensorSpec(f"{prefix}.weights_scaling_factor", (1,), torch.float32))
            specs.append(TensorSpec(f"{prefix}.activation_scaling_factor", (1,), torch.float32))

    specs.append(TensorSpec(VOCAB_EMBEDDING, (int(config["vocab_size"]), d), dtype))
    for i in range(int(config["num_hidden_layers"])):
        p = layer_prefix(i)
        specs.append(TensorSpec(f"{p}.input_layernorm.weight", (d,), dtype))
        linear(f"{p}.attention.qkv", ((nq + 2 * nkv) * hs, d), bool(config.get("attn_bias")))
        if fp8_kv:
            specs.append(TensorSpec(f"{p}.attention.kv_cache_scaling_factor", (1,), torch.float32))
        linear(f"{p}.attention.dense", (d, nq * hs), False)
        specs.append(TensorSpec(f"{p}.post_layernorm.weight", (d,), dtype))
        linear(f"{p}.mlp.fc", (inter, d), False)
        linear(f"{p}.mlp.gate", (inter, d), False)
        linear(f"{p}.mlp.proj", (d, inter), False)
    specs.append(TensorSpec(LN_F, (d,), dtype))
    specs.append(TensorSpec(LM_HEAD, (padded_vocab(config), d), dtype))
    if (config.get("medusa_trt") or {}).get("drafter", "medusa") != "medusa":
        # Another drafter's tensors are its module's own parameters, named in docs/formats.md; they
        # stay in the model dtype in an FP8 checkpoint and are replicated on every TP rank.
        return specs + [TensorSpec(name, shape, dtype) for name, shape in drafter_tensors(config)]
    for h in range(int(config.get("num_medusa_heads", 0))):
        for layer in range(int(config.get("num_medusa_layers", 0))):
            linear(medusa_linear_prefix(h, layer), (d, d), True)
        specs.append(TensorSpec(medusa_lm_head(h), (padded_vocab(config), d), dtype))
    return specs


# ----------------------------------------------------------------------------------------------
# Tensor parallelism: one rule per name, used to split (converter) and to merge (loaders)
# ----------------------------------------------------------------------------------------------

_QKV = re.compile(r"^transformer\.layers\.\d+\.attention\.qkv\.(weight|bias)$")
_ROW = re.compile(r"^transformer\.layers\.\d+\.(attention\.dense|mlp\.proj)\.weight$")
_COL = re.compile(r"^(transformer\.layers\.\d+\.mlp\.(fc|gate)"
                  r"|medusa_heads\.\d+\.medusa_layers\.\d+\.linear)\.(weight|bias)$")
_VOCAB = re.compile(r"^(lm_head|medusa_heads\.\d+\.lm_head)\.weight$")


def tp_rule(name: str) -> str:
    """How a tensor is split across ranks: qkv | column (dim 0) | row (dim 1) | vocab | replicate.

    Row-parallel layers (attention.dense, mlp.proj) produce partial sums that TensorRT-LLM
    all-reduces; column-parallel ones (mlp.fc/gate, Medusa linears) produce slices of the output.
    The vocab rule pads with zero rows so every rank holds the same number of logits.
    """
    if _QKV.match(name):
        return "qkv"
    if _ROW.match(name):
        return "row"
    if _COL.match(name):
        return "column"
    if _VOCAB.match(name):
        return "vocab"
    return "replicate"


def check_tp(config: dict) -> None:
    """Raise CheckpointError when tp_size cannot split this model."""
    tp = tp_size_of(config)
    nq, nkv = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    problems = []
    if tp < 1:
        problems.append(f"tp_size {tp} must be at least 1")
    else:
        if nq % tp:
            problems.append(f"tp_size {tp} does not divide num_attention_heads {nq}")
        if nkv % tp and tp % nkv:
            problems.append(f"tp_size {tp} and num_key_value_heads {nkv}: one must divide the other "
                            f"(KV heads are split, or duplicated when fewer than tp_size)")
        if int(config["intermediate_size"]) % tp:
            problems.append(f"tp_size {tp} does not divide intermediate_size {config['intermediate_size']}")
        if int(config["hidden_size"]) % tp:
            problems.append(f"tp_size {tp} does not divide hidden_size {config['hidden_size']} "
                            f"(Medusa linears are split on their output dim)")
    if problems:
        raise CheckpointError("; ".join(problems))


def _qkv_sizes(config: dict) -> tuple[int, int, int, int]:
    """(q rows, kv rows, q rows per rank, kv rows per rank) of a fused qkv tensor."""
    tp = tp_size_of(config)
    nq, nkv = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    hs = int(config.get("head_size") or int(config["hidden_size"]) // nq)
    return nq * hs, nkv * hs, nq // tp * hs, max(nkv // tp, 1) * hs


def shard_tensor(name: str, tensor: torch.Tensor, config: dict, rank: int) -> torch.Tensor:
    """The rank-`rank` shard of the full (unsharded) tensor `name` under config's tp_size."""
    tp = tp_size_of(config)
    if tp == 1:
        return tensor
    rule = tp_rule(name)
    if rule == "replicate" or (rule == "row" and tensor.dim() < 2):
        return tensor
    if rule == "qkv":
        q_rows, kv_rows, q_local, kv_local = _qkv_sizes(config)
        if tensor.shape[0] != q_rows + 2 * kv_rows:
            raise CheckpointError(f"{name}: {list(tensor.shape)} has {tensor.shape[0]} rows, "
                                  f"expected q {q_rows} + k {kv_rows} + v {kv_rows}")
        q, k, v = tensor.split([q_rows, kv_rows, kv_rows], dim=0)
        nkv = int(config["num_key_value_heads"])
        # With fewer KV heads than ranks, each KV head is shared by tp // nkv consecutive ranks.
        kv_start = (rank * kv_local) if nkv >= tp else (rank // (tp // nkv)) * kv_local
        return torch.cat([q.narrow(0, rank * q_local, q_local),
                          k.narrow(0, kv_start, kv_local),
                          v.narrow(0, kv_start, kv_local)], dim=0)
    if rule == "vocab":
        rows = -(-tensor.shape[0] // tp) * tp
        if rows != tensor.shape[0]:
            tensor = torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])
        return tensor.narrow(0, rank * rows // tp, rows // tp)
    dim = 1 if rule == "row" else 0
    if tensor.shape[dim] % tp:
        raise CheckpointError(f"{name}: dim {dim} of {list(tensor.shape)} is not divisible by tp_size {tp}")
    size = tensor.shape[dim] // tp
    return tensor.narrow(dim, rank * size, size).contiguous()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Bitwise, so it also works for float8 (no torch.equal kernel) and treats NaN payloads as equal.
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def merge_ranks(name: str, shards: Sequence[torch.Tensor], config: dict) -> torch.Tensor:
    """Inverse of shard_tensor: the full tensor from every rank's shard (vocab padding kept)."""
    tp = tp_size_of(config)
    if len(shards) != tp:
        raise CheckpointError(f"{name}: got {len(shards)} shards for tp_size {tp}")
    if tp == 1:
        return shards[0]
    rule = tp_rule(name)
    if rule == "replicate" or (rule == "row" and shards[0].dim() < 2):
        for r, s in enumerate(shards[1:], start=1):
            if not _same_bits(s, shards[0]):
                raise CheckpointError(f"{name}: replicated tensor differs between rank 0 and rank {r}")
        return shards[0]
    if rule == "qkv":
        _, _, q_local, kv_local = _qkv_sizes(config)
        parts = [s.split([q_local, kv_local, kv_local], dim=0) for s in shards]
        nkv = int(config["num_key_value_heads"])
        group = 1 if nkv >= tp else tp // nkv
        for r in range(tp):
            first = r - r % group
            if r != first and not (_same_bits(parts[r][1], parts[first][1])
                                   and _same_bits(parts[r][2], parts[first][2])):
                raise CheckpointError(f"{name}: duplicated KV head differs between rank {first} and rank {r}")
        leaders = range(0, tp, group)
        return torch.cat([p[0] for p in parts] + [parts[r][1] for r in leaders]
                         + [parts[r][2] for r in leaders], dim=0)
    return torch.cat(list(shards), dim=1 if rule == "row" else 0)


def rank_shape(spec: TensorSpec, config: dict, rank: int) -> tuple[int, ...]:
    # Shapes follow from the split rules themselves, applied to a tensor with no storage.
    meta = torch.empty(spec.shape, dtype=spec.dtype, device="meta")
    return tuple(shard_tensor(spec.name, meta, config, rank).shape)


# ----------------------------------------------------------------------------------------------
# Whole checkpoints
# ----------------------------------------------------------------------------------------------

def rank_file(directory: str | os.PathLike, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.safetensors"


class CheckpointWriter:
    """Streams a checkpoint to `out_dir`: full tensors in, every rank's shard out.

    Tensors must arrive in `names` order (that of expected_tensors) with the planned dtype; the
    vocab-split tensors may come unpadded. `close` writes config.json last, so a directory with a
    config.json is complete.
    """

    def __init__(self, out_dir: str | os.PathLike, config: dict):
        self.out_dir = Path(out_dir)
        self.config = config
        check_tp(config)
        self.specs = expected_tensors(config)
        self.tp = tp_size_of(config)
        self._writers: list[SafetensorsWriter] = []
        try:
            for rank in range(self.tp):
                plan = [(s.name, s.dtype, rank_shape(s, config, rank)) for s in self.specs]
                self._writers.append(SafetensorsWriter(rank_file(self.out_dir, rank), plan))
        except BaseException:
            for w in self._writers:
                w._file.close()
            raise
        self._index = 0
        self.nbytes_total = sum(w.nbytes_total for w in self._writers)  # files, headers included
        self.nbytes_data = sum(w.nbytes_data for w in self._writers)  # tensor bytes only

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            for w in self._writers:
                w._file.close()

    def add(self, name: str, tensor: torch.Tensor) -> int:
        """Write one full tensor to every rank; returns the bytes written."""
        spec = self.specs[self._index] if self._index < len(self.specs) else None
        if spec is None or spec.name != name:
            raise CheckpointError(f"{self.out_dir}: tensor {name!r} added out of order; "
                                  f"expected {spec.name if spec else 'no more tensors'!r}")
        shape = tuple(tensor.shape)
        ok = shape == spec.shape or (tp_rule(name) == "vocab"
                                     and shape == (int(self.config["vocab_size"]), *spec.shape[1:]))
        if not ok:
            raise CheckpointError(f"{self.out_dir}: tensor {name!r} has shape {list(shape)}, "
                                  f"expected {list(spec.shape)} for this config")
        written = sum(w.write(name, shard_tensor(name, tensor, self.config, r))
                      for r, w in enumerate(self._writers))
        self._index += 1
        return written

    def close(self) -> None:
        for w in self._writers:
            w.close()
        with open(self.out_dir / "config.json", "w") as f:
            json.dump(self.config, f, indent=2)
            f.write("\n")


def write_checkpoint(out_dir: str | os.PathLike, config: dict,
                     tensors: dict[str, torch.Tensor] | Iterator[tuple[str, torch.Tensor]]) -> None:
    """Write a whole checkpoint from full tensors (a dict, or (name, tensor) pairs in order)."""
    items = tensors.items() if isinstance(tensors, dict) else tensors
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    with CheckpointWriter(out_dir, config) as writer:
        if isinstance(tensors, dict):
            missing = [n for n in writer.names if n not in tensors]
            extra = [n for n in tensors if n not in set(writer.names)]
            if missing or extra:
                raise CheckpointError(f"{out_dir}: tensors do not match the config: missing {missing[:5]}, "
                                      f"unexpected {extra[:5]}")
            items = ((n, tensors[n]) for n in writer.names)
        for name, tensor in items:
            writer.add(name, tensor)


def read_config(directory: str | os.PathLike) -> dict:
    """config.json of a merged checkpoint, with every field that is present type- and range-checked
    (validate_checkpoint reports the missing ones)."""
    path = Path(directory) / "config.json"
    config = read_json_object(path, CheckpointError, "merged checkpoint config.json")
    validate_config(config, path)
    return config


_POSITIVE_INTS = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "head_size",
                  "intermediate_size", "vocab_size", "max_position_embeddings", "max_draft_len")


MIN_DRAFT_VOCAB = 16  # a step takes each head's top-10 within the draft vocabulary


def check_draft_vocab(ids: object, vocab_size: int | None, where: str, error: type[CheckpointError] = CheckpointError,
                      min_size: int = MIN_DRAFT_VOCAB) -> list[int]:
    """A draft vocabulary (heads config.json `draft_vocab`, merged config.json `medusa_trt.draft_vocab`):
    at least `min_size` distinct token ids below vocab_size. An id outside the vocabulary would index
    past the lm_head rows at the first step, so every reader refuses it here, naming `where`."""
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise error(f"{where} must be a list of token ids, got {str(ids)[:60]}")
    limit = vocab_size if isinstance(vocab_size, int) and not isinstance(vocab_size, bool) else None
    bad = [i for i in ids if i < 0 or (limit is not None and i >= limit)]
    if bad:
        expected = f"0..{limit - 1}" if limit is not None else "non-negative ids"
        raise error(f"{where} holds token id {bad[0]}, outside the vocabulary; expected ids in {expected}")
    if len(set(ids)) != len(ids):
        seen: set[int] = set()
        twice = next(i for i in ids if i in seen or seen.add(i))
        raise error(f"{where} holds token id {twice} more than once; expected each id once")
    if len(ids) < min_size:
        raise error(f"{where} has {len(ids)} ids; expected at least {min_size} distinct token ids")
    return sorted(ids)


def validate_config(config: dict, path: Path) -> None:
    """Types and ranges of the config.json fields this project reads; absent fields are left to
    validate_checkpoint's list of missing keys."""
    def req(obj, key, kind, prefix="", **kw):
        return require(obj, key, kind, file=path, prefix=prefix, error=CheckpointError, default=None, **kw)

    for key in _POSITIVE_INTS:
        req(config, key, int, positive=True, maximum=MAX_DRAFT_LEN if key == "max_draft_len" else None)
    for key in ("num_medusa_heads", "num_medusa_layers", "embedding_sharding_dim"):
        req(config, key, int, nonnegative=True)
    for key in ("rotary_base", "norm_epsilon"):
        req(config, key, float, positive=True)
    req(config, "dtype", str, choices=tuple(CONFIG_DTYPES))
    req(config, "logits_dtype", str, choices=tuple(CONFIG_DTYPES))
    for key in ("architecture", "model_type"):
        req(config, key, str)
    # What the model computes: values it does not read would be decoded as if they were these.
    req(config, "hidden_act", str, choices=("silu",))
    req(config, "position_embedding_type", str, choices=("rope_gpt_neox",))
    for key in ("attn_bias", "mlp_bias", "use_parallel_embedding", "tie_word_embeddings"):
        req(config, key, bool)
    req(config, "sliding_window", int, positive=True)
    layer_types = req(config, "layer_types", list)
    if layer_types is not None:
        bad = [t for t in layer_types if t not in (SLIDING_ATTENTION, FULL_ATTENTION)]
        layers = config.get("num_hidden_layers")
        if bad or (isinstance(layers, int) and len(layer_types) != layers):
            raise CheckpointError(f"{path}: layer_types has {len(layer_types)} entries{f' ({bad[0]!r})' if bad else ''}; "
                                  f"expected {SLIDING_ATTENTION!r} or {FULL_ATTENTION!r} for each of the "
                                  f"{layers} layers")
    req(config, "rotary_scaling", dict)
    mapping = req(config, "mapping", dict)
    for key in ("world_size", "tp_size", "pp_size"):
        if mapping is not None:
            req(mapping, key, int, "mapping.", positive=True)
    quant = req(config, "quantization", dict)
    if quant is not None:
        for key in ("quant_algo", "kv_cache_quant_algo"):
            req(quant, key, str, "quantization.", choices=("FP8",))
        req(quant, "exclude_modules", list, "quantization.")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = config.get(key)
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= 0) and not (
                isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v)):
            raise CheckpointError(f"{path}: {key} {v!r}; expected a token id, a list of token ids or null")
    ours = req(config, "medusa_trt", dict)
    if ours is not None:
        req(ours, "drafter", str, "medusa_trt.")
        if ours.get("draft_vocab") is not None:
            check_draft_vocab(ours["draft_vocab"], config.get("vocab_size"), f"{path}: medusa_trt.draft_vocab")
        if ours.get("drafter") == "amphista":
            _check_amphista(config, ours, path)
    if config.get("num_attention_heads") and config.get("num_key_value_heads") and (
            config["num_attention_heads"] % config["num_key_value_heads"]):
        raise CheckpointError(f"{path}: num_attention_heads {config['num_attention_heads']} is not a multiple of "
                              f"num_key_value_heads {config['num_key_value_heads']}")


def _check_amphista(config: dict, ours: dict, path: Path) -> None:
    """The Amphista drafter's shape block (medusa_trt.amphista), and its head count beside the
    config's num_medusa_heads, which the runtime's trees read."""
    from medusa_trt.drafters.amphista import AmphistaConfig

    try:
        shape = AmphistaConfig.from_dict(ours.get("amphista"), str(path))
    except (TypeError, ValueError) as e:
        raise CheckpointError(str(e)) from None
    heads = config.get("num_medusa_heads")
    if isinstance(heads, int) and heads != shape.num_heads:
        raise CheckpointError(f"{path}: num_medusa_heads {heads}, but medusa_trt.amphista.num_heads is "
                              f"{shape.num_heads}; expected the drafter's head count in both")


def validate_checkpoint(directory: str | os.PathLike, *, strict: bool = True) -> list[str]:
    """Check names, shapes and dtypes of every rank file against config.json (headers only).

    Returns the list of problems; with strict=True a non-empty list raises CheckpointError.
    """
    directory = Path(directory)
    problems: list[str] = []
    config = read_config(directory)
    missing_keys = [k for k in REQUIRED_CONFIG_KEYS if k not in config]
    if missing_keys:
        problems.append(f"config.json lacks keys {missing_keys}")
    else:
        mapping = config["mapping"]
        tp = tp_size_of(config)
        if int(mapping.get("world_size", tp)) != tp * int(mapping.get("pp_size", 1)):
            problems.append(f"mapping {mapping}: world_size must be tp_size * pp_size")
        if int(mapping.get("pp_size", 1)) != 1:
            problems.append(f"mapping pp_size {mapping['pp_size']}: only 1 is supported")
        try:
            check_tp(config)
            specs = expected_tensors(config)
        except CheckpointError as e:
            problems.append(str(e))
            specs = None
        for rank in range(tp if specs is not None else 0):
            path = rank_file(directory, rank)
            if not path.exists():
                problems.append(f"{path.name} is missing")
                continue
            try:
                with SafetensorsFile(path) as f:
                    found = f.tensors
            except CheckpointError as e:
                problems.append(str(e))
                continue
            for spec in specs:
                info = found.get(spec.name)
                shape = rank_shape(spec, config, rank)
                if info is None:
                    problems.append(f"{path.name}: missing tensor {spec.name!r}")
                elif info.shape != shape or info.dtype != spec.dtype:
                    problems.append(f"{path.name}: {spec.name!r} is {info.dtype}{list(info.shape)}, "
                                    f"expected {spec.dtype}{list(shape)}")
            known = {s.name for s in specs}
            problems += [f"{path.name}: unexpected tensor {n!r}" for n in found if n not in known]
        extra = sorted(p.name for p in directory.glob("rank*.safetensors")
                       if not re.fullmatch(r"rank\d+", p.stem) or int(p.stem[4:]) >= tp)
        problems += [f"{name} does not belong to a tp_size {tp} checkpoint" for name in extra]
    if strict and problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise CheckpointError(f"{directory}: invalid checkpoint: {shown}")
    return problems


def check_finite_weights(directory: str | os.PathLike) -> None:
    """Every tensor of every rank file is finite, or a CheckpointError naming the file and tensor
    (a checkpoint edited after medusa-convert, which checks what it writes). One tensor at a time,
    so a builder that hands the directory to another tool (trtllm-build) is covered too."""
    directory = Path(directory)
    for rank in range(tp_size_of(read_config(directory))):
        path = rank_file(directory, rank)
        with SafetensorsFile(path) as f:
            for name in f.keys():
                check_finite(f.read(name), f"{path}: tensor {name!r}")


def load_checkpoint(directory: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """Config and full (unsharded) weights of a merged checkpoint, ranks merged when tp_size > 1.

    Vocab-split tensors (lm_head, medusa_heads.{h}.lm_head) keep their zero padding rows; slice
    to config["vocab_size"].
    """
    directory = Path(directory)
    validate_checkpoint(directory)
    config = read_config(directory)
    files = [SafetensorsFile(rank_file(directory, r)) for r in range(tp_size_of(config))]
    try:
        weights = {}
        for name in files[0].keys():
            parts = [f.read(name) for f in files]
            for f, part in zip(files, parts, strict=True):  # the reference never runs on NaN either
                check_finite(part, f"{f.path}: tensor {name!r}")
            weights[name] = merge_ranks(name, parts, config)
        return config, weights
    finally:
        for f in files:
            f.close()
