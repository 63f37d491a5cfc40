"""One copy of the weights for an engine's graphs (issue 13).

The exporter writes each graph (decoder, heads, fused step) with its own initializers: the fused
step graph repeats every decoder weight and the heads graph the lm_head, and the exporter names
them differently per graph and sometimes stores a pre-transposed copy (the decoder's lm_head as
[hidden, vocab], the heads' as [vocab, hidden]). `share_weights` moves every initializer of all
graphs into one external-data file, written once per distinct content (dtype, shape, bytes), and
points each graph's TensorProto at (location, offset, length) in it (onnx's external-data
convention, which ONNX Runtime and onnx.checker read). A 2-D float initializer that is the
transpose of one already written becomes a Transpose node over it: ONNX Runtime folds it at load,
so the arithmetic (and every output bit) is unchanged and the disk holds one copy.

Offsets of large tensors are page aligned, the alignment ONNX Runtime needs to map external data
into memory instead of reading it into its own buffers.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

WEIGHTS_FILE = "weights.bin"
ALIGNMENT = 4096  # page size: ONNX Runtime maps external data whose offset is page aligned
MIN_EXTERNAL_BYTES = 1024  # smaller tensors (shape constants) stay inside their graph


@dataclass(frozen=True)
class SharedWeights:
    path: Path  # the weights file
    graph_bytes: int  # initializer bytes of all graphs before sharing
    file_bytes: int  # the weights file's size (distinct tensors + alignment padding)
    tensors: int  # distinct tensors written
    transposed: int  # initializers replaced by a Transpose of a shared tensor


def _float_dtype(data_type: int):
    import numpy as np
    from onnx import TensorProto

    return {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}.get(data_type)


def share_weights(graphs: list[Path], weights_file: str = WEIGHTS_FILE) -> SharedWeights:
    """Rewrites `graphs` (in one directory) in place to share `weights_file` beside them; external
    data files they used before are removed. Returns what was written."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    directory = graphs[0].parent
    out_path = directory / weights_file
    models = [onnx.load(str(g), load_external_data=False) for g in graphs]
    old_data = {e.value for m in models for t in m.graph.initializer for e in t.external_data if e.key == "location"}
    for m in models:  # everything is in memory now; the old files go once the new ones are written
        onnx.external_data_helper.load_external_data_for_model(m, str(directory))

    def key(data_type: int, dims: tuple, raw: bytes) -> tuple:
        return data_type, dims, hashlib.sha256(raw).digest()

    def transpose_key(t) -> tuple | None:
        dtype = _float_dtype(t.data_type)
        if dtype is None or len(t.dims) != 2:
            return None
        return key(t.data_type, tuple(t.dims)[::-1], np.frombuffer(t.raw_data, dtype).reshape(t.dims).T.tobytes())

    # Pass 1: every large initializer's content key, and its transpose's for 2-D float ones.
    entries = []  # (graph index, initializer, key, transpose key)
    for i, m in enumerate(models):
        for t in m.graph.initializer:
            if t.HasField("raw_data") and len(t.raw_data) >= MIN_EXTERNAL_BYTES:  # small ones stay inline
                entries.append((i, t, key(t.data_type, tuple(t.dims), t.raw_data), transpose_key(t)))
    present = {e[2] for e in entries}

    def as_transpose(k: tuple, tk: tuple | None) -> bool:
        # Of a pair of tensors that are each other's transpose, the [vocab, hidden]-like layout (rows
        # >= columns: the checkpoint's and the embedding Gather's) is stored; the other is derived.
        return tk is not None and tk != k and tk in present and (k[1][0], k[2]) < (k[1][1], tk[2])

    offsets: dict[tuple, tuple[int, int]] = {}  # key -> (offset, length) in the weights file
    graph_bytes = sum(len(e[1].raw_data) for e in entries)
    transposed = 0

    def point(t, offset: int, length: int) -> None:
        t.ClearField("raw_data")
        t.data_location = TensorProto.EXTERNAL
        del t.external_data[:]
        for k, v in (("location", weights_file), ("offset", str(offset)), ("length", str(length))):
            t.external_data.add(key=k, value=v)

    tmp = out_path.with_name(out_path.name + ".tmp")
    with open(tmp, "wb") as f:
        for _, t, k, tk in entries:  # pass 2: the stored tensors, once per distinct content
            if as_transpose(k, tk):
                continue
            if k not in offsets:
                pos = f.tell()
                if len(t.raw_data) >= ALIGNMENT:
                    pos = -(-pos // ALIGNMENT) * ALIGNMENT
                    f.write(b"\0" * (pos - f.tell()))
                f.write(t.raw_data)
                offsets[k] = (pos, len(t.raw_data))
            point(t, *offsets[k])
        f.flush()
        os.fsync(f.fileno())
        file_bytes = f.tell()
    new_nodes: dict[int, list] = {}
    for i, t, k, tk in entries:  # pass 3: the derived ones, a Transpose node over the stored tensor
        if not as_transpose(k, tk):
            continue
        source = TensorProto(name=f"{t.name}__shared_T", data_type=t.data_type, dims=tk[1])
        point(source, *offsets[tk])
        models[i].graph.initializer.append(source)
        new_nodes.setdefault(i, []).append(
            helper.make_node("Transpose", [source.name], [t.name], perm=[1, 0], name=f"{t.name}__shared_T_node"))
        t.name = ""  # removed below: the node's output takes its name
        transposed += 1
    for i, nodes in new_nodes.items():
        graph = models[i].graph
        kept = [t for t in graph.initializer if t.name]
        del graph.initializer[:]
        graph.initializer.extend(kept)
        old = list(graph.node)
        del graph.node[:]
        graph.node.extend(nodes + old)  # before their users: the graph stays topologically sorted
    os.replace(tmp, out_path)
    for g, m in zip(graphs, models, strict=True):
        onnx.save_model(m, str(g))
    for name in old_data - {weights_file}:
        (directory / name).unlink(missing_ok=True)
    return SharedWeights(out_path, graph_bytes, file_bytes, len(offsets), transposed)
