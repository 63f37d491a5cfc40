"""Reading Hugging Face base model directories: config normalization and lazy weight access."""

from __future__ import annotations

import logging
import os
import pickle
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from medusa_trt.checkpoint import (
    FULL_ATTENTION,
    LM_HEAD,
    LN_F,
    SLIDING_ATTENTION,
    VOCAB_EMBEDDING,
    layer_prefix,
)
from medusa_trt.errors import CheckpointError, read_json_object, require
from medusa_trt.safetensors_io import SafetensorsFile, check_finite

log = logging.getLogger("medusa_trt.converter")


class ConvertError(CheckpointError):
    """Bad converter input: the message names the file, the value and what was expected."""


# HF architecture -> HF model_type. TensorRT-LLM runs Mistral as "llama" (sliding window aside).
KNOWN_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                       "Qwen2ForCausalLM": "qwen2"}
TRTLLM_MODEL_TYPE = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # codes, weights only with their scale
# What transformers' config classes (MistralConfig, Qwen2Config) give a key that config.json leaves out,
# where it differs from the fallbacks below (LlamaConfig's): a Mistral config without `sliding_window`
# still slides over 4096 positions in transformers.
HF_DEFAULTS = {"mistral": {"sliding_window": 4096, "max_position_embeddings": 131072},
               "qwen2": {"max_position_embeddings": 32768}}
_DTYPE_ALIASES = {"float16": "float16", "fp16": "float16", "half": "float16", "bfloat16": "bfloat16",
                  "bf16": "bfloat16", "float32": "float32", "fp32": "float32", "float": "float32"}


def read_json(path: Path) -> dict:
    return read_json_object(path, ConvertError)


# ----------------------------------------------------------------------------------------------
# Lazy access to tensors spread over safetensors and pickle files
# ----------------------------------------------------------------------------------------------

def load_pickled_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A state dict from a .bin/.pt pickle, loaded so that it cannot run code.

    weights_only=True restricts unpickling to tensors and plain containers; anything else (custom
    classes, functions) is refused before it is constructed. Zip-format files are memory-mapped
    so tensors are paged in only when read.
    """
    mmap = zipfile.is_zipfile(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        globals_ = [ln.split("Unsupported global:")[1].split(" was not")[0].strip()
                    for ln in str(e).splitlines() if "Unsupported global:" in ln]
        if globals_:  # a real pickle that names classes or functions
            raise ConvertError(f"{path}: refused to unpickle: the file needs more than tensors to load "
                               f"({globals_[0]}); only plain state dicts of tensors are accepted") from None
        raise ConvertError(f"{path}: cannot read as a PyTorch checkpoint (not a pickle of tensors: "
                           f"{_first_line(e)}); expected a state dict saved by torch.save") from None
    except Exception as e:  # noqa: BLE001  torch's unpickler raises KeyError, IndexError, ... on bytes that are no pickle
        raise ConvertError(f"{path}: cannot read as a PyTorch checkpoint ({type(e).__name__}: {_first_line(e)}); "
                           "expected a state dict saved by torch.save") from None
    if not isinstance(obj, dict):
        raise ConvertError(f"{path}: holds a {type(obj).__name__}, expected a state dict (name -> tensor)")
    for key, value in obj.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise ConvertError(f"{path}: entry {key!r} holds a {type(value).__name__}, expected a tensor "
                               f"(a flat state dict of tensors)")
    return obj


def _first_line(err: BaseException) -> str:
    """The part of an error message worth a line: torch's unpickling errors open with paragraphs of
    advice and end with the operand or global that failed."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    useful = [ln for ln in lines if ln.startswith("Unsupported") or "error:" in ln.lower()]
    return (useful[-1] if useful else lines[0] if lines else "no message")[:200]


@dataclass
class TensorSource:
    """Names -> tensors across safetensors and pickle files; `read` loads one tensor at a time."""

    files: list[Path]
    where: dict[str, Path] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    _safetensors: dict[Path, SafetensorsFile] = field(default_factory=dict)
    _pickle: tuple[Path, dict] | None = None
    _memory: dict[str, torch.Tensor] | None = None  # tensors already loaded (a GGUF base)

    @classmethod
    def in_memory(cls, tensors: dict[str, torch.Tensor], origin: Path) -> TensorSource:
        """Tensors already in memory, reported as coming from `origin` in error messages."""
        return cls([origin], dict.fromkeys(tensors, origin), {n: tuple(t.shape) for n, t in tensors.items()},
                   {n: t.dtype for n, t in tensors.items()}, _memory=dict(tensors))

    @classmethod
    def open(cls, files: Sequence[Path]) -> TensorSource:
        src = cls(list(files))
        try:
            for path in src.files:
                if path.suffix == ".safetensors":
                    st = src._safetensors[path] = SafetensorsFile(path)
                    entries = {n: (i.shape, i.dtype) for n, i in st.tensors.items()}
                else:
                    entries = {n: (tuple(t.shape), t.dtype) for n, t in load_pickled_state_dict(path).items()}
                for name, (shape, dtype) in entries.items():
                    if name in src.where:
                        raise ConvertError(f"tensor {name!r} appears in both {src.where[name]} and {path}")
                    src.where[name] = path
                    src.shapes[name] = shape
                    src.dtypes[name] = dtype
        except BaseException:
            src.close()
            raise
        return src

    def names(self) -> list[str]:
        return list(self.where)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def read(self, name: str) -> torch.Tensor:
        if self._memory is not None:
            return self._memory[name]
        path = self.where[name]
        if path in self._safetensors:
            return self._safetensors[path].read(name)
        # Keep one pickle loaded: HF shards are ordered by layer, as are our reads.
        if self._pickle is None or self._pickle[0] != path:
            self._pickle = None
            self._pickle = (path, load_pickled_state_dict(path))
        return self._pickle[1][name]

    def close(self) -> None:
        for st in self._safetensors.values():
            st.close()
        self._safetensors.clear()
        self._pickle = None
        self._memory = None


def find_weight_files(directory: Path) -> list[Path] | None:
    """The weight files of an HF model dir, or None when it has none we can read."""
    layout = weight_layout(directory)
    return None if layout is None else layout[0]


def weight_layout(directory: Path) -> tuple[list[Path], Path | None] | None:
    """(the weight files, the index naming them or None) of an HF model dir, in transformers' order
    (modeling_utils): model.safetensors, its index, pytorch_model.bin, its index. A dir holding both
    a single file and an index loads the single file there, so it does here."""
    for single, index_name in (("model.safetensors", "model.safetensors.index.json"),
                               ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (directory / single).is_file():
            return [directory / single], None
        index_path = directory / index_name
        if index_path.exists():
            weight_map = read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConvertError(f"{index_path}: no 'weight_map' object naming the shard files")
            files = []
            for name, shard in weight_map.items():
                if not isinstance(shard, str) or not shard:
                    raise ConvertError(f"{index_path}: weight_map[{name!r}] is {shard!r}; expected the name of a "
                                       "shard file")
            for shard in dict.fromkeys(weight_map.values()):
                path = directory / shard
                if not path.is_file():
                    raise ConvertError(f"{index_path}: shard {shard!r} listed in weight_map is missing")
                files.append(path)
            return files, index_path
    return None


def check_index(index_path: Path, source: TensorSource) -> None:
    """Every tensor an index lists must be in the shard it names."""
    for name, shard in read_json(index_path)["weight_map"].items():
        if source.where.get(name) != index_path.parent / shard:
            raise ConvertError(f"{index_path}: lists tensor {name!r} in {shard}, but that shard does not hold it")


# ----------------------------------------------------------------------------------------------
# The base model
# ----------------------------------------------------------------------------------------------

@dataclass
class BaseModel:
    dir: Path
    config_path: Path
    hf_config: dict
    model_type: str  # HF model_type: llama | mistral | qwen2
    weights: TensorSource
    generation_config: dict = field(default_factory=dict)
    tokenizer: object | None = None  # a loaded HF tokenizer when the base has no tokenizer files (GGUF)
    gguf: dict | None = None  # what the GGUF file held (converter/gguf.py), recorded in the checkpoint


def read_base(base_dir: Path) -> BaseModel:
    """An HF model directory (GGUF files: converter/gguf.py)."""
    if base_dir.exists() and not base_dir.is_dir():
        raise ConvertError(f"{base_dir}: --base is a file; expected a Hugging Face model directory or a .gguf file")
    if not base_dir.is_dir():
        raise ConvertError(f"{base_dir}: base model directory not found")
    config_path = base_dir / "config.json"
    if not config_path.exists():
        raise ConvertError(f"{config_path}: not found; --base must be a Hugging Face model directory")
    hf_config = read_json(config_path)
    model_type = base_model_type(hf_config, config_path)
    generation = _read_generation_config(base_dir / "generation_config.json")
    check_base_config(hf_config, config_path, generation)
    layout = weight_layout(base_dir)
    if layout is None:
        raise ConvertError(f"{base_dir}: no weights found; expected model.safetensors, "
                           f"model.safetensors.index.json, pytorch_model.bin or pytorch_model.bin.index.json")
    files, index_path = layout
    weights = TensorSource.open(files)
    try:
        if index_path is not None:
            check_index(index_path, weights)
    except BaseException:
        weights.close()
        raise
    return BaseModel(base_dir, config_path, hf_config, model_type, weights, generation)


def _read_generation_config(path: Path) -> dict:
    return read_json(path) if path.exists() else {}


def base_model_type(hf_config: dict, path: Path) -> str:
    """The HF model_type of a supported base, or a ConvertError naming what was found."""
    archs = require(hf_config, "architectures", list, file=path, error=ConvertError, default=[])
    arch = archs[0] if archs else None
    if arch is not None and not isinstance(arch, str):
        raise ConvertError(f"{path}: architectures[0] {arch!r}; expected a class name (a string)")
    model_type = require(hf_config, "model_type", str, file=path, error=ConvertError, default=None)
    expected = ", ".join(KNOWN_ARCHITECTURES)
    if arch in KNOWN_ARCHITECTURES:
        if model_type is not None and model_type != KNOWN_ARCHITECTURES[arch]:
            raise ConvertError(f"{path}: architecture {arch!r} does not match model_type {model_type!r}")
        return KNOWN_ARCHITECTURES[arch]
    # Medusa-2 training scripts save the base config under their own class name; the config
    # schema (model_type) is still that of the base.
    if (arch is None or "medusa" in arch.lower()) and model_type in TRTLLM_MODEL_TYPE:
        return model_type
    raise ConvertError(f"{path}: unsupported architecture {arch!r} (model_type {model_type!r}); "
                       f"expected one of {expected}")


def normalize_rope(hf_config: dict, path: Path) -> tuple[float, dict | None]:
    """(rotary_base, rotary_scaling) from either HF config form, every value checked (a number
    given as text is one ConvertError naming the key, not a float() traceback or a silent cast).

    transformers >= 5 writes `rope_parameters: {rope_theta, rope_type, ...}`; older configs have
    `rope_theta` and `rope_scaling: {type | rope_type, ...}`.
    """
    def req(obj, key, kind, prefix="", **kw):
        return require(obj, key, kind, file=path, error=ConvertError, prefix=prefix, **kw)

    theta = req(hf_config, "rope_theta", float, positive=True, default=10000.0)
    params = req(hf_config, "rope_parameters", dict, default={})
    legacy = req(hf_config, "rope_scaling", dict, default={})
    if params and legacy:
        # transformers (5.x, convert_rope_params_to_dict) takes a non-empty rope_scaling over
        # rope_parameters whole, so it applies the scaling and drops rope_parameters' theta for
        # rope_scaling's own, else the top-level rope_theta, else 10000. Follow it while no theta is lost.
        kept = req(legacy, "rope_theta", float, "rope_scaling.", positive=True, default=theta)
        dropped = req(params, "rope_theta", float, "rope_parameters.", positive=True, default=kept)
        if dropped != kept:
            raise ConvertError(f"{path}: rope_scaling replaces rope_parameters in transformers, which then drops "
                               f"rope_parameters.rope_theta {dropped} for {kept}; expected one of the two (the "
                               "scaling inside rope_parameters)")
        theta, scaling, where = kept, legacy, "rope_scaling."
    elif params:
        if "rope_theta" not in params and "rope_type" not in params:
            raise ConvertError(f"{path}: rope_parameters per layer type ({sorted(params)}) are not "
                               f"supported; expected one {{rope_theta, rope_type}} object")
        theta = req(params, "rope_theta", float, "rope_parameters.", positive=True, default=theta)
        scaling, where = params, "rope_parameters."
    else:  # transformers reads a rope_theta inside rope_scaling over the top-level one
        theta = req(legacy, "rope_theta", float, "rope_scaling.", positive=True, default=theta)
        scaling, where = legacy, "rope_scaling."
    rope_type = (req(scaling, "rope_type", str, where, default=None) or req(scaling, "type", str, where, default=None)
                 or "default")
    if rope_type == "default":
        return theta, None
    if rope_type not in ("linear", "llama3"):
        raise ConvertError(f"{path}: rope type {rope_type!r} is not supported; expected default, linear "
                           f"or llama3")
    keys = ["factor"]
    if rope_type == "llama3":
        keys += ["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
    missing = [k for k in keys if k not in scaling]
    if missing:
        raise ConvertError(f"{path}: rope type {rope_type!r} lacks {missing}")
    out: dict = {"type": rope_type, "factor": req(scaling, "factor", float, where, positive=True)}
    if rope_type == "llama3":
        out["low_freq_factor"] = req(scaling, "low_freq_factor", float, where, positive=True)
        out["high_freq_factor"] = req(scaling, "high_freq_factor", float, where, positive=True)
        out["original_max_position_embeddings"] = req(scaling, "original_max_position_embeddings", int, where,
                                                      positive=True)
    return theta, out


def source_dtype(base: BaseModel) -> str:
    """The base's dtype name: from its config, else from its embedding tensor."""
    name = base.hf_config.get("dtype") or base.hf_config.get("torch_dtype")
    if isinstance(name, str) and name in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[name]
    embed = "model.embed_tokens.weight"
    if embed in base.weights:
        return str(base.weights.dtypes[embed]).removeprefix("torch.")
    return "float32"


def check_base_config(c: dict, path: Path, generation: dict | None = None) -> None:
    """Every config.json value the converter reads, checked once where the config is read (read_base,
    read_gguf_base): its type (a number given as text is refused, naming the file and key), its
    range, and what this converter supports. The readers after it (base_config, normalize_rope,
    the heads) may then trust the values."""
    def req(key, kind, **kw):
        return require(c, key, kind, file=path, error=ConvertError, **kw)

    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "vocab_size"):
        req(key, int, positive=True)
    nq = c["num_attention_heads"]
    nkv = req("num_key_value_heads", int, positive=True, default=nq)
    if nq % nkv:
        raise ConvertError(f"{path}: num_attention_heads {nq} is not a multiple of num_key_value_heads {nkv}")
    req("head_dim", int, positive=True, default=None)
    req("max_position_embeddings", int, positive=True, default=None)
    req("rms_norm_eps", float, positive=True, default=None)
    for key in ("mlp_bias", "attention_bias", "tie_word_embeddings", "use_sliding_window"):
        req(key, bool, default=False)
    req("sliding_window", int, positive=True, default=None)
    for key in ("dtype", "torch_dtype"):
        req(key, str, default=None)
    for key in ("bos_token_id", "eos_token_id"):
        _token_ids(c, key, path)
        _token_ids(generation or {}, key, path.with_name("generation_config.json"))
    if req("hidden_act", str, default="silu") != "silu":
        raise ConvertError(f"{path}: hidden_act {c.get('hidden_act')!r} is not supported; expected 'silu'")
    if c.get("mlp_bias"):
        raise ConvertError(f"{path}: mlp_bias true is not supported")
    normalize_rope(c, path)


def base_config(base: BaseModel) -> dict:
    """The TensorRT-LLM config keys that describe the base model (its values checked by
    check_base_config when the base was read)."""
    c, path = {**HF_DEFAULTS.get(base.model_type, {}), **base.hf_config}, base.config_path
    nq = c["num_attention_heads"]
    nkv = c.get("num_key_value_heads") or nq
    head_size = c.get("head_dim") or c["hidden_size"] // nq
    max_pos = c.get("max_position_embeddings") or 2048
    norm_eps = float(c.get("rms_norm_eps") or 1e-6)
    if base.model_type != "qwen2" and c.get("attention_bias"):
        raise ConvertError(f"{path}: attention_bias true is not supported for {base.model_type}")
    rotary_base, rotary_scaling = normalize_rope(c, path)
    sliding_window, layer_types = _sliding_window(base, c, path)
    gen = base.generation_config
    config = {
        "model_type": TRTLLM_MODEL_TYPE[base.model_type],
        "num_hidden_layers": c["num_hidden_layers"],
        "num_attention_heads": nq,
        "num_key_value_heads": nkv,
        "hidden_size": c["hidden_size"],
        "head_size": head_size,
        "intermediate_size": c["intermediate_size"],
        "vocab_size": c["vocab_size"],
        "position_embedding_type": "rope_gpt_neox",
        "max_position_embeddings": max_pos,
        "hidden_act": "silu",
        "rotary_base": rotary_base,
        "rotary_scaling": rotary_scaling,
        "norm_epsilon": norm_eps,
        "attn_bias": base.model_type == "qwen2",
        "mlp_bias": False,
        "sliding_window": sliding_window,
        "bos_token_id": c.get("bos_token_id") if c.get("bos_token_id") is not None else gen.get("bos_token_id"),
        "eos_token_id": c.get("eos_token_id") if c.get("eos_token_id") is not None else gen.get("eos_token_id"),
        "tie_word_embeddings": bool(c.get("tie_word_embeddings", False)),
    }
    if layer_types is not None:
        config["layer_types"] = layer_types
    if base.model_type == "qwen2":
        config["qwen_type"] = "qwen2"
    return config


def _sliding_window(base: BaseModel, c: dict, path: Path) -> tuple[int | None, list[str] | None]:
    """The window and the layers that use it, as transformers reads the base config: Mistral slides in
    every layer when `sliding_window` is set; Qwen2 only with `use_sliding_window`, and then in the
    layers its `layer_types` name, by default those from `max_window_layers` on (Qwen2Config);
    Llama has no window (LlamaAttention ignores the key)."""
    window = c.get("sliding_window")
    if base.model_type == "llama" or window is None:
        return None, None
    if base.model_type != "qwen2":
        return window, None
    if not c.get("use_sliding_window", False):
        return None, None  # Qwen2 configs carry a window size even when it is switched off
    layers = c["num_hidden_layers"]
    types = c.get("layer_types")
    if types is None:
        first = require(c, "max_window_layers", int, file=path, error=ConvertError, nonnegative=True, default=28)
        types = [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(layers)]
    elif not (isinstance(types, list) and len(types) == layers
              and all(t in (SLIDING_ATTENTION, FULL_ATTENTION) for t in types)):
        raise ConvertError(f"{path}: layer_types {str(types)[:80]}; expected {SLIDING_ATTENTION!r} or "
                           f"{FULL_ATTENTION!r} for each of the {layers} layers")
    if SLIDING_ATTENTION not in types:
        return None, None
    return window, None if FULL_ATTENTION not in types else types


def _token_ids(c: dict, key: str, path: Path) -> None:
    """A token id, a list of them, or null."""
    v = c.get(key)
    ok = v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0) or (
        isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v))
    if not ok:
        raise ConvertError(f"{path}: {key} {v!r}; expected a token id, a list of token ids or null")


# Tensors in HF checkpoints that carry no weights (recomputed at load time).
def _ignorable(name: str) -> bool:
    return name.endswith(".rotary_emb.inv_freq")


@dataclass(frozen=True)
class Piece:
    """One output tensor: the source tensors concatenated on dim 0, and their expected shapes."""

    source: TensorSource
    keys: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    scales: tuple[str | None, ...] = ()  # per key: a scale tensor to dequantize FP8 with

    def check(self, what: str) -> None:
        for i, (key, shape) in enumerate(zip(self.keys, self.shapes, strict=True)):
            if key not in self.source:
                raise ConvertError(f"{what}: tensor {key!r} not found in {_files(self.source)}")
            if self.source.shapes[key] != shape:
                raise ConvertError(f"{self.source.where[key]}: tensor {key!r} has shape "
                                   f"{list(self.source.shapes[key])}, expected {list(shape)} for {what}")
            dtype = self.source.dtypes.get(key)
            name = str(dtype).removeprefix("torch.")
            if dtype is not None and not dtype.is_floating_point:  # a cast would turn its codes into weights
                raise ConvertError(f"{self.source.where[key]}: tensor {key!r} has dtype {name}, expected "
                                   f"floating-point weights for {what}")
            if dtype in FP8_DTYPES and not (self.scales and self.scales[i]):  # so would one of FP8 codes
                raise ConvertError(f"{self.source.where[key]}: tensor {key!r} has dtype {name} and no scale, expected "
                                   f"floating-point weights for {what} (convert from the unquantized model)")

    def load(self, dtype: torch.dtype) -> torch.Tensor:
        parts = []
        for i, key in enumerate(self.keys):
            t = self.source.read(key)
            scale = self.scales[i] if self.scales else None
            if scale is not None:
                t = t.to(torch.float32) * self.source.read(scale).to(torch.float32)
            parts.append(t)
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        out = out.to(dtype)
        # Once, on what is written: NaN/Inf in a source stays NaN/Inf here, and a cast that overflows shows too.
        check_finite(out, f"{_files(self.source)}: tensor {', '.join(map(repr, self.keys))} (as {dtype})", ConvertError)
        return out


def _files(source: TensorSource) -> str:
    names = [str(p) for p in source.files]
    return names[0] if len(names) == 1 else f"{names[0]} (+{len(names) - 1} more files)"


def base_pieces(base: BaseModel, config: dict, head_keys: set[str]) -> dict[str, Piece]:
    """Output name -> Piece for every base tensor; any base tensor left unplaced is an error.

    `head_keys` are tensors of the base dir that belong to Medusa heads (Medusa-2 / ModelOpt
    full models) and are placed by the heads reader.
    """
    src = base.weights
    d, nq, nkv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    hs, inter, vocab = config["head_size"], config["intermediate_size"], config["vocab_size"]

    def piece(keys, shapes) -> Piece:
        return Piece(src, tuple(keys), tuple(tuple(s) for s in shapes))

    pieces = {VOCAB_EMBEDDING: piece(["model.embed_tokens.weight"], [(vocab, d)])}
    for i in range(config["num_hidden_layers"]):
        hf, out = f"model.layers.{i}", layer_prefix(i)
        attn = f"{hf}.self_attn"
        pieces[f"{out}.input_layernorm.weight"] = piece([f"{hf}.input_layernorm.weight"], [(d,)])
        pieces[f"{out}.attention.qkv.weight"] = piece(
            [f"{attn}.q_proj.weight", f"{attn}.k_proj.weight", f"{attn}.v_proj.weight"],
            [(nq * hs, d), (nkv * hs, d), (nkv * hs, d)])
        if config["attn_bias"]:
            pieces[f"{out}.attention.qkv.bias"] = piece(
                [f"{attn}.q_proj.bias", f"{attn}.k_proj.bias", f"{attn}.v_proj.bias"],
                [(nq * hs,), (nkv * hs,), (nkv * hs,)])
        pieces[f"{out}.attention.dense.weight"] = piece([f"{attn}.o_proj.weight"], [(d, nq * hs)])
        pieces[f"{out}.post_layernorm.weight"] = piece([f"{hf}.post_attention_layernorm.weight"], [(d,)])
        # TensorRT-LLM's fc is the branch that goes through SiLU (HF gate_proj); its gate is up_proj.
        pieces[f"{out}.mlp.fc.weight"] = piece([f"{hf}.mlp.gate_proj.weight"], [(inter, d)])
        pieces[f"{out}.mlp.gate.weight"] = piece([f"{hf}.mlp.up_proj.weight"], [(inter, d)])
        pieces[f"{out}.mlp.proj.weight"] = piece([f"{hf}.mlp.down_proj.weight"], [(d, inter)])
    pieces[LN_F] = piece(["model.norm.weight"], [(d,)])
    pieces[LM_HEAD] = piece([base_lm_head_key(base)], [(vocab, d)])

    for name, p in pieces.items():
        p.check(f"{name} ({base.model_type} base {base.dir})")
    used = {k for p in pieces.values() for k in p.keys}
    for name in src.names():
        if name not in used and name not in head_keys and not _ignorable(name):
            raise ConvertError(f"{src.where[name]}: cannot place tensor {name!r}: not a weight of a "
                               f"{base.model_type} model with this config ({base.config_path})")
    return pieces


def base_lm_head_key(base: BaseModel) -> str:
    """The base tensor that holds the output matrix: lm_head, or the embedding when tied."""
    if "lm_head.weight" in base.weights:
        return "lm_head.weight"
    if base.hf_config.get("tie_word_embeddings", False):
        return "model.embed_tokens.weight"
    raise ConvertError(f"{base.dir}: no lm_head.weight tensor and tie_word_embeddings is not true in "
                       f"{base.config_path}")


def default_out_dtype(base: BaseModel) -> str:
    name = source_dtype(base)
    return name if name in ("float16", "bfloat16", "float32") else "float16"


def same_dir(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
