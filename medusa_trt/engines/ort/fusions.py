"""ONNX Runtime's fused contrib ops in place of the exported decoder's plain ones (issue 13).

The exporter writes each decoder layer as the reference computes it, in plain ops: RoPE as Split,
Neg, Concat, two Muls and an Add per query and per key, the residual Add before each RMSNorm.
At one new token a layer's MatMuls are small, so op count sets much of a step's cost, and every
op is a separate dispatch (and with several intra-op threads, a separate fork/join). This pass
rewrites, in an exported graph, patterns the exporter produces from modeling.py into ONNX
Runtime's com.microsoft ops with the same arithmetic:

- "rotary": x * cos + rotate_half(x) * sin -> RotaryEmbedding(x, position_ids, cos_cache, sin_cache)
  (not interleaved; 4-D [B, H, S, D] input). The caches are the reference's cos/sin of
  position * inv_freq for every position below max_position_embeddings, computed by torch as the
  reference computes them; tree nodes keep their own positions (position_ids is per token).
- "skip_norm": RMSNormalization(a + b) -> SkipSimplifiedLayerNormalization(a, b), whose fourth
  output is the sum (the residual stream the next layer reads).
- "gate_up": MatMuls (float, MatMulNBits, or an int8 engine's MatMulIntegerToFloat with its row
  scale's Mul) with constant weights reading the same input (the MLP's gate and up projections) ->
  one MatMul over the weights concatenated along N, then a Split: one kernel call (and one
  fork/join of the intra-op threads) instead of two. Each output column is the same dot product as
  before (an int8 column's exact integer sum, its own scale, the row's). Where both the fused
  MatMulNBits and the fused offset correction of an exact int4 engine are split only to be added
  half by half, they are added first and split once.

One more rewrite, not optional because it changes the graph's outputs: `write_cache_in_place`
(engine.json onnx.cache_in_place) makes the new K/V land in the cache buffers the runtime binds.

Only ONNX Runtime has these ops: medusa-build applies the pass to ONNX Runtime engines, never to
the graphs the TensorRT builders read. Each fusion is optional so each can be measured alone
(BENCHMARKS.md). Outputs equal the plain graph's to float32 rounding (RoPE within 1 ulp: the
kernel's multiply-add order); medusa-check verifies built engines against the reference.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

FUSIONS = ("rotary", "skip_norm", "gate_up")
TENSOR_SCATTER_OPSET = 24  # write_cache_in_place's op
STACKED_KV = ("present_keys", "present_values")  # the new K/V outputs an in-place graph drops
MS_DOMAIN = "com.microsoft"


def _reads(node) -> list[str]:
    """The names a node reads: its inputs, and the outer-scope names its subgraphs (If branches)
    read."""
    names = list(node.input)
    for a in node.attribute:
        if a.g is not None:
            names += [i for sub in a.g.node for i in _reads(sub)]
    return names


class _Graph:
    """Producer/consumer indexes over a GraphProto's nodes (rebuilt after each rewrite)."""

    def __init__(self, graph):
        self.graph = graph
        self.producer = {o: n for n in graph.node for o in n.output if o}
        self.consumers: dict[str, list] = {}
        for n in graph.node:
            for i in _reads(n):
                self.consumers.setdefault(i, []).append(n)
        self.init = {t.name: t for t in graph.initializer}
        self.initializers = set(self.init)
        self.outputs = {o.name for o in graph.output}

    def op(self, name: str, *ops: str):
        """The node producing `name` when its op type is one of `ops`."""
        n = self.producer.get(name)
        return n if n is not None and n.op_type in ops else None

    def only_used_by(self, name: str, node) -> bool:
        return name not in self.outputs and all(c is node for c in self.consumers.get(name, []))


def _replace_nodes(graph, replace: dict[int, list], remove: set[int]) -> None:
    """Rewrites graph.node in order: a node whose id is in `replace` becomes those nodes, in its
    place (every input is computed by then and every reader comes later); the `remove` ids go."""
    kept = [m for n in graph.node if id(n) not in remove for m in replace.get(id(n), [n])]
    del graph.node[:]
    graph.node.extend(kept)


def _attr(node, name: str, default=None):
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _traces_to(g: _Graph, name: str, op_type: str) -> bool:
    """Whether `name` is produced by `op_type`, possibly through Cast/Unsqueeze/Reshape."""
    while (n := g.producer.get(name)) is not None:
        if n.op_type == op_type:
            return True
        if n.op_type not in ("Cast", "Unsqueeze", "Reshape", "Expand"):
            return False
        name = n.input[0]
    return False


# Ops whose output values take only a size from their inputs (an index range, a shape): a value
# computed through them is not computed from those inputs' values.
_SIZE_ONLY = ("Range", "Shape", "ConstantOfShape")


def _computed_from(g: _Graph, name: str, graph_input: str) -> bool:
    """Whether the values of `name` are computed from the graph input `graph_input` (any path that
    reads values, not only a size: the fused step's drafter rows are as many as the base accepted,
    but their positions are the drafter cache's)."""
    seen, todo = set(), [name]
    while todo:
        n = todo.pop()
        if n == graph_input:
            return True
        node = g.producer.get(n)
        if node is None or id(node) in seen or node.op_type in _SIZE_ONLY:
            continue
        seen.add(id(node))
        todo.extend(i for i in node.input if i)
    return False


def _rotary_match(g: _Graph, add, position_ids: str | None = None):
    """(x, nodes to remove, cos name) when `add` is x * cos + cat(-x2, x1) * sin, x split in halves
    along its last axis, cos/sin from Cos/Sin nodes; else None."""
    if len(add.input) != 2:
        return None
    muls = [g.op(i, "Mul") for i in add.input]
    if None in muls:
        return None
    for m_cos, m_sin in (muls, muls[::-1]):
        for cat_in, sin in (m_sin.input, m_sin.input[::-1]):
            cat = g.op(cat_in, "Concat")
            if cat is None or len(cat.input) != 2 or _attr(cat, "axis") not in (-1, 3):
                continue
            neg = g.op(cat.input[0], "Neg")
            split = g.producer.get(cat.input[1])
            if neg is None or split is None or split.op_type != "Split" or g.producer.get(neg.input[0]) is not split:
                continue
            if list(split.output) != [cat.input[1], neg.input[0]]:  # cat(-x2, x1) of split(x) = (x1, x2)
                continue
            if _attr(split, "axis") not in (-1, 3) or (len(split.input) > 1 and split.input[1]) or \
                    _attr(split, "num_outputs") != 2:
                continue
            x = split.input[0]
            others = [i for i in m_cos.input if i != x]
            if len(others) != 1 or x not in m_cos.input or not _traces_to(g, others[0], "Cos") \
                    or not _traces_to(g, sin, "Sin"):
                continue
            # RotaryEmbedding reads the graph's position_ids: a rotation at other positions (the
            # fused step's drafter cache, at its own lengths) keeps its plain ops.
            if position_ids is not None and not _computed_from(g, others[0], position_ids):
                continue
            nodes = [split, neg, cat, m_sin, m_cos]
            inner = [(split.output[0], (cat, neg)), (split.output[1], (neg,)), (neg.output[0], (cat,)),
                     (cat.output[0], (m_sin,)), (m_sin.output[0], (add,)), (m_cos.output[0], (add,))]
            if all(o not in g.outputs and {id(c) for c in g.consumers.get(o, [])} <= {id(u) for u in users}
                   for o, users in inner):
                return x, nodes
    return None


def _fuse_rotary(model, cos_cache: np.ndarray, sin_cache: np.ndarray, position_ids: str) -> int:
    from onnx import helper, numpy_helper

    graph = model.graph
    g = _Graph(graph)
    remove, replace = set(), {}
    for node in graph.node:
        if node.op_type != "Add":
            continue
        match = _rotary_match(g, node, position_ids)
        if match is None:
            continue
        x, nodes = match
        remove.update(id(n) for n in nodes)
        replace[id(node)] = [helper.make_node(
            "RotaryEmbedding", [x, position_ids, "rotary_cos_cache", "rotary_sin_cache"], list(node.output),
            name=f"{node.name or node.output[0]}_rotary", domain=MS_DOMAIN, interleaved=0)]
    if not replace:
        return 0
    _replace_nodes(graph, replace, remove)
    graph.initializer.extend([numpy_helper.from_array(cos_cache, "rotary_cos_cache"),
                              numpy_helper.from_array(sin_cache, "rotary_sin_cache")])
    return len(replace)


def _fuse_skip_norm(model) -> int:
    from onnx import helper

    graph = model.graph
    g = _Graph(graph)
    remove, replace = set(), {}
    for norm in graph.node:
        if norm.op_type != "RMSNormalization" or _attr(norm, "axis", -1) != -1 or _attr(norm, "stash_type", 1) != 1:
            continue
        add = g.op(norm.input[0], "Add")
        if add is None or id(add) in replace or len(norm.input) < 2 or norm.input[1] not in g.initializers:
            continue
        # Both addends are activations of the residual stream (same shape), not a broadcast constant.
        if any(i in g.initializers or g.op(i, "Constant") is not None for i in add.input):
            continue
        total = add.output[0]
        outputs = [norm.output[0]] if g.only_used_by(total, norm) else [norm.output[0], "", "", total]
        replace[id(add)] = [helper.make_node(
            "SkipSimplifiedLayerNormalization", [add.input[0], add.input[1], norm.input[1]], outputs,
            name=f"{norm.name or norm.output[0]}_skip", domain=MS_DOMAIN, epsilon=float(_attr(norm, "epsilon", 1e-5)))]
        remove.add(id(norm))
    if not replace:
        return 0
    _replace_nodes(graph, replace, remove)
    return len(replace)


def _constant(g: _Graph, name: str):
    """The initializer behind `name`, directly or through a Reshape to [-1] (MatMulNBits' scales),
    as (TensorProto, flattened); None otherwise."""
    if name in g.initializers:
        return g.init[name], False
    n = g.op(name, "Reshape")
    if n is not None and n.input[0] in g.initializers and n.input[1] in g.initializers:
        from onnx import numpy_helper

        if numpy_helper.to_array(g.init[n.input[1]]).tolist() == [-1]:
            return g.init[n.input[0]], True
    return None


def _fuse_gate_up(model) -> int:
    """Groups MatMul / MatMulNBits / int8 MatMulIntegerToFloat nodes reading one input with constant
    weights into one node."""
    import numpy as np
    from onnx import helper, numpy_helper

    graph = model.graph
    g = _Graph(graph)
    groups: dict[tuple, list] = {}
    for n in graph.node:
        if n.op_type == "MatMul" and n.input[1] in g.initializers and len(g.init[n.input[1]].dims) == 2:
            key = ("MatMul", n.input[0], g.init[n.input[1]].dims[0], g.init[n.input[1]].data_type)
        elif n.op_type == "MatMulNBits" and n.domain == MS_DOMAIN and len(n.input) in (3, 4) and \
                n.input[1] in g.initializers and all(i in g.initializers for i in n.input[3:]) and \
                _constant(g, n.input[2]):
            attrs = tuple(_attr(n, a) for a in ("K", "bits", "block_size", "accuracy_level"))
            key = ("MatMulNBits", n.input[0], attrs, len(n.input))  # with zero points or without
        elif (row_scale := _int8_row_scale(g, n)) is not None:
            key = ("MatMulIntegerToFloat", *n.input[:1], *n.input[2:3], *n.input[4:], row_scale,
                   g.init[n.input[1]].dims[0])
        else:
            continue
        groups.setdefault(key, []).append(n)
    remove, replace, new_init = set(), {}, []
    for key, nodes in groups.items():
        if len(nodes) < 2:
            continue
        first = nodes[0]
        stem = f"{first.name or first.output[0]}_fused"
        if key[0] == "MatMulIntegerToFloat":
            # The int8 form (ops._matmul_int8_translation): each member scaled by the same row scale
            # after its GEMM; the fused GEMM is scaled once, then split into the members' Muls' outputs.
            muls = [g.consumers[n.output[0]][0] for n in nodes]
            for suffix, i in (("qweight_t", 1), ("scales", 3)):
                arrays = [numpy_helper.to_array(g.init[n.input[i]]) for n in nodes]
                new_init.append(numpy_helper.from_array(np.concatenate(arrays, axis=-1), f"{stem}.{suffix}"))
            sizes = [g.init[n.input[1]].dims[1] for n in nodes]
            fused = helper.make_node("MatMulIntegerToFloat", [first.input[0], f"{stem}.qweight_t", first.input[2],
                                                              f"{stem}.scales", first.input[4]],
                                     [f"{stem}.out"], name=stem, domain=MS_DOMAIN)
            scaled = helper.make_node("Mul", [f"{stem}.out", key[4]], [f"{stem}.scaled"], name=f"{stem}_scale")
            new_init.append(numpy_helper.from_array(np.array(sizes, dtype=np.int64), f"{stem}.sizes"))
            split = helper.make_node("Split", [f"{stem}.scaled", f"{stem}.sizes"], [m.output[0] for m in muls],
                                     name=f"{stem}_split", axis=-1)
            replace[id(first)] = [fused, scaled, split]
            remove.update(id(n) for n in nodes[1:])
            remove.update(id(m) for m in muls)
            continue
        if key[0] == "MatMul":
            ws = [numpy_helper.to_array(g.init[n.input[1]]) for n in nodes]
            new_init.append(numpy_helper.from_array(np.concatenate(ws, axis=1), f"{stem}.weight"))
            sizes = [w.shape[1] for w in ws]
            fused = helper.make_node("MatMul", [first.input[0], f"{stem}.weight"], [f"{stem}.out"], name=stem)
        else:
            packed = [numpy_helper.to_array(g.init[n.input[1]]) for n in nodes]
            scales = [numpy_helper.to_array(_constant(g, n.input[2])[0]).reshape(-1) for n in nodes]
            parts = {"packed": packed, "scales": scales}
            if key[3] == 4:
                parts["zero_points"] = [numpy_helper.to_array(g.init[n.input[3]]) for n in nodes]
            sizes = [int(_attr(n, "N")) for n in nodes]
            for suffix, arrays in parts.items():
                new_init.append(numpy_helper.from_array(np.concatenate(arrays, axis=0), f"{stem}.{suffix}"))
            attrs = dict(zip(("K", "bits", "block_size", "accuracy_level"), key[2], strict=True))
            fused = helper.make_node("MatMulNBits", [first.input[0], *(f"{stem}.{suffix}" for suffix in parts)],
                                     [f"{stem}.out"], name=stem, domain=MS_DOMAIN, N=sum(sizes), **attrs)
        new_init.append(numpy_helper.from_array(np.array(sizes, dtype=np.int64), f"{stem}.sizes"))
        split = helper.make_node("Split", [f"{stem}.out", f"{stem}.sizes"], [n.output[0] for n in nodes],
                                 name=f"{stem}_split", axis=-1)
        replace[id(first)] = [fused, split]
        remove.update(id(n) for n in nodes[1:])
    if not replace:
        return 0
    # The fused node sits where the group's first node was: every input is computed by then, and
    # every consumer of any member comes after it.
    _replace_nodes(graph, replace, remove)
    graph.initializer.extend(new_init)
    _add_before_split(model)
    return len(replace)


def _int8_row_scale(g: _Graph, n) -> str | None:
    """For a MatMulIntegerToFloat of the int8 form (A, constant int8 B [K, N], a_scale, constant
    column scales [N], a_zero_point) whose output only a Mul by the row scale reads: that scale."""
    if n.op_type != "MatMulIntegerToFloat" or n.domain != MS_DOMAIN or len(n.input) != 5 or \
            n.input[1] not in g.initializers or n.input[3] not in g.initializers or len(g.init[n.input[1]].dims) != 2:
        return None
    readers = g.consumers.get(n.output[0], [])
    if len(readers) != 1 or readers[0].op_type != "Mul" or not g.only_used_by(n.output[0], readers[0]):
        return None
    return next((i for i in readers[0].input if i != n.output[0]), None)


def _add_before_split(model) -> int:
    """Split(a) and Split(b) whose outputs are only added pairwise, part i of a to part i of b,
    -> Split(a + b): one Add and one Split instead of one Add per part and two Splits. An exact
    int4 engine adds its offsets' correction MatMul to each MatMulNBits (quant.Int4Linear), so
    after the fusion above the MLP's gate and up each had an Add of two split halves. Elementwise
    the same sums, so the same bits."""
    from onnx import helper, numpy_helper

    graph = model.graph
    g = _Graph(graph)

    def sizes(split) -> list[int] | None:
        if len(split.input) != 2 or split.input[1] not in g.initializers:
            return None
        return numpy_helper.to_array(g.init[split.input[1]]).tolist()

    def pairs_up(a, b) -> list | None:
        """The Adds when every output i of Split a is read only by one Add of it and output i of b."""
        # On the last axis only: there a broadcast Add of the unsplit tensors lines up as the parts' did.
        if len(a.output) != len(b.output) or sizes(a) != sizes(b) or _attr(a, "axis", 0) != -1 or \
                _attr(b, "axis", 0) != -1:
            return None
        adds = []
        for x, y in zip(a.output, b.output, strict=True):
            readers = g.consumers.get(x, [])
            if len(readers) != 1 or readers[0].op_type != "Add" or {*readers[0].input} != {x, y} or \
                    not g.only_used_by(x, readers[0]) or not g.only_used_by(y, readers[0]):
                return None
            adds.append(readers[0])
        return adds

    position = {id(m): i for i, m in enumerate(graph.node)}
    replace: dict[int, list] = {}
    remove: set[int] = set()
    for n in graph.node:
        if n.op_type != "Split" or id(n) in remove or id(n) in replace or sizes(n) is None:
            continue
        first = g.consumers.get(n.output[0], [])
        if len(first) != 1 or first[0].op_type != "Add":
            continue
        other = next((g.op(i, "Split") for i in first[0].input if i != n.output[0]), None)
        if other is None or other is n or id(other) in remove or id(other) in replace:
            continue
        adds = pairs_up(n, other)
        if adds is None:
            continue
        total = f"{n.name or n.output[0]}_sum"
        add = helper.make_node("Add", [n.input[0], other.input[0]], [total], name=total)
        split = helper.make_node("Split", [total, n.input[1]], [a.output[0] for a in adds], name=f"{total}_split",
                                 axis=-1)
        # In place of the later Split: both inputs are computed by then, and the Adds' readers follow it.
        later = max(n, other, key=lambda x: position[id(x)])
        replace[id(later)] = [add, split]
        remove.update({id(n), id(other), *(id(a) for a in adds)} - {id(later)})
    if not replace:
        return 0
    _replace_nodes(graph, replace, remove)
    return len(replace)


def _cache_in_place(model, write_indices: str, present: dict[str, str]) -> int:
    """Slice(past) -> ScatterElements(new K/V at past_lengths[b] + slot) becomes
    TensorScatter(past, new K/V, past_lengths) -> Slice: the new keys go into the cache buffer itself
    (a graph output, `present[past]`), and attention reads the same first max(past_lengths) + S
    keys. Only for attention forms that place new keys at each sequence's own length
    (onnx/attention.py: AttentionForm.places_new_keys), whose scatter indices are past_lengths[b] + slot."""
    from onnx import helper

    graph = model.graph
    g = _Graph(graph)
    remove, replace = set(), {}
    for name in present:
        readers = g.consumers.get(name, [])
        slices = [n for n in readers if n.op_type == "Slice"]
        # Besides its Slice, a past may only be read for its shape (the buffer's contents change).
        if len(slices) != 1 or any(n.op_type not in ("Slice", "Shape") for n in readers):
            continue
        sl = slices[0]
        scatters = g.consumers.get(sl.output[0], [])
        if len(scatters) != 1 or scatters[0].op_type != "ScatterElements" or scatters[0].input[0] != sl.output[0] \
                or _attr(scatters[0], "axis") != 2 or _attr(scatters[0], "reduction", b"none") not in (b"none", "none") \
                or not _indices_from(g, scatters[0].input[1], write_indices):
            continue
        scatter = scatters[0]
        remove.add(id(sl))
        replace[id(scatter)] = [
            helper.make_node("TensorScatter", [name, scatter.input[2], write_indices], [present[name]],
                             name=f"{scatter.name or scatter.output[0]}_in_place", axis=2),
            helper.make_node("Slice", [present[name], *sl.input[1:]], list(scatter.output), name=sl.name)]
    if len(replace) != len(present):  # all or nothing: the runtime binds every present output
        return 0
    _replace_nodes(graph, replace, remove)
    past_info = {i.name: i for i in graph.input}
    for past, out in present.items():
        info = graph.output.add()
        info.CopyFrom(past_info[past])
        info.name = out
    return len(replace)


def _indices_from(g: _Graph, name: str, source: str) -> bool:
    """Whether scatter indices `name` are computed from graph input `source` by the exporter's
    Unsqueeze/Expand/Add chain (past_lengths[b] + slot)."""
    while (n := g.producer.get(name)) is not None:
        if n.op_type not in ("Expand", "Unsqueeze", "Add", "Reshape", "Cast"):
            return False
        if source in n.input:
            return True
        name = n.input[0]
    return False


def write_cache_in_place(path: Path, num_layers: int, drop_outputs: tuple[str, ...]) -> int:
    """Rewrites the graph at `path` to write new K/V into its cache inputs (_cache_in_place): outputs
    present_key_{i}/present_value_{i} replace `drop_outputs` (the stacked new K/V). ONNX Runtime's
    TensorScatter (opset 24) writes in place when the runtime binds each present output to its past
    input's memory (runtime/ort/backend.py), so a step copies no part of the cache it does not read
    and the runtime scatters nothing after it. Returns the number of caches rewritten (0: the graph
    has no such pattern and is left as it was)."""
    import onnx

    from medusa_trt.engine_dir import past_names, present_names

    model = onnx.load(str(path), load_external_data=False)
    present = dict(zip(past_names(num_layers), present_names(num_layers), strict=True))
    n = _cache_in_place(model, "past_lengths", present)
    if not n:
        return 0
    kept = [o for o in model.graph.output if o.name not in drop_outputs]
    del model.graph.output[:]
    model.graph.output.extend(kept)
    for op in model.opset_import:
        if op.domain in ("", "ai.onnx"):
            op.version = max(op.version, TENSOR_SCATTER_OPSET)
    _prune(model)
    onnx.save_model(model, str(path))
    return n


def _prune(model) -> None:
    """Drops nodes whose outputs nothing reads (the cos/sin computation after "rotary") and the
    initializers no node reads any more."""
    graph = model.graph
    outputs = {o.name for o in graph.output}
    while True:
        used = {i for n in graph.node for i in _reads(n)} | outputs
        kept = [n for n in graph.node if any(o in used for o in n.output if o)]
        if len(kept) == len(graph.node):
            break
        del graph.node[:]
        graph.node.extend(kept)
    kept_init = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept_init)


def rotary_caches(inv_freq, max_positions: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [max_positions, head_dim / 2] of position * inv_freq, as the reference computes them
    (modeling.MedusaModel.forward_hidden: float32 products, then cos/sin, then the model dtype)."""
    import torch

    freqs = torch.arange(max_positions, dtype=torch.long)[:, None].float() * inv_freq.float()[None, :]
    return freqs.cos().to(dtype).numpy(), freqs.sin().to(dtype).numpy()


def fuse_onnx_file(path: Path, fusions: Iterable[str], cos_cache: np.ndarray | None = None,
                   sin_cache: np.ndarray | None = None) -> dict[str, int]:
    """Applies `fusions` (names from FUSIONS) to the graph at `path` in place; returns how many
    patterns each replaced. "rotary" needs the caches (rotary_caches)."""
    import onnx

    fusions = list(fusions)
    unknown = sorted(set(fusions) - set(FUSIONS))
    if unknown:
        raise ValueError(f"unknown ONNX Runtime fusion(s) {unknown}; expected some of {list(FUSIONS)}")
    # Only "gate_up" reads weights; otherwise tensors stored outside the graph stay where they are.
    model = onnx.load(str(path), load_external_data=False)
    locations = {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}
    if "gate_up" in fusions and locations:
        onnx.external_data_helper.load_external_data_for_model(model, str(path.parent))
    counts = {}
    if "rotary" in fusions:
        if cos_cache is None or sin_cache is None:
            raise ValueError("the rotary fusion needs the cos/sin caches")
        counts["rotary"] = _fuse_rotary(model, cos_cache, sin_cache, "position_ids")
    if "skip_norm" in fusions:
        counts["skip_norm"] = _fuse_skip_norm(model)
    if "gate_up" in fusions:
        counts["gate_up"] = _fuse_gate_up(model)
    if any(counts.values()):
        if not any(o.domain == MS_DOMAIN for o in model.opset_import):
            model.opset_import.append(onnx.helper.make_opsetid(MS_DOMAIN, 1))
        _prune(model)
        if "gate_up" in fusions and locations:  # loaded above: written back to the graph's one data file
            onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=sorted(locations)[0])
        else:
            onnx.save_model(model, str(path))
    return counts
