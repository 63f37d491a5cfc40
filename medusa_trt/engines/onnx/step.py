"""The fused step graph (`model_step.onnx`, models with heads): one greedy decoding step, the
decoder over a tree's tokens, greedy acceptance, the heads at the last accepted node and the next
tree's tokens (medusa_trt/acceptance.py, the functions the decoding loop runs eagerly). It is the
decoder graph export.py exports, node for node, between two small traced parts (the slots with
logits before it, acceptance and drafting after it: _compose_step), so a build traces the decoder
once:

  inputs   input_ids, position_ids, past_lengths, new_mask, past_*   as the decoder's (export.py;
                            new = tree slots)
           retrieve         [batch, paths, depth + 1] int64  root..leaf slots of each sequence's
                            paths, -1 padded (a tree per sequence: trees chosen per step); heads
                            0..min(depth, heads)-1 draft the next tree, the others are not computed
           candidate_index  [slots - 1] int64  next tree's slots in the heads' flat top-k (its
                            length also sets how many of the last slots get logits: a tree's)
           drafter_past_lengths, drafter_past_*   a drafter with a cache of its own (Amphista,
                            engine_dir.DRAFTER_STEP_INPUTS): its cache, which it reads over the
                            accepted path (_cached_draft) instead of the heads at the last node
  outputs  best_path, accepted  [batch] int64
           next_tokens      [batch, slots] int64  the next step's input_ids (a static tree's)
           next_topk, next_logp  [batch, used heads, k] int64, float32  each drafting head's top-k
                            token ids and log-probabilities: what a tree chosen per step is
                            chosen from (runtime/dynamic.py)
           present_keys, present_values  as the decoder's
           drafter_present_keys, drafter_present_values  with such a drafter: its K/V of the accepted
                            path, which `commit` appends to its cache
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from medusa_trt.acceptance import candidates_from_topk, greedy_accept, path_of
from medusa_trt.engine_dir import DRAFTER_STEP_INPUTS, STEP_INPUT_NAMES, past_names, step_outputs
from medusa_trt.engines.onnx.tracing import drop_stack_traces
from medusa_trt.modeling import MedusaModel

if TYPE_CHECKING:
    import onnx


def _step_start(input_ids: torch.Tensor, candidate_index: torch.Tensor):
    """The first of the slots whose logits the fused step computes: the last W = 1 +
    len(candidate_index), all of a tree's slots; at a prefill through the step graph
    (runtime/steps.py: _fused_prefill, the prompt's last token in the last slot) a tree's width
    instead of the whole prompt's lm_head."""
    return torch.sym_max(input_ids.shape[1] - (candidate_index.shape[0] + 1), 0)


class _StepRowsModule(nn.Module):
    """The fused step's first part (see _compose_step): its slots with logits, as the decoder's
    logit_positions [B, W]."""

    def forward(self, input_ids, candidate_index):
        start = _step_start(input_ids, candidate_index)
        return torch.arange(start, input_ids.shape[1], device=input_ids.device)[None].expand(input_ids.shape[0], -1)


class _StepAcceptModule(nn.Module):
    """The fused greedy step after the decoder (see the module docstring and _compose_step): one
    session call per decoding step instead of two, and no acceptance or top-k in host code
    (BENCHMARKS.md has the measured gain). It reads the decoder's logits [B, W, V] at the step's
    slots, only their argmax, and its `hidden`: at those slots too, or at every new row when the
    decoder graph holds them all (`hidden_all_rows`, a drafter with a cache of its own)."""

    def __init__(self, decoder: nn.Module, k: int, hidden_all_rows: bool):  # export.py's _ExportModule
        super().__init__()
        self.decoder, self.k, self.hidden_all_rows = decoder, k, hidden_all_rows

    def forward(self, input_ids, retrieve, candidate_index, logits, hidden, drafter_past_lengths=None,
                drafter_past=None):
        b = input_ids.shape[0]
        start = _step_start(input_ids, candidate_index)
        first = 0 if self.hidden_all_rows else start  # the slot of hidden's first row
        argmax = logits.argmax(-1)
        argmax = torch.cat([argmax.new_zeros(b, start), argmax], dim=1)  # [B, S] by slot; < start never read
        best, accepted = greedy_accept(retrieve, input_ids, argmax)
        path = path_of(retrieve, best)  # [B, D+1]
        last = path.gather(1, accepted[:, None])  # [B, 1] slot whose outputs continue
        root = argmax.gather(1, last).squeeze(1)
        h = hidden.gather(1, (last - first)[:, :, None].expand(-1, -1, hidden.shape[-1]))[:, 0]  # [B, d]
        # A tree of depth D drafts with heads 0..D-1 only: the others' lm_head rows are not computed
        # (on an int4 engine with tree [[0]], 1 of 4 rows; docs/benchmarks/issue-13-int4.md). A tree
        # chosen per step is as deep as its deepest path (a context chain may be deeper than the heads).
        depth = retrieve.shape[-1] - 1
        torch._check(depth >= 1)
        used = torch.sym_min(depth, self.decoder.model.drafter.num_heads)
        if drafter_past is not None:  # a drafter with its own cache: it takes the committed path first
            top, logp, dk, dv = self._cached_draft(path, accepted, argmax, hidden, first, drafter_past_lengths,
                                                   drafter_past)
            top, logp = top.narrow(1, 0, used), logp.narrow(1, 0, used)
            return best, accepted, candidates_from_topk(root, top, candidate_index), top, logp, dk, dv
        top, logp = self.decoder.draft.topk(h, self.k, used)  # [B, used, k] each
        return best, accepted, candidates_from_topk(root, top, candidate_index), top, logp

    def _cached_draft(self, path, accepted, argmax, hidden, first, past_lengths, past):
        """The accepted path's rows [B, D+1] (the first accepted + 1 valid) appended to the drafter's
        cache with the token chosen after each (the argmax at each node: the next accepted token, then
        the new root), drafts at the last. Returns the top-k ids [B, K, k] and the rows' K/V [2, B,
        Hkv, D+1, hd], which the runtime commits (accepted + 1 of them), and the log-probs [B, K, k]."""
        model = self.decoder.model
        width = path.shape[1]
        # Only the first max(accepted) + 1 path rows can be committed: the adaptation layers run over
        # those alone, not the tree's whole depth (a dynamic:16 tree is 6.2 rows deep on average,
        # 3.6 of them accepted; on an int4 engine each row is one more through every MatMulNBits).
        # The rows past them are zeros in the K/V output, which keeps the tree's depth + 1 rows.
        kept = accepted.max().item() + 1
        torch._check(kept >= 1)
        torch._check(kept <= width)
        path = path.narrow(1, 0, kept)
        b, n = path.shape
        j = torch.arange(n, device=path.device)
        valid = j[None] <= accepted[:, None]  # [B, D+1]
        slots = path.clamp(min=0)
        after = argmax.gather(1, slots)
        h = hidden.gather(1, (slots - first).clamp(min=0)[..., None].expand(-1, -1, hidden.shape[-1]))
        t = past[0].shape[2]
        prefix = torch.arange(t, device=path.device)[None, None, :] < past_lengths[:, None, None]
        new = (torch.ones(n, n, dtype=torch.bool, device=path.device).tril()[None] & valid[:, None, :]) | torch.eye(
            n, dtype=torch.bool, device=path.device)[None]
        mask = torch.cat([prefix.expand(b, n, t), new], dim=-1)
        cache = (torch.stack([past[0], past[2]]), torch.stack([past[1], past[3]]))
        h1, h2, dk, dv = model.drafter.adapt(h, after, model.vocab_embedding, past_lengths[:, None] + j, mask, cache)
        rows = accepted[:, None, None].expand(b, 1, h1.shape[-1])
        top, logp = model.drafter.topk(h1.gather(1, rows)[:, 0], h2.gather(1, rows)[:, 0], model.lm_head, self.k)
        return top, logp, F.pad(dk, (0, 0, 0, width - n)), F.pad(dv, (0, 0, 0, width - n))


_TORCH_DTYPES = {1: torch.float32, 10: torch.float16, 16: torch.bfloat16}  # onnx.TensorProto FLOAT, FLOAT16, BFLOAT16


def export_step(model: MedusaModel, wrapper: nn.Module, decoder: onnx.ModelProto, inputs: dict, topk: int,
                hidden_all_rows: bool, opset: int, table: dict, dims: tuple) -> onnx.ModelProto:
    """The fused step graph: the decoder graph just exported (`decoder`, model.onnx's own graph)
    between two small traced parts, _StepRowsModule before it and _StepAcceptModule after
    (_compose_step). A build then traces the decoder once, not twice (tracing is most of a build's
    time), and a step's decoder is the plain step's graph itself. `inputs` are the step's example
    inputs (export.py: step_example_inputs), `topk` its per-head top-k (step_topk)."""
    from torch.export import Dim

    batch, new, logits = dims
    cached = model.drafter.has_cache
    rows_program = torch.onnx.export(
        _StepRowsModule().eval(), (), kwargs={"input_ids": inputs["input_ids"], "candidate_index": inputs["candidate_index"]},
        dynamic_shapes={"input_ids": {0: batch, 1: new}, "candidate_index": {0: Dim("candidates")}},
        input_names=["input_ids", "candidate_index"], output_names=["logit_positions"], opset_version=opset,
        dynamo=True, optimize=True, verbose=False)
    # The decoder's outputs as it typed them (logits are float32 in a float16 graph too).
    dtypes = {o.name: _TORCH_DTYPES[o.type.tensor_type.elem_type] for o in decoder.graph.output}
    b, s = inputs["input_ids"].shape
    w = s  # the example's slots all have logits: 1 + 7 candidates >= 6 slots
    accept_inputs = {"input_ids": inputs["input_ids"], "retrieve": inputs["retrieve"],
                     "candidate_index": inputs["candidate_index"],
                     "logits": torch.zeros(b, w, model.cfg.vocab_size, dtype=dtypes["logits"]),
                     "hidden": torch.zeros(b, s if hidden_all_rows else w, model.cfg.hidden_size, dtype=dtypes["hidden"])}
    shapes = {"input_ids": {0: batch, 1: new}, "retrieve": {0: batch, 1: Dim("paths"), 2: Dim("path_length")},
              "candidate_index": {0: Dim("candidates")}, "logits": {0: batch, 1: logits},
              "hidden": {0: batch, 1: new if hidden_all_rows else logits}}
    if cached:
        accept_inputs.update(drafter_past_lengths=inputs["drafter_past_lengths"], drafter_past=inputs["drafter_past"])
        shapes.update(drafter_past_lengths={0: batch},
                      drafter_past=tuple({0: batch, 2: Dim("drafter_past")} for _ in range(4)))
    outputs = step_outputs(cached)
    accept_outputs = [n for n in outputs if n not in ("present_keys", "present_values")]
    accept_program = torch.onnx.export(
        _StepAcceptModule(wrapper, topk, hidden_all_rows).eval(), (), kwargs=accept_inputs,
        dynamic_shapes=shapes, input_names=[*accept_inputs.keys()][:5] + ([*DRAFTER_STEP_INPUTS] if cached else []),
        output_names=accept_outputs, opset_version=opset, dynamo=True, custom_translation_table=table or None,
        optimize=True, verbose=False)
    inputs_order = [*STEP_INPUT_NAMES, *past_names(model.cfg.num_layers), *(DRAFTER_STEP_INPUTS if cached else ())]
    for program in (rows_program, accept_program):
        drop_stack_traces(program)
    return _compose_step(rows_program.model_proto, decoder, accept_program.model_proto,
                         inputs_order, list(outputs))


def _compose_step(rows: onnx.ModelProto, decoder: onnx.ModelProto, accept: onnx.ModelProto, inputs: list[str],
                  outputs: list[str]) -> onnx.ModelProto:
    """One graph of the three: `rows` computes the decoder's logit_positions, `decoder` is the decoder
    graph as exported, and `accept` reads its logits and hidden. Names in `rows` and `accept` other than
    the step's own inputs and outputs get a prefix of their part, so nothing clashes with the decoder's."""
    import onnx

    shared = set(inputs) | set(outputs) | {"logit_positions", "logits", "hidden"}
    for part, prefix in ((rows, "step_rows/"), (accept, "step_accept/")):
        _rename(part.graph, lambda name, prefix=prefix: name if name in shared else prefix + name)
    graphs = (rows.graph, decoder.graph, accept.graph)
    infos = {v.name: v for g in graphs for v in (*g.input, *g.output)}
    graph = onnx.helper.make_graph(
        [n for g in graphs for n in g.node], decoder.graph.name + "_step",
        [infos[name] for name in inputs], [infos[name] for name in outputs],
        [t for g in graphs for t in g.initializer],
        value_info=[*(v for g in graphs for v in g.value_info), infos["logits"], infos["hidden"],
                    infos["logit_positions"]])
    functions = {(f.domain, f.name, f.overload): f for m in (rows, decoder, accept) for f in m.functions}
    opsets = {o.domain: o.version for m in (rows, decoder, accept) for o in m.opset_import}
    composed = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opsets.items()],
                                      functions=list(functions.values()), ir_version=decoder.ir_version,
                                      producer_name=decoder.producer_name, producer_version=decoder.producer_version)
    return composed


def _rename(graph: onnx.GraphProto, rename: Callable[[str], str]) -> None:
    """Renames, in place, every value, initializer and node of `graph` and of its subgraphs (the
    exporter writes an If for a symbolic max), whose references to outer values follow them."""
    import onnx

    for node in graph.node:
        node.name = rename(node.name) if node.name else ""
        for values in (node.input, node.output):
            names = [rename(n) if n else "" for n in values]
            del values[:]
            values.extend(names)
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                _rename(attribute.g, rename)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for g in attribute.graphs:
                    _rename(g, rename)
    for t in graph.initializer:
        t.name = rename(t.name)
    for v in (*graph.input, *graph.output, *graph.value_info):
        v.name = rename(v.name)
