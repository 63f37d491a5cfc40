"""The KV cache's I/O with an ONNX Runtime graph, one small object per cache mode (OrtBackend picks
the mode once, at load, and makes one object per cache, at `start` and `keep`):

- ReturnedCache (CPU): the cache goes to `session.run` as numpy views, which ONNX Runtime reads in
  place; the graph returns the new tokens' K/V, and `commit` scatters the kept ones after each
  committed prefix. On a 2-core CPU that measured as fast as IOBinding or faster (docs/benchmarks/engine-and-serving.md,
  issue 4): run() hands its own output buffers to numpy without a copy, and binding costs a dozen
  calls per step.
- BoundCache (CUDA): the cache and the new K/V stay in device memory, bound by pointer
  (IOBinding); the other outputs land in host memory, for the decoding loop is host code.
- InPlaceCache (engine.json onnx.cache_in_place: int4 CPU engines): the graph writes the new K/V
  into the cache at each sequence's length + slot (engines/ort/fusions.py: write_cache_in_place);
  each layer's buffer is bound as both its past input and its present output, once per cache and
  session, and a step binds only its small inputs and outputs. `commit` moves only the accepted
  slots of a branching path.

Each has the same interface: run(session, feeds, outputs) -> the named outputs as host tensors, the
new tokens' K/V pending until commit(lengths, slots, counts) -> the new lengths.
"""

from __future__ import annotations

import numpy as np
import torch

from medusa_trt.engine_dir import present_names
from medusa_trt.runtime.backend import compact_in_place, scatter_pending

# name -> (shape, numpy dtype) of a graph's outputs other than the cache
Outputs = dict[str, tuple[tuple[int, ...], type]]


class ReturnedCache:
    """The graph returns the new K/V (its last two outputs); commit scatters the kept ones."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, past_names: list[str]):
        self.keys, self.values = keys, values
        # Each layer's K and V as a contiguous numpy view, made once per cache rather than per step.
        self._feeds = {name: (keys if i % 2 == 0 else values)[i // 2].numpy() for i, name in enumerate(past_names)}
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def run(self, session, feeds: dict[str, np.ndarray], outputs: Outputs) -> list[torch.Tensor]:
        *named, new_k, new_v = (torch.from_numpy(a) for a in session.run(None, {**feeds, **self._feeds}))
        self._pending = (new_k, new_v)
        return named

    def commit(self, lengths: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        lengths = scatter_pending(self.keys, self.values, self._pending, lengths, slots, counts)
        self._pending = None
        return lengths


class BoundCache(ReturnedCache):
    """The device path: the cache and the new K/V stay in device memory, bound by pointer
    (IOBinding); the named outputs land in host arrays."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, past_names: list[str]):
        self.keys, self.values, self._past_names = keys, values, past_names
        self._pending = None

    def run(self, session, feeds: dict[str, np.ndarray], outputs: Outputs) -> list[torch.Tensor]:
        layers, b, heads, _, head_dim = self.keys.shape
        s = feeds["input_ids"].shape[1]
        np_dtype = NP_DTYPES[self.keys.dtype]
        device = self.keys.device.type
        new_k = torch.empty(layers, b, heads, s, head_dim, dtype=self.keys.dtype, device=self.keys.device)
        new_v = torch.empty_like(new_k)
        io = session.io_binding()
        for name, array in feeds.items():
            io.bind_cpu_input(name, array)  # a few bytes each; ONNX Runtime copies them over
        for i, name in enumerate(self._past_names):
            _bind(io.bind_input, name, (self.keys if i % 2 == 0 else self.values)[i // 2], device, np_dtype)
        arrays = _bind_host_outputs(io, outputs)
        _bind(io.bind_output, "present_keys", new_k, device, np_dtype)
        _bind(io.bind_output, "present_values", new_v, device, np_dtype)
        if device == "cuda":
            torch.cuda.synchronize()  # torch wrote the cache on its stream; ONNX Runtime runs on its own
        session.run_with_iobinding(io)
        self._pending = (new_k, new_v)
        return [torch.from_numpy(a) for a in arrays]


class InPlaceCache:
    """The graph writes the new K/V into the bound cache; commit compacts a branching path's slots."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, past_names: list[str]):
        self.keys, self.values = keys, values
        self._views = [(past, present, (keys if i % 2 == 0 else values)[i // 2].numpy())
                       for i, (past, present) in enumerate(zip(past_names, present_names(len(keys)), strict=True))]
        self._bindings: dict = {}  # session -> its IOBinding with the cache bound (a replaced session binds anew)
        self._width = 0  # new tokens of the last run: what commit may have to move

    def run(self, session, feeds: dict[str, np.ndarray], outputs: Outputs) -> list[torch.Tensor]:
        """Binds the step's few small inputs, and `outputs` to new host arrays, returned as tensors:
        ONNX Runtime writes them there, so nothing is copied after, and the 2 x layers cache outputs
        are never wrapped for Python."""
        io = self._bindings.get(session)
        if io is None:
            io = self._bindings[session] = self._cache_binding(session)
        for name, array in feeds.items():
            io.bind_cpu_input(name, array)
        arrays = _bind_host_outputs(io, outputs)
        session.run_with_iobinding(io)
        self._width = feeds["input_ids"].shape[1]
        return [torch.from_numpy(a) for a in arrays]

    def _cache_binding(self, session):
        """A new IOBinding of `session` with each layer's cache view bound as its past input and as
        its present output (one memory: the graph writes the new K/V into it)."""
        io = session.io_binding()
        for past, present, view in self._views:
            for bind, name in ((io.bind_input, past), (io.bind_output, present)):
                bind(name, "cpu", 0, view.dtype, list(view.shape), view.ctypes.data)
        return io

    def commit(self, lengths: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # The run wrote every new token's K/V at its length + slot already. One new token (a plain
        # step) is where it belongs: only wider steps may move slots.
        if self._width == 1:
            return lengths + counts
        return compact_in_place(self.keys, self.values, lengths, slots, counts)


# The cache dtypes Python can bind (numpy has no bfloat16; ONNX Runtime's CPU kernels mostly lack it too).
NP_DTYPES = {torch.float32: np.float32, torch.float16: np.float16}


def _bind_host_outputs(io, outputs: Outputs) -> list[np.ndarray]:
    arrays = []
    for name, (shape, dtype) in outputs.items():
        arrays.append(np.empty(shape, dtype=dtype))
        io.bind_output(name, "cpu", 0, dtype, list(shape), arrays[-1].ctypes.data)
    return arrays


def _bind(bind, name: str, tensor: torch.Tensor, device: str, np_dtype) -> None:
    """Binds a contiguous torch tensor's memory to a graph input or output, without a copy."""
    if not tensor.is_contiguous():
        raise AssertionError(f"{name}: binding needs a contiguous tensor")  # an internal invariant
    if tensor.numel() == 0:  # no memory to point at
        bind(name, device)
        return
    device_id = (tensor.device.index or 0) if device == "cuda" else 0
    bind(name, device, device_id, np_dtype, list(tensor.shape), tensor.data_ptr())
