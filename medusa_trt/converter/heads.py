"""Finding and reading Medusa heads in every known format (docs/formats.md section 1).

The tensors decide: head and layer counts are counted from the keys, never taken from a config
(published v1 configs under-report the head count), and every key must be placed or the
conversion fails.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from medusa_trt.checkpoint import check_draft_vocab, medusa_linear_prefix, medusa_lm_head
from medusa_trt.converter.hf_base import (
    FP8_DTYPES,
    BaseModel,
    ConvertError,
    Piece,
    TensorSource,
    base_config,
    base_lm_head_key,
    find_weight_files,
    read_json,
    same_dir,
)

log = logging.getLogger("medusa_trt.converter")

HEAD_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "medusa_lm_head.pth", "medusa_lm_head.bin")
HEAD_FORMATS = ("medusa_v1", "medusa_v2", "medusa2_full", "modelopt", "amphista")
AMPHISTA_FILE = "amphista.safetensors"  # this project's Amphista format (docs/formats.md)
# Key prefix inside full-model directories -> format name.
_PREFIXES = {"medusa_heads.": "modelopt", "medusa_head.": "medusa2_full"}

_LINEAR = re.compile(r"^(\d+)\.(\d+)\.linear\.(weight|bias|weight_scale|input_scale)$")
_LM_HEAD = re.compile(r"^(\d+)\.(\d+)\.(weight|weight_scale|input_scale)$")


@dataclass
class MedusaHeads:
    format: str  # one of HEAD_FORMATS
    path: Path  # the file or directory the head tensors came from
    source: TensorSource
    owns_source: bool  # False when the tensors live in the base's own files
    num_heads: int
    num_layers: int
    has_lm_head: bool
    # (head, layer, param) -> source key; layer None is the head's lm_head.
    keys: dict[tuple[int, int | None, str], str]
    config: dict
    config_path: Path | None
    amphista: dict | None = None  # an Amphista drafter's shape (drafters.amphista.AmphistaConfig)

    def close(self) -> None:
        if self.owns_source:
            self.source.close()


def head_keys_in(source: TensorSource) -> set[str]:
    return {n for n in source.names() if n.startswith(tuple(_PREFIXES))}


def find_heads(heads_path: Path | None, base: BaseModel) -> MedusaHeads:
    """Locate the heads, detect their format, and parse every key."""
    base_head_keys = head_keys_in(base.weights)
    if heads_path is None or (heads_path.is_dir() and same_dir(heads_path, base.dir)):
        if not base_head_keys:
            raise ConvertError(f"{base.dir}: no Medusa head tensors (medusa_head.* or medusa_heads.*) in "
                               f"the base directory; pass --heads with a Medusa head file or directory")
        return _parse(base.weights, False, base.dir, base.hf_config, base.config_path, base)
    if base_head_keys:
        raise ConvertError(f"{base.dir}: the base already holds Medusa heads "
                           f"({sorted(base_head_keys)[0]!r}, ...) and --heads {heads_path} was also given; "
                           f"pass one source of heads")
    if not heads_path.exists():
        raise ConvertError(f"{heads_path}: --heads not found")
    if heads_path.is_dir() and (heads_path / AMPHISTA_FILE).is_file():
        if medusa := [n for n in HEAD_FILES if (heads_path / n).is_file()]:
            raise ConvertError(f"{heads_path}: holds both {AMPHISTA_FILE} and {medusa[0]}, two drafters; "
                               "expected one drafter per --heads directory")
    if (heads_path / AMPHISTA_FILE).is_file() if heads_path.is_dir() else heads_path.name == AMPHISTA_FILE:
        return _amphista(heads_path if heads_path.is_dir() else heads_path.parent, base)
    if heads_path.is_dir():
        # A heads file when there is one (safetensors preferred), else a full-model directory.
        files = [heads_path / n for n in HEAD_FILES if (heads_path / n).is_file()][:1]
        files = files or find_weight_files(heads_path) or []
        if not files:
            raise ConvertError(f"{heads_path}: no Medusa head file; expected one of {', '.join(HEAD_FILES)} "
                               f"or a model directory holding medusa_head.* / medusa_heads.* tensors")
        config_path = heads_path / "config.json"
    else:
        files = [heads_path]
        config_path = heads_path.parent / "config.json"
    config = read_json(config_path) if config_path.exists() else {}
    source = TensorSource.open(files)
    try:
        return _parse(source, True, heads_path, config, config_path if config_path.exists() else None, base)
    except BaseException:
        source.close()
        raise


def _parse(source: TensorSource, owns: bool, path: Path, config: dict, config_path: Path | None,
           base: BaseModel) -> MedusaHeads:
    names = source.names()
    prefix = next((p for p in _PREFIXES if any(n.startswith(p) for n in names)), "")
    keys: dict[tuple[int, int | None, str], str] = {}
    lm_index: dict[int, int] = {}
    ignored_base = 0
    for name in names:
        if prefix and not name.startswith(prefix):
            # Full-model directories also hold the base weights: those come from --base.
            if name.startswith("model.") or name == "lm_head.weight" or name.endswith(".inv_freq"):
                ignored_base += 1
                continue
            raise _unplaceable(source, name, f"expected {prefix}* head tensors or base weights")
        key = name[len(prefix):]
        if m := _LINEAR.match(key):
            keys[(int(m[1]), int(m[2]), m[3])] = name
        elif m := _LM_HEAD.match(key):
            h, j = int(m[1]), int(m[2])
            if lm_index.setdefault(h, j) != j:
                raise _unplaceable(source, name, f"head {h} already has an output matrix at index {lm_index[h]}")
            keys[(h, None, m[3])] = name
        else:
            raise _unplaceable(source, name, "expected {h}.{l}.linear.weight|bias or {h}.{L}.weight")
    if ignored_base and owns:
        log.info("%s: ignoring %d base-model tensors; the base weights come from --base %s",
                 path, ignored_base, base.dir)

    linear = [(h, layer) for (h, layer, p) in keys if layer is not None and p == "weight"]
    if not linear:
        raise ConvertError(f"{path}: no Medusa head tensors ({prefix or ''}{{h}}.{{l}}.linear.weight) found")
    num_heads = 1 + max(h for h, _ in linear)
    num_layers = 1 + max(layer for _, layer in linear)
    for h in range(num_heads):
        for layer in range(num_layers):
            for param in ("weight", "bias"):
                if (h, layer, param) not in keys:
                    raise ConvertError(f"{_where(source, keys)}: head {h} layer {layer} has no "
                                       f"{prefix}{h}.{layer}.linear.{param}; heads 0..{num_heads - 1} must "
                                       f"each have layers 0..{num_layers - 1} with weight and bias")
    for (h, layer, param), name in keys.items():
        if h >= num_heads or (layer is not None and layer >= num_layers):
            raise _unplaceable(source, name, f"heads 0..{num_heads - 1} have linear weights for layers "
                                             f"0..{num_layers - 1} only")
        if layer is None and lm_index[h] != num_layers:
            raise _unplaceable(source, name, f"a head with {num_layers} layer(s) has its output matrix at "
                                             f"{prefix}{h}.{num_layers}.weight")
        if layer is None and param != "weight" and (h, None, "weight") not in keys:
            raise _unplaceable(source, name, "a scale without its weight")
    with_lm = sorted(h for (h, layer, p) in keys if layer is None and p == "weight")
    if with_lm and len(with_lm) != num_heads:
        missing = sorted(set(range(num_heads)) - set(with_lm))
        raise ConvertError(f"{_where(source, keys)}: heads {with_lm} have their own lm_head "
                           f"({prefix}{{h}}.{num_layers}.weight) but heads {missing} do not")
    has_lm_head = bool(with_lm)
    fmt = _PREFIXES.get(prefix) or ("medusa_v1" if has_lm_head else "medusa_v2")
    heads = MedusaHeads(fmt, path, source, owns, num_heads, num_layers, has_lm_head, keys, config,
                        config_path)
    _check_config_counts(heads)
    _check_shapes(heads, base)
    return heads


def _amphista(path: Path, base: BaseModel) -> MedusaHeads:
    """An Amphista drafter directory: amphista.safetensors + config.json (drafter, amphista shape,
    hidden_size, optional draft_vocab), checked against the base: every tensor the drafter's shape
    names, no other, each with its shape."""
    from medusa_trt.drafters.amphista import AmphistaConfig

    config_path = path / "config.json"
    if not config_path.is_file():
        raise ConvertError(f"{path}: an Amphista drafter needs its config.json beside {AMPHISTA_FILE}")
    config = read_json(config_path)
    if config.get("drafter") != "amphista":
        raise ConvertError(f"{config_path}: drafter {config.get('drafter')!r}; expected \"amphista\" beside "
                           f"{AMPHISTA_FILE}")
    try:
        shape = AmphistaConfig.from_dict(config.get("amphista"), str(config_path))
    except (TypeError, ValueError) as e:
        raise ConvertError(str(e).replace("medusa_trt.amphista", "amphista")) from None
    arch = base_config(base)  # the base's shape as the merged checkpoint records it
    base_shape = {"hidden_size": arch["hidden_size"], "vocab_size": arch["vocab_size"],
                  "num_attention_heads": arch["num_attention_heads"],
                  "num_key_value_heads": arch["num_key_value_heads"], "head_dim": arch["head_size"]}
    for key, want in base_shape.items():  # all but hidden_size optional: drafters written before them lack them
        value = config.get(key)
        if (key == "hidden_size" or value is not None) and value != want:
            raise ConvertError(f"{config_path}: {key} {value!r} does not match the base {key} {want} "
                               f"({base.config_path})")
    source = TensorSource.open([path / AMPHISTA_FILE])
    heads = MedusaHeads("amphista", path, source, True, shape.num_heads, 0, shape.lm_head == "own",
                        {(0, None, n): n for n in source.names()}, config, config_path)
    heads.amphista = shape.to_dict()
    return heads


def amphista_pieces(heads: MedusaHeads, config: dict) -> dict[str, Piece]:
    """Output name -> Piece for every tensor of an Amphista drafter (the merged config names its
    shape): a missing, extra or misshapen tensor is one error naming it."""
    from medusa_trt.drafters import drafter_tensors

    want = dict(drafter_tensors(config))
    have = set(heads.source.names())
    names = {n.removeprefix("amphista."): n for n in want}
    extra = sorted(have - set(names))
    if extra:
        raise ConvertError(f"{heads.source.where[extra[0]]}: tensor {extra[0]!r} is not part of an Amphista "
                           f"drafter of this shape ({heads.config_path})")
    return {full: Piece(heads.source, (short,), (want[full],)) for short, full in names.items()}


def _where(source: TensorSource, keys: dict) -> Path:
    return source.where[next(iter(keys.values()))]


def _unplaceable(source: TensorSource, name: str, why: str) -> ConvertError:
    where = source.where.get(name, source.files[0])
    return ConvertError(f"{where}: cannot place head tensor {name!r}: {why}")


def _check_config_counts(heads: MedusaHeads) -> None:
    cfg = heads.config
    if heads.format == "modelopt":
        block = cfg.get("medusa") if isinstance(cfg.get("medusa"), dict) else {}
        said = {"heads": block.get("num_medusa_heads"), "layers": block.get("num_medusa_layers")}
        names = {"heads": "medusa.num_medusa_heads", "layers": "medusa.num_medusa_layers"}
    else:
        said = {"heads": cfg.get("medusa_num_heads"), "layers": cfg.get("medusa_num_layers")}
        names = {"heads": "medusa_num_heads", "layers": "medusa_num_layers"}
    found = {"heads": heads.num_heads, "layers": heads.num_layers}
    for what in ("heads", "layers"):
        if said[what] is not None and said[what] != found[what]:
            log.warning("%s: %s is %s but the tensors hold %d %s; using %d (counted from the tensors)",
                        heads.config_path, names[what], said[what], found[what], what, found[what])
    if str(cfg.get("version", "")) == "2" and heads.has_lm_head:
        log.warning("%s: version \"2\" means heads without their own lm_head, but %s has one per head; "
                    "using them", heads.config_path, heads.path)


def _check_shapes(heads: MedusaHeads, base: BaseModel) -> None:
    d, vocab = base.hf_config["hidden_size"], base.hf_config["vocab_size"]
    cfg_path = base.config_path
    for (h, layer, param), name in heads.keys.items():
        shape = heads.source.shapes[name]
        where = f"{heads.source.where[name]}: head tensor {name!r}"
        if param == "input_scale" or param == "weight_scale":
            if len(shape) > 1 or (shape and shape[0] != 1):
                raise ConvertError(f"{where} has shape {list(shape)}, expected a per-tensor scale [] or [1]")
            continue
        if layer is None:  # the head's own lm_head [vocab, hidden]
            if len(shape) != 2 or shape[1] != d:
                raise ConvertError(f"{where} has shape {list(shape)}: hidden size "
                                   f"{shape[-1] if shape else None} does not match the base hidden_size "
                                   f"{d} ({cfg_path})")
            if shape[0] != vocab:
                raise ConvertError(f"{where} has shape {list(shape)}: vocab {shape[0]} does not match the "
                                   f"base vocab_size {vocab} ({cfg_path})")
        elif param == "weight" and shape != (d, d):
            raise ConvertError(f"{where} has shape {list(shape)}: head hidden size does not match the base "
                               f"hidden_size {d} ({cfg_path}); expected [{d}, {d}]")
        elif param == "bias" and shape != (d,):
            raise ConvertError(f"{where} has shape {list(shape)}: head hidden size does not match the base "
                               f"hidden_size {d} ({cfg_path}); expected [{d}]")
        fp8 = heads.source.dtypes[name] in FP8_DTYPES
        if param == "weight" and fp8 and (h, layer, "weight_scale") not in heads.keys:
            raise ConvertError(f"{where} is FP8 but has no weight_scale to dequantize it with")


def head_pieces(heads: MedusaHeads, base: BaseModel, config: dict) -> dict[str, Piece]:
    """Output name -> Piece for every Medusa tensor; heads without an lm_head get the base's."""
    d, vocab = config["hidden_size"], config["vocab_size"]
    pieces: dict[str, Piece] = {}
    scaled = [k for k in heads.keys if k[2] == "input_scale"]
    if scaled:
        log.info("%s: dropping %d FP8 input scales of the heads; activation scales are recalibrated when "
                 "quantizing", heads.path, len(scaled))
    for h in range(heads.num_heads):
        for layer in range(heads.num_layers):
            prefix = medusa_linear_prefix(h, layer)
            for param, shape in (("weight", (d, d)), ("bias", (d,))):
                scale = heads.keys.get((h, layer, "weight_scale")) if param == "weight" else None
                pieces[f"{prefix}.{param}"] = Piece(heads.source, (heads.keys[(h, layer, param)],),
                                                    (shape,), (scale,))
        if heads.has_lm_head:
            pieces[medusa_lm_head(h)] = Piece(heads.source, (heads.keys[(h, None, "weight")],),
                                              ((vocab, d),), (heads.keys.get((h, None, "weight_scale")),))
        else:
            pieces[medusa_lm_head(h)] = Piece(base.weights, (base_lm_head_key(base),), ((vocab, d),))
    return pieces


def draft_vocab(heads: MedusaHeads, vocab_size: int) -> list[int] | None:
    """The heads' draft vocabulary (config.json `draft_vocab`, written by medusa-train-heads when the
    heads were trained over a vocabulary subset), checked as every reader checks it, in ascending order."""
    ids = heads.config.get("draft_vocab")
    if ids is None:
        return None
    return check_draft_vocab(ids, vocab_size, f"{heads.config_path or heads.path}: draft_vocab", ConvertError)
