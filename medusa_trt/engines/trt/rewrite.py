"""The exported decoder graph, rewritten for TensorRT: attention nodes become tree-attention plugin nodes.

`engines/onnx/export.py` writes each layer's attention (form "attention23") as

    Attention(q, Concat(past_key_i, k), Concat(past_value_i, v), Unsqueeze(mask, [1]))

with the dense mask built in the graph: mask = [prefix(past_lengths) | new_mask], [B, S, P + S] bool;
a layer with a sliding window reads And(mask, keys within the window of each query's position)
instead (modeling.sliding_window_mask). The plugin (`tree_attention/plugin.py`, semantics in
`tree_attention/kernel.py`) computes exactly that from a compact description of the same mask: every
query sees the valid past [0, past_lens[b]), the new tokens through a packed int32 mask, and with
its `window` attribute only the keys at positions > its position - window. So each Attention node
is replaced by

    tree_attention(q, Concat(past_key_i, k), Concat(past_value_i, v), past_lens, packed_mask, positions)

reusing the Concat outputs as they are (the kernel's K/V layout is past first, new tokens last) and
the Attention node's output tensor (nothing downstream changes). `past_lens` and `packed_mask` are
computed once, for all layers, from the graph inputs `past_lengths` and `new_mask`:

- past_lens = Cast(past_lengths, int32): the plugin's int32 input.
- positions = Cast(position_ids, int32): the new tokens' positions (read by windowed layers only).
- packed_mask = bits of new_mask packed 32 to a word, [B, S, ceil(S / 32)] int32: new_mask is
  zero-padded to a multiple of 32 columns, reshaped to [B, S, W, 32] and summed against
  [1, 2, 4, ..., 2**31] (2**31 as int32 is INT_MIN, which is bit 31 in two's complement; the bits
  are distinct, so the sum never carries and equals their OR).

Why the packed mask is computed in the graph rather than fed by the runtime (say, from
`TreeBuffers.packed_mask`): the engine then keeps the exact interface of every other engine (the
Backend protocol hands the runtime `new_mask` [B, S, S] bool, not a tree), prefill's causal mask
and ragged batches need no special case, and one mask serves every layer. The cost is a few tiny
elementwise ops on [B, S, S] per step, negligible next to one layer's attention.

Plugin node: op type PLUGIN_NAME in domain PLUGIN_NAMESPACE, with `plugin.onnx_node_attributes`:
`plugin_namespace` (how TensorRT's ONNX parser finds a plugin registered as "namespace::name"),
`aot` = 1 (use the ahead-of-time kernel, so the engine needs no Python at run time), `scale` and
`window`: the checkpoint's sliding window on the nodes whose mask is windowed, 0 elsewhere (the
caller passes ModelConfig.windows; the count of windowed masks found must match it).
The parser's default plugin version ("1") is the version `tensorrt.plugin` registers, so the node
carries no `plugin_version`. The domain is what onnx.checker and ONNX Runtime key custom ops on;
TensorRT dispatches on the op type alone.

Quantize/dequantize nodes of FP8 graphs are left as they are: only the nodes listed above change.

`reference_session` runs a rewritten graph in ONNX Runtime with the plugin op implemented by the
PyTorch reference (or the Triton kernel in its interpreter) through onnxruntime-extensions: the CPU
proof that the rewrite is wired right.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from medusa_trt.errors import MedusaTrtError
from medusa_trt.runtime.trt.tree_attention.plugin import (
    INPUT_NAMES,
    PLUGIN_NAME,
    PLUGIN_NAMESPACE,
    SCALE_ATTR,
    WINDOW_ATTR,
    onnx_node_attributes,
)

log = logging.getLogger(__name__)

PAST_LENS = "tree_attention_past_lens"  # [B] int32, shared by every plugin node
PACKED_MASK = "tree_attention_packed_mask"  # [B, S, W] int32, shared by every plugin node
POSITIONS = "tree_attention_positions"  # [B, S] int32, shared by every plugin node
PLUGIN_OPSET_VERSION = 1
_MASK_INPUT, _LENGTHS_INPUT, _POSITIONS_INPUT = "new_mask", "past_lengths", "position_ids"
_ONNX_DOMAINS = (None, "", "ai.onnx")  # gs leaves the default domain None


class RewriteError(MedusaTrtError):
    """A graph the rewrite cannot handle; the message names the node and what was expected."""


@dataclass(frozen=True)
class RewriteResult:
    path: Path  # the rewritten .onnx
    replaced: tuple[str, ...]  # names of the Attention nodes replaced, in graph order
    plugin_nodes: tuple[str, ...]  # names of the plugin nodes that replaced them


def _require_graphsurgeon():
    try:
        import onnx_graphsurgeon as gs
    except ImportError as e:
        raise ImportError("the TensorRT graph rewrite needs onnx-graphsurgeon: "
                          "pip install 'medusa-trt[tensorrt]' (or pip install onnx-graphsurgeon)") from e
    return gs


def rewrite_attention(model, scale: float | None = None, windows: Sequence[int | None] = ()):
    """(rewritten model, replaced node names, plugin node names): a copy of the exported decoder
    `model` (onnx.ModelProto) with every Attention node replaced by a tree-attention plugin node.
    `windows`: the model's sliding window per layer (ModelConfig.windows; empty or all None: none).

    Initializers stored as external data stay external (they are not loaded): save the result in
    the same directory as the source so their relative locations still resolve.
    """
    gs = _require_graphsurgeon()
    from onnx_graphsurgeon.logger import G_LOGGER

    severity = G_LOGGER.severity
    G_LOGGER.severity = G_LOGGER.ERROR  # it warns that numpy has no bfloat16 (the type is kept)
    try:
        return _rewrite(gs, model, scale, windows)
    finally:
        G_LOGGER.severity = severity


def _rewrite(gs, model, scale, windows):
    import onnx

    graph = gs.import_onnx(model)
    inputs = {t.name: t for t in graph.inputs}
    for name in (_LENGTHS_INPUT, _MASK_INPUT, _POSITIONS_INPUT):
        if name not in inputs:
            raise RewriteError(f"graph input {name!r} not found (inputs: {sorted(inputs)}); expected a decoder "
                               "graph exported by medusa_trt.engines.onnx.export")
    attention = [n for n in graph.nodes if n.op == "Attention" and n.domain in _ONNX_DOMAINS]
    if not attention:
        ops = sorted({n.op for n in graph.nodes})
        raise RewriteError(f"no Attention node in the graph (ops: {', '.join(ops)}); export with "
                           "attention='attention23' (the other forms have no single attention node)")

    window = _the_window(windows)
    checked = [(node, *_check_attention(node, inputs)) for node in attention]
    windowed = sum(w for _, _, w in checked)
    expected = sum(w is not None for w in windows)
    if windowed != expected:
        raise RewriteError(f"{windowed} of the graph's {len(attention)} Attention nodes read a sliding-window mask, "
                           f"but the model has {expected} layers with a window ({list(windows)}); expected the "
                           "graph exported from this checkpoint")
    past_lens = _add_node(graph, "Cast", [inputs[_LENGTHS_INPUT]], PAST_LENS, np.int32, ["batch"],
                          attrs={"to": onnx.TensorProto.INT32})
    positions = _add_node(graph, "Cast", [inputs[_POSITIONS_INPUT]], POSITIONS, np.int32, ["batch", "new_tokens"],
                          attrs={"to": onnx.TensorProto.INT32})
    packed = _packed_mask(graph, inputs[_MASK_INPUT])

    replaced, plugin_nodes = [], []
    for node, node_scale, node_windowed in checked:
        q, keys, values = node.inputs[:3]
        out = node.outputs[0]
        if out.dtype is None:  # the plugin returns q's dtype and shape; say so for shape inference
            out.dtype, out.shape = q.dtype, q.shape
        plugin = gs.Node(
            op=PLUGIN_NAME, name=f"{node.name}/tree_attention", domain=PLUGIN_NAMESPACE,
            attrs=onnx_node_attributes(scale if scale is not None else node_scale, window if node_windowed else None),
            inputs=[q, keys, values, past_lens, packed, positions], outputs=[out],
        )
        node.inputs.clear()
        node.outputs.clear()
        graph.nodes.append(plugin)
        replaced.append(node.name)
        plugin_nodes.append(plugin.name)
    # cleanup drops the Attention nodes and the dense-mask subgraph, which nothing reads any more.
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    out_model = gs.export_onnx(graph)
    out_model.ir_version = model.ir_version
    _set_plugin_opset(out_model)
    return out_model, tuple(replaced), tuple(plugin_nodes)


def rewrite_onnx_file(src: str | Path, dst: str | Path | None = None, scale: float | None = None,
                      windows: Sequence[int | None] = ()) -> RewriteResult:
    """Rewrites the decoder graph at `src` into `dst` (default: `<stem>_trt.onnx` beside it);
    `windows` as in rewrite_attention.

    External data is neither loaded nor copied: `dst` must be in `src`'s directory, where the
    rewritten graph's references to the weight files still resolve.
    """
    import onnx

    src = Path(src)
    dst = Path(dst) if dst is not None else src.with_name(src.stem + "_trt.onnx")
    if not src.is_file():
        raise RewriteError(f"{src}: ONNX file not found")
    if dst.resolve().parent != src.resolve().parent:
        raise RewriteError(f"{dst}: must be in the directory of {src} (its external data files stay there)")
    model = onnx.load(str(src), load_external_data=False)
    rewritten, replaced, plugins = rewrite_attention(model, scale, windows)
    onnx.save(rewritten, str(dst))
    try:
        check_rewritten(dst)
    except Exception:
        dst.unlink(missing_ok=True)
        raise
    log.info("%s: %d attention nodes -> %s::%s plugin nodes (%s)", dst, len(replaced), PLUGIN_NAMESPACE,
             PLUGIN_NAME, ", ".join(plugins[:3]) + (" ..." if len(plugins) > 3 else ""))
    return RewriteResult(dst, replaced, plugins)


def check_rewritten(path: str | Path) -> None:
    """onnx.checker on the rewritten file (plugin nodes are custom-domain ops, which it accepts; given
    the path, it finds external data beside it), and the invariants the rewrite promises: no
    Attention node left, every plugin node fully wired."""
    import onnx

    onnx.checker.check_model(str(path))
    model = onnx.load(str(path), load_external_data=False)
    if any(n.op_type == "Attention" and n.domain in ("", "ai.onnx") for n in model.graph.node):
        raise RewriteError(f"{path}: the rewritten graph still has an Attention node")
    for node in model.graph.node:
        if node.op_type == PLUGIN_NAME and node.domain == PLUGIN_NAMESPACE:
            if len(node.input) != len(INPUT_NAMES) or not all(node.input):
                raise RewriteError(f"{path}: plugin node {node.name}: inputs {list(node.input)}, "
                                   f"expected {INPUT_NAMES}")


# -- graph pieces ---------------------------------------------------------------------------------


def _add_node(graph, op: str, inputs: list, name: str, dtype, shape, attrs: dict | None = None):
    import onnx_graphsurgeon as gs

    out = gs.Variable(name, dtype=dtype, shape=shape)
    graph.nodes.append(gs.Node(op=op, name=f"{name}/{op}", attrs=attrs or {}, inputs=inputs, outputs=[out]))
    return out


def _const(name: str, values) -> object:
    import onnx_graphsurgeon as gs

    return gs.Constant(name, np.asarray(values))


def _packed_mask(graph, new_mask):
    """[B, S, S] bool -> [B, S, ceil(S/32)] int32, bit j % 32 of word j // 32 = new_mask[..., j]
    (little-endian bit order, the layout of medusa_trt.tree.pack_mask and TensorRT-LLM)."""
    import onnx

    p = PACKED_MASK
    bits = _add_node(graph, "Cast", [new_mask], f"{p}/bits", np.int32, None, attrs={"to": onnx.TensorProto.INT32})
    shape = _add_node(graph, "Shape", [new_mask], f"{p}/shape", np.int64, [3])
    batch_rows = _add_node(graph, "Slice", [shape, _const(f"{p}/c0", [0]), _const(f"{p}/c2", [2])],
                           f"{p}/batch_rows", np.int64, [2])
    cols = _add_node(graph, "Slice", [shape, _const(f"{p}/c2b", [2]), _const(f"{p}/c3", [3])],
                     f"{p}/cols", np.int64, [1])
    words = _add_node(graph, "Div", [_add_node(graph, "Add", [cols, _const(f"{p}/c31", [31])], f"{p}/cols31",
                                               np.int64, [1]), _const(f"{p}/c32", [32])],
                      f"{p}/words", np.int64, [1])
    pad = _add_node(graph, "Sub", [_add_node(graph, "Mul", [words, _const(f"{p}/c32b", [32])], f"{p}/padded_cols",
                                             np.int64, [1]), cols], f"{p}/pad", np.int64, [1])
    pads = _add_node(graph, "Concat", [_const(f"{p}/zeros5", [0, 0, 0, 0, 0]), pad], f"{p}/pads", np.int64, [6],
                     attrs={"axis": 0})
    padded = _add_node(graph, "Pad", [bits, pads, _const(f"{p}/zero", np.int32(0))], f"{p}/padded", np.int32, None)
    target = _add_node(graph, "Concat", [batch_rows, words, _const(f"{p}/c32c", [32])], f"{p}/grouped_shape",
                       np.int64, [4], attrs={"axis": 0})
    grouped = _add_node(graph, "Reshape", [padded, target], f"{p}/grouped", np.int32, None)
    # Bit weights as int32: 1 << 31 wraps to INT32_MIN, bit 31 of a two's-complement word.
    weights = (np.uint32(1) << np.arange(32, dtype=np.uint32)).view(np.int32)
    weighted = _add_node(graph, "Mul", [grouped, _const(f"{p}/bit_weights", weights)], f"{p}/weighted",
                         np.int32, None)
    return _add_node(graph, "ReduceSum", [weighted, _const(f"{p}/last_axis", [-1])], p, np.int32,
                     ["batch", "new_tokens", None], attrs={"keepdims": 0})


def _producer(tensor):
    return tensor.inputs[0] if getattr(tensor, "inputs", None) else None


def _attr_int(node, name: str, default: int = 0) -> int:
    return int(node.attrs.get(name, default))


def _reads_input(tensor, name: str, limit: int = 64) -> bool:
    """Whether graph input `name` is an ancestor of `tensor` (searched up to `limit` nodes)."""
    seen, stack = set(), [tensor]
    while stack and len(seen) < limit:
        t = stack.pop()
        if t.name == name:
            return True
        node = _producer(t)
        if node is not None and id(node) not in seen:
            seen.add(id(node))
            stack.extend(node.inputs)
    return False


def _the_window(windows: Sequence[int | None]) -> int | None:
    """The one sliding window of a model's layers (None: no layer has one)."""
    sizes = {w for w in windows if w is not None}
    if len(sizes) > 1:
        raise RewriteError(f"layer windows {list(windows)}: the plugin rewrite expects one window size")
    return sizes.pop() if sizes else None


def _check_attention(node, inputs: dict) -> tuple[float | None, bool]:
    """Checks that `node` is the exporter's attention (see the module docstring), so the plugin's
    semantics are its semantics; returns its scale attribute (None: 1/sqrt(D)) and whether its mask
    is cut to a sliding window."""
    where = f"Attention node {node.name!r}"
    extra = [t.name for t in node.inputs[4:] if t is not None and t.name]
    if len(node.inputs) < 4 or extra:
        raise RewriteError(f"{where}: inputs {[t.name for t in node.inputs]}, expected exactly (q, k, v, attn_mask) "
                           "with the past concatenated into k/v")
    if _attr_int(node, "is_causal") or float(node.attrs.get("softcap", 0.0)) != 0.0:
        raise RewriteError(f"{where}: is_causal={_attr_int(node, 'is_causal')} softcap={node.attrs.get('softcap')}, "
                           "expected 0 and 0.0 (the mask carries causality)")
    for out in node.outputs[1:]:
        if out.outputs:
            raise RewriteError(f"{where}: output {out.name!r} is read by {[n.name for n in out.outputs]}; "
                               "expected only the attention output to be used")
    q = node.inputs[0]
    if q.shape is not None and len(q.shape) != 4:
        raise RewriteError(f"{where}: q has shape {q.shape}, expected 4 dims [B, H, S, D]")
    for index, kind in ((1, "key"), (2, "value")):
        concat = _producer(node.inputs[index])
        past = concat.inputs[0] if concat is not None and concat.inputs else None
        sliced = _producer(past) if past is not None else None
        if sliced is not None and sliced.op == "Slice":  # the committed prefix of the past (onnx/export.py)
            past = sliced.inputs[0]
        ok = (concat is not None and concat.op == "Concat" and len(concat.inputs) == 2
              and _attr_int(concat, "axis") in (2, -2)
              and past.name.startswith(f"past_{kind}_") and past.name in inputs)
        if not ok:
            raise RewriteError(f"{where}: input {index} ({node.inputs[index].name!r}) is not Concat(past_{kind}_i, "
                               f"new, axis=2) of a graph input; the plugin needs the past first, new tokens last")
    unsqueeze = _producer(node.inputs[3])
    mask = unsqueeze.inputs[0] if unsqueeze is not None and unsqueeze.op == "Unsqueeze" else None
    joined = _producer(mask) if mask is not None else None
    # A sliding-window layer's mask: And(the full mask, a window condition on position_ids).
    windowed = (joined is not None and joined.op == "And" and len(joined.inputs) == 2
                and _reads_input(joined.inputs[1], _POSITIONS_INPUT))
    if windowed:
        joined = _producer(joined.inputs[0])
    ok = (joined is not None and joined.op == "Concat" and len(joined.inputs) == 2
          and _attr_int(joined, "axis") in (2, -1) and joined.inputs[1].name == _MASK_INPUT
          and _reads_input(joined.inputs[0], _LENGTHS_INPUT))
    if not ok:
        raise RewriteError(f"{where}: attn_mask {node.inputs[3].name!r} is not Unsqueeze(Concat(prefix("
                           f"{_LENGTHS_INPUT}), {_MASK_INPUT})), nor that cut to a sliding window by "
                           f"{_POSITIONS_INPUT}; the plugin rebuilds exactly those masks")
    scale = node.attrs.get("scale")
    return None if scale is None else float(scale), windowed


def _set_plugin_opset(model) -> None:
    import onnx

    imports = {op.domain: op for op in model.opset_import}
    if PLUGIN_NAMESPACE in imports:
        imports[PLUGIN_NAMESPACE].version = PLUGIN_OPSET_VERSION
    else:
        model.opset_import.append(onnx.helper.make_opsetid(PLUGIN_NAMESPACE, PLUGIN_OPSET_VERSION))


# -- the plugin op in ONNX Runtime (CPU proof of the wiring) ------------------------------------------

ORT_OP_IMPLS = ("reference", "kernel")
_ort_impl = {"impl": "reference"}


@functools.cache
def _register_ort_op() -> str:
    """Registers PLUGIN_NAMESPACE::PLUGIN_NAME with onnxruntime-extensions (float32 q/k/v) and
    returns its custom-op library path. Registration is process-wide, hence once."""
    try:
        from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op
    except ImportError as e:
        raise ImportError("running the rewritten graph in ONNX Runtime needs onnxruntime-extensions: "
                          "pip install onnxruntime-extensions") from e
    dt = PyCustomOpDef

    @onnx_op(op_type=f"{PLUGIN_NAMESPACE}::{PLUGIN_NAME}",
             inputs=[dt.dt_float, dt.dt_float, dt.dt_float, dt.dt_int32, dt.dt_int32, dt.dt_int32],
             outputs=[dt.dt_float],
             attrs={SCALE_ATTR: dt.dt_float, WINDOW_ATTR: dt.dt_int64, "plugin_namespace": dt.dt_string,
                    "aot": dt.dt_int64})
    def tree_attention_op(q, k, v, past_lens, packed_mask, positions, **attrs):
        import torch

        from medusa_trt.runtime.trt.tree_attention.kernel import reference_tree_attention, tree_attention

        fn = tree_attention if _ort_impl["impl"] == "kernel" else reference_tree_attention
        scale = float(attrs.get(SCALE_ATTR, 0.0)) or None  # 0.0: 1/sqrt(D), as in the plugin
        q, k, v, past_lens, packed_mask, positions = (torch.from_numpy(np.ascontiguousarray(a))
                                                      for a in (q, k, v, past_lens, packed_mask, positions))
        return fn(q, k, v, past_lens, packed_mask, scale, positions, int(attrs.get(WINDOW_ATTR, 0))).numpy()

    return get_library_path()


def reference_session(onnx_path: str | Path, impl: str = "reference", threads: int = 1):
    """An ONNX Runtime CPU session for a rewritten float32 graph, the plugin op computed by
    `reference_tree_attention` (impl "reference") or by `kernel.tree_attention` (impl "kernel": the
    Triton kernel when triton runs interpreted in this process, the reference otherwise)."""
    import onnxruntime as ort

    if impl not in ORT_OP_IMPLS:
        raise ValueError(f"impl {impl!r}: expected one of {ORT_OP_IMPLS}")
    library = _register_ort_op()
    _ort_impl["impl"] = impl
    so = ort.SessionOptions()
    so.register_custom_ops_library(library)
    so.intra_op_num_threads = threads
    # As runtime/ort/session.py's session_options: ONNX Runtime's QDQ fusions turn an FP8 graph's DequantizeLinear ->
    # MatMul into kernels without float8 inputs; float graphs have no Q/DQ, so nothing changes for them.
    so.add_session_config_entry("session.disable_quant_qdq", "1")
    so.log_severity_level = 3
    return ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
