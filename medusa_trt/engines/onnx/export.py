"""ONNX export of the reference model (base decoder + Medusa heads), the graphs both ONNX backends start from.

The graph is `MedusaModel.forward` itself, traced by torch.onnx's dynamo exporter, so the engine
and the reference share one implementation. What differs from eager was chosen by measurement on
a 2-core CPU with 10M and 100M-parameter models (benchmarks/bench_onnx.py):

- one past input per layer and per K/V: a stacked [L, ...] input costs ONNX Runtime a Gather copy
  of every layer's cache per step (docs/benchmarks/engine-and-serving.md);
- the past may be the runtime's whole cache buffer (capacity T >= every committed length): the
  graph slices it to max(past_lengths) and builds the prefix mask from `past_lengths`, so a step
  costs the committed length, not the capacity (docs/benchmarks/issue-13-int4.md). The runtime passes the
  buffer as it is; in the graph, that Slice and the default attention form's Concat of past and new
  K/V each copy the committed prefix once per layer and step;
- attention as the opset-23 `Attention` op by default (attention.py: ATTENTION_FORMS lists the
  alternatives);
- Medusa heads as one 2-D MatMul per head: ONNX Runtime prepacks 2-D constant weights, and the
  reference's batched einsum runs several times slower there.

A checkpoint with a sliding window gets a second mask, built once per graph: the first cut to the
keys at positions > a query's position - window (modeling.sliding_window_mask), read by the layers
with the window. A cached key's position is its index; a new key's, its position_ids entry. Every
attention form takes it as it takes the first, so all of them apply the window.

FP8 checkpoints export as explicit quantization (opset >= 19; the ops in ops.py), the form TensorRT builds FP8 engines
from: each quantized Linear's weight is a float8e4m3fn initializer behind DequantizeLinear with its
per-tensor scale, its input goes through QuantizeLinear -> DequantizeLinear with the calibrated
activation scale, and with an FP8 KV cache the new keys/values do too. Q/DQ run in float32, where the
checkpoint's scales live (`x` is cast to float32 first in a float16 graph): that is the reference's
arithmetic, and ONNX Runtime's CPU kernels do not take a float16 input with a float32 scale.

int4 models (quant.quantize_model_int4, medusa-build --weights int4) export each Int4Linear as one
com.microsoft MatMulNBits node over its packed bytes, scales and zero points (none with per-block
offsets, whose blocksum(x) @ offsets^T traces as Reshape, ReduceSum, MatMul and Add; bits=8 for an
8-bit lm_head). int8 models (quant.quantize_model_int8, --weights int8) export each Int8Linear as
its input's rows rounded to int8 (ReduceMax, Div, one QuantizeLinear with a block per row), one
com.microsoft MatMulIntegerToFloat over the int8 weight (the column scales applied in its output
stage) and a float Mul by the row scales.

Graph interface (names are the contract with `medusa_trt.runtime.ort`):

  inputs   input_ids        [batch, new] int64
           position_ids     [batch, new] int64   absolute positions (tree nodes: length + depth)
           past_lengths     [batch] int64        committed cache entries [0, n) of each sequence
           new_mask         [batch, new, new] bool  which new tokens each new token sees
           logit_positions  [batch, logits] int64   rows of `new` to produce logits for
           past_key_{i}, past_value_{i}  [batch, kv_heads, past, head_dim]  for each layer i
  outputs  logits           [batch, logits, vocab] float32
           hidden           [batch, logits, hidden_size]  final normed hidden state at those rows
           present_keys, present_values  [layers, batch, kv_heads, new, head_dim]  new tokens only

The heads graph (`model_heads.onnx`) maps hidden [rows, hidden_size] -> medusa_logits [heads, rows,
vocab]. The fused step graph (`model_step.onnx`, models with heads) is built in step.py from the
decoder graph exported here.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from medusa_trt.engine_dir import (
    DRAFTER_INPUT_NAMES,
    DRAFTER_OUTPUT_NAMES,
    HEADS_INPUT,
    HEADS_OUTPUT,
    INPUT_NAMES,
    OUTPUT_NAMES,
    past_names,
)
from medusa_trt.engines.onnx.attention import (
    ATTENTION_FORMS,
    DEFAULT_ATTENTION,
    MIN_OPSET,
    AttentionForm,
    PlacedMask,
)
from medusa_trt.engines.onnx.drafters import graph_form
from medusa_trt.engines.onnx.ops import (
    export_dequant,
    export_fake_quant,
    export_int4_matmul,
    export_int8_matmul,
    fp8_translations,
    has_fp8,
    has_int4,
    has_int8,
    int4_translations,
    int8_translations,
)
from medusa_trt.engines.onnx.step import export_step
from medusa_trt.engines.onnx.tracing import drop_stack_traces, one_torchlib_registry, quiet_exporter
from medusa_trt.fp8 import FP8Module, dequantize_fp8, fake_quant_fp8
from medusa_trt.modeling import MedusaModel, sliding_window_mask
from medusa_trt.quant import Int4Linear, Int8Linear, int8_matmul, nbits_matmul
from medusa_trt.tree import candidate_topk

log = logging.getLogger(__name__)

DEFAULT_OPSET = 23  # RMSNormalization and Attention became standard ops in opset 23
MIN_FP8_OPSET = 19  # float8 types in QuantizeLinear/DequantizeLinear
MAX_PROTOBUF_BYTES = 2**31 - 1  # one protobuf message; larger models must use external data
# The graph interface (names, past_names) is part of the engine-dir contract: medusa_trt/engine_dir.py.


# -- export ------------------------------------------------------------------------------------


class _ExportModule(nn.Module):
    """The graph's interface around MedusaModel.forward (see the module docstring)."""

    def __init__(self, model: MedusaModel, committed_prefix: bool = True, places_new_keys: bool = False):
        super().__init__()
        self.model = model
        self.committed_prefix = committed_prefix
        self.places_new_keys = places_new_keys
        # The decoder graph's `hidden` output at every new row, not at logit_positions only (export_onnx's
        # hidden_all_rows): set while the decoder graph is exported, and so for the step graph built from it.
        self.hidden_all_rows = False
        # The drafter's exported form (drafters/): the heads graph and the fused step draft through it.
        # A drafter with a cache of its own exports as the drafter graph instead (_DrafterModule).
        self.draft = None if model.drafter.has_cache else graph_form(model.drafter, model.lm_head)

    def forward(self, input_ids, position_ids, past_lengths, new_mask, logit_positions, past):
        b, s = input_ids.shape
        if self.committed_prefix:
            # Attention reads only the committed prefix [0, max(past_lengths)) of the cache buffer
            # (and the S keys after it when new keys are placed in it), so a step costs what the
            # cache holds, not its capacity (docs/benchmarks/issue-13-int4.md).
            used = past_lengths.max().item()
            torch._check(used >= 0)
            end = used + s if self.places_new_keys else used
            torch._check(end <= past[0].shape[2])
            past = tuple(p.narrow(2, 0, end) for p in past)
        t = past[0].shape[2]
        keys = torch.arange(t, device=input_ids.device)
        window_mask = None
        if self.places_new_keys:  # new token j of sequence b at key past_lengths[b] + j
            after = keys[None, :] - past_lengths[:, None]  # [B, T]: a key's offset after the prefix
            new = (after >= 0) & (after < s)
            slot = after.clamp(0, s - 1)
            tree = new_mask.gather(2, slot[:, None, :].expand(b, s, t)) & new[:, None, :]
            slots = (past_lengths[:, None] + torch.arange(s, device=input_ids.device))[:, None, :, None]
            mask = PlacedMask((after < 0)[:, None, :] | tree, slots)
            if any(self.model.cfg.windows):
                # A key's position: its index in the prefix, its token's position_ids after it.
                key_positions = torch.where(after < 0, keys[None, :], position_ids.gather(1, slot))
                window_mask = PlacedMask(sliding_window_mask(mask.mask, position_ids, key_positions,
                                                             self.model.cfg.sliding_window), slots)
        else:
            prefix = keys[None, None, :] < past_lengths[:, None, None]
            mask = torch.cat([prefix.expand(b, s, t), new_mask], dim=-1)  # [B, S, T+S]
        return self.model.forward_hidden(input_ids, position_ids, mask, past[0::2], past[1::2], logit_positions,
                                         window_mask, all_hidden=self.hidden_all_rows)


class _HeadsModule(nn.Module):
    """The heads graph: hidden [N, d] -> medusa_logits [H, N, V]. Separate from the decoder graph
    because a decoding step needs the heads at one row per sequence (the last accepted node, known
    only after verification), not at every tree slot: that halves a 64-slot step's cost here."""

    def __init__(self, decoder: _ExportModule):
        super().__init__()
        self.decoder = decoder

    def forward(self, hidden):
        return self.decoder.draft.rows(hidden).permute(1, 0, 2)


class _DrafterModule(nn.Module):
    """The drafter graph of a drafter with a cache of its own (Amphista): appends each sequence's
    newly committed rows to the drafter's cache and drafts at the last of them.

      inputs   hidden [batch, new, d], next_tokens [batch, new] (the token after each row),
               position_ids [batch, new], past_lengths [batch] (the drafter cache's committed rows),
               new_mask [batch, new, new], last [batch] (each sequence's last new row),
               past_key_{i}, past_value_{i} [batch, kv_heads, past, head_dim] for its 2 layers
      outputs  medusa_logits [heads, batch, vocab] float32, present_keys/values [2, batch, kv_heads, new, head_dim]
    """

    def __init__(self, model: MedusaModel):
        super().__init__()
        self.model = model

    def forward(self, hidden, next_tokens, position_ids, past_lengths, new_mask, last, past):
        model, drafter = self.model, self.model.drafter
        b, c = next_tokens.shape
        t = past[0].shape[2]
        prefix = torch.arange(t, device=hidden.device)[None, None, :] < past_lengths[:, None, None]
        mask = torch.cat([prefix.expand(b, c, t), new_mask], dim=-1)
        cache = (torch.stack([past[0], past[2]]), torch.stack([past[1], past[3]]))
        h1, h2, new_k, new_v = drafter.adapt(hidden, next_tokens, model.vocab_embedding, position_ids, mask, cache)
        rows = last[:, None, None].expand(b, 1, h1.shape[-1])
        logits = drafter.heads(h1.gather(1, rows)[:, 0], h2.gather(1, rows)[:, 0], model.lm_head)
        return logits, new_k, new_v


def drafter_example_inputs(model: MedusaModel) -> dict:
    cfg = model.cfg
    cache = torch.zeros(2, cfg.num_kv_heads, 5, cfg.head_dim, dtype=model.dtype)
    return {"hidden": torch.zeros(2, 3, cfg.hidden_size, dtype=model.dtype),
            "next_tokens": torch.zeros(2, 3, dtype=torch.long),
            "position_ids": torch.arange(3).repeat(2, 1) + 5,
            "past_lengths": torch.full((2,), 5, dtype=torch.long),
            "new_mask": torch.ones(2, 3, 3, dtype=torch.bool).tril(),
            "last": torch.full((2,), 2, dtype=torch.long),
            "past": tuple(cache.clone() for _ in range(4))}


def step_example_inputs(model: MedusaModel) -> dict:
    """Fused step graph inputs: a 6-slot tree ([0], [1], [2], [0, 0], [0, 0, 0], cut to the model's
    heads when it has fewer than 3) and 7 candidates, sizes distinct from every other dimension."""
    inputs = example_inputs(model, batch=2, new=6, past=5)
    del inputs["logit_positions"]
    past = inputs.pop("past")
    depth = min(model.cfg.num_medusa_heads, 3)  # the graph drafts with as many heads as the tree is deep
    retrieve = torch.tensor([[0, 1, 4, 5], [0, 2, -1, -1], [0, 3, -1, -1]])[:, :depth + 1].expand(2, -1, -1)
    out = {**inputs, "retrieve": retrieve, "candidate_index": torch.arange(7) % (depth * step_topk(model)),
           "past": past}
    if model.drafter.has_cache:  # the drafter's cache: 2 layers, 4 committed rows
        cache = torch.zeros(2, model.cfg.num_kv_heads, 4, model.cfg.head_dim, dtype=model.dtype)
        out.update(drafter_past_lengths=torch.full((2,), 4, dtype=torch.long),
                   drafter_past=tuple(cache.clone() for _ in range(4)))
    return out


def step_topk(model: MedusaModel) -> int:
    """Top-k the fused step graph takes of each head: the runtime's k for every tree whose ranks are
    below tree.CANDIDATE_TOPK (engine.json records it; the runtime uses the graph when they agree)."""
    return candidate_topk(model.cfg.vocab_size)


@contextlib.contextmanager
def _export_mode(model: MedusaModel, form: AttentionForm, wrapper: nn.Module) -> Iterator[None]:
    """Swaps the attention form, the int4 ops and the FP8 ops for the duration of the trace."""
    saved = [layer.attend for layer in model.layers]
    for layer in model.layers:
        layer.attend = form.function
    fp8 = [m for m in wrapper.modules() if isinstance(m, FP8Module)]
    for m in fp8:
        m.fake_quant, m.dequant = export_fake_quant, export_dequant
    int4 = [m for m in wrapper.modules() if isinstance(m, Int4Linear)]
    for m in int4:
        m.matmul = export_int4_matmul
    int8 = [m for m in wrapper.modules() if isinstance(m, Int8Linear)]
    for m in int8:
        m.matmul = export_int8_matmul
    try:
        yield
    finally:
        for layer, fn in zip(model.layers, saved, strict=True):
            layer.attend = fn
        for m in fp8:
            m.fake_quant, m.dequant = fake_quant_fp8, dequantize_fp8
        for m in int4:
            m.matmul = nbits_matmul
        for m in int8:
            m.matmul = int8_matmul


def example_inputs(model: MedusaModel, batch: int = 2, new: int = 3, past: int = 5, logits: int = 2) -> dict:
    """Inputs in graph order (sizes distinct so the tracer infers no false equalities)."""
    cfg = model.cfg
    cache = torch.zeros(batch, cfg.num_kv_heads, past, cfg.head_dim, dtype=model.dtype)
    return {
        "input_ids": torch.zeros(batch, new, dtype=torch.long),
        "position_ids": torch.arange(new).repeat(batch, 1) + past,
        "past_lengths": torch.full((batch,), past, dtype=torch.long),
        "new_mask": torch.ones(batch, new, new, dtype=torch.bool).tril(),
        "logit_positions": torch.zeros(batch, logits, dtype=torch.long),
        "past": tuple(cache.clone() for _ in range(2 * cfg.num_layers)),
    }


@dataclass(frozen=True)
class ExportResult:
    path: Path  # the .onnx file
    files: tuple[Path, ...]  # every file written (the .onnx, plus external data when used)
    opset: int
    attention: str
    external_data: bool
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    heads_path: Path | None  # the heads graph (hidden [N, d] -> medusa_logits [H, N, V]); None without heads
    step_path: Path | None  # the fused greedy step graph; None without heads or when not asked for
    step_topk: int  # its per-head top-k
    shared_lm_head: bool  # heads use the base lm_head, as one MatMul
    drafter_path: Path | None = None  # the drafter graph of a drafter with a cache (_DrafterModule)


def export_onnx(
    model: MedusaModel,
    path: str | Path,
    *,
    attention: str = DEFAULT_ATTENTION,
    opset: int = DEFAULT_OPSET,
    external_data: bool | None = None,
    fused_step: bool = False,
    committed_prefix: bool = True,
    hidden_all_rows: bool = False,
    on_stage: Callable[[str], object] = lambda stage: None,
) -> ExportResult:
    """Exports `model` (in its current dtype) to `path`. `external_data` None: only when the
    weights exceed the 2 GB protobuf limit. `fused_step`: also the fused greedy step graph (with its
    own copy of the decoder's weights: medusa-build then shares them, engines/ort/weights.py).
    `committed_prefix`: attention reads only the cache's committed prefix (a Slice per past input); off, the past inputs go straight into the
    attention's Concat, the form the TensorRT rewrite (engines/trt/rewrite.py) recognises.
    `hidden_all_rows`: the decoder graph's `hidden` output holds every new row ([batch, new_tokens,
    hidden]) while its logits stay at logit_positions, so a drafter with a cache of its own takes every
    prompt row from a prefill that computes the logits of the last row only.
    `on_stage(name)` is called as each graph's export starts (a build's progress bar moves with it)."""
    if attention not in ATTENTION_FORMS:
        raise ValueError(f"attention form {attention!r} is unknown; expected one of {sorted(ATTENTION_FORMS)}")
    form = ATTENTION_FORMS[attention]
    if not MIN_OPSET <= opset <= DEFAULT_OPSET:
        raise ValueError(f"opset {opset} is not supported; expected {MIN_OPSET}..{DEFAULT_OPSET}")
    if opset < form.min_opset:
        raise ValueError(f"attention form {attention!r} needs opset >= {form.min_opset}, got opset {opset}")
    fp8 = has_fp8(model)
    if fp8 and opset < MIN_FP8_OPSET:
        raise ValueError(f"an FP8 model needs opset >= {MIN_FP8_OPSET} (float8 QuantizeLinear/DequantizeLinear), "
                         f"got opset {opset}")
    try:
        import onnxscript  # noqa: F401  (torch.onnx's exporter needs it; fail with a clear message)
    except ImportError as e:
        raise RuntimeError("ONNX export needs the 'onnxscript' package (pip install onnxscript)") from e
    import onnx
    from torch.export import Dim

    path = Path(path)
    cfg = model.cfg
    cached_drafter = model.drafter.has_cache
    wrapper = _ExportModule(model, committed_prefix, form.places_new_keys).eval()
    inputs = example_inputs(model)
    batch, new, past, logits = Dim("batch"), Dim("new_tokens"), Dim("past"), Dim("num_logits")
    dynamic_shapes = {
        "input_ids": {0: batch, 1: new},
        "position_ids": {0: batch, 1: new},
        "past_lengths": {0: batch},
        "new_mask": {0: batch, 1: new, 2: new},
        "logit_positions": {0: batch, 1: logits},
        "past": tuple({0: batch, 2: past} for _ in range(2 * cfg.num_layers)),
    }
    table = {}
    if form.translation:
        table[form.custom_op()._opoverload] = form.translation  # registers the op
    if fp8:
        table.update(fp8_translations())
    if has_int4(model):
        table.update(int4_translations())
    if has_int8(model):
        table.update(int8_translations())
    weight_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    if external_data is None:
        external_data = weight_bytes > MAX_PROTOBUF_BYTES - (64 << 20)  # leave room for the graph itself
    if external_data:
        log.info("%s: %.2f GB of weights go to external data files", path, weight_bytes / 1e9)
    with _export_mode(model, form, wrapper), torch.no_grad(), quiet_exporter(), one_torchlib_registry():
        on_stage("export decoder graph")
        wrapper.hidden_all_rows = hidden_all_rows
        program = torch.onnx.export(
            wrapper, (), kwargs=inputs, dynamic_shapes=dynamic_shapes, input_names=[*INPUT_NAMES, *past_names(cfg.num_layers)],
            output_names=list(OUTPUT_NAMES), opset_version=opset, dynamo=True, custom_translation_table=table or None,
            optimize=True, verbose=False,
        )
        wrapper.hidden_all_rows = False
        heads_program = drafter_program = None
        if cached_drafter:
            d_inputs = drafter_example_inputs(model)
            b, new, dpast = Dim("batch"), Dim("new_rows"), Dim("drafter_past")
            d_shapes = {"hidden": {0: b, 1: new}, "next_tokens": {0: b, 1: new}, "position_ids": {0: b, 1: new},
                        "past_lengths": {0: b}, "new_mask": {0: b, 1: new, 2: new}, "last": {0: b},
                        "past": tuple({0: b, 2: dpast} for _ in range(4))}
            drafter_program = torch.onnx.export(
                _DrafterModule(model).eval(), (), kwargs=d_inputs, dynamic_shapes=d_shapes,
                input_names=[*DRAFTER_INPUT_NAMES, *past_names(2)], output_names=list(DRAFTER_OUTPUT_NAMES),
                opset_version=opset, dynamo=True, custom_translation_table=table or None, optimize=True, verbose=False,
            )
        elif cfg.num_medusa_heads:
            hidden = torch.zeros(3, cfg.hidden_size, dtype=model.dtype)
            on_stage("export heads graph")
            heads_program = torch.onnx.export(
                _HeadsModule(wrapper).eval(), (hidden,), dynamic_shapes=({0: Dim("rows")},),
                input_names=[HEADS_INPUT], output_names=[HEADS_OUTPUT], opset_version=opset, dynamo=True,
                custom_translation_table=table or None, optimize=True, verbose=False,
            )
        for p in (program, heads_program, drafter_program):
            if p is not None:
                drop_stack_traces(p)
        step_model = None
        if cfg.num_medusa_heads and fused_step:
            on_stage("export fused step graph")
            step_model = export_step(model, wrapper, program.model_proto, step_example_inputs(model), step_topk(model),
                                     hidden_all_rows, opset, table, (batch, new, logits))
    on_stage("save graphs")
    path.parent.mkdir(parents=True, exist_ok=True)
    program.save(path, external_data=external_data)
    heads_path = None
    if heads_program is not None:
        heads_path = path.with_name(path.stem + "_heads.onnx")
        heads_program.save(heads_path, external_data=external_data)
    drafter_path = None
    if drafter_program is not None:
        drafter_path = path.with_name(path.stem + "_drafter.onnx")
        drafter_program.save(drafter_path, external_data=external_data)
    step_path = None
    if step_model is not None:
        step_path = path.with_name(path.stem + "_step.onnx")
        onnx.save_model(step_model, step_path, save_as_external_data=external_data, location=step_path.name + ".data")
    files = [p for p in (path, heads_path, step_path, drafter_path) if p is not None]
    if external_data:
        files += sorted(p for p in path.parent.glob(path.stem + "*.data"))
    return ExportResult(path, tuple(files), opset, attention, bool(external_data),
                        (*INPUT_NAMES, *past_names(cfg.num_layers)), OUTPUT_NAMES, heads_path, step_path,
                        step_topk(model), bool(wrapper.draft and wrapper.draft.shared_lm_head), drafter_path)
