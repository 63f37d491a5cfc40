"""FP8 checkpoint numerics, as modules swapped into a MedusaModel: the FP8 part of the reference
model's quantization (medusa_trt/quant.py holds the engines' int4 and int8 weight schemes).

modeling.py is the float model and knows none of this (gpt-fast's model.py / quantize.py split):
the functions here rewrite a model in place, and each quantized module computes what an engine's
quantized op computes, so engine-vs-reference parity stays tight.

FP8 (`quantization.quant_algo == "FP8"` in a checkpoint, docs/formats.md section 2) runs as fake
quantization: quantized Linears keep their float8_e4m3fn weights and dequantize them (q * scale, in
float32) at each call, and quantize-dequantize their input with the calibrated activation scale;
with an FP8 KV cache the new keys/values go through the same round trip before attention, so a
token reads its own K/V exactly as later steps read them from the cache. This is the arithmetic of
the engines' explicit QuantizeLinear/DequantizeLinear graphs. MedusaModel.from_weights calls
`load_fp8` for a checkpoint with a quantization block; this module imports no modeling code, so
that call makes no import cycle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from medusa_trt.checkpoint import ModelConfig, is_fp8_module, layer_prefix, medusa_linear_prefix

# -- FP8 numbers (per-tensor, symmetric float8_e4m3fn): scale = amax / 448, dequantized x = q * scale --

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn value


def fp8_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """The float32 (1,) scaling factor for a tensor whose largest magnitude is `amax`.

    An all-zero tensor gets 1.0: any scale represents zero exactly, and 1.0 keeps the runtime's
    x / scale finite (TensorRT and ONNX Runtime divide by it).
    """
    amax = torch.as_tensor(amax, dtype=torch.float32).reshape(1)
    return torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in float32, saturated to +-448, rounded to nearest-even float8_e4m3fn.

    Saturation is explicit because e4m3fn has no infinity (an overflow would be NaN in some
    converters); it is what ONNX QuantizeLinear does with its default saturate=1.
    """
    y = x.to(torch.float32) / scale.to(torch.float32)
    return y.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * scale computed in float32 (as ONNX DequantizeLinear does), then cast to `dtype`."""
    return (q.to(torch.float32) * scale.to(torch.float32)).to(dtype)


def fake_quant_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Quantize to float8_e4m3fn and back (in float32), returned in x's dtype: what a value looks like
    after an FP8 GEMM input or an FP8 KV cache. `scale` broadcasts against x."""
    return dequantize_fp8(quantize_fp8(x, scale), scale, x.dtype)


class FP8Module(nn.Module):
    """Base of the modules holding float8 weights and float32 scales as buffers (named in `kept`).

    nn.Module.to(dtype) casts every floating-point tensor, float8 included, so `model.to(float16)`
    would silently turn an FP8 model into a float16 one and round its scales. Dtype casts skip the
    kept buffers; device moves still apply to them. `fake_quant` and `dequant` are plain attributes
    (like DecoderLayer.attend) so an exporter can swap them for explicit Q/DQ ops.
    """

    kept: tuple[str, ...] = ()

    def __init__(self) -> None:
        super().__init__()
        self.fake_quant = fake_quant_fp8
        self.dequant = dequantize_fp8

    def _apply(self, fn, recurse=True):
        saved = {n: self._buffers.pop(n) for n in self.kept if self._buffers.get(n) is not None}
        try:
            return super()._apply(fn, recurse)
        finally:
            device = fn(torch.empty(0)).device  # where fn sends tensors, whatever it does to dtypes
            self._buffers.update({n: t.to(device) for n, t in saved.items()})


class FP8Linear(FP8Module):
    """A TensorRT-LLM FP8 Linear emulated in the model dtype: y = dq(q(x)) @ dq(W)^T + b, per-tensor
    scales, weight stored as float8_e4m3fn. Loads the checkpoint's names (`weight`,
    `weights_scaling_factor`, `activation_scaling_factor`, `bias`)."""

    kept = ("weight", "weights_scaling_factor", "activation_scaling_factor")

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn))
        self.register_buffer("weights_scaling_factor", torch.ones(1))
        self.register_buffer("activation_scaling_factor", torch.ones(1))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fake_quant(x, self.activation_scaling_factor)
        w = self.dequant(self.weight, self.weights_scaling_factor, x.dtype)
        return F.linear(x, w, self.bias)


class FP8KVCache(FP8Module):
    """The round trip of keys/values through an FP8 KV cache with one per-layer scale."""

    kept = ("scale",)

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fake_quant(x, self.scale)


class FP8HeadLinears(FP8Module):
    """Every Medusa ResBlock linear of an FP8 checkpoint, stacked like MedusaHeads.w (drafters/medusa.py): weight
    [H, L, d, d] float8_e4m3fn and per-tensor scales [H, L] (each head and layer has its own)."""

    kept = ("weight", "weights_scaling_factor", "activation_scaling_factor")

    def __init__(self, num_heads: int, num_layers: int, dim: int):
        super().__init__()
        self.register_buffer("weight", torch.zeros(num_heads, num_layers, dim, dim, dtype=torch.float8_e4m3fn))
        self.register_buffer("weights_scaling_factor", torch.ones(num_heads, num_layers))
        self.register_buffer("activation_scaling_factor", torch.ones(num_heads, num_layers))

    def layer(self, x: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [H, ..., d] -> (x quantized-dequantized per head, weights [H, d, d] in x's dtype)."""
        shape = (-1,) + (1,) * (x.dim() - 1)
        xq = self.fake_quant(x, self.activation_scaling_factor[:, layer].reshape(shape))
        w = self.dequant(self.weight[:, layer], self.weights_scaling_factor[:, layer].reshape(-1, 1, 1), x.dtype)
        return xq, w


# -- FP8 checkpoints: the modules that hold their tensors ------------------------------------------

_DECODER_LINEARS = {"attention.qkv": "qkv", "attention.dense": "dense", "mlp.fc": "fc", "mlp.gate": "gate",
                    "mlp.proj": "proj"}  # TensorRT-LLM name -> DecoderLayer attribute
_FP8_SCALES = ("weights_scaling_factor", "activation_scaling_factor")


def _is_fp8(cfg: ModelConfig, module: str) -> bool:
    """Whether the Linear named `module` (TensorRT-LLM name) holds FP8 weights and scales."""
    return is_fp8_module(module, {"quantization": cfg.quantization})


def _kv_cache_fp8(cfg: ModelConfig) -> bool:
    return (cfg.quantization or {}).get("kv_cache_quant_algo") == "FP8"


def _fp8_heads(cfg: ModelConfig) -> bool:
    """Whether the Medusa linears are FP8: all of them or none (one stacked tensor holds them)."""
    names = [medusa_linear_prefix(h, j) for h in range(cfg.num_medusa_heads) for j in range(cfg.num_medusa_layers)]
    flags = {_is_fp8(cfg, n) for n in names}
    if len(flags) > 1:
        raise ValueError(f"quantization.exclude_modules {(cfg.quantization or {}).get('exclude_modules')} "
                         "quantizes some Medusa linears but not others; expected all or none")
    return flags == {True}


def load_fp8(model: nn.Module, weights: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
    """Swaps into `model` the modules of an FP8 checkpoint's quantization block, and adds the tensors
    they hold to `state` (module names, what MedusaModel.from_weights loads): FP8Linear for each
    quantized decoder Linear, FP8KVCache in each layer with an FP8 KV cache, FP8HeadLinears in place
    of the drafter's stacked weights for FP8 Medusa linears. Called while the model is on the meta device, so the new
    modules allocate nothing before the checkpoint's tensors are assigned."""
    cfg = model.cfg
    heads = _fp8_heads(cfg)
    for i, layer in enumerate(model.layers):
        src, dst = f"{layer_prefix(i)}.", f"layers.{i}."
        for name, attr in _DECODER_LINEARS.items():
            if _is_fp8(cfg, src + name):
                linear = getattr(layer, attr)
                setattr(layer, attr, FP8Linear(linear.in_features, linear.out_features, linear.bias is not None))
                for scale in _FP8_SCALES:
                    state[f"{dst}{attr}.{scale}"] = weights[f"{src}{name}.{scale}"]
        if _kv_cache_fp8(cfg):
            layer.kv_cache = FP8KVCache()
            state[f"{dst}kv_cache.scale"] = weights[f"{src}attention.kv_cache_scaling_factor"]
    if heads:
        h, n = cfg.num_medusa_heads, cfg.num_medusa_layers

        def stacked(param: str) -> torch.Tensor:  # [H, L, ...]
            return torch.stack([torch.stack([weights[f"{medusa_linear_prefix(k, j)}.{param}"] for j in range(n)])
                                for k in range(h)])

        model.drafter.register_parameter("w", None)  # the weights live in drafter.fp8 instead, as float8 + scales
        model.drafter.fp8 = FP8HeadLinears(h, n, cfg.hidden_size)
        state["drafter.fp8.weight"] = state.pop("drafter.w")  # modeling stacked the float8 weights as [H, L, d, d]
        for scale in _FP8_SCALES:
            state[f"drafter.fp8.{scale}"] = stacked(scale).reshape(h, n)
