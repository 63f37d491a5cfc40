"""medusa-build's engine: merged checkpoint -> engine directory, one builder per backend.

What every backend shares lives here: checkpoint validation, the atomic directory write (a temp
dir beside --out, renamed at the end), the tokenizer copy, checksums and `engine.json`. A backend
is one function in BUILDERS that writes its artifacts into the temp dir and returns its part of
engine.json (onnxruntime here; tensorrt and tensorrt-llm in their own modules, which import the
options, BuildError, the limits and the progress bar from engines/options.py, not from here).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import platform
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from medusa_trt.checkpoint import read_config, validate_checkpoint
from medusa_trt.engine_dir import (  # noqa: F401 (re-exported: the engine format's names used to live here)
    DEVICES,
    DTYPES,
    ENGINE_FORMAT_VERSION,
    ENGINE_JSON,
    OUTPUT_NAMES,
    artifact_checksums,
    graph_outputs,
    sha256_file,
    validate_engine,
    verify_artifacts,
)
from medusa_trt.engines.options import (  # BuildError, BuildOptions: also imported from here by their users
    BuildError,
    BuildOptions,
    limits_for,
    progress_bar,
)
from medusa_trt.errors import CheckpointError
from medusa_trt.outputs import atomic_output_dir, check_output_dir

log = logging.getLogger(__name__)

_CHECKPOINT_ONLY = ("config.json",)  # checkpoint files that are not copied into the engine


@dataclass(frozen=True)
class BuildResult:
    out: Path
    engine: dict  # the engine.json written
    seconds: float


# A builder gets the options, the validated checkpoint config and the temp engine dir; it writes its
# artifacts there and returns its engine.json entries (at least "dtype").
Builder = Callable[[BuildOptions, dict, Path], dict]


# ONNX Runtime (1.31) fuses DequantizeLinear -> MatMul at its extended optimization levels into
# MatMulIntegerToFloat, whose kernel has no float8 input: an FP8 graph fails to load. Turning off the
# QDQ fusions (and only them) keeps every other fusion of the default level; ONNX Runtime then folds
# the weights' DequantizeLinear into float initializers at load, and the activations' Q/DQ run as
# written. medusa_trt.runtime.ort_backend.session_options sets it for every engine (a float graph
# has no Q/DQ, so nothing changes there); engine.json records it for FP8 engines.
FP8_SESSION_CONFIG = {"session.disable_quant_qdq": "1"}


def _quantization_part(config: dict) -> dict | None:
    quant = config.get("quantization") or {}
    if not (quant.get("quant_algo") or quant.get("kv_cache_quant_algo")):
        return None
    return {
        "quant_algo": quant.get("quant_algo"),
        "kv_cache_quant_algo": quant.get("kv_cache_quant_algo"),
        "exclude_modules": quant.get("exclude_modules"),
        "onnx": "per-tensor float8e4m3fn QuantizeLinear/DequantizeLinear: weights as float8 initializers "
                "behind DequantizeLinear, Linear inputs (and new K/V with an FP8 KV cache) quantized-"
                "dequantized with the calibrated scales, in float32",
        "session_config": FP8_SESSION_CONFIG,
        "session_config_why": "ONNX Runtime 1.31 fuses DequantizeLinear->MatMul into MatMulIntegerToFloat at "
                              "the extended/all levels, which rejects float8 inputs; disabling the QDQ fusions "
                              "keeps the other optimizations (ORT_ENABLE_BASIC would also work, without them)",
    }


# -- int4 weights (medusa-build --weights int4; engine.json "weights" section) ----------------------
# Chosen on a 2-core AVX-512 VNNI CPU with ONNX Runtime 1.31 (BENCHMARKS.md, issue 13): accuracy
# level 4 (int8 activations per block) runs SmolLM2-135M-sized MatMuls several times faster than
# level 0, which is slower than float32 below the lm_head's size; block 32 was fastest at one row.
INT4_DEFAULT_BLOCK_SIZE = 32
INT4_DEFAULT_ACCURACY_LEVEL = 4
# Zero points by default: per-block float offsets (--int4-offsets) and an 8-bit lm_head keep a GGUF's
# Q4_1 / Q8_0 weights exactly (top-1 agreement with float32 0.665 -> 0.968 on SmolLM2) but cost a step
# 1.15-1.23x on the AVX2 CPU (BENCHMARKS.md, issue 13 (p)), and the peers measured run zero-anchored grids.


def default_attention(opset: int, weights: dict) -> str:
    """The fastest exact attention form: int4 weights with int8 activations (accuracy level 4) turn
    float32 rounding noise into different logits, so their tree rows and one-row steps must agree
    bit for bit. "chain_f32" (engines/onnx_export.py) does for plain steps and chain trees, the
    trees that pay on a CPU (every tuned int4 tree so far is one), ~4% faster a step than
    "row_exact_f32", which keeps branching trees exact too; "row_exact", in float64, costs ~10% more
    (BENCHMARKS.md, issue 13). Float engines keep the fused Attention op ("split" below opset 23)."""
    from medusa_trt.engines.onnx_export import DEFAULT_ATTENTION

    if weights.get("format") == "int4" and weights.get("accuracy_level") == 4:
        return "chain_f32"
    return DEFAULT_ATTENTION if opset >= 23 else "split"


def gguf_blocks_hint(config: dict, offsets: bool, lm_head_bits: int) -> str | None:
    """What --weights int4 without the GGUF-exact options gives up on a checkpoint converted from a
    GGUF whose blocks those options would keep (its tensor types, as medusa-convert records them):
    the default re-rounds Q4_1 blocks onto zero-point grids and a Q8_0 lm_head onto 4 bits, a
    second rounding as large as the first. None when there is nothing to keep."""
    types = ((config.get("medusa_trt") or {}).get("gguf") or {}).get("tensor_types") or {}
    missing = [f for f, kept in (("--int4-offsets", "Q4_1" not in types or offsets),
                                 ("--int4-lm-head-bits 8", "Q8_0" not in types or lm_head_bits == 8)) if not kept]
    if not missing:
        return None
    blocks = " and ".join(f"{t} ({types[t]} tensor{'s' * (types[t] != 1)})" for t in ("Q4_1", "Q8_0") if t in types)
    return (f"the base came from a GGUF of {blocks}; {' '.join(missing)} would keep those blocks exactly "
            "(SmolLM2-135M: top-1 agreement with float32 0.97 against 0.66, a step ~1.2x; BENCHMARKS.md, "
            "issue 13 (p)), this build re-quantizes them")


def _quantize_int4(opts: BuildOptions, config: dict, model) -> dict:
    """Quantizes `model` in place for --weights int4; returns engine.json's "weights" section."""
    from medusa_trt.quant import INT4_ACCURACY_LEVELS, INT4_BLOCK_SIZES, LM_HEAD_BITS, quantize_model_int4

    block = int(opts.extra.get("int4_block_size", INT4_DEFAULT_BLOCK_SIZE))
    level = int(opts.extra.get("int4_accuracy_level", INT4_DEFAULT_ACCURACY_LEVEL))
    if block not in INT4_BLOCK_SIZES:
        raise BuildError(f"--int4-block-size {block}: expected one of {', '.join(map(str, INT4_BLOCK_SIZES))}")
    if level not in INT4_ACCURACY_LEVELS:
        raise BuildError(f"--int4-accuracy-level {level}: expected one of {', '.join(map(str, INT4_ACCURACY_LEVELS))}")
    if (config.get("quantization") or {}).get("quant_algo"):
        raise BuildError(f"{opts.checkpoint / 'config.json'}: an FP8 checkpoint cannot be built with --weights "
                         "int4; convert the base without --quantize fp8")
    offsets = bool(opts.extra.get("int4_offsets", False))
    lm_head_bits = int(opts.extra.get("int4_lm_head_bits", 4))
    if lm_head_bits not in LM_HEAD_BITS:
        raise BuildError(f"--int4-lm-head-bits {lm_head_bits}: expected one of {', '.join(map(str, LM_HEAD_BITS))}")
    hint = gguf_blocks_hint(config, offsets, lm_head_bits)
    if hint:
        log.warning("%s: %s", opts.checkpoint / "config.json", hint)
    skipped = quantize_model_int4(model, block, level, draft=True, offsets=offsets, lm_head_bits=lm_head_bits)
    for name in skipped:
        log.warning("--weights int4: %s stays %s: its input size is not a multiple of --int4-block-size %d",
                    name, model.dtype, block)
    return {"format": "int4", "op": "com.microsoft.MatMulNBits", "bits": 4, "block_size": block,
            "accuracy_level": level, "symmetric": False, "offsets": offsets, "lm_head": "lm_head" not in skipped,
            "lm_head_bits": lm_head_bits,
            "heads_use_lm_head": bool(model.drafter.uses_base_lm_head), "draft_int4": model.drafter.draft_int4 is not None,
            "float_linears": skipped}


# engines/onnx_fusions.py; each measured alone on SmolLM2-135M (BENCHMARKS.md, issue 13).
ORT_DEFAULT_FUSIONS = ("rotary", "skip_norm", "gate_up")


def _ort_fusions(opts: BuildOptions, config: dict, model, graphs: list) -> dict[str, int]:
    """Rewrites the decoder and step graphs with ONNX Runtime's fused ops (opts.extra["fusions"],
    default ORT_DEFAULT_FUSIONS); returns how many patterns each fusion replaced per graph."""
    from medusa_trt.engines.onnx_fusions import FUSIONS, fuse_onnx_file, rotary_caches

    fusions = list(opts.extra.get("fusions", ORT_DEFAULT_FUSIONS))
    unknown = sorted(set(fusions) - set(FUSIONS))
    if unknown:
        raise BuildError(f"fusions {unknown}: expected some of {', '.join(FUSIONS)}")
    if not fusions:
        return {}
    positions = opts.max_seq_len or int(config["max_position_embeddings"])  # the runtime keeps positions below
    cos, sin = rotary_caches(model.inv_freq, positions, model.dtype)
    counts: dict[str, int] = {}
    for path in graphs:
        if path is not None:
            for name, n in fuse_onnx_file(path, fusions, cos, sin).items():
                counts[name] = max(counts.get(name, 0), n)
    return counts


def _cache_in_place(opts: BuildOptions, config: dict, result) -> bool:
    """Rewrites the decoder and step graphs to write new K/V into the cache buffers in place
    (engines/onnx_fusions.py: write_cache_in_place) when the attention form places each new token
    at its own sequence's length, on CPU engines (opts.extra["cache_in_place"], default on). Both
    graphs or neither: the runtime binds one way for the whole engine."""
    from medusa_trt.engines.onnx_export import ATTENTION_FORMS
    from medusa_trt.engines.onnx_fusions import STACKED_KV, write_cache_in_place

    if not (ATTENTION_FORMS[result.attention].places_new_keys and opts.device == "cpu"
            and opts.extra.get("cache_in_place", True)):
        return False
    layers = config["num_hidden_layers"]
    graphs = [p for p in (result.path, result.step_path) if p is not None]
    done = [write_cache_in_place(p, layers, STACKED_KV) for p in graphs]
    if any(n != 2 * layers for n in done):
        raise BuildError(f"{', '.join(map(str, graphs))}: the cache writes of {done} caches were rewritten in "
                         f"place, expected {2 * layers} per graph (an exporter change the rewrite does not know)")
    return True


def _build_onnxruntime(opts: BuildOptions, config: dict, workdir: Path) -> dict:
    from medusa_trt.engines.onnx_export import ATTENTION_FORMS, DEFAULT_OPSET, export_onnx
    from medusa_trt.engines.onnx_fusions import TENSOR_SCATTER_OPSET
    from medusa_trt.engines.onnx_weights import share_weights
    from medusa_trt.modeling import MedusaModel

    opset = opts.opset or DEFAULT_OPSET
    dtype = resolve_dtype(opts, config)
    steps = ["load checkpoint", "export ONNX"]
    bar = progress_bar(len(steps), opts.progress, "medusa-build")
    try:
        bar.set_postfix_str(steps[0])
        model = MedusaModel.from_checkpoint(opts.checkpoint, dtype=dtype)
        weights = {"format": "float"}
        if opts.extra.get("weights", "float") == "int4":
            weights = _quantize_int4(opts, config, model)
        attention = opts.attention or default_attention(opset, weights)
        bar.update()
        bar.set_postfix_str(steps[1])
        try:
            result = export_onnx(model, workdir / "model.onnx", attention=attention, opset=opset,
                                 fused_step=opts.extra.get("fused_step", True))
        except ValueError as e:  # an option the exporter refuses (opset, attention form)
            raise BuildError(str(e)) from None
        fusions = _ort_fusions(opts, config, model, [result.path, result.step_path])
        in_place = _cache_in_place(opts, config, result)
        # One copy of the weights for all graphs (engines/onnx_weights.py): the step graph and the
        # heads graph would otherwise each repeat the decoder's weights.
        shared = share_weights([p for p in (result.path, result.heads_path, result.step_path) if p is not None])
        log.info("%s: %.0f MB of graph weights stored as %.0f MB (%d tensors)", shared.path,
                 shared.graph_bytes / 1e6, shared.file_bytes / 1e6, shared.tensors)
        bar.update()
    finally:
        bar.close()
    part = {
        "dtype": dtype,
        "weights": weights,
        "onnx": {"file": result.path.name, "opset": max(result.opset, TENSOR_SCATTER_OPSET) if in_place else result.opset,
                 "attention": result.attention,
                 # Tree steps stay inside one block of this many keys (engines/onnx_export.py: KEY_BLOCK).
                 **({"key_block": block} if (block := ATTENTION_FORMS[result.attention].key_block) else {}),
                 # Only chain trees are exact: the runtime verifies a tree's main chain (tree.main_chain).
                 **({"chains_only": True} if ATTENTION_FORMS[result.attention].chains_only else {}),
                 "external_data": True, "weights_file": shared.path.name,
                 # Off (--no-prepack): the sessions share one mapping of weights_file (runtime/ort_backend.py).
                 "prepack_weights": bool(opts.extra.get("prepack_weights", True)),
                 "inputs": list(result.input_names),
                 "outputs": graph_outputs(OUTPUT_NAMES, config["num_hidden_layers"], in_place),
                 # New K/V written into the cache inputs, returned as present_* outputs that the runtime
                 # binds to the same memory (engines/onnx_fusions.py: write_cache_in_place).
                 "cache_in_place": in_place,
                 "heads_file": result.heads_path.name if result.heads_path else None,
                 "shared_lm_head": result.shared_lm_head,
                 # The fused greedy step graph (engines/onnx_export.py), used for greedy decoding of
                 # trees whose ranks are all below step_topk.
                 "step_file": result.step_path.name if result.step_path else None,
                 "step_topk": result.step_topk,
                 # ONNX Runtime contrib ops written in place of plain ones (engines/onnx_fusions.py).
                 "fusions": fusions},
    }
    quant = _quantization_part(config)
    if quant:
        part["quantization"] = quant
    return part


def _build_tensorrt(opts: BuildOptions, config: dict, workdir: Path) -> dict:
    from medusa_trt.engines.tensorrt import build_tensorrt  # imported on use: TensorRT is an optional extra

    return build_tensorrt(opts, config, workdir)


def _build_trtllm(opts: BuildOptions, config: dict, workdir: Path) -> dict:
    from medusa_trt.engines.trtllm import build_trtllm

    return build_trtllm(opts, config, workdir)


BUILDERS: dict[str, Builder] = {
    "onnxruntime": _build_onnxruntime,
    "tensorrt": _build_tensorrt,
    "tensorrt-llm": _build_trtllm,
}


def resolve_dtype(opts: BuildOptions, config: dict) -> str:
    """The engine's compute dtype. CPU engines default to float32: float16 graphs run on ONNX
    Runtime's CPU provider with casts around ops it has no float16 kernel for, which measured 4-7%
    slower than float32 on a 10M model (and less exact). bfloat16 is refused: numpy, through which
    the runtime hands buffers to ONNX Runtime, has no bfloat16."""
    dtype = opts.dtype or ("float32" if opts.device == "cpu" else config["dtype"])
    if dtype == "bfloat16":
        hint = "float32" if opts.device == "cpu" else "float16"
        raise BuildError(f"dtype bfloat16{' (the checkpoint dtype)' if not opts.dtype else ''}: ONNX Runtime "
                         f"engines run float32 or float16; pass --dtype {hint}")
    if dtype not in DTYPES:
        raise BuildError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if dtype != config["dtype"]:
        log.info("checkpoint dtype %s, engine dtype %s (weights cast at export)", config["dtype"], dtype)
    return dtype


def check_options(opts: BuildOptions, config: dict) -> None:
    if opts.backend not in BUILDERS:
        raise BuildError(f"--backend {opts.backend!r}: expected one of {', '.join(BUILDERS)}")
    if opts.device not in DEVICES:
        raise BuildError(f"--device {opts.device!r}: expected one of {', '.join(DEVICES)}")
    path = opts.checkpoint / "config.json"
    if config.get("architecture") != "MedusaForCausalLM":
        raise BuildError(f"{path}: architecture {config.get('architecture')!r} is not a merged checkpoint "
                         "(expected 'MedusaForCausalLM'; run medusa-convert first)")
    quant = (config.get("quantization") or {})
    for key in ("quant_algo", "kv_cache_quant_algo"):
        if quant.get(key) not in (None, "FP8"):
            raise BuildError(f"{path}: quantization.{key} {quant[key]!r} is not supported; expected FP8 or null "
                             "(medusa-convert --quantize fp8 / --kv-cache-dtype fp8)")
    if (quant.get("quant_algo") or quant.get("kv_cache_quant_algo")) and opts.opset is not None and opts.opset < 19:
        raise BuildError(f"--opset {opts.opset}: an FP8 checkpoint ({path}) needs opset >= 19 "
                         "(float8 QuantizeLinear/DequantizeLinear)")
    if opts.extra.get("weights", "float") != "float" and opts.backend != "onnxruntime":
        raise BuildError(f"--weights {opts.extra['weights']}: only --backend onnxruntime builds int4 engines")
    for name in ("max_batch_size", "max_seq_len", "max_draft_len"):
        value = getattr(opts, name)
        if value is not None and value < 1:
            raise BuildError(f"--{name.replace('_', '-')} {value}: expected a positive integer")
    max_pos = int(config["max_position_embeddings"])
    if opts.max_seq_len is not None and opts.max_seq_len > max_pos:
        raise BuildError(f"--max-seq-len {opts.max_seq_len} exceeds the model's max_position_embeddings "
                         f"{max_pos} ({path})")


def build_engine(opts: BuildOptions) -> BuildResult:
    """Validates the checkpoint, builds the engine in a temp dir and renames it to opts.out."""
    start = time.perf_counter()
    opts.checkpoint, opts.out = Path(opts.checkpoint), Path(opts.out)
    try:
        validate_checkpoint(opts.checkpoint)
        config = read_config(opts.checkpoint)
    except CheckpointError as e:
        raise BuildError(str(e)) from None
    check_options(opts, config)
    check_output_dir(opts.out, opts.force, BuildError)
    if opts.out.resolve() == opts.checkpoint.resolve() or opts.checkpoint.resolve().is_relative_to(opts.out.resolve()):
        raise BuildError(f"{opts.out}: --out must not be or contain the checkpoint {opts.checkpoint}")

    with atomic_output_dir(opts.out, opts.force, BuildError) as tmp:
        backend_part = BUILDERS[opts.backend](opts, config, tmp)
        _copy_tokenizer(opts.checkpoint, tmp)
        engine = engine_json(opts, config, backend_part, tmp, time.perf_counter() - start)
        validate_engine(engine, opts.out / ENGINE_JSON)  # the writer obeys the schema its readers check
        (tmp / ENGINE_JSON).write_text(json.dumps(engine, indent=2) + "\n")
    return BuildResult(opts.out, engine, time.perf_counter() - start)


def engine_json(opts: BuildOptions, config: dict, backend_part: dict, workdir: Path, seconds: float) -> dict:
    heads = int(config["num_attention_heads"])
    limits = limits_for(opts, config)
    engine = {
        "format_version": ENGINE_FORMAT_VERSION,
        "backend": opts.backend,
        "device": opts.device,
        "dtype": backend_part.pop("dtype"),
        "model": {
            "model_type": config.get("model_type"),
            "vocab_size": int(config["vocab_size"]),
            "hidden_size": int(config["hidden_size"]),
            "intermediate_size": int(config["intermediate_size"]),
            "num_layers": int(config["num_hidden_layers"]),
            "num_heads": heads,
            "num_kv_heads": int(config.get("num_key_value_heads") or heads),
            "head_dim": int(config.get("head_size") or int(config["hidden_size"]) // heads),
            "max_position_embeddings": int(config["max_position_embeddings"]),
        },
        "medusa": {
            "num_heads": int(config.get("num_medusa_heads") or 0),
            "num_layers": int(config.get("num_medusa_layers") or 0),
            "max_draft_len": limits.max_draft_len,
        },
        "limits": asdict(limits),
        **backend_part,
        "eos_token_id": config.get("eos_token_id"),
        # The HF model_type the tokenizer belongs to: transformers picks the tokenizer class from it
        # when tokenizer_config.json names a generic class, and the engine dir has no config.json.
        "tokenizer": {"model_type": (config.get("medusa_trt") or {}).get("base_model_type") or config.get("model_type")},
        "checkpoint": {
            "path": str(opts.checkpoint.resolve()),
            "dtype": config.get("dtype"),
            "config_sha256": sha256_file(opts.checkpoint / "config.json"),
        },
        "artifacts": artifact_checksums(workdir),
        "tools": tool_versions(),
        "build": {"seconds": round(seconds, 3), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()}},
    }
    return engine


def tool_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for dist in ("medusa-trt", "torch", "onnx", "onnxruntime", "onnxruntime-gpu", "onnxscript", "transformers"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def _copy_tokenizer(checkpoint: Path, workdir: Path) -> None:
    """Everything in the checkpoint that is not weights or its config: tokenizer, generation config."""
    for path in sorted(checkpoint.iterdir()):
        if path.is_file() and path.name not in _CHECKPOINT_ONLY and not path.name.endswith(".safetensors"):
            shutil.copy2(path, workdir / path.name)

