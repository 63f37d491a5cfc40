"""The ONNX Runtime engine behind the runtime's Backend interface.

The KV cache is one preallocated torch tensor per K and V, [L, B, Hkv, capacity, D], on the
engine's device, allocated once per `start`. The runtime hands each layer's buffer to the graph as
it is (no slice, copy or transfer on the host side); inside the graph, the default attention form
slices it to the longest committed length and concatenates the new K/V after that prefix, so every
layer copies the committed prefix once per step and a step costs the committed length, not the
capacity (engines/onnx_export.py). The graph returns only the new tokens' K/V; `commit` scatters
the kept ones after each committed prefix, which is the compaction step.

In-place engines (engine.json onnx.cache_in_place: int4 CPU engines) write the new K/V into the
buffers themselves, at each sequence's length + slot (engines/onnx_fusions.py:
write_cache_in_place): each layer's buffer is bound as both its past input and its present output,
once per cache, and a step binds only its small inputs and outputs. `commit` then moves only the
accepted slots of a branching path (backend.compact_in_place). A plain greedy step on such an
engine is one call with everything bound once (`plain_greedy_step`): forward, commit and argmax;
a greedy Medusa step likewise (`greedy_tree_step`): the fused step graph and the commit.

Otherwise, on the CPU the cache goes to `session.run` as numpy views, which ONNX Runtime reads in
place; on a 2-core CPU that measured as fast as IOBinding or faster (BENCHMARKS.md, issue 4): run()
hands its own output buffers to numpy without a copy, and binding costs a dozen calls per step. On CUDA the
cache and the new K/V stay in device memory, bound by pointer (IOBinding), and logits come back to
host tensors: the decoding loop is host code. Returned tensors are new every step, so a caller may keep them.

Sessions open on first use. ONNX Runtime packs every constant MatMul weight into a buffer of its own
per session, so each open session holds a copy of the decoder's weights: a greedy Medusa decode on
the CPU runs on the fused step graph alone (its prefill too, runtime/decoding.py), plain decoding on
the decoder graph alone, and only a process doing both, or sampling, holds two copies (BENCHMARKS.md,
issue 13 memory). The graphs' inputs and outputs are checked against engine.json at load, from the
files.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from medusa_trt.checkpoint import CONFIG_DTYPES
from medusa_trt.engine_dir import (  # noqa: F401 (EngineError, read_engine_json: re-exported)
    HEADS_INPUT,
    HEADS_OUTPUT,
    INPUT_NAMES,
    OUTPUT_NAMES,
    STEP_INPUT_NAMES,
    STEP_OUTPUT_NAMES,
    EngineError,
    check_artifacts,
    check_graph,
    check_weight_format,
    graph_outputs,
    past_names,
    present_names,
    read_engine_json,
)
from medusa_trt.runtime.backend import ModelInfo, check_forward, compact_in_place, scatter_pending, zero_cache

if TYPE_CHECKING:
    from medusa_trt.runtime.decoding import StepTree

_PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


class _Session:
    """An OrtBackend attribute holding one of its graphs' sessions, opened on first read (None when
    the engine has no such graph); assigning replaces it (tests and benchmarks wrap sessions)."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, backend, owner=None):
        if backend is None:
            return self
        if self.name not in backend._sessions:
            graph = backend._graphs[self.name]
            backend._sessions[self.name] = None if graph is None else make_session(
                backend.engine_dir / graph, backend.device, backend._threads, backend._prepack, backend._weights,
                backend._spinning)
        return backend._sessions[self.name]

    def __set__(self, backend, session) -> None:
        backend._sessions[self.name] = session
        backend._bindings.clear()  # bound to the sessions they were made for


def session_options(threads: int | None = None, *, spinning: bool = False, level: str = "all",
                    prepack: bool = True):
    """Options measured on a 2-core CPU for decoding (benchmarks/bench_onnx.py --sweep-options): all
    graph optimizations (they fuse RMSNorm, SiLU and MatMul+Transpose), one intra-op thread per core
    this process may use, sequential execution (the graph is a chain), and no spinning by default: a
    spinning worker burns a core that another process may need, and on a shared machine steps get
    much slower. On cores the engine has to itself, `spinning=True` (ONNX Runtime's own default) saves
    a thread wake-up per op, which is what a second thread gains in a short int4 step
    (BENCHMARKS.md, issue 13).

    QDQ fusions are off: at the extended level ONNX Runtime 1.31 rewrites DequantizeLinear -> MatMul
    into MatMulIntegerToFloat, which rejects the float8 inputs of FP8 engines (engine.json's
    quantization block says so too); float engines have no Q/DQ, so nothing changes for them."""
    import onnxruntime as ort

    levels = {"basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
              "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
              "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
    so = ort.SessionOptions()
    so.graph_optimization_level = levels[level]
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.intra_op_num_threads = threads or len(os.sched_getaffinity(0))
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    so.add_session_config_entry("session.disable_quant_qdq", "1")
    if not prepack:  # engine.json onnx.prepack_weights (engines/build.py says when and why)
        so.add_session_config_entry("session.disable_prepacking", "1")
    so.log_severity_level = 3  # warnings about unused initializers are noise to users
    return so


class SharedWeights:
    """One read-only mapping of an engine's shared weights file (engines/onnx_weights.py), handed to
    every session as its initializers (SessionOptions.add_initializer): ONNX Runtime then computes
    from these pages instead of mapping or copying the file once per session, so a loaded engine's
    weights are resident once (BENCHMARKS.md, issue 13). Tensors are built once per (offset, dtype,
    shape) and shared by every graph that refers to them."""

    def __init__(self, path: Path):
        self.path = path
        self._file = np.memmap(path, dtype=np.uint8, mode="r")
        self._values: dict[tuple, object] = {}

    def initializers(self, onnx_path: Path) -> dict[str, object]:
        """OrtValues over the mapping for the graph's initializers stored in this file."""
        import onnx
        import onnxruntime as ort
        from onnx.helper import tensor_dtype_to_np_dtype

        graph = onnx.load(str(onnx_path), load_external_data=False).graph
        out = {}
        for t in graph.initializer:
            info = {e.key: e.value for e in t.external_data}
            if t.data_location != onnx.TensorProto.EXTERNAL or info.get("location") != self.path.name:
                continue
            offset, length = int(info.get("offset", 0)), int(info["length"])
            key = (offset, length, t.data_type, tuple(t.dims))
            if key not in self._values:
                if offset + length > len(self._file):
                    raise EngineError(f"{onnx_path}: initializer {t.name!r} reads bytes {offset}..{offset + length} "
                                      f"of {self.path}, which has {len(self._file)}; rebuild the engine")
                array = self._file[offset:offset + length].view(tensor_dtype_to_np_dtype(t.data_type))
                self._values[key] = ort.OrtValue.ortvalue_from_numpy(array.reshape(tuple(t.dims)))
            out[t.name] = self._values[key]
        return out


def execution_provider(device: str) -> str:
    """ONNX Runtime's provider for `device`, checked to be in this onnxruntime (no CPU fall back)."""
    import onnxruntime as ort

    if device not in _PROVIDERS:
        raise EngineError(f"device {device!r} is not supported; expected one of {sorted(_PROVIDERS)}")
    provider = _PROVIDERS[device]
    available = ort.get_available_providers()
    if provider not in available:
        hint = " (install the 'gpu' extra: pip install 'medusa-trt[gpu]')" if device == "cuda" else ""
        raise EngineError(f"device {device!r} needs ONNX Runtime's {provider}, which this onnxruntime "
                          f"{ort.__version__} lacks{hint}; available: {', '.join(available)}")
    return provider


def make_session(onnx_path: str | Path, device: str = "cpu", threads: int | None = None, prepack: bool = True,
                 weights: SharedWeights | None = None, spinning: bool = False):
    """An InferenceSession on exactly `device`: a missing provider is an error, never a CPU fall back.
    `weights`: the engine's shared weights file, mapped once for all its sessions."""
    import onnxruntime as ort

    provider = execution_provider(device)
    providers = [provider] if device == "cpu" else [provider, "CPUExecutionProvider"]  # CPU only for shape ops
    so = session_options(threads, prepack=prepack, spinning=spinning)
    if weights is not None:
        for name, value in weights.initializers(Path(onnx_path)).items():
            so.add_initializer(name, value)
    try:
        session = ort.InferenceSession(str(onnx_path), so, providers=providers)
    except Exception as e:  # onnxruntime raises its own exception types, one per failure kind
        raise EngineError(f"{onnx_path}: onnxruntime {ort.__version__} cannot load it ({e}); an older "
                          "onnxruntime may lack the engine's opset: rebuild with a lower --opset") from None
    if session.get_providers()[0] != provider:
        raise EngineError(f"{onnx_path}: ONNX Runtime did not enable {provider} (got {session.get_providers()})")
    return session


def matmul_nbits_session(w: torch.Tensor, block_size: int, accuracy_level: int, threads: int | None = 1,
                         spinning: bool = False):
    """A session of one MatMulNBits node, input "A" [M, K] -> "Y" [M, N], over w [N, K] quantized the
    way int4 engines hold it (modeling.quantize_int4), with the engines' session options."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from medusa_trt.modeling import quantize_int4

    n, k = w.shape
    packed, scales, zero_points = (t.numpy() for t in quantize_int4(w, block_size))
    node = helper.make_node("MatMulNBits", ["A", "B", "S", "Z"], ["Y"], domain="com.microsoft", K=k, N=n, bits=4,
                            block_size=block_size, accuracy_level=accuracy_level)
    graph = helper.make_graph(
        [node], "matmul_nbits", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
        [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales.reshape(-1), "S"),
         numpy_helper.from_array(zero_points, "Z")])
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21),
                                                                   helper.make_opsetid("com.microsoft", 1)])
    return ort.InferenceSession(model.SerializeToString(), session_options(threads, spinning=spinning),
                                providers=["CPUExecutionProvider"])


@functools.cache
def one_row_kernel_differs(block_size: int, accuracy_level: int) -> bool:
    """Whether this CPU's MatMulNBits (4-bit, `block_size`, `accuracy_level`) computes a lone row to
    other bits than the same row among others: ONNX Runtime's AVX2 build has a one-row kernel of its
    own for blocks of 32 and more, its AVX-512 build does not (BENCHMARKS.md, issue 13 (l)). Answered
    once per process by one small graph run on one row, then on that row among three."""
    g = torch.Generator().manual_seed(0)
    session = matmul_nbits_session(torch.randn(64, 4 * block_size, generator=g), block_size, accuracy_level)
    rows = torch.randn(3, 4 * block_size, generator=g).numpy()
    (one,) = session.run(None, {"A": rows[:1]})
    (three,) = session.run(None, {"A": rows})
    return not np.array_equal(one[0], three[0])


class OrtBackend:
    """An ONNX Runtime engine directory behind the Backend interface (see module docstring)."""

    host_threads = 1  # torch threads for the decoding loop's own small ops (see decoding.generate)
    session, heads_session, step_session = _Session(), _Session(), _Session()  # decoder, heads, fused step

    def __init__(self, engine_dir: str | Path, device: str | None = None, threads: int | None = None,
                 spinning: bool = False):
        self.engine_dir = Path(engine_dir)
        if threads is not None and threads < 1:
            raise EngineError(f"threads {threads}: expected >= 1 (or None: one per core)")
        self.engine = engine = read_engine_json(self.engine_dir)
        self.device = device or engine.get("device", "cpu")
        model, limits, onnx_info = engine["model"], engine["limits"], engine["onnx"]
        onnx_path = self.engine_dir / onnx_info["file"]
        if not onnx_path.is_file():
            raise EngineError(f"{onnx_path}: missing; the engine directory is incomplete (rebuild it)")
        check_artifacts(self.engine_dir, engine)
        if self.device == "cuda" and not torch.cuda.is_available():
            raise EngineError("device 'cuda' keeps the KV cache in torch CUDA tensors, but this torch "
                              f"{torch.__version__} has no CUDA device")
        execution_provider(self.device)  # at load, though sessions open on first use
        # Sessions over one shared weights file (engines/onnx_weights.py) map it rather than copy it,
        # unless they prepack: then each session holds its own packed copy (engine.json says which).
        prepack = onnx_info.get("prepack_weights", True)
        weights_file = onnx_info.get("weights_file")
        # The sessions keep references to the mapped tensors; self keeps the mapping alive as long.
        # Only without prepacking: a prepacking session keeps its packed copy and lets ONNX Runtime
        # release the file's pages, which a shared initializer would pin (BENCHMARKS.md, issue 13 memory).
        shared = weights_file and not prepack and self.device == "cpu"
        self._weights = SharedWeights(self.engine_dir / weights_file) if shared else None
        self._threads, self._prepack, self._spinning = threads, prepack, spinning
        # The fused greedy step (one call per step) on the CPU; on CUDA greedy steps take the
        # forward + heads path, whose outputs stay bound in device memory.
        step_file = onnx_info.get("step_file") if self.device == "cpu" else None
        self._graphs = {"session": onnx_info["file"], "heads_session": onnx_info.get("heads_file"),
                        "step_session": step_file}
        self._sessions: dict = {}
        # In-place engines (engine.json onnx.cache_in_place): the graphs write new K/V into the cache
        # buffers they are bound to, one IOBinding per session, bound once per cache (_cache_changed).
        self.in_place = onnx_info.get("cache_in_place", False)
        if self.in_place and self.device != "cpu":
            raise EngineError(f"{self.engine_dir / 'engine.json'}: onnx.cache_in_place engines run on the CPU; "
                              f"device {self.device!r} needs an engine built with --device {self.device}")
        self._bindings: dict = {}
        # The Backend's optional one-call plain greedy step: in-place engines bind it once per cache.
        self.plain_greedy_step = self._plain_greedy_step if self.in_place else None
        # Where this CPU's MatMulNBits runs a single row on a kernel of its own (ONNX Runtime's AVX2
        # build: a one-row GEMV that rounds otherwise than its multi-row GEMM), a one-token step at
        # batch 1 runs as two rows, the second a throwaway copy, and a lone logits row is computed
        # twice, so a plain step's logits are the bits a Medusa step computes for that row and Medusa
        # greedy stays equal to plain greedy (BENCHMARKS.md, issue 13 (l)). It costs such a plain step
        # ~8% (SmolLM2); where the kernels agree, nothing.
        weights = engine.get("weights") or {}
        self.pad_one_row = bool(self.device == "cpu" and weights.get("format") == "int4"
                                and one_row_kernel_differs(weights["block_size"], weights["accuracy_level"]))
        self.fused_step_topk = onnx_info.get("step_topk") if step_file else None
        # The Backend's optional one-call greedy tree step: fused step and commit, bound once per
        # cache, batch and tree (_TreeBinding).
        self.greedy_tree_step = self._greedy_tree_step if self.in_place and self.fused_step_topk else None
        self._check_graphs(engine)
        self.num_layers, self.num_kv_heads = model["num_layers"], model["num_kv_heads"]
        self.head_dim, self.num_medusa_heads = model["head_dim"], engine["medusa"]["num_heads"]
        self.vocab_size, self.hidden_size = model["vocab_size"], model["hidden_size"]
        self.dtype = CONFIG_DTYPES[engine["dtype"]]
        self.max_batch_size = limits["max_batch_size"]
        self.use_binding = self.device != "cpu"  # IOBinding: required on CUDA, measurable on the CPU
        self.info = ModelInfo(self.vocab_size, self.num_medusa_heads, limits["max_seq_len"], limits["max_draft_len"],
                              onnx_info.get("key_block"), onnx_info.get("chains_only", False))
        self._past_names = past_names(self.num_layers)
        self._np_dtype = {torch.float32: np.float32, torch.float16: np.float16}.get(self.dtype)
        if self._np_dtype is None:  # numpy has no bfloat16; ONNX Runtime's CPU kernels mostly lack it too
            raise EngineError(f"{self.engine_dir / 'engine.json'}: dtype {engine['dtype']} cannot be bound "
                              "from Python; rebuild with --dtype float32 or float16")
        self.start(1, 1)

    def open_sessions(self) -> None:
        """Opens every graph's session now: a server decodes in every mode, and its first requests
        should not pay for opening one (each holds its own packed copy of the weights)."""
        for name in self._graphs:
            getattr(self, name)

    @property
    def open_session_names(self) -> frozenset[str]:
        """The graphs whose sessions are open ("session", "heads_session", "step_session"): each
        open one holds its own packed copy of the weights."""
        return frozenset(self._sessions)

    # -- Backend interface ---------------------------------------------------------------------

    def _check_graphs(self, engine: dict) -> None:
        """The graphs' inputs and outputs against engine.json (layer count, vocabulary), read from the
        files (the sessions open later, on first use)."""
        import onnx

        def io(graph) -> tuple[dict, dict]:
            initializers = {t.name for t in graph.initializer}

            def shapes(values) -> dict:
                return {v.name: [d.dim_value if d.HasField("dim_value") else d.dim_param
                                 for d in v.type.tensor_type.shape.dim] for v in values if v.name not in initializers}
            return shapes(graph.input), shapes(graph.output)

        layers = engine["model"]["num_layers"]
        past = past_names(layers)
        expected = {"session": ([*INPUT_NAMES, *past], graph_outputs(OUTPUT_NAMES, layers, self.in_place), ("logits",)),
                    "heads_session": ([HEADS_INPUT], [HEADS_OUTPUT], (HEADS_OUTPUT,)),
                    "step_session": ([*STEP_INPUT_NAMES, *past], graph_outputs(STEP_OUTPUT_NAMES, layers, self.in_place),
                                     ())}
        for name, file in self._graphs.items():
            if file is None:
                continue
            path = self.engine_dir / file
            graph = onnx.load(str(path), load_external_data=False).graph
            writes = any(o.name.startswith("present_key_") for o in graph.output)
            if name != "heads_session" and writes != self.in_place:
                raise EngineError(f"{path}: the graph {'writes' if writes else 'does not write'} the cache in place "
                                  f"(present_key_* outputs), engine.json records onnx.cache_in_place {self.in_place} "
                                  "(engine.json and the graph disagree: rebuild the engine)")
            check_graph(engine, path, *io(graph), *expected[name])
            if name == "session":
                check_weight_format(engine, path, {n.op_type for n in graph.node})

    def start(self, batch: int, capacity: int) -> None:
        if batch > self.max_batch_size:
            raise ValueError(f"batch {batch} exceeds the engine's max_batch_size {self.max_batch_size} "
                             f"({self.engine_dir / 'engine.json'}); rebuild with a larger --max-batch-size")
        self.keys, self.values = zero_cache(self.num_layers, batch, self.num_kv_heads, capacity, self.head_dim,
                                            self.dtype, self.device)
        self.lengths = torch.zeros(batch, dtype=torch.long)
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self._width = 0  # new tokens of the last step (in-place engines: what commit may have to move)
        self._cache_changed()

    def _cache_changed(self) -> None:
        self._bindings = {}
        # Each layer's K and V as a contiguous numpy view, made once per cache rather than per step.
        self._cache_feeds = {} if self.device != "cpu" else {
            name: (self.keys if i % 2 == 0 else self.values)[i // 2].numpy()
            for i, name in enumerate(self._past_names)}

    def _room_for_two_rows(self, longest: int) -> bool:
        """Whether a padded one-token step's throwaway row (position and slot longest + 1) fits."""
        return longest + 1 < min(self.keys.shape[3], self.info.max_seq_len)

    def forward(self, input_ids, position_ids, new_mask, logit_positions=None, with_heads=True):
        if self.pad_one_row and input_ids.numel() == 1 and self._room_for_two_rows(int(self.lengths.max())):
            # One token as a two-row step (see pad_one_row): the second row, a copy written one slot
            # further, attends the first and is never read or committed.
            return self.forward(input_ids.repeat(1, 2), torch.cat([position_ids, position_ids + 1], dim=1),
                                torch.ones(1, 2, 2, dtype=torch.bool).tril(), torch.zeros(1, 1, dtype=torch.long),
                                with_heads)
        s = input_ids.shape[1]
        logit_positions = check_forward(self.keys, self.lengths, input_ids, position_ids, logit_positions,
                                        self.info.max_seq_len, self.engine_dir / "engine.json")
        kept = logit_positions.shape[1]
        if self.pad_one_row and logit_positions.numel() == 1:
            # A lone logits row would take the lm_head's MatMulNBits to the one-row kernel too: the
            # row is asked for twice and kept once, so the logits of a plain step and of a prefill
            # are the bits a tree step computes for that row.
            logit_positions = logit_positions.repeat(1, 2)
        feeds = _host_feeds(input_ids=input_ids, position_ids=position_ids, past_lengths=self.lengths,
                            new_mask=new_mask, logit_positions=logit_positions)
        if self.in_place:
            self._width = s
            b, k = logit_positions.shape
            logits, hidden = self._run_in_place("session", feeds, {"logits": ((b, k, self.vocab_size), np.float32),
                                                                   "hidden": ((b, k, self.hidden_size), self._np_dtype)})
            new_k = new_v = None
        elif not self.use_binding:
            feeds.update(self._cache_feeds)  # ONNX Runtime reads these views in place (no copy)
            logits, hidden, new_k, new_v = (torch.from_numpy(a) for a in self.session.run(None, feeds))
        else:
            logits, hidden, new_k, new_v = self._run_bound(feeds, logit_positions.shape[1], s)
        self._pending = (new_k, new_v)
        logits, hidden = logits[:, :kept], hidden[:, :kept]
        self._hidden = hidden  # [B, K, d] host tensor: the heads run on the rows the loop picks
        if not with_heads:
            return logits, None
        return logits, self._run_heads(hidden.reshape(-1, hidden.shape[-1])).reshape(-1, *hidden.shape[:2], self.vocab_size)

    def fused_step(self, input_ids, position_ids, new_mask, retrieve, candidate_index):
        """Verifies a tree, accepts greedily and drafts the next tree's tokens in one call (the step
        graph, engines/onnx_export.py). Returns best path [B], accepted draft tokens [B] and the next
        input_ids [B, 1 + C]; the new tokens' KV stays pending until `commit`."""
        if self.pad_one_row and input_ids.numel() == 1 and self._room_for_two_rows(int(self.lengths.max())):
            # A lone slot (a one-token prompt's prefill, a tree cut to its root) as two rows, as forward
            # pads one token (see pad_one_row): retrieve never names the throwaway slot.
            return self.fused_step(input_ids.repeat(1, 2), torch.cat([position_ids, position_ids + 1], dim=1),
                                   torch.ones(1, 2, 2, dtype=torch.bool).tril(), retrieve, candidate_index)
        check_forward(self.keys, self.lengths, input_ids, position_ids, None, self.info.max_seq_len,
                      self.engine_dir / "engine.json")
        feeds = _host_feeds(input_ids=input_ids, position_ids=position_ids, past_lengths=self.lengths,
                            new_mask=new_mask, retrieve=retrieve, candidate_index=candidate_index)
        if self.in_place:
            b, self._width = input_ids.shape
            return tuple(self._run_in_place("step_session", feeds, {
                "best_path": ((b,), np.int64), "accepted": ((b,), np.int64),
                "next_tokens": ((b, 1 + len(candidate_index)), np.int64)}))
        outputs = self.step_session.run(None, {**feeds, **self._cache_feeds})
        best, accepted, next_tokens, new_k, new_v = (torch.from_numpy(a) for a in outputs)
        self._pending = (new_k, new_v)
        return best, accepted, next_tokens

    def _run_in_place(self, name: str, feeds: dict, outputs: dict[str, tuple]) -> list[torch.Tensor]:
        """Runs an in-place engine's graph: each layer's cache view is bound as its past input and as
        its present output (same memory: the graph writes the new K/V into it), once per cache. A
        step binds its few small inputs, and `outputs` (name -> (shape, numpy dtype)) to new host
        arrays, returned as tensors: ONNX Runtime writes them there, so nothing is copied after, and
        the 2 x layers cache outputs are never wrapped for Python."""
        session = getattr(self, name)
        io = self._bindings.get(name)
        if io is None:
            io = self._bindings[name] = self._cache_binding(session)
        for n, array in feeds.items():
            io.bind_cpu_input(n, array)
        arrays = []
        for n, (shape, dtype) in outputs.items():
            arrays.append(np.empty(shape, dtype=dtype))
            io.bind_output(n, "cpu", 0, dtype, list(shape), arrays[-1].ctypes.data)
        session.run_with_iobinding(io)
        return [torch.from_numpy(a) for a in arrays]

    def _cache_binding(self, session):
        """A new IOBinding of `session` with each layer's cache view bound as its past input and as
        its present output (one memory: an in-place graph writes the new K/V into it)."""
        io = session.io_binding()
        for past, present in zip(self._past_names, present_names(self.num_layers), strict=True):
            view = self._cache_feeds[past]
            for bind, n in ((io.bind_input, past), (io.bind_output, present)):
                bind(n, "cpu", 0, view.dtype, list(view.shape), view.ctypes.data)
        return io

    def _plain_greedy_step(self, tokens: torch.Tensor) -> torch.Tensor:
        """forward(tokens[:, None] at each sequence's length), commit of that one slot and the argmax
        of its logits, the same graph call as that sequence of calls, with every input and output
        bound once by pointer (_PlainBinding). A plain step of a 135M int4 engine is ~5 ms, and the
        Backend calls' torch ops around it cost ~0.2 ms more, each 10-40 us on caches the step has
        evicted (BENCHMARKS.md, issue 13 (h)). Returns the next tokens [B]."""
        bound = self._bindings.get("plain")
        if bound is None or bound.lengths_tensor is not self.lengths or len(tokens) != len(bound.ids):
            bound = self._bindings["plain"] = _PlainBinding.make(self, len(tokens))
        padded = bound.ids.shape[1] == 2  # one token as two rows (pad_one_row)
        if bound.longest >= min(self.keys.shape[3], self.info.max_seq_len) or (
                padded and not self._room_for_two_rows(bound.longest)):
            if padded and bound.longest < min(self.keys.shape[3], self.info.max_seq_len):
                # No room for the throwaway row: forward + commit do the step (they fall back to one row).
                logits, _ = self.forward(tokens[:, None], self.lengths[:, None], torch.ones(1, 1, 1, dtype=torch.bool),
                                         with_heads=False)
                self.commit(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long))
                return logits[:, 0].argmax(-1)
            check_forward(self.keys, self.lengths, tokens[:, None], self.lengths[:, None], None, self.info.max_seq_len,
                          self.engine_dir / "engine.json")  # raises the error that forward would
        bound.ids[:] = tokens.numpy()[:, None]
        self.session.run_with_iobinding(bound.io)
        bound.lengths += 1  # the commit: self.lengths is this memory
        bound.longest += 1
        if bound.positions is not None:
            bound.positions += 1
        return torch.from_numpy(bound.logits[:, 0].argmax(-1))

    def _greedy_tree_step(self, tokens: torch.Tensor, tree: StepTree) -> tuple[torch.Tensor, ...]:
        """fused_step(tokens[:, :T] at each sequence's length + the tree's offsets) and the commit of
        each accepted path, the same graph call as that pair of calls, with every input and output
        bound once per cache, batch and tree (_TreeBinding). Around a ~15 ms step those calls'
        Python and torch cost ~0.8 ms on a 2-core AVX2 host, this ~0.1 ms (BENCHMARKS.md, issue 13
        (m)). Returns best path [B], accepted draft tokens [B] and the next tree's tokens [B, 1 + C]."""
        if self.pad_one_row and tree.num_slots == 1 and len(tokens) == 1:  # fused_step pads the lone slot
            best, accepted, next_tokens = self.fused_step(tokens[:, :1], self.lengths[:, None], tree.mask[None],
                                                          tree.retrieve, tree.candidate_index)
            self.commit(torch.zeros(1, 1, dtype=torch.long), accepted + 1)
            return best, accepted, next_tokens
        bound = self._bindings.get("tree")
        if (bound is None or bound.tree is not tree or bound.lengths_tensor is not self.lengths
                or len(tokens) != len(bound.ids)):
            bound = self._bindings["tree"] = _TreeBinding.make(self, tree)
        longest = int(bound.lengths.max())
        if longest + tree.num_slots > self.keys.shape[3] or longest + bound.depth >= self.info.max_seq_len:
            check_forward(self.keys, self.lengths, tokens[:, : tree.num_slots], self.lengths[:, None] + tree.position_offsets,
                          None, self.info.max_seq_len, self.engine_dir / "engine.json")  # raises what fused_step would
        bound.ids[:] = tokens.numpy()[:, : tree.num_slots]
        np.add(bound.lengths[:, None], bound.offsets, out=bound.positions)
        self.step_session.run_with_iobinding(bound.io)
        best, accepted = bound.best.copy(), bound.accepted.copy()  # the next step writes the bound ones
        if not tree.is_chain:  # an accepted chain is where it belongs; a branch's slots move
            slots = torch.tensor([tree.paths[p] for p in best.tolist()])
            compact_in_place(self.keys, self.values, self.lengths, slots, torch.from_numpy(accepted + 1))
        bound.lengths += accepted + 1  # the commit: self.lengths is this memory
        return torch.from_numpy(best), torch.from_numpy(accepted), torch.from_numpy(bound.next_tokens.copy())

    def heads(self, rows: torch.Tensor) -> torch.Tensor:
        return self._run_heads(self._hidden[torch.arange(len(rows)), rows])

    def _run_heads(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, d] -> medusa logits [H, N, V] (the engine's heads graph; a few KB in and out)."""
        if self.heads_session is None:
            return torch.zeros(0, hidden.shape[0], self.vocab_size)
        (out,) = self.heads_session.run(None, {"hidden": np.ascontiguousarray(hidden.numpy())})
        return torch.from_numpy(out)

    def _run_bound(self, feeds: dict, k: int, s: int):
        """The device path: the cache and the new K/V stay in device memory, bound by pointer
        (IOBinding); logits land in host tensors for the decoding loop."""
        b = feeds["input_ids"].shape[0]
        logits = torch.empty(b, k, self.vocab_size, dtype=torch.float32)
        hidden = torch.empty(b, k, self.hidden_size, dtype=self.dtype)
        new_k = torch.empty(self.num_layers, b, self.num_kv_heads, s, self.head_dim, dtype=self.dtype, device=self.device)
        new_v = torch.empty_like(new_k)
        io = self.session.io_binding()
        for name, array in feeds.items():
            io.bind_cpu_input(name, array)  # a few bytes each; ONNX Runtime copies them over
        for i, name in enumerate(self._past_names):
            _bind(io.bind_input, name, (self.keys if i % 2 == 0 else self.values)[i // 2], self.device, self._np_dtype)
        _bind(io.bind_output, "logits", logits, "cpu", np.float32)
        _bind(io.bind_output, "hidden", hidden, "cpu", self._np_dtype)
        _bind(io.bind_output, "present_keys", new_k, self.device, self._np_dtype)
        _bind(io.bind_output, "present_values", new_v, self.device, self._np_dtype)
        if self.device == "cuda":
            torch.cuda.synchronize()  # torch wrote the cache on its stream; ONNX Runtime runs on its own
        self.session.run_with_iobinding(io)
        return logits, hidden, new_k, new_v

    def commit(self, slots: torch.Tensor, counts: torch.Tensor) -> None:
        if self.in_place:  # the step wrote every new token's K/V at its length + slot already
            # One new token (a plain step) is where it belongs: only wider steps may move slots.
            self.lengths = self.lengths + counts if self._width == 1 else \
                compact_in_place(self.keys, self.values, self.lengths, slots, counts)
            return
        self.lengths = scatter_pending(self.keys, self.values, self._pending, self.lengths, slots, counts)
        self._pending = None

    def keep(self, rows: torch.Tensor) -> None:
        on_device = rows.to(self.device)
        self.keys, self.values = self.keys[:, on_device], self.values[:, on_device]
        self.lengths = self.lengths[rows]
        self._pending = None
        self._cache_changed()


@dataclass
class _PlainBinding:
    """A plain step's graph call bound once: the caches (past and present, one memory), the token
    ids, each sequence's length as both past_lengths and position_ids (one memory: a plain step's
    new token sits at its sequence's length), the constant mask and logit position, and the outputs.
    `lengths` is also the backend's `lengths` tensor, so the step's commit is one in-place add.
    With the backend's pad_one_row at batch 1 the token goes in twice (two rows, a causal mask),
    the positions [length, length + 1] get an array of their own, and the first row's logits are
    computed twice (as forward does: the lm_head's two-row kernel)."""

    io: object  # onnxruntime IOBinding
    ids: np.ndarray  # [B, 1], or [1, 2] padded
    lengths: np.ndarray  # [B] int64
    lengths_tensor: torch.Tensor  # `lengths` as the backend's tensor (a later commit replaces it)
    longest: int  # max(lengths), kept as a Python int
    positions: np.ndarray | None  # [1, 2] when padded (advanced with the lengths); else `lengths` serves
    constants: tuple[np.ndarray, ...]  # new_mask, logit_positions: kept alive for their pointers
    logits: np.ndarray  # [B, 1, V], or [1, 2, V] padded (the same row twice)
    hidden: np.ndarray  # [B, 1, d], or [1, 2, d] padded

    @classmethod
    def make(cls, backend: OrtBackend, batch: int) -> _PlainBinding:
        io = backend._cache_binding(backend.session)
        lengths = backend.lengths.numpy().astype(np.int64)  # a copy: the old tensor may be shared
        width = 2 if backend.pad_one_row and batch == 1 else 1
        ids = np.zeros((batch, width), np.int64)
        positions = lengths[:, None] + np.arange(width)[None] if width > 1 else None
        mask = np.tril(np.ones((batch, width, width), np.bool_))
        rows = np.zeros((batch, width), np.int64)  # logit_positions: the first row (twice when padded: forward)
        logits = np.empty((batch, width, backend.vocab_size), np.float32)
        hidden = np.empty((batch, width, backend.hidden_size), backend._np_dtype)
        position_ids = (positions, positions.shape) if positions is not None else (lengths, (batch, 1))
        for name, array, shape in (("input_ids", ids, ids.shape), ("position_ids", *position_ids),
                                   ("past_lengths", lengths, (batch,)), ("new_mask", mask, mask.shape),
                                   ("logit_positions", rows, rows.shape)):
            io.bind_input(name, "cpu", 0, array.dtype, list(shape), array.ctypes.data)
        for name, array in (("logits", logits), ("hidden", hidden)):
            io.bind_output(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
        backend.lengths = torch.from_numpy(lengths)
        return cls(io, ids, lengths, backend.lengths, int(lengths.max()), positions, (mask, rows), logits, hidden)


@dataclass
class _TreeBinding:
    """A greedy tree step's graph call bound once (the step graph): the caches (past and present,
    one memory), the token ids, the positions (each sequence's length + the tree's offsets,
    rewritten in place each step), each sequence's length (also the backend's `lengths` tensor, so
    the commit is an in-place add), the tree's constant mask, retrieve and candidate_index, and the
    outputs. Made for one StepTree: a cut tree (StepTree.within_block) binds anew."""

    io: object  # onnxruntime IOBinding
    tree: StepTree  # the tree bound (identity: runtime/decoding.py makes each tree, and each cut, once)
    ids: np.ndarray  # [B, T]
    positions: np.ndarray  # [B, T]
    offsets: np.ndarray  # [T] the tree's position offsets
    depth: int  # the largest offset: positions reach length + depth
    lengths: np.ndarray  # [B] int64
    lengths_tensor: torch.Tensor  # `lengths` as the backend's tensor (a later commit replaces it)
    constants: tuple[np.ndarray, ...]  # new_mask, retrieve, candidate_index: kept alive for their pointers
    best: np.ndarray  # [B]
    accepted: np.ndarray  # [B]
    next_tokens: np.ndarray  # [B, 1 + C]

    @classmethod
    def make(cls, backend: OrtBackend, tree: StepTree) -> _TreeBinding:
        io = backend._cache_binding(backend.step_session)
        lengths = backend.lengths.numpy().astype(np.int64)  # a copy: the old tensor may be shared
        batch, t = len(lengths), tree.num_slots
        offsets = tree.position_offsets.numpy().astype(np.int64)
        ids, positions = np.zeros((batch, t), np.int64), np.zeros((batch, t), np.int64)
        mask = np.ascontiguousarray(np.broadcast_to(tree.mask.numpy().astype(np.bool_), (batch, t, t)))
        retrieve = np.ascontiguousarray(tree.retrieve.numpy(), dtype=np.int64)
        index = np.ascontiguousarray(tree.candidate_index.numpy(), dtype=np.int64)
        for name, array in (("input_ids", ids), ("position_ids", positions), ("past_lengths", lengths),
                            ("new_mask", mask), ("retrieve", retrieve), ("candidate_index", index)):
            io.bind_input(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
        best, accepted = np.empty(batch, np.int64), np.empty(batch, np.int64)
        next_tokens = np.empty((batch, 1 + len(index)), np.int64)
        for name, array in (("best_path", best), ("accepted", accepted), ("next_tokens", next_tokens)):
            io.bind_output(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
        backend.lengths = torch.from_numpy(lengths)
        return cls(io, tree, ids, positions, offsets, int(offsets.max()), lengths, backend.lengths,
                   (mask, retrieve, index), best, accepted, next_tokens)


def _host_feeds(**tensors: torch.Tensor) -> dict[str, np.ndarray]:
    """The graphs' small host inputs as contiguous numpy arrays: new_mask bool, the rest int64."""
    return {name: np.ascontiguousarray(t.numpy(), dtype=np.bool_ if name == "new_mask" else np.int64)
            for name, t in tensors.items()}


def _bind(bind, name: str, tensor: torch.Tensor, device: str, np_dtype) -> None:
    """Binds a contiguous torch tensor's memory to a graph input or output, without a copy."""
    if not tensor.is_contiguous():
        raise AssertionError(f"{name}: binding needs a contiguous tensor")  # an internal invariant
    if tensor.numel() == 0:  # e.g. medusa_logits of a model without heads: no memory to point at
        bind(name, device)
        return
    device_id = (tensor.device.index or 0) if device == "cuda" else 0
    bind(name, device, device_id, np_dtype, list(tensor.shape), tensor.data_ptr())
