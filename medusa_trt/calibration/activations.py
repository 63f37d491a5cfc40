"""Calibration of the int8 and int4 engines on text: what the base's Linears see as input.

The float reference model (`MedusaModel`) runs token sequences as prompts while forward hooks on
its base Linears record their inputs. From them come:

- the int8 engines' float channels: each Linear's input channels that peak highest
  (`calibrate_float_channels`);
- the int4 engines' calibrated rounding: each input channel's mean square (`calibrate_input_power`),
  the weights of quant.quantize_int4's grid search, and per output row whether the searched grid
  beats the nearest one on the output (`choose_searched_rows`). The engine keeps the mean squares
  and the rows (`int4_calibration_tensors`, docs/formats.md "int4 weights"), and medusa-check's
  reference searches again from them (`int4_grids`), so both hold the same bytes.

Text comes from `medusa-build --calibration FILE` or from the model itself (`sample_own_text`).
quant.py holds the quantizers; this module only measures, and hands them what it found.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from medusa_trt.quant import base_linear_names, dequantize_int4, quantize_int4

Int4Grid = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # MatMulNBits' packed B, scales, zero points

# The Linears that get float channels: the attention's output projection (`dense`) gains nothing
# from them on SmolLM2 (KL to float32 0.0100 without, 0.0103 with), and each Linear with them costs
# four more graph nodes a step (docs/benchmarks/issue-35-amphista.md, section ac).
FLOAT_CHANNEL_LINEARS = ("qkv", "fc", "gate", "proj", "lm_head")

ROWS_SUFFIX = ":rows"  # int4_importance.safetensors: "<Linear>" importance [K], "<Linear>:rows" uint8 [N]


def record_linear_inputs(model: nn.Module, samples: Sequence[Sequence[int]], names: Sequence[str], record: Callable) -> int:
    """Runs each token sequence of `samples` through the float `model` as one prompt, calling
    record(name, x [rows, K] float32) with every input of the base Linears `names`; returns the rows."""
    def hook(name):
        def call(module, args, output):
            record(name, args[0].detach().reshape(-1, args[0].shape[-1]).float())
        return call

    handles = [model.get_submodule(n).register_forward_hook(hook(n)) for n in names]
    cfg, rows = model.cfg, 0
    empty = torch.zeros(cfg.num_layers, 1, cfg.num_kv_heads, 0, cfg.head_dim, dtype=model.dtype)
    try:
        with torch.no_grad():
            for ids in samples:
                s = len(ids)
                model.forward_hidden(torch.tensor([list(ids)]), torch.arange(s)[None],
                                     torch.ones(1, s, s, dtype=torch.bool).tril(), empty, empty)
                rows += s
    finally:
        for h in handles:
            h.remove()
    return rows


def _input_statistics(model: nn.Module, samples: Sequence[Sequence[int]], names: Sequence[str]
                      ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Per base Linear in `names`: each input channel's largest magnitude and its mean square over
    every row of the token sequences `samples` (each run through the float `model` as one prompt)."""
    peak: dict[str, torch.Tensor] = {}
    power: dict[str, torch.Tensor] = {}

    def record(name: str, x: torch.Tensor) -> None:
        a, sq = x.abs().amax(0), (x * x).sum(0)
        peak[name] = torch.maximum(peak[name], a) if name in peak else a
        power[name] = power[name] + sq if name in power else sq

    rows = record_linear_inputs(model, samples, names, record)
    return peak, {n: p / max(rows, 1) for n, p in power.items()}


def calibrate_float_channels(model: nn.Module, samples: Sequence[Sequence[int]], count: int) -> dict[str, list[int]]:
    """For each base Linear of the float `model` named in FLOAT_CHANNEL_LINEARS, the `count` input
    channels whose largest magnitude over the token sequences `samples` (each run as one prompt) is
    largest, ascending."""
    names = [n for n in base_linear_names(model) if n.rpartition(".")[2] in FLOAT_CHANNEL_LINEARS]
    peak, _ = _input_statistics(model, samples, names)
    count = min(count, *(p.numel() for p in peak.values()))
    return {n: sorted(peak[n].topk(count).indices.tolist()) for n in names}


def calibrate_input_power(model: nn.Module, samples: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
    """Each base Linear's (lm_head included) input channels' mean square over the token sequences
    `samples`: how much a weight error in that column moves the output, the importance
    quantize_int4's grid search weighs errors by. A floor of 1e-6 of the mean keeps a silent
    channel's weights from being rounded arbitrarily."""
    _, power = _input_statistics(model, samples, base_linear_names(model))
    return {n: p + 1e-6 * p.mean().clamp(min=1e-30) for n, p in power.items()}


def _pick_rows(rows: torch.Tensor, searched: Int4Grid, nearest: Int4Grid) -> Int4Grid:
    """Each output row's tensors from `searched` where `rows` holds, else from `nearest` (every
    MatMulNBits tensor has the output rows first, and the search treats each row alone)."""
    return tuple(torch.where(rows.reshape(-1, *[1] * (s.dim() - 1)), s, n)
                 for s, n in zip(searched, nearest, strict=True))


@torch.no_grad()
def choose_searched_rows(model: nn.Module, samples: Sequence[Sequence[int]], importance: dict[str, torch.Tensor],
                         block_size: int) -> tuple[dict[str, torch.Tensor], dict[str, Int4Grid]]:
    """Per base Linear of `importance`: the output rows [N] bool whose searched grid (quantize_int4
    with importance) gives a smaller squared output error over the calibration rows than the nearest
    grid, and the grid that results (what quantize_int4 with those rows gives, without searching a
    second time). The output error counts how channels move together, which the search's per-channel
    weights do not, and on some models (a small random one) the search alone moved the output further."""
    names = [n for n in importance if model.get_submodule(n).in_features % block_size == 0]
    errors, totals, grids = {}, {}, {}
    for n in names:
        w = model.get_submodule(n).weight.detach().float()
        grids[n] = (quantize_int4(w, block_size), quantize_int4(w, block_size, importance[n]))
        errors[n] = torch.stack([w - dequantize_int4(*g) for g in grids[n]]).transpose(1, 2)  # [2, K, N]
        totals[n] = torch.zeros(2, w.shape[0])

    def record(name: str, x: torch.Tensor) -> None:
        totals[name] += ((x @ errors[name]) ** 2).sum(1)

    record_linear_inputs(model, samples, names, record)
    rows = {n: totals[n][1] < totals[n][0] for n in names}
    return rows, {n: _pick_rows(rows[n], grids[n][1], grids[n][0]) for n in names}


def int4_grids(model: nn.Module, importance: dict[str, torch.Tensor], rows: dict[str, torch.Tensor],
               block_size: int) -> dict[str, Int4Grid]:
    """The grids an engine's calibrated rounding holds, from what it keeps (split_int4_calibration):
    each Linear of `importance` searched with it in its `rows` (all rows where `rows` lacks it).
    Raises ValueError for a name that is no base Linear or a tensor of the wrong shape."""
    known = set(base_linear_names(model))
    unknown = sorted((set(importance) | set(rows)) - known)
    if unknown:
        raise ValueError(f"int4 importance for {', '.join(unknown)}: expected base Linear names "
                         "(layers.<i>.qkv|dense|fc|gate|proj, lm_head)")
    grids = {}
    for name, weight in importance.items():
        linear = model.get_submodule(name)
        if weight.shape != (linear.in_features,):
            raise ValueError(f"int4 importance for {name}: shape {tuple(weight.shape)}, expected ({linear.in_features},)")
        chosen = rows.get(name)
        if chosen is not None and chosen.shape != (linear.out_features,):
            raise ValueError(f"int4 searched rows for {name}: shape {tuple(chosen.shape)}, expected "
                             f"({linear.out_features},)")
        if linear.in_features % block_size == 0:
            grids[name] = quantize_int4(linear.weight, block_size, weight, None if chosen is None else chosen.bool())
    return grids


def int4_calibration_tensors(importance: dict[str, torch.Tensor], rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors an int4 engine keeps of its calibrated rounding (docs/formats.md, "int4 weights")."""
    return {**{n: t.contiguous() for n, t in importance.items()},
            **{n + ROWS_SUFFIX: r.to(torch.uint8).contiguous() for n, r in rows.items()}}


def split_int4_calibration(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """int4_calibration_tensors' inverse: (importance, searched rows as bool)."""
    rows = {n[: -len(ROWS_SUFFIX)]: t.bool() for n, t in tensors.items() if n.endswith(ROWS_SUFFIX)}
    return {n: t for n, t in tensors.items() if not n.endswith(ROWS_SUFFIX)}, rows


@torch.no_grad()
def sample_own_text(model: nn.Module, start_id: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """`count` sequences of `length` tokens after `start_id`, sampled from the float `model` itself at
    temperature 1 (a fixed seed): calibration text for a checkpoint that brings none."""
    cfg, gen = model.cfg, torch.Generator().manual_seed(seed)
    ids = torch.full((count, 1), int(start_id), dtype=torch.int64)
    past_k = past_v = torch.zeros(cfg.num_layers, count, cfg.num_kv_heads, 0, cfg.head_dim, dtype=model.dtype)
    for p in range(length):
        mask = torch.ones(count, 1, p + 1, dtype=torch.bool)
        logits, _, k, v = model.forward_hidden(ids[:, -1:], torch.full((count, 1), p), mask, past_k, past_v)
        past_k, past_v = torch.cat([past_k, k], 3), torch.cat([past_v, v], 3)
        ids = torch.cat([ids, torch.multinomial(logits[:, -1].float().softmax(-1), 1, generator=gen)], 1)
    return ids.tolist()
