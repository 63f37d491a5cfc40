"""medusa-build --backend onnxruntime: the ONNX Runtime engine builder and its options (OrtOptions).

The pipeline, in build_onnxruntime's order: load the checkpoint (quantized in place for --weights
int4), pick the attention form (onnx/attention.py), export the decoder, heads and fused step graphs
(onnx/export.py), rewrite them with ONNX Runtime's fused ops (fusions.py) and, where the attention
form allows it, to write the cache in place, then store one copy of their weights (weights.py).
Returns the engine.json part of the backend: dtype, "weights", "onnx" and, for FP8 checkpoints,
"quantization".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

from medusa_trt.engine_dir import DTYPES, OUTPUT_NAMES, graph_outputs
from medusa_trt.engines.options import (
    BackendOptions,
    BuildError,
    BuildOptions,
    backend_options,
    limits_for,
    progress_bar,
)

log = logging.getLogger(__name__)


# ONNX Runtime (1.31) fuses DequantizeLinear -> MatMul at its extended optimization levels into
# MatMulIntegerToFloat, whose kernel has no float8 input: an FP8 graph fails to load. Turning off the
# QDQ fusions (and only them) keeps every other fusion of the default level; ONNX Runtime then folds
# the weights' DequantizeLinear into float initializers at load, and the activations' Q/DQ run as
# written. medusa_trt.runtime.ort.session.session_options sets it for every engine (a float graph
# has no Q/DQ, so nothing changes there); engine.json records it for FP8 engines.
FP8_SESSION_CONFIG = {"session.disable_quant_qdq": "1"}

# -- int4 weights (medusa-build --weights int4; engine.json "weights" section) ----------------------
# Chosen on a 2-core AVX-512 VNNI CPU with ONNX Runtime 1.31 (docs/benchmarks/issue-13-int4.md):
# accuracy level 4 (int8 activations per block) runs SmolLM2-135M-sized MatMuls several times faster
# than level 0, which is slower than float32 below the lm_head's size; block 32 was fastest at one row.
INT4_DEFAULT_BLOCK_SIZE = 32
INT4_DEFAULT_ACCURACY_LEVEL = 4
# Zero points by default: per-block float offsets (--int4-offsets) and an 8-bit lm_head keep a GGUF's
# Q4_1 / Q8_0 weights exactly (top-1 agreement with float32 much closer on SmolLM2) but cost a slower
# step on the AVX2 CPU (docs/benchmarks/issue-13-int4.md (p)), and the peers measured run
# zero-anchored grids.

# -- int4 zero-point blocks: "calibrated" searches each block's grid for the least error weighted by
# its inputs' mean squares on calibration text (quant.quantize_int4); "nearest" rounds onto the
# block's own range, as onnxruntime-genai's builder does. Same format, same step cost; on SmolLM2
# top-1 agreement with float32 0.68 -> 0.78 (docs/benchmarks/issue-35-amphista.md, section ad).
INT4_ROUNDINGS = ("calibrated", "nearest")

# -- int8 (--weights int8): float input channels, chosen on SmolLM2-135M (docs/benchmarks/issue-35-
# amphista.md, section ac): 16 per Linear bring the reference's top-1 agreement with float32 from
# 0.88 to 0.96 (8: 0.95).
INT8_DEFAULT_FLOAT_CHANNELS = 16

# fusions.py; each measured alone on SmolLM2-135M (docs/benchmarks/issue-13-int4.md).
ORT_DEFAULT_FUSIONS = ("rotary", "skip_norm", "gate_up")


@dataclass(frozen=True)
class OrtOptions(BackendOptions):
    """medusa-build's ONNX Runtime options (the flags marked "onnxruntime" in its --help)."""

    backend: ClassVar[str] = "onnxruntime"

    weights: str = "float"  # --weights: "int4" 4-bit weight-only MatMulNBits; "int8" int8 weights and
    # activations (MatMulInteger); "float": the engine dtype
    int4_block_size: int = INT4_DEFAULT_BLOCK_SIZE  # --int4-block-size; read with weights "int4" only
    int4_accuracy_level: int = INT4_DEFAULT_ACCURACY_LEVEL  # --int4-accuracy-level
    # --int4-offsets / --no-int4-offsets: a float offset per block instead of a zero point;
    # --int4-lm-head-bits. None: as the checkpoint's GGUF blocks say (gguf_int4_defaults).
    int4_offsets: bool | None = None
    int4_lm_head_bits: int | None = None
    int4_rounding: str = "calibrated"  # --int4-rounding (INT4_ROUNDINGS); zero-point blocks only
    int8_float_channels: int = INT8_DEFAULT_FLOAT_CHANNELS  # --int8-float-channels; 0: none
    calibration: Path | None = None  # --calibration; None: text the model samples itself
    fusions: tuple[str, ...] = ORT_DEFAULT_FUSIONS  # fusions.FUSIONS to apply; () for the plain graphs
    cache_in_place: bool = True  # off: --no-cache-in-place
    fused_step: bool = True  # off: --no-fused-step
    prepack_weights: bool = True  # off: --no-prepack

    def check(self) -> None:
        """Raises BuildError for a value the builder cannot use, naming its flag."""
        from medusa_trt.engines.ort.fusions import FUSIONS
        from medusa_trt.quant import INT4_ACCURACY_LEVELS, INT4_BLOCK_SIZES, LM_HEAD_BITS

        if self.weights == "int4":
            for flag, value, allowed in (("--int4-block-size", self.int4_block_size, INT4_BLOCK_SIZES),
                                         ("--int4-accuracy-level", self.int4_accuracy_level, INT4_ACCURACY_LEVELS),
                                         ("--int4-lm-head-bits", self.int4_lm_head_bits, LM_HEAD_BITS)):
                if value not in allowed:
                    raise BuildError(f"{flag} {value}: expected one of {', '.join(map(str, allowed))}")
        if self.int4_rounding not in INT4_ROUNDINGS:
            raise BuildError(f"--int4-rounding {self.int4_rounding!r}: expected one of {', '.join(INT4_ROUNDINGS)}")
        if self.int8_float_channels < 0:
            raise BuildError(f"--int8-float-channels {self.int8_float_channels}: expected a count >= 0")
        if self.calibration is not None and not self.calibrates:
            raise BuildError(f"--calibration {self.calibration}: read only with --weights int8 and "
                             "--int8-float-channels above 0, or --weights int4 with --int4-rounding calibrated "
                             "(not --int4-offsets, which a base from a GGUF of Q4_1 blocks gets unless "
                             "--no-int4-offsets)")
        unknown = sorted(set(self.fusions) - set(FUSIONS))
        if unknown:
            raise BuildError(f"fusions {unknown}: expected some of {', '.join(FUSIONS)}")

    @property
    def calibrates(self) -> bool:
        """Whether the build runs calibration text through the model: int8 float channels, or int4
        zero-point blocks searched against the inputs' mean squares."""
        if self.weights == "int8":
            return self.int8_float_channels > 0
        return self.weights == "int4" and self.int4_rounding == "calibrated" and not self.int4_offsets


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


def _gguf_tensor_types(config: dict) -> dict[str, int]:
    """The GGUF tensor types medusa-convert recorded for a base it read from a GGUF ({} otherwise)."""
    return ((config.get("medusa_trt") or {}).get("gguf") or {}).get("tensor_types") or {}


def gguf_int4_defaults(ort: OrtOptions, config: dict) -> OrtOptions:
    """`ort` with --int4-offsets and --int4-lm-head-bits decided where the flags left them (None):
    a base read from a GGUF of Q4_1 blocks keeps them exactly (offsets), and its Q8_0 embedding, the
    tied lm_head, as int8 blocks. Re-rounding such blocks onto zero-point grids is a second rounding
    as large as the first (top-1 agreement with the GGUF 0.78 against 0.96 on SmolLM2, at a 14%
    faster plain step: BENCHMARKS.md, int4 engines); the flags choose that explicitly."""
    types = _gguf_tensor_types(config)
    offsets = ("Q4_1" in types) if ort.int4_offsets is None else ort.int4_offsets
    bits = (8 if "Q8_0" in types else 4) if ort.int4_lm_head_bits is None else ort.int4_lm_head_bits
    return replace(ort, int4_offsets=offsets, int4_lm_head_bits=bits)


def gguf_blocks_hint(config: dict, offsets: bool, lm_head_bits: int) -> str | None:
    """What --weights int4 without the GGUF-exact options gives up on a checkpoint converted from a
    GGUF whose blocks those options would keep (its tensor types, as medusa-convert records them):
    --no-int4-offsets re-rounds Q4_1 blocks onto zero-point grids and --int4-lm-head-bits 4 a Q8_0
    lm_head onto 4 bits, a second rounding as large as the first. None when there is nothing to keep."""
    types = _gguf_tensor_types(config)
    missing = [f for f, kept in (("--int4-offsets", "Q4_1" not in types or offsets),
                                 ("--int4-lm-head-bits 8", "Q8_0" not in types or lm_head_bits == 8)) if not kept]
    if not missing:
        return None
    blocks = " and ".join(f"{t} ({types[t]} tensor{'s' * (types[t] != 1)})" for t in ("Q4_1", "Q8_0") if t in types)
    return (f"the base came from a GGUF of {blocks}; {' '.join(missing)} (the default for it) would keep "
            "those blocks exactly (the GGUF's quality at a slower step: BENCHMARKS.md, int4 engines); this "
            "build re-quantizes them")


INT4_IMPORTANCE_FILE = "int4_importance.safetensors"  # engine.json weights.rounding.file


def _quantize_int4(opts: BuildOptions, ort: OrtOptions, config: dict, model, workdir: Path, dtype: str) -> dict:
    """Quantizes `model` in place for --weights int4; returns engine.json's "weights" section."""
    from medusa_trt.quant import INT4_BLOCK_SIZES, Int4Linear, base_linear_names, quantize_model_int4

    if (config.get("quantization") or {}).get("quant_algo"):
        raise BuildError(f"{opts.checkpoint / 'config.json'}: an FP8 checkpoint cannot be built with --weights "
                         "int4; convert the base without --quantize fp8")
    if dtype != "float32":  # the scales, the int8 embedding and medusa-check's reference are float32
        raise BuildError(f"--dtype {dtype} with --weights int4: expected float32 (a {dtype} int4 graph mixes its "
                         f"activations with float32 scales, which ONNX Runtime refuses to load)")
    block, level = ort.int4_block_size, ort.int4_accuracy_level
    # A block that fits no base Linear leaves a float graph recorded as int4, which no runtime loads.
    sizes = sorted({model.get_submodule(n).in_features for n in base_linear_names(model)})
    if all(size % block for size in sizes):
        raise BuildError(f"--int4-block-size {block}: no base Linear's input size ({', '.join(map(str, sizes))}) is "
                         f"a multiple of it, so nothing would be int4; expected one of "
                         f"{[b for b in INT4_BLOCK_SIZES if any(size % b == 0 for size in sizes)]}")
    offsets, lm_head_bits = ort.int4_offsets, ort.int4_lm_head_bits
    hint = gguf_blocks_hint(config, offsets, lm_head_bits)
    if hint:
        log.warning("%s: %s", opts.checkpoint / "config.json", hint)
    grids, rounding = None, "offsets" if offsets else "nearest"
    if ort.calibrates:
        from medusa_trt.calibration.activations import (
            calibrate_input_power,
            choose_searched_rows,
            int4_calibration_tensors,
        )
        from medusa_trt.safetensors_io import save_tensors

        samples, source = _calibration(opts, ort, config, model, "--int4-rounding nearest")
        importance = calibrate_input_power(model, samples)
        if lm_head_bits == 8:  # an int8 lm_head has no zero-point grid to search
            importance.pop("lm_head", None)
        rows, grids = choose_searched_rows(model, samples, importance, block)
        # The reference (medusa-check) searches the same grids: it reads the weights and rows from here.
        save_tensors(int4_calibration_tensors(importance, rows), workdir / INT4_IMPORTANCE_FILE)
        searched = sum(int(r.sum()) for r in rows.values())
        rounding = {"method": "calibrated", "calibration": source, "file": INT4_IMPORTANCE_FILE,
                    "searched_rows": f"{searched} of {sum(r.numel() for r in rows.values())}"}
    # The embedding as int8 rows, except where the rows are to stay the GGUF's own (--int4-offsets).
    skipped = quantize_model_int4(model, block, level, draft=True, offsets=offsets, lm_head_bits=lm_head_bits,
                                  embedding=not offsets, grids=grids)
    for name in skipped:
        log.warning("--weights int4: %s stays %s: its input size is not a multiple of --int4-block-size %d",
                    name, model.dtype, block)
    # Whether the drafter's own weights are int4 too (medusa-check quantizes its reference to match).
    drafter_int4 = any(isinstance(m, Int4Linear) for m in model.drafter.modules())
    return {"format": "int4", "op": "com.microsoft.MatMulNBits", "bits": 4, "block_size": block,
            "accuracy_level": level, "symmetric": False, "offsets": offsets, "lm_head": "lm_head" not in skipped,
            "lm_head_bits": lm_head_bits,
            "heads_use_lm_head": bool(model.drafter.uses_base_lm_head), "draft_int4": drafter_int4,
            "float_linears": skipped, "embedding": "float" if offsets else "int8", "rounding": rounding}


# Calibration (int8 float channels, int4 rounding): at most this many samples of at most this many
# tokens from --calibration, or this many sequences the model samples itself (a channel's peak is a
# property of the model: 8 x 64 sampled tokens chose channels about as good as 32 chat prompts,
# section ac).
CALIBRATION_SAMPLES, CALIBRATION_TOKENS, OWN_TEXT = 32, 512, (32, 128)


def _calibration(opts: BuildOptions, ort: OrtOptions, config: dict, model, without: str
                 ) -> tuple[list[list[int]], str]:
    """Token sequences to calibrate on, and what they were (engine.json). `without`: the flag that
    builds without calibration, for the error of a checkpoint with nothing to sample from."""
    from medusa_trt.calibration.activations import sample_own_text

    # Positions the engine never runs would calibrate on rotations it never sees.
    positions = limits_for(opts, config).max_seq_len
    if ort.calibration is not None:
        from transformers import AutoTokenizer

        from medusa_trt.data import DataError, read_prompts

        try:
            texts = read_prompts(ort.calibration)[:CALIBRATION_SAMPLES]
        except DataError as e:
            raise BuildError(f"--calibration {e}") from None
        try:
            tokenizer = AutoTokenizer.from_pretrained(opts.checkpoint)
        except (OSError, ValueError) as e:
            raise BuildError(f"{opts.checkpoint}: no tokenizer to read --calibration with ({e})") from None
        samples = [ids[:min(CALIBRATION_TOKENS, positions)] for ids in tokenizer(texts, add_special_tokens=False).input_ids if ids]
        if not samples:
            raise BuildError(f"--calibration {ort.calibration}: its texts read as no tokens; expected text")
        return samples, f"{ort.calibration}: {len(samples)} texts"
    start = config.get("bos_token_id")
    start = start[0] if isinstance(start, list) and start else start
    if not isinstance(start, int):
        raise BuildError(f"{opts.checkpoint / 'config.json'}: bos_token_id {start!r}: expected a token id to sample "
                         f"calibration text from; pass --calibration FILE or {without}")
    count, length = OWN_TEXT[0], min(OWN_TEXT[1], positions - 1)  # the start token takes a position
    return (sample_own_text(model, start, count, length),
            f"{count} x {length} tokens sampled from the model after token {start} (seed 0)")


def _quantize_int8(opts: BuildOptions, ort: OrtOptions, config: dict, model, dtype: str) -> dict:
    """Quantizes `model` in place for --weights int8; returns engine.json's "weights" section."""
    from medusa_trt.calibration.activations import FLOAT_CHANNEL_LINEARS, calibrate_float_channels
    from medusa_trt.quant import Int8Linear, base_linear_names, quantize_model_int8

    if (config.get("quantization") or {}).get("quant_algo"):
        raise BuildError(f"{opts.checkpoint / 'config.json'}: an FP8 checkpoint cannot be built with --weights "
                         "int8; convert the base without --quantize fp8")
    if dtype != "float32":
        raise BuildError(f"--dtype {dtype} with --weights int8: expected float32 (the int8 products are "
                         "scaled back to float32)")
    if opts.device != "cpu":
        raise BuildError(f"--device {opts.device} with --weights int8: expected cpu (ONNX Runtime's CUDA "
                         "MatMulInteger takes no uint8 rows; the form is for CPUs with int8 dot products)")
    channels, float_part = {}, None
    if ort.int8_float_channels:
        # As many float channels as a Linear has inputs would leave it float: an int8 engine in name only.
        narrowest = min(model.get_submodule(n).in_features for n in base_linear_names(model)
                        if n.rpartition(".")[2] in FLOAT_CHANNEL_LINEARS)
        if ort.int8_float_channels >= narrowest:
            raise BuildError(f"--int8-float-channels {ort.int8_float_channels}: the narrowest int8 Linear has "
                             f"{narrowest} input channels; expected fewer (the default is {INT8_DEFAULT_FLOAT_CHANNELS})")
        samples, source = _calibration(opts, ort, config, model, "--int8-float-channels 0")
        channels = calibrate_float_channels(model, samples, ort.int8_float_channels)
        float_part = {"count": len(next(iter(channels.values()))), "calibration": source, "channels": channels}
    quantize_model_int8(model, draft=True, embedding=True, float_channels=channels)
    scheme = "weights int8 per output channel, symmetric; activations int8 per row, symmetric"
    if float_part:
        scheme += "; each base Linear's float_channels input channels kept in float32 (a float MatMul beside)"
    return {"format": "int8", "op": "MatMulIntegerToFloat", "bits": 8, "scheme": scheme,
            "lm_head": True, "heads_use_lm_head": bool(model.drafter.uses_base_lm_head),
            "draft_int8": any(isinstance(m, Int8Linear) for m in model.drafter.modules()), "embedding": "int8",
            **({"float_channels": float_part} if float_part else {})}


def _ort_fusions(opts: BuildOptions, ort: OrtOptions, config: dict, model, graphs: list) -> dict[str, int]:
    """Rewrites the decoder and step graphs with ONNX Runtime's fused ops (ort.fusions); returns how
    many patterns each fusion replaced per graph."""
    from medusa_trt.engines.ort.fusions import fuse_onnx_file, rotary_caches

    if not ort.fusions:
        return {}
    positions = limits_for(opts, config).max_seq_len  # the runtime keeps positions below
    cos, sin = rotary_caches(model.inv_freq, positions, model.dtype)
    counts: dict[str, int] = {}
    for path in graphs:
        if path is not None:
            for name, n in fuse_onnx_file(path, list(ort.fusions), cos, sin).items():
                counts[name] = max(counts.get(name, 0), n)
    return counts


def _cache_in_place(config: dict, result) -> None:
    """Rewrites the decoder and step graphs to write new K/V into the cache buffers in place
    (fusions.py: write_cache_in_place). Both graphs or neither: the runtime binds one way for the
    whole engine."""
    from medusa_trt.engines.ort.fusions import STACKED_KV, write_cache_in_place

    layers = config["num_hidden_layers"]
    graphs = [p for p in (result.path, result.step_path) if p is not None]
    done = [write_cache_in_place(p, layers, STACKED_KV) for p in graphs]
    if any(n != 2 * layers for n in done):
        raise BuildError(f"{', '.join(map(str, graphs))}: the cache writes of {done} caches were rewritten in "
                         f"place, expected {2 * layers} per graph (an exporter change the rewrite does not know)")


def build_onnxruntime(opts: BuildOptions, config: dict, workdir: Path) -> dict:
    """The BUILDERS entry for --backend onnxruntime (see the module docstring)."""
    from medusa_trt.engines.onnx.attention import default_attention, engine_attention
    from medusa_trt.engines.onnx.export import DEFAULT_OPSET, export_onnx
    from medusa_trt.engines.ort.fusions import TENSOR_SCATTER_OPSET
    from medusa_trt.engines.ort.weights import share_weights
    from medusa_trt.modeling import MedusaModel

    ort = gguf_int4_defaults(backend_options(opts, OrtOptions), config)
    opset = opts.opset or DEFAULT_OPSET
    dtype = resolve_dtype(opts, config)
    ort.check()
    # One bar step per piece of work, each graph's export its own (they take most of a build).
    heads = bool(config.get("num_medusa_heads"))
    total = 5 + (ort.weights != "float") + heads + (heads and ort.fused_step)
    bar = progress_bar(total, opts.progress, "medusa-build")
    started: list[str] = []

    def stage(name: str) -> None:
        if started:  # the previous stage is done
            bar.update()
        started.append(name)
        bar.set_postfix_str(name)

    try:
        stage("load checkpoint")
        model = MedusaModel.from_checkpoint(opts.checkpoint, dtype=dtype)
        weights = {"format": "float"}
        if ort.weights == "int4":
            stage("quantize int4")
            weights = _quantize_int4(opts, ort, config, model, workdir, dtype)
        elif ort.weights == "int8":
            stage("quantize int8")
            weights = _quantize_int8(opts, ort, config, model, dtype)
        attention = opts.attention or default_attention(opset, weights)
        try:
            result = export_onnx(model, workdir / "model.onnx", attention=attention, opset=opset,
                                 fused_step=ort.fused_step, hidden_all_rows=model.drafter.has_cache, on_stage=stage)
        except ValueError as e:  # an option the exporter refuses (opset, attention form)
            raise BuildError(str(e)) from None
        stage("fuse ops")
        fusions = _ort_fusions(opts, ort, config, model, [result.path, result.step_path])
        form = engine_attention(result.attention, opts.device, ort.cache_in_place)
        if form.cache_in_place:
            _cache_in_place(config, result)
        # One copy of the weights for all graphs (weights.py): the step graph and the heads graph
        # would otherwise each repeat the decoder's weights.
        stage("share weights")
        shared = share_weights([p for p in (result.path, result.heads_path, result.step_path, result.drafter_path)
                                if p is not None])
        log.info("%s: %.0f MB of graph weights stored as %.0f MB (%d tensors)", shared.path,
                 shared.graph_bytes / 1e6, shared.file_bytes / 1e6, shared.tensors)
        bar.update()
    finally:
        bar.close()
    in_place = form.cache_in_place
    part = {
        "dtype": dtype,
        "weights": weights,
        "onnx": {"file": result.path.name, "opset": max(result.opset, TENSOR_SCATTER_OPSET) if in_place else result.opset,
                 "attention": result.attention,
                 # Tree steps stay inside one block of this many keys (onnx/attention.py: KEY_BLOCK).
                 **({"key_block": form.key_block} if form.key_block else {}),
                 # Only chain trees are exact: the runtime verifies a tree's main chain (tree.main_chain).
                 **({"chains_only": True} if form.chains_only else {}),
                 "external_data": True, "weights_file": shared.path.name,
                 # Off (--no-prepack): the sessions share one mapping of weights_file (runtime/ort/backend.py).
                 "prepack_weights": bool(ort.prepack_weights),
                 "inputs": list(result.input_names),
                 "outputs": graph_outputs(OUTPUT_NAMES, config["num_hidden_layers"], in_place),
                 # New K/V written into the cache inputs, returned as present_* outputs that the runtime
                 # binds to the same memory (fusions.py: write_cache_in_place).
                 "cache_in_place": in_place,
                 "heads_file": result.heads_path.name if result.heads_path else None,
                 # A drafter with its own cache (Amphista): its graph, in place of the heads graph.
                 **({"drafter": model.drafter.kind, "drafter_file": result.drafter_path.name}
                    if result.drafter_path else {}),
                 # Its decoder graph's `hidden` holds every new row, so a prefill asks for the logits of the
                 # last row only and still hands the drafter every prompt row.
                 **({"hidden_all_rows": True} if result.drafter_path else {}),
                 "shared_lm_head": result.shared_lm_head,
                 # The fused greedy step graph (onnx/export.py), used for greedy decoding of trees
                 # whose ranks are all below step_topk.
                 "step_file": result.step_path.name if result.step_path else None,
                 "step_topk": result.step_topk,
                 # Its retrieve is per sequence and it returns the drafter's top-k log-probs: trees chosen
                 # per step run on it (runtime/dynamic.py).
                 **({"step_dynamic": True} if result.step_path else {}),
                 # ONNX Runtime contrib ops written in place of plain ones (fusions.py).
                 "fusions": fusions},
    }
    quant = _quantization_part(config)
    if quant:
        part["quantization"] = quant
    return part


def resolve_dtype(opts: BuildOptions, config: dict) -> str:
    """The engine's compute dtype. CPU engines default to float32: float16 graphs run on ONNX
    Runtime's CPU provider with casts around ops it has no float16 kernel for, which measured slower
    than float32 on a 10M model (and less exact). bfloat16 is refused: numpy, through which the
    runtime hands buffers to ONNX Runtime, has no bfloat16."""
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
