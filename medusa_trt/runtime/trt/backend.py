"""A TensorRT engine directory (medusa-build --backend tensorrt) behind the runtime's Backend interface.

Same graph interface and cache layout as the ONNX Runtime engine (runtime/ort/backend.py): the KV cache is
one torch CUDA tensor per K and V, [L, B, Hkv, capacity, D], allocated once per `start`; each
layer's slice is bound to the engine by pointer (`set_tensor_address`) as it is, the graph masks
entries past each sequence's committed length, and `commit` scatters the kept new K/V after each
committed prefix. The engines run on torch's current CUDA stream (`execute_async_v3`), so torch's
own work on the cache (commit, keep) is ordered with them without extra synchronization.

The small per-step inputs (ids, positions, lengths, mask) are copied to the device each step; the
logits come back to host tensors, because the decoding loop is host code. The Medusa heads run in
their own engine (heads.engine) on the rows the loop asks for; the hidden state never leaves the GPU.
A drafter with a cache of its own (Amphista) runs in drafter.engine instead, with its 2-layer cache
kept beside the decoder's the same way: each `draft` appends the committed rows and drafts at the last.

Engines built with the tree-attention plugin embed its ahead-of-time compiled kernel, so loading
needs neither Python plugin code nor Triton; should a TensorRT version still ask for the plugin's
creator, the plugin is registered and deserialization retried.
"""

from __future__ import annotations

from pathlib import Path

import torch

from medusa_trt.engine_dir import EngineError, check_artifacts, past_names, read_engine_json
from medusa_trt.runtime.backend import (
    Backend,
    ModelInfo,
    check_forward,
    drafter_inputs,
    last_rows,
    scatter_pending,
    zero_cache,
)
from medusa_trt.runtime.trt.versions import EXTRA_HINT, tensorrt_version_problem

_INPUTS = ("input_ids", "position_ids", "past_lengths", "new_mask", "logit_positions")
_OUTPUTS = ("logits", "hidden", "present_keys", "present_values")


def _torch_dtype(trt, dtype):
    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
             trt.int32: torch.int32, trt.int64: torch.int64, trt.bool: torch.bool, trt.int8: torch.int8}
    if dtype not in table:
        raise EngineError(f"engine tensor dtype {dtype} has no torch equivalent here")
    return table[dtype]


class _Engine:
    """One deserialized engine and its execution context, run by tensor name."""

    def __init__(self, trt, runtime, path: Path, uses_plugin: bool):
        if not path.is_file():
            raise EngineError(f"{path}: missing; the engine directory is incomplete (rebuild it)")
        data = path.read_bytes()
        engine = runtime.deserialize_cuda_engine(data)
        if engine is None and uses_plugin:
            from medusa_trt.runtime.trt.tree_attention.plugin import register_plugin

            register_plugin()
            engine = runtime.deserialize_cuda_engine(data)
        if engine is None:
            raise EngineError(f"{path}: TensorRT {trt.__version__} cannot deserialize it (built with another "
                              "TensorRT version or for another GPU? rebuild it here with medusa-build)")
        self.trt, self.path, self.engine = trt, path, engine
        self.context = engine.create_execution_context()
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self.inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self.dtypes = {n: _torch_dtype(trt, engine.get_tensor_dtype(n)) for n in names}

    def max_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.engine.get_tensor_profile_shape(name, 0)[2])

    def run(self, feeds: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
        """Binds `feeds` (device tensors, contiguous) and fresh outputs, and enqueues the engine on torch's
        current stream; returns the outputs (valid once the stream reaches them)."""
        missing = set(self.inputs) - set(feeds)
        if missing:
            raise EngineError(f"{self.path}: inputs {sorted(missing)} not given")
        for name in self.inputs:
            t = feeds[name]
            if t.dtype != self.dtypes[name] or not t.is_contiguous() or t.device != device:
                raise AssertionError(f"{name}: {t.dtype} on {t.device}, contiguous={t.is_contiguous()}; expected "
                                     f"contiguous {self.dtypes[name]} on {device}")  # an internal invariant
            if not self.context.set_input_shape(name, tuple(t.shape)):
                lo, _, hi = self.engine.get_tensor_profile_shape(name, 0)
                raise ValueError(f"{name}: shape {tuple(t.shape)} is outside the engine's profile {tuple(lo)}.."
                                 f"{tuple(hi)} ({self.path}); rebuild with larger --max-batch-size/--max-seq-len")
            self.context.set_tensor_address(name, t.data_ptr())
        outputs = {}
        for name in self.outputs:
            shape = tuple(self.context.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise EngineError(f"{self.path}: output {name} has unresolved shape {shape}")
            out = torch.empty(shape, dtype=self.dtypes[name], device=device)
            self.context.set_tensor_address(name, out.data_ptr())
            outputs[name] = out
        if not self.context.execute_async_v3(torch.cuda.current_stream(device).cuda_stream):
            raise RuntimeError(f"{self.path}: TensorRT execute_async_v3 failed (see the TensorRT log)")
        return outputs


class TensorRTBackend(Backend):
    """A TensorRT engine directory behind the Backend interface (see the module docstring)."""

    host_threads = 1  # the engine computes on the GPU; the loop's torch ops are tiny (decoding.generate)

    def __init__(self, engine_dir: str | Path, device: str | None = None):
        self.engine_dir = Path(engine_dir)
        self.engine_info = info = read_engine_json(self.engine_dir, "tensorrt", "tensorrt")
        check_artifacts(self.engine_dir, info)
        try:
            import tensorrt as trt
        except ImportError as e:
            raise EngineError(f"{self.engine_dir}: a TensorRT engine needs TensorRT, which is not importable here "
                              f"({e}): {EXTRA_HINT}") from None
        problem = tensorrt_version_problem(trt.__version__)
        if problem:
            raise EngineError(f"{self.engine_dir}: {problem}")
        if not torch.cuda.is_available():
            raise EngineError(f"{self.engine_dir}: TensorRT engines run on CUDA, and torch {torch.__version__} sees "
                              "no CUDA device")
        if device not in (None, "cuda") and not str(device).startswith("cuda"):
            raise EngineError(f"device {device!r}: a TensorRT engine runs on 'cuda' only")
        self.device = torch.device(device or "cuda")
        self.trt = trt
        self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        section = info["tensorrt"]
        uses_plugin = section.get("attention") == "plugin"
        self.decoder = _Engine(trt, self._runtime, self.engine_dir / section["engine"], uses_plugin)
        heads_file = section.get("heads_engine")
        self.heads_engine = _Engine(trt, self._runtime, self.engine_dir / heads_file, False) if heads_file else None
        drafter_file = section.get("drafter_engine")
        self.drafter_engine = _Engine(trt, self._runtime, self.engine_dir / drafter_file, False) if drafter_file else None
        model, limits = info["model"], info["limits"]
        self.num_layers, self.num_kv_heads = model["num_layers"], model["num_kv_heads"]
        self.head_dim, self.hidden_size, self.vocab_size = model["head_dim"], model["hidden_size"], model["vocab_size"]
        self.num_medusa_heads = info["medusa"]["num_heads"]
        self.info = ModelInfo(self.vocab_size, self.num_medusa_heads, limits["max_seq_len"], limits["max_draft_len"],
                              drafter_cache=self.drafter_engine is not None,
                              max_batch_size=limits["max_batch_size"], hidden_all_rows=bool(section.get("hidden_all_rows")))
        self._past_names = [f"past_{kind}_{i}" for i in range(self.num_layers) for kind in ("key", "value")]
        self.dtype = self.decoder.dtypes[self._past_names[0]]
        self.max_capacity = self.decoder.max_shape(self._past_names[0])[2]
        self.start(1, 1)

    # -- Backend interface ---------------------------------------------------------------------

    def start(self, batch: int, capacity: int) -> None:
        if batch > self.info.max_batch_size:
            raise ValueError(f"batch {batch} exceeds the engine's max_batch_size {self.info.max_batch_size} "
                             f"({self.engine_dir / 'engine.json'}); rebuild with a larger --max-batch-size")
        if capacity > self.max_capacity:
            raise ValueError(f"cache capacity {capacity} exceeds the engine's largest past {self.max_capacity} "
                             f"({self.engine_dir / 'engine.json'}); rebuild with a larger --max-seq-len")
        self.keys, self.values = zero_cache(self.num_layers, batch, self.num_kv_heads, capacity, self.head_dim,
                                            self.dtype, self.device)
        self.lengths = torch.zeros(batch, dtype=torch.long)
        if self.drafter_engine is not None:  # the drafter's own cache: its 2 layers, committed rows only
            self.drafter_keys, self.drafter_values = zero_cache(
                2, batch, self.num_kv_heads, capacity, self.head_dim, self.drafter_engine.dtypes["past_key_0"], self.device)
            self.drafter_lengths = torch.zeros(batch, dtype=torch.long)
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self._hidden: torch.Tensor | None = None

    @torch.inference_mode()
    def forward(self, input_ids, position_ids, new_mask, logit_positions=None, with_heads=True):
        logit_positions = check_forward(self.keys, self.lengths, input_ids, position_ids, logit_positions,
                                        self.info.max_seq_len, self.engine_dir / "engine.json")
        dev = self.device
        host = {"input_ids": input_ids, "position_ids": position_ids, "past_lengths": self.lengths,
                "new_mask": new_mask, "logit_positions": logit_positions}
        feeds = {name: value.to(dev, self.decoder.dtypes[name], non_blocking=True).contiguous()
                 for name, value in host.items()}
        for i, name in enumerate(self._past_names):
            feeds[name] = (self.keys if i % 2 == 0 else self.values)[i // 2]  # contiguous [B, Hkv, cap, D]
        out = self.decoder.run(feeds, dev)
        self._pending = (out["present_keys"], out["present_values"])
        self._hidden = out["hidden"]  # [B, K, d] on the device
        logits = out["logits"].float().cpu()  # waits for the engine
        if not with_heads:
            return logits, None
        hidden = self._hidden
        return logits, self._run_heads(hidden.reshape(-1, hidden.shape[-1])).reshape(-1, *hidden.shape[:2], self.vocab_size)

    @torch.inference_mode()
    def draft(self, rows: torch.Tensor, counts: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        if self._hidden is None:
            raise RuntimeError("draft() without a forward()")
        if self.drafter_engine is not None:
            return self._run_drafter(rows, counts, next_tokens)
        b = self._hidden.shape[0]  # the heads engine is a Medusa drafter's: the last committed row only
        index = torch.arange(b, device=self.device), last_rows(rows, counts).to(self.device)
        return self._run_heads(self._hidden[index].contiguous())

    def _run_drafter(self, rows: torch.Tensor, counts: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """drafter.engine (engines/onnx/export.py, _DrafterModule): each sequence's committed rows
        appended to the drafter's cache, drafts at the last; logits [H, B, V] float32 on the host.
        The cache is bound whole, as the decoder's: the graph masks past each committed length."""
        b, c = len(rows), int(counts.max())
        past = int(self.drafter_lengths.max()) if b else 0
        if past + c > self.drafter_keys.shape[3]:
            raise ValueError(f"drafter cache overflow: {past} + {c} rows > capacity {self.drafter_keys.shape[3]}")
        engine, dev = self.drafter_engine, self.device
        feeds = {name: t.to(dev, engine.dtypes[name], non_blocking=True).contiguous()
                 for name, t in drafter_inputs(self._hidden, rows, counts, next_tokens, self.drafter_lengths).items()}
        for i, name in enumerate(past_names(2)):
            feeds[name] = (self.drafter_keys if i % 2 == 0 else self.drafter_values)[i // 2]  # [B, Hkv, cap, D]
        out = engine.run(feeds, dev)
        self.drafter_lengths = scatter_pending(self.drafter_keys, self.drafter_values,
                                               (out["present_keys"], out["present_values"]), self.drafter_lengths,
                                               torch.arange(c).expand(b, c), counts)
        return out["medusa_logits"].float().cpu()

    def _run_heads(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, d] on the device -> medusa logits [H, N, V] float32 on the host, in chunks of the
        heads engine's largest profile."""
        n = hidden.shape[0]
        if self.heads_engine is None or self.num_medusa_heads == 0:
            return torch.zeros(0, n, self.vocab_size)
        chunk = self.heads_engine.max_shape(self.heads_engine.inputs[0])[0]
        parts = []
        for start in range(0, n, chunk):
            rows = hidden[start:start + chunk].to(self.heads_engine.dtypes[self.heads_engine.inputs[0]]).contiguous()
            out = self.heads_engine.run({self.heads_engine.inputs[0]: rows}, self.device)
            parts.append(out[self.heads_engine.outputs[0]].float())
        return torch.cat(parts, dim=1).cpu()

    def commit(self, slots: torch.Tensor, counts: torch.Tensor) -> None:
        self.lengths = scatter_pending(self.keys, self.values, self._pending, self.lengths, slots, counts)
        self._pending = None

    def keep(self, rows: torch.Tensor) -> None:
        on_device = rows.to(self.device)
        self.keys, self.values = self.keys[:, on_device].contiguous(), self.values[:, on_device].contiguous()
        self.lengths = self.lengths[rows]
        if self.drafter_engine is not None:
            self.drafter_keys = self.drafter_keys[:, on_device].contiguous()
            self.drafter_values = self.drafter_values[:, on_device].contiguous()
            self.drafter_lengths = self.drafter_lengths[rows]
        self._pending = None
        if self._hidden is not None:
            self._hidden = self._hidden[on_device]
