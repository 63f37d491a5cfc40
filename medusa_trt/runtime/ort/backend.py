"""The ONNX Runtime engine behind the runtime's Backend interface.

The KV cache is one preallocated torch tensor per K and V, [L, B, Hkv, capacity, D], on the
engine's device, allocated once per `start`. The runtime hands each layer's buffer to the graph as
it is (no slice, copy or transfer on the host side); inside the graph, the default attention form
slices it to the longest committed length and concatenates the new K/V after that prefix, so every
layer copies the committed prefix once per step and a step costs the committed length, not the
capacity (engines/onnx/export.py). How the graph's K/V reach the cache is the cache mode, one
small object per mode (runtime/ort/cache.py): K/V returned and scattered by `commit` (CPU), bound
in device memory (CUDA), or written in place by the graph (in-place int4 CPU engines). Returned
tensors are new every step, so a caller may keep them.

Every decoder and step graph call goes through one boundary (OrtBackend._feeds): the rows as the
kernel needs them (pad_one_row), the checks against the cache, and the host feeds. The heads and
drafter graphs take their own small feeds (_run_heads, _run_drafter).

Sessions open on first use. ONNX Runtime packs every constant MatMul weight into a buffer of its own
per session, so each open session holds a copy of the decoder's weights: a greedy Medusa decode on
the CPU runs on the fused step graph alone (its prefill too, runtime/steps.py), plain decoding on
the decoder graph alone, and only a process doing both, or sampling, holds two copies. A drafter
with a cache of its own (Amphista) is the exception: its prefill runs the decoder and drafter graphs
(every prompt row into the drafter's cache), so its greedy decode opens the decoder's session too
(docs/benchmarks/issue-13-int4.md, memory). The graphs' inputs and outputs are checked against
engine.json at load, from the files.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from medusa_trt.checkpoint import CONFIG_DTYPES
from medusa_trt.engine_dir import (
    DRAFTER_INPUT_NAMES,
    DRAFTER_OUTPUT_NAMES,
    DRAFTER_STEP_INPUTS,
    HEADS_INPUT,
    HEADS_OUTPUT,
    INPUT_NAMES,
    OUTPUT_NAMES,
    STEP_INPUT_NAMES,
    EngineError,
    check_artifacts,
    check_graph,
    check_positions,
    check_weight_format,
    graph_outputs,
    past_names,
    read_engine_json,
    step_outputs,
)
from medusa_trt.runtime.backend import (
    Backend,
    ModelInfo,
    check_forward,
    drafter_inputs,
    last_rows,
    scatter_pending,
    zero_cache,
)
from medusa_trt.runtime.ort.cache import NP_DTYPES, BoundCache, InPlaceCache, ReturnedCache
from medusa_trt.runtime.ort.session import (
    OrtSessionOptions,
    SharedWeights,
    execution_provider,
    make_session,
    one_row_kernel_differs,
)


class _Session:
    """An OrtBackend attribute holding one of its graphs' sessions, opened on first read (None when
    the engine has no such graph); assigning replaces it (tests and benchmarks wrap sessions)."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, backend, owner=None):
        return self if backend is None else self.open(backend)

    def open(self, backend):
        if self.name not in backend._sessions:
            graph = backend._graphs[self.name]
            backend._sessions[self.name] = None if graph is None else make_session(
                backend.engine_dir / graph, backend.device, backend.options, backend._prepack, backend._weights,
                int8_weights=backend._int8)
        return backend._sessions[self.name]

    def __set__(self, backend, session) -> None:
        backend._sessions[self.name] = session  # an in-place cache binds a new session anew


class OrtBackend(Backend):
    """An ONNX Runtime engine directory behind the Backend interface (see module docstring)."""

    host_threads = 1  # torch threads for the decoding loop's own small ops (see decoding.generate)
    # decoder, heads, fused step, and the drafter graph of a drafter with a cache of its own (Amphista)
    session, heads_session, step_session, drafter_session = _Session(), _Session(), _Session(), _Session()

    def __init__(self, engine_dir: str | Path, device: str | None = None, options: OrtSessionOptions | None = None):
        self.engine_dir = Path(engine_dir)
        self.options = options = options or OrtSessionOptions()  # every session's threads and spinning
        if options.threads is not None and options.threads < 1:
            raise EngineError(f"threads {options.threads}: expected >= 1 (or None: one per core)")
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
        # Sessions over one shared weights file (engines/ort/weights.py) map it rather than copy it,
        # unless they prepack: then each session holds its own packed copy (engine.json says which).
        self._prepack = onnx_info.get("prepack_weights", True)
        weights_file = onnx_info.get("weights_file")
        # The sessions keep references to the mapped tensors; self keeps the mapping alive as long.
        # Only without prepacking: a prepacking session keeps its packed copy and lets ONNX Runtime
        # release the file's pages, which a shared initializer would pin (docs/benchmarks/issue-13-int4.md, memory).
        shared = weights_file and not self._prepack and self.device == "cpu"
        self._weights = SharedWeights(self.engine_dir / weights_file) if shared else None
        # The fused greedy step (one call per step) on the CPU; on CUDA greedy steps take the
        # forward + heads path, whose outputs stay bound in device memory.
        step_file = onnx_info.get("step_file") if self.device == "cpu" else None
        self._graphs = {"session": onnx_info["file"], "heads_session": onnx_info.get("heads_file"),
                        "step_session": step_file, "drafter_session": onnx_info.get("drafter_file")}
        self._sessions: dict = {}
        # In-place engines (engine.json onnx.cache_in_place): the graphs write new K/V into the cache
        # buffers they are bound to (runtime/ort/cache.py).
        self.in_place = onnx_info.get("cache_in_place", False)
        if self.in_place and self.device != "cpu":
            raise EngineError(f"{self.engine_dir / 'engine.json'}: onnx.cache_in_place engines run on the CPU; "
                              f"device {self.device!r} needs an engine built with --device {self.device}")
        # The cache mode, one object per cache (start, keep). IOBinding is required on CUDA; on the
        # CPU session.run on numpy views is as fast (runtime/ort/cache.py), and a test may pick BoundCache.
        self.cache_mode = InPlaceCache if self.in_place else ReturnedCache if self.device == "cpu" else BoundCache
        # Where this CPU's MatMulNBits runs a single row on a kernel of its own (ONNX Runtime's AVX2
        # build: a one-row GEMV that rounds otherwise than its multi-row GEMM), a one-token step at
        # batch 1 runs as two rows, the second a throwaway copy, and a lone logits row is computed
        # twice, so a plain step's logits are the bits a Medusa step computes for that row and Medusa
        # greedy stays equal to plain greedy (docs/benchmarks/issue-13-int4.md (l), with its cost).
        # Where the kernels agree, nothing changes. Applied in one place: _feeds.
        weights = engine.get("weights") or {}
        self._int8 = weights.get("format") == "int8"  # make_session: int8 weights on a CPU without VNNI
        self.pad_one_row = bool(self.device == "cpu" and weights.get("format") == "int4"
                                and one_row_kernel_differs(weights["block_size"], weights["accuracy_level"]))
        self.fused_step_topk = onnx_info.get("step_topk") if step_file else None
        self.fused_step_dynamic = bool(step_file and onnx_info.get("step_dynamic"))
        self._check_graphs(engine)
        self.num_layers, self.num_kv_heads = model["num_layers"], model["num_kv_heads"]
        self.head_dim, self.num_medusa_heads = model["head_dim"], engine["medusa"]["num_heads"]
        self.vocab_size, self.hidden_size = model["vocab_size"], model["hidden_size"]
        self.dtype = CONFIG_DTYPES[engine["dtype"]]
        self.info = ModelInfo(self.vocab_size, self.num_medusa_heads, limits["max_seq_len"], limits["max_draft_len"],
                              onnx_info.get("key_block"), onnx_info.get("chains_only", False),
                              drafter_cache=bool(onnx_info.get("drafter_file")),
                              max_batch_size=limits["max_batch_size"], hidden_all_rows=bool(onnx_info.get("hidden_all_rows")))
        self._past_names = past_names(self.num_layers)
        self._np_dtype = NP_DTYPES.get(self.dtype)
        if self._np_dtype is None:  # numpy has no bfloat16; ONNX Runtime's CPU kernels mostly lack it too
            raise EngineError(f"{self.engine_dir / 'engine.json'}: dtype {engine['dtype']} cannot be bound "
                              "from Python; rebuild with --dtype float32 or float16")
        self.start(1, 1)

    def open_sessions(self) -> None:
        """Opens every graph's session now: a server decodes in every mode, and its first requests
        should not pay for opening one (each holds its own packed copy of the weights)."""
        for graph in (OrtBackend.session, OrtBackend.heads_session, OrtBackend.step_session,
                      OrtBackend.drafter_session):
            graph.open(self)

    @property
    def open_session_names(self) -> frozenset[str]:
        """The graphs whose sessions are open ("session", "heads_session", "step_session",
        "drafter_session"): each open one holds its own packed copy of the weights."""
        return frozenset(name for name, session in self._sessions.items() if session is not None)

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
        cached = bool(engine["onnx"].get("drafter_file"))  # a drafter with its own cache
        expected = {"session": ([*INPUT_NAMES, *past], graph_outputs(OUTPUT_NAMES, layers, self.in_place), ("logits",)),
                    "heads_session": ([HEADS_INPUT], [HEADS_OUTPUT], (HEADS_OUTPUT,)),
                    "step_session": ([*STEP_INPUT_NAMES, *past, *(DRAFTER_STEP_INPUTS if cached else ())],
                                     graph_outputs(step_outputs(cached, bool(engine["onnx"].get("step_dynamic"))), layers,
                                                  self.in_place), ()),
                    "drafter_session": ([*DRAFTER_INPUT_NAMES, *past_names(2)], list(DRAFTER_OUTPUT_NAMES),
                                        (HEADS_OUTPUT,))}
        for name, file in self._graphs.items():
            if file is None:
                continue
            path = self.engine_dir / file
            try:
                graph = onnx.load(str(path), load_external_data=False).graph
            except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and kin: the file is not a graph
                raise EngineError(f"{path}: not a readable ONNX graph ({type(e).__name__}); the engine dir is damaged: "
                                  "rebuild the engine") from None
            writes = any(o.name.startswith("present_key_") for o in graph.output)
            if name in ("session", "step_session") and writes != self.in_place:
                raise EngineError(f"{path}: the graph {'writes' if writes else 'does not write'} the cache in place "
                                  f"(present_key_* outputs), engine.json records onnx.cache_in_place {self.in_place} "
                                  "(engine.json and the graph disagree: rebuild the engine)")
            check_graph(engine, path, *io(graph), *expected[name])
            check_positions(engine, path, graph)
            if name == "session":
                check_weight_format(engine, path, {n.op_type for n in graph.node})
                # The runtime allocates the cache in engine.json's dtype; a graph of another one would
                # refuse every call.
                cache = {v.name: v.type.tensor_type.elem_type for v in graph.input}.get(past[0])
                want = {"float32": onnx.TensorProto.FLOAT, "float16": onnx.TensorProto.FLOAT16,
                        "bfloat16": onnx.TensorProto.BFLOAT16}.get(engine["dtype"])
                if cache is not None and want is not None and cache != want:
                    raise EngineError(f"{path}: input {past[0]!r} is {onnx.TensorProto.DataType.Name(cache)}, engine.json "
                                      f"records dtype {engine['dtype']!r} (engine.json and the graph disagree: rebuild "
                                      "the engine)")

    # -- Backend interface ---------------------------------------------------------------------

    def start(self, batch: int, capacity: int) -> None:
        if batch > self.info.max_batch_size:
            raise ValueError(f"batch {batch} exceeds the engine's max_batch_size {self.info.max_batch_size} "
                             f"({self.engine_dir / 'engine.json'}); rebuild with a larger --max-batch-size")
        self.keys, self.values = zero_cache(self.num_layers, batch, self.num_kv_heads, capacity, self.head_dim,
                                            self.dtype, self.device)
        self.lengths = torch.zeros(batch, dtype=torch.long)
        self.cache = self.cache_mode(self.keys, self.values, self._past_names)
        if self.info.drafter_cache:  # the drafter's own cache: its 2 layers, committed rows only
            # On the host whatever the device: the drafter and step graphs take it as numpy feeds, and
            # scatter_pending writes their host outputs into it (a CUDA tensor has no .numpy()).
            self.drafter_keys, self.drafter_values = zero_cache(2, batch, self.num_kv_heads, capacity, self.head_dim,
                                                                self.dtype, "cpu")
            self.drafter_lengths = torch.zeros(batch, dtype=torch.long)
        self._drafter_pending = None

    def forward(self, input_ids, position_ids, new_mask, logit_positions=None, with_heads=True):
        s = input_ids.shape[1]
        feeds, kept = self._feeds(input_ids, position_ids, new_mask, logit_positions)
        b, k = feeds["logit_positions"].shape
        rows = feeds["input_ids"].shape[1] if self.info.hidden_all_rows else k  # a padded lone row counts
        logits, hidden = self.cache.run(self.session, feeds, {"logits": ((b, k, self.vocab_size), np.float32),
                                                              "hidden": ((b, rows, self.hidden_size), self._np_dtype)})
        logits, hidden = logits[:, :kept], hidden[:, : s if self.info.hidden_all_rows else kept]
        self._hidden = hidden  # [B, K, d] host tensor: the heads run on the rows the loop picks
        if not with_heads:
            return logits, None
        return logits, self._run_heads(hidden.reshape(-1, hidden.shape[-1])).reshape(-1, *hidden.shape[:2], self.vocab_size)

    def fused_step(self, input_ids, position_ids, new_mask, retrieve, candidate_index):
        """Verifies a tree, accepts greedily and drafts the next tree's tokens in one call (the step
        graph, engines/onnx/export.py). Returns best path [B], accepted draft tokens [B] and the next
        input_ids [B, 1 + C], then, where fused_step_dynamic, the drafter's top-k ids and log-probs
        [B, H, k] (None otherwise); the new tokens' KV stays pending until `commit`. A drafter with its
        own cache takes the accepted path in the same call; its new rows stay pending until `commit`
        too."""
        b = len(input_ids)
        if self.fused_step_dynamic and retrieve.dim() == 2:  # one tree for the batch, as the graph takes it per sequence
            retrieve = retrieve.expand(b, -1, -1)
        feeds, _ = self._feeds(input_ids, position_ids, new_mask, retrieve=retrieve, candidate_index=candidate_index)
        outputs = {"best_path": ((b,), np.int64), "accepted": ((b,), np.int64),
                   "next_tokens": ((b, 1 + len(candidate_index)), np.int64)}
        if self.fused_step_dynamic:
            top = (b, min(retrieve.shape[-1] - 1, self.num_medusa_heads), self.fused_step_topk)
            outputs.update(next_topk=(top, np.int64), next_logp=(top, np.float32))
        if not self.info.drafter_cache:
            out = self.cache.run(self.step_session, feeds, outputs)
            return (*out, None, None) if len(out) == 3 else tuple(out)
        past = int(self.drafter_lengths.max())
        n = retrieve.shape[-1]  # the path's rows: depth + 1
        if past + n > self.drafter_keys.shape[3]:
            raise ValueError(f"drafter cache overflow: {past} + {n} rows > capacity {self.drafter_keys.shape[3]}")
        feeds["drafter_past_lengths"] = np.ascontiguousarray(self.drafter_lengths.numpy(), dtype=np.int64)
        for i, name in enumerate(DRAFTER_STEP_INPUTS[1:]):
            cache = self.drafter_keys if "key" in name else self.drafter_values
            feeds[name] = np.ascontiguousarray(cache[i // 2, :, :, :past].numpy())
        shape = (2, b, self.num_kv_heads, n, self.head_dim)
        outputs.update(drafter_present_keys=(shape, self._np_dtype), drafter_present_values=(shape, self._np_dtype))
        *out, new_k, new_v = self.cache.run(self.step_session, feeds, outputs)
        # The path's drafter rows are committed with the base's (commit: the first accepted + 1).
        self._drafter_pending = (new_k, new_v)
        return (*out, None, None) if len(out) == 3 else tuple(out)

    def _feeds(self, input_ids, position_ids, new_mask, logit_positions=None, **step_inputs):
        """A graph call's host feeds, with the rows as the kernel needs them: where pad_one_row, a lone
        token (a plain step, a one-token prompt, a tree cut to its root) runs as two rows, the second
        a copy written one slot further that attends the first and is never read, committed or
        named by retrieve; and a lone logits row is asked for twice and kept once (the lm_head's
        MatMulNBits would take it to the one-row kernel too), so the logits of a plain step and of a
        prefill are the bits a tree step computes for that row. Checks the call against the cache.
        `step_inputs`: the step graph's (retrieve, candidate_index); without them the call is the
        decoder's, which takes logit_positions. Returns the feeds and the logits rows to keep."""
        decoder = not step_inputs
        if self.pad_one_row and input_ids.numel() == 1 and self._room_for_two_rows(int(self.lengths.max())):
            input_ids, position_ids = input_ids.repeat(1, 2), torch.cat([position_ids, position_ids + 1], dim=1)
            new_mask = torch.ones(1, 2, 2, dtype=torch.bool).tril()
            logit_positions = torch.zeros(1, 1, dtype=torch.long) if decoder else None
        logit_positions = check_forward(self.keys, self.lengths, input_ids, position_ids, logit_positions,
                                        self.info.max_seq_len, self.engine_dir / "engine.json")
        if not decoder:
            return _host_feeds(input_ids=input_ids, position_ids=position_ids, past_lengths=self.lengths,
                               new_mask=new_mask, **step_inputs), 0
        kept = logit_positions.shape[1]
        if self.pad_one_row and logit_positions.numel() == 1:
            logit_positions = logit_positions.repeat(1, 2)
        return _host_feeds(input_ids=input_ids, position_ids=position_ids, past_lengths=self.lengths,
                           new_mask=new_mask, logit_positions=logit_positions), kept

    def _room_for_two_rows(self, longest: int) -> bool:
        """Whether a padded one-token step's throwaway row (position and slot longest + 1) fits."""
        return longest + 1 < min(self.keys.shape[3], self.info.max_seq_len)

    def draft(self, rows: torch.Tensor, counts: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        if self.info.drafter_cache:
            return self._run_drafter(rows, counts, next_tokens)
        # The heads graph is a Medusa drafter's (engines/onnx/drafters.py): the last committed row only.
        return self._run_heads(self._hidden[torch.arange(len(rows)), last_rows(rows, counts)])

    def _run_drafter(self, rows: torch.Tensor, counts: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """The drafter graph (engines/onnx/export.py, _DrafterModule): each sequence's committed rows
        appended to the drafter's cache (backend.drafter_inputs), drafts at the last."""
        b, c = len(rows), int(counts.max())
        past = int(self.drafter_lengths.max()) if b else 0
        if past + c > self.drafter_keys.shape[3]:
            raise ValueError(f"drafter cache overflow: {past} + {c} rows > capacity {self.drafter_keys.shape[3]}")
        feeds = {name: np.ascontiguousarray(t.numpy())
                 for name, t in drafter_inputs(self._hidden, rows, counts, next_tokens, self.drafter_lengths).items()}
        for i, name in enumerate(past_names(2)):
            cache = self.drafter_keys if name.startswith("past_key") else self.drafter_values
            feeds[name] = np.ascontiguousarray(cache[i // 2, :, :, :past].numpy())
        logits, new_k, new_v = self.drafter_session.run(None, feeds)
        self.drafter_lengths = scatter_pending(self.drafter_keys, self.drafter_values,
                                               (torch.from_numpy(new_k), torch.from_numpy(new_v)), self.drafter_lengths,
                                               torch.arange(c).expand(b, c), counts)
        return torch.from_numpy(logits)

    def _run_heads(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, d] -> medusa logits [H, N, V] (the engine's heads graph; a few KB in and out)."""
        if self.heads_session is None:
            return torch.zeros(0, hidden.shape[0], self.vocab_size)
        (out,) = self.heads_session.run(None, {"hidden": np.ascontiguousarray(hidden.numpy())})
        return torch.from_numpy(out)

    def commit(self, slots: torch.Tensor, counts: torch.Tensor) -> None:
        self.lengths = self.cache.commit(self.lengths, slots, counts)
        pending, self._drafter_pending = self._drafter_pending, None
        if pending is not None:  # a fused step's accepted path, in path order: its first counts[b] rows
            n = pending[0].shape[3]
            self.drafter_lengths = scatter_pending(self.drafter_keys, self.drafter_values, pending,
                                                   self.drafter_lengths, torch.arange(n).expand(len(counts), n), counts)

    def keep(self, rows: torch.Tensor) -> None:
        on_device = rows.to(self.device)
        self.keys, self.values = self.keys[:, on_device], self.values[:, on_device]
        self.lengths = self.lengths[rows]
        self.cache = self.cache_mode(self.keys, self.values, self._past_names)
        if self.info.drafter_cache:
            self.drafter_keys, self.drafter_values = self.drafter_keys[:, on_device], self.drafter_values[:, on_device]
            self.drafter_lengths = self.drafter_lengths[rows]


def _host_feeds(**tensors: torch.Tensor) -> dict[str, np.ndarray]:
    """The graphs' small host inputs as contiguous numpy arrays: new_mask bool, the rest int64."""
    return {name: np.ascontiguousarray(t.numpy(), dtype=np.bool_ if name == "new_mask" else np.int64)
            for name, t in tensors.items()}
