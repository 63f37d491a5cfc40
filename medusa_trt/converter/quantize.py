"""medusa-convert --quantize fp8: calibrated per-tensor FP8 in TensorRT-LLM's checkpoint conventions.

What is written (docs/formats.md section 2; scale = amax / 448, dequantized x = q * scale):
- every decoder Linear (qkv, dense, fc, gate, proj): float8_e4m3fn weight, float32 (1,)
  `weights_scaling_factor` from the weight's own amax and `activation_scaling_factor` from the
  calibrated input amax;
- fused qkv: one weight scale, the max over q, k and v. The fused tensor is quantized once from
  the full-precision weights with that shared scale, which is what quantizing q, k and v separately
  and requantizing them with the max scale approximates (with a second rounding we skip);
- fc and gate read the same input and get the same activation scale (the max of their two ranges,
  equal anyway), so trtllm-build may fuse them into one GEMM;
- `--kv-cache-dtype fp8`: `attention.kv_cache_scaling_factor` = max(|K|, |V|) / 448 per layer;
- lm_head, embeddings, norms and (unless `--quantize-heads`) the Medusa heads keep the model dtype;
  `exclude_modules` says so explicitly because TensorRT-LLM replaces its default exclusions with
  the list when one is given. A Medusa head's own lm_head is never quantized (`*lm_head`).

There is no weights-only mode: TensorRT-LLM's FP8 Linear needs an activation scale, so FP8 weights
without calibrated activation scales would not be a checkpoint trtllm-build accepts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from medusa_trt.checkpoint import is_fp8_module, layer_prefix, medusa_linear_prefix
from medusa_trt.converter.hf_base import ConvertError
from medusa_trt.fp8 import fp8_scale, quantize_fp8

log = logging.getLogger("medusa_trt.converter")

QUANTIZE_CHOICES = ("fp8",)
KV_CACHE_DTYPES = ("fp8",)
# Modules that stay in the model dtype. Norms are not Linears (nothing would quantize them); they are
# listed so the config says what the checkpoint holds.
EXCLUDED = ["*lm_head", "*vocab_embedding", "*ln_f", "*layernorm"]
EXCLUDED_HEADS = "*medusa_heads*"
_DECODER_LINEARS = ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")


@dataclass
class QuantOptions:
    """The FP8 options of medusa-convert; `quantize=None, kv_cache_dtype=None` means none."""

    quantize: str | None = None  # "fp8": decoder Linears in FP8
    kv_cache_dtype: str | None = None  # "fp8": FP8 KV cache scales
    calib_data: Path | None = None  # .txt (one sample per line) or .jsonl ({"text": ...})
    calib_samples: int | None = None  # first N samples (default DEFAULT_CALIB_SAMPLES)
    calib_seq_len: int | None = None  # cut samples to L tokens; None: whole (error past the context)
    quantize_heads: bool = False  # Medusa ResBlock linears in FP8 too

    def __post_init__(self) -> None:
        if self.calib_data is not None:
            self.calib_data = Path(self.calib_data)

    @property
    def active(self) -> bool:
        return self.quantize is not None or self.kv_cache_dtype is not None

    def check(self) -> None:
        """Option errors that need no input file read: raised before anything else happens."""
        if self.quantize not in (None, *QUANTIZE_CHOICES):
            raise ConvertError(f"--quantize {self.quantize!r}: expected one of {', '.join(QUANTIZE_CHOICES)}")
        if self.kv_cache_dtype not in (None, *KV_CACHE_DTYPES):
            raise ConvertError(f"--kv-cache-dtype {self.kv_cache_dtype!r}: expected one of "
                               f"{', '.join(KV_CACHE_DTYPES)}")
        if self.quantize_heads and self.quantize is None:
            # The one output that cannot carry head scales: a checkpoint whose quant_algo is not FP8
            # (TensorRT-LLM reads one quant_algo per model; exclude_modules can only subtract from it).
            raise ConvertError("--quantize-heads needs --quantize fp8 (heads are quantized with the model, "
                               "never alone)")
        if self.active and self.calib_data is None:
            what = "--quantize fp8" if self.quantize else "--kv-cache-dtype fp8"
            raise ConvertError(f"{what} needs --calib-data FILE (.txt with one sample per line, or .jsonl "
                               f"with a 'text' field): activation and KV scales are calibrated, and FP8 "
                               f"weights without activation scales are not a TensorRT-LLM FP8 checkpoint")
        if not self.active and (self.calib_data is not None or self.calib_samples is not None
                                or self.calib_seq_len is not None):
            raise ConvertError("--calib-data/--calib-samples/--calib-seq-len are used only with "
                               "--quantize fp8 or --kv-cache-dtype fp8")
        if self.calib_samples is not None and self.calib_samples < 1:
            raise ConvertError(f"--calib-samples {self.calib_samples}: expected a positive integer")
        if self.calib_seq_len is not None and self.calib_seq_len < 1:
            raise ConvertError(f"--calib-seq-len {self.calib_seq_len}: expected a positive integer")


def quantization_block(opts: QuantOptions) -> dict:
    """The config.json `quantization` block for these options."""
    if opts.quantize is None:
        return {"quant_algo": None, "kv_cache_quant_algo": "FP8" if opts.kv_cache_dtype else None,
                "exclude_modules": None}
    excluded = EXCLUDED + ([] if opts.quantize_heads else [EXCLUDED_HEADS])
    return {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8" if opts.kv_cache_dtype else None,
            "exclude_modules": excluded}


def fp8_tensors(config: dict, weights: dict[str, torch.Tensor], amax: dict[str, float]) -> Callable[[str], torch.Tensor]:
    """name -> the tensor to write under the quantized `config`, from the unquantized merged `weights`
    (full, unsharded) and the calibrated ranges. Weights are quantized when asked for, one at a time."""
    scales: dict[str, torch.Tensor] = {}  # tensor name -> float32 (1,)
    for i in range(int(config["num_hidden_layers"])):
        p = layer_prefix(i)
        for linear in _DECODER_LINEARS:
            _add_linear_scales(scales, config, weights, amax, f"{p}.{linear}")
        fc, gate = f"{p}.mlp.fc.activation_scaling_factor", f"{p}.mlp.gate.activation_scaling_factor"
        if fc in scales and gate in scales:  # one input, one scale
            scales[fc] = scales[gate] = torch.maximum(scales[fc], scales[gate])
        if (config.get("quantization") or {}).get("kv_cache_quant_algo") == "FP8":
            scales[f"{p}.attention.kv_cache_scaling_factor"] = fp8_scale(_range(amax, f"{p}.attention.kv_cache"))
    for h in range(int(config.get("num_medusa_heads", 0))):
        for layer in range(int(config.get("num_medusa_layers", 0))):
            _add_linear_scales(scales, config, weights, amax, medusa_linear_prefix(h, layer))

    def tensor(name: str) -> torch.Tensor:
        if name in scales:
            return scales[name]
        prefix = name.removesuffix(".weight")
        if name.endswith(".weight") and f"{prefix}.weights_scaling_factor" in scales:
            return quantize_fp8(weights[name], scales[f"{prefix}.weights_scaling_factor"])
        return weights[name]

    return tensor


def _range(amax: dict[str, float], name: str) -> float:
    if name not in amax:  # a calibration bug, not bad input
        raise RuntimeError(f"calibration recorded no range for {name}")
    return amax[name]


def _add_linear_scales(scales: dict, config: dict, weights: dict, amax: dict, prefix: str) -> None:
    if not is_fp8_module(prefix, config):
        return
    w = weights[f"{prefix}.weight"]
    scales[f"{prefix}.weights_scaling_factor"] = fp8_scale(w.abs().max().float())
    scales[f"{prefix}.activation_scaling_factor"] = fp8_scale(_range(amax, prefix))
