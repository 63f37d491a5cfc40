"""ONNX Runtime sessions as the engines need them: the session options (threads and spinning as
one OrtSessionOptions value, from the CLI flags through load_backend to every session), sessions on
exactly one provider, one shared mapping of an engine's weights, and the probe for the one-row
MatMulNBits kernel (OrtBackend.pad_one_row)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from medusa_trt.engine_dir import EngineError

if TYPE_CHECKING:
    import onnx

_PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


@dataclass(frozen=True)
class OrtSessionOptions:
    """How an engine's sessions use the CPU (medusa-run/bench/tune-tree/demo --threads and --spin),
    handed as one value from the flags through load_backend to every session of the engine.
    `threads`: intra-op threads (None: one per core this process may use); `spin`: worker threads
    spin between ops instead of sleeping (see session_options)."""

    threads: int | None = None
    spin: bool = False


def session_options(options: OrtSessionOptions | None = None, *, level: str = "all", prepack: bool = True):
    """Options measured on a 2-core CPU for decoding (benchmarks/investigations/bench_onnx_sweeps.py --sweep-options): all
    graph optimizations (they fuse RMSNorm, SiLU and MatMul+Transpose), one intra-op thread per core
    this process may use, sequential execution (the graph is a chain), and no spinning by default: a
    spinning worker burns a core that another process may need, and on a shared machine steps get
    much slower. On cores the engine has to itself, `options.spin` (ONNX Runtime's own default) saves
    a thread wake-up per op, which is what a second thread gains in a short int4 step
    (docs/benchmarks/issue-13-int4.md); the workers still stop spinning when a run ends.

    QDQ fusions are off: at the extended level ONNX Runtime 1.31 rewrites DequantizeLinear -> MatMul
    into MatMulIntegerToFloat, which rejects the float8 inputs of FP8 engines (engine.json's
    quantization block says so too); float engines have no Q/DQ, so nothing changes for them."""
    import onnxruntime as ort

    options = options or OrtSessionOptions()
    levels = {"basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
              "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
              "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
    so = ort.SessionOptions()
    so.graph_optimization_level = levels[level]
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.intra_op_num_threads = options.threads or len(os.sched_getaffinity(0))
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if options.spin else "0")
    # Spinning pays between the ops of one run; after a run the workers stop at once. Left spinning,
    # they hold the cores the next session's run needs: an Amphista prefill's drafter call right
    # after the decoder's took 2x as long at 2 threads (docs/benchmarks/issue-35-amphista.md (h)).
    so.add_session_config_entry("session.force_spinning_stop", "1" if options.spin else "0")
    so.add_session_config_entry("session.disable_quant_qdq", "1")
    if not prepack:  # engine.json onnx.prepack_weights (engines/ort/build.py says when and why)
        so.add_session_config_entry("session.disable_prepacking", "1")
    so.log_severity_level = 3  # warnings about unused initializers are noise to users
    return so


class SharedWeights:
    """One read-only mapping of an engine's shared weights file (engines/ort/weights.py), handed to
    every session as its initializers (SessionOptions.add_initializer): ONNX Runtime then computes
    from these pages instead of mapping or copying the file once per session, so a loaded engine's
    weights are resident once (docs/benchmarks/issue-13-int4.md). Tensors are built once per (offset, dtype,
    shape) and shared by every graph that refers to them."""

    def __init__(self, path: Path):
        self.path = path
        self._file = np.memmap(path, dtype=np.uint8, mode="r")
        self._values: dict[tuple, object] = {}

    def initializers(self, onnx_path: Path, graph: onnx.GraphProto) -> dict[str, object]:
        """OrtValues over the mapping for the initializers of `graph` (onnx_path's, loaded without
        its external data) stored in this file."""
        import onnx
        import onnxruntime as ort
        from onnx.helper import tensor_dtype_to_np_dtype

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


def make_session(onnx_path: str | Path, device: str = "cpu", options: OrtSessionOptions | None = None,
                 prepack: bool = True, weights: SharedWeights | None = None, int8_weights: bool = False):
    """An InferenceSession on exactly `device`: a missing provider is an error, never a CPU fall back.
    `weights`: the engine's shared weights file, mapped once for all its sessions. `int8_weights`:
    the graph may hold int8 MatMulIntegerToFloat weights (engine.json weights.format "int8"), which
    a CPU whose kernel saturates reads as uint8 (int8_weights_as_unsigned); other graphs open as
    they are, without a look inside."""
    import onnxruntime as ort

    provider = execution_provider(device)
    providers = [provider] if device == "cpu" else [provider, "CPUExecutionProvider"]  # CPU only for shape ops
    so = session_options(options, prepack=prepack)
    unsigned = int8_weights and device == "cpu" and signed_int8_gemm_saturates()
    proto = None
    if weights is not None or unsigned:  # the graph, without its weights, read once for both uses
        import onnx

        proto = onnx.load(str(onnx_path), load_external_data=False)
    if weights is not None:
        for name, value in weights.initializers(Path(onnx_path), proto.graph).items():
            so.add_initializer(name, value)
    model: str | bytes = str(onnx_path)
    if unsigned and int8_weights_as_unsigned(proto):
        model = proto.SerializeToString()  # its external data stays where it is, beside the file
        so.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                    str(Path(onnx_path).parent))
    try:
        session = ort.InferenceSession(model, so, providers=providers)
    except Exception as e:  # onnxruntime raises its own exception types, one per failure kind
        raise EngineError(f"{onnx_path}: onnxruntime {ort.__version__} cannot load it ({e}); an older "
                          "onnxruntime may lack the engine's opset: rebuild with a lower --opset") from None
    if session.get_providers()[0] != provider:
        raise EngineError(f"{onnx_path}: ONNX Runtime did not enable {provider} (got {session.get_providers()})")
    return session


@functools.cache
def signed_int8_gemm_saturates() -> bool:
    """Whether this CPU's MatMulIntegerToFloat over uint8 rows and int8 weights loses bits. ONNX
    Runtime's x86 kernels without VNNI (AVX2, AVX-512 without VNNI) add each pair of u8 x s8 products
    in int16 (vpmaddubsw), which saturates at 32767: two products of 255 x 127 already pass it. With
    VNNI (one instruction summing into int32) and on uint8 weights (widened to int16 before the
    multiply) the sums are exact. Answered once per process by one small graph whose sums saturate
    if the kernel does: rows of 255 against weights of 127, at 1 and 8 rows."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    k, n = 64, 16
    inits = [numpy_helper.from_array(np.full((k, n), 127, np.int8), "B"),
             numpy_helper.from_array(np.array(1.0, np.float32), "S"),
             numpy_helper.from_array(np.array(128, np.uint8), "Z")]
    node = helper.make_node("MatMulIntegerToFloat", ["A", "B", "S", "S", "Z"], ["Y"], domain="com.microsoft")
    graph = helper.make_graph([node], "int8_probe", [helper.make_tensor_value_info("A", TensorProto.UINT8, ["M", k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])], inits)
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21),
                                                                   helper.make_opsetid("com.microsoft", 1)])
    session = ort.InferenceSession(model.SerializeToString(), session_options(OrtSessionOptions(threads=1)),
                                   providers=["CPUExecutionProvider"])
    exact = float((255 - 128) * 127 * k)
    return any(not (session.run(None, {"A": np.full((rows, k), 255, np.uint8)})[0] == exact).all()
               for rows in (1, 8))


def int8_weights_as_unsigned(model: onnx.ModelProto) -> int:
    """Rewrites, in place, each MatMulIntegerToFloat of `model` (an onnx ModelProto) whose weights are
    an int8 initializer to read them as uint8 (the same values + 128) with zero point 128: the same
    integer sums, bit for bit, through ONNX Runtime's u8 x u8 kernel, which is exact on every CPU
    (signed_int8_gemm_saturates). The conversion (Cast to int16, + 128, Cast to uint8) reads
    initializers only, so the session folds it into one uint8 initializer at load, which it then
    prepacks as it did the int8 one. Returns the number of nodes rewritten; engine files stay as built."""
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    int8 = {t.name for t in graph.initializer if t.data_type == TensorProto.INT8}
    # Only the form the exporter writes (ops._matmul_int8_translation): no weight zero point of its own.
    nodes = [n for n in graph.node if n.op_type == "MatMulIntegerToFloat" and n.domain == "com.microsoft"
             and len(n.input) > 1 and n.input[1] in int8 and (len(n.input) < 6 or not n.input[5])]
    if not nodes:
        return 0
    offset, zero = "int8_as_uint8_offset", "int8_as_uint8_zero_point"
    graph.initializer.extend([numpy_helper.from_array(np.array(128, np.int16), offset),
                              numpy_helper.from_array(np.array(128, np.uint8), zero)])
    conversions, converted = [], {}
    for node in nodes:
        weight = node.input[1]
        if weight not in converted:
            converted[weight] = f"{weight}_as_uint8"
            conversions += [helper.make_node("Cast", [weight], [f"{weight}_as_int16"], to=TensorProto.INT16),
                            helper.make_node("Add", [f"{weight}_as_int16", offset], [f"{weight}_as_int16_plus_128"]),
                            helper.make_node("Cast", [f"{weight}_as_int16_plus_128"], [converted[weight]],
                                             to=TensorProto.UINT8)]
        inputs = list(node.input) + [""] * (6 - len(node.input))  # a_zero_point is input 4, b_zero_point 5
        inputs[1], inputs[5] = converted[weight], zero
        del node.input[:]
        node.input.extend(inputs)
    rest = list(graph.node)  # the conversions first: an ONNX graph lists its nodes in topological order
    del graph.node[:]
    graph.node.extend(conversions + rest)
    return len(nodes)


def matmul_nbits_session(w: torch.Tensor, block_size: int, accuracy_level: int,
                         options: OrtSessionOptions | None = None):
    """A session of one MatMulNBits node, input "A" [M, K] -> "Y" [M, N], over w [N, K] quantized the
    way int4 engines hold it (quant.quantize_int4), with the engines' session options."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from medusa_trt.quant import quantize_int4

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
    return ort.InferenceSession(model.SerializeToString(), session_options(options or OrtSessionOptions(threads=1)),
                                providers=["CPUExecutionProvider"])


@functools.cache
def one_row_kernel_differs(block_size: int, accuracy_level: int) -> bool:
    """Whether this CPU's MatMulNBits (4-bit, `block_size`, `accuracy_level`) computes a lone row to
    other bits than the same row among others: ONNX Runtime's AVX2 build has a one-row kernel of its
    own for blocks of 32 and more, its AVX-512 build does not (docs/benchmarks/issue-13-int4.md (l)). Answered
    once per process by one small graph run on one row, then on that row among three."""
    g = torch.Generator().manual_seed(0)
    session = matmul_nbits_session(torch.randn(64, 4 * block_size, generator=g), block_size, accuracy_level)
    rows = torch.randn(3, 4 * block_size, generator=g).numpy()
    (one,) = session.run(None, {"A": rows[:1]})
    (three,) = session.run(None, {"A": rows})
    return not np.array_equal(one[0], three[0])
