"""medusa-build --backend tensorrt: the exported ONNX graphs built into TensorRT engines (options: TrtOptions).

Steps: export the decoder and heads graphs (`engines/onnx/export.py`, attention form "attention23"), replace
the attention nodes by tree-attention plugin nodes (`rewrite.py`), register the plugin with
TensorRT's Python plugin API, parse the rewritten graph from its file (so external weight files
resolve), and build a strongly typed network with one optimization profile:

    rank0.engine   the decoder: same inputs and outputs as the ONNX Runtime engine's model.onnx
    heads.engine   the Medusa heads graph: hidden [N, d] -> medusa_logits [H, N, V]
    drafter.engine in place of heads.engine, a drafter with a cache of its own (Amphista): the
                   drafter graph of the ONNX Runtime engine (model_drafter.onnx), with the
                   decoder's `hidden` holding every new row (a prefill hands the drafter every
                   prompt row); its attention over its own 2-layer cache is plain ops (MatMul,
                   Softmax, Where), parsed as exported in both attention modes

Why the heads get an engine of their own rather than staying in ONNX Runtime: their lm_heads are
H x V x d weights (5 x 32000 x 4096 for a 7B model), which on the CPU would cost more per step than
the whole decoder on the GPU, and running them in onnxruntime-gpu would add a second GPU runtime
(and its CUDA libraries) to the engine for two matmuls per head. A second small TensorRT engine
keeps the hidden state on the device and the runtime to one library. They stay a separate graph
(not outputs of rank0.engine) for the reason the ONNX Runtime engine separates them: a step needs
them at one row per sequence, known only after verification.

Strongly typed network: every tensor keeps the type the ONNX graph gives it, so FP8 checkpoints'
explicit QuantizeLinear/DequantizeLinear pairs (float8e4m3fn) run as written, and float16/bfloat16
graphs are not re-typed by TensorRT's precision heuristics. A float32 engine also turns TF32 off:
float32 engines are for verification against the reference, where TF32's 10-bit mantissa would
dominate the error.

`--trt-attention native` skips the rewrite: TensorRT's own attention (the ONNX Attention op of the
export, with its dense mask) instead of the plugin, for comparison. Parsers that predate the ONNX
Attention op can build it from plain ops with `--attention split`.

Optimization profile (one, so the runtime never switches profiles): each dynamic dimension gets
min 1, opt the decoding hot path (a full Medusa tree of max_draft_len + 1 tokens, the largest
batch), max the engine's limits (a prompt of max_seq_len tokens in one prefill). The past length
allows max_seq_len + max_draft_len + 1: the runtime binds its whole cache, whose capacity is the
prompt, the new tokens and one tree of slack.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from medusa_trt.engine_dir import DTYPES
from medusa_trt.engines.options import (
    BackendOptions,
    BuildError,
    BuildOptions,
    Limits,
    backend_options,
    limits_for,
    progress_bar,
)
from medusa_trt.runtime.trt.versions import EXTRA_HINT, tensorrt_version_problem

log = logging.getLogger(__name__)

ENGINE_FILE = "rank0.engine"
HEADS_ENGINE_FILE = "heads.engine"
DRAFTER_ENGINE_FILE = "drafter.engine"
ONNX_DIR = "onnx"
ATTENTION_MODES = ("plugin", "native")
DEFAULT_ATTENTION_MODE = "plugin"


@dataclass(frozen=True)
class TrtOptions(BackendOptions):
    """medusa-build's TensorRT options (the flags marked "--backend tensorrt" in its --help)."""

    backend: ClassVar[str] = "tensorrt"

    trt_attention: str | None = None  # --trt-attention: ATTENTION_MODES; None: DEFAULT_ATTENTION_MODE
    keep_onnx: bool = False  # --keep-onnx: keep the exported (and rewritten) graphs in <out>/onnx

    @property
    def mode(self) -> str:
        return self.trt_attention or DEFAULT_ATTENTION_MODE

    def check(self) -> None:
        """Raises BuildError for a value the builder cannot use, naming its flag."""
        if self.mode not in ATTENTION_MODES:
            raise BuildError(f"--trt-attention {self.mode!r}: expected one of {', '.join(ATTENTION_MODES)}")


Shape = tuple[int, ...]
Profile = dict[str, tuple[Shape, Shape, Shape]]  # input name -> (min, opt, max)


def _min_opt_max(*spec: tuple[int, int, int]) -> tuple[Shape, Shape, Shape]:
    """One input's profile from its dimensions' (min, opt, max) triples: (min shape, opt shape, max shape)."""
    return tuple(tuple(d[i] for d in spec) for i in range(3))  # type: ignore[return-value]


def decoder_profile(limits: Limits, num_layers: int, num_kv_heads: int, head_dim: int) -> Profile:
    """Optimization-profile shapes of every decoder input (names from engine_dir)."""
    from medusa_trt.engine_dir import past_names

    b, tree, seq = limits.max_batch_size, limits.tree, limits.max_seq_len
    batch, new = (1, b, b), (1, min(tree, seq), seq)
    profile: Profile = {
        "input_ids": _min_opt_max(batch, new),
        "position_ids": _min_opt_max(batch, new),
        "past_lengths": _min_opt_max(batch),
        "new_mask": _min_opt_max(batch, new, new),
        "logit_positions": _min_opt_max(batch, new),
    }
    # opt: half the context, a typical cache capacity; max: a whole context plus one tree.
    past = (1, max(1, seq // 2), limits.max_past)
    for name in past_names(num_layers):
        profile[name] = _min_opt_max(batch, (num_kv_heads,) * 3, past, (head_dim,) * 3)
    return profile


def drafter_profile(limits: Limits, num_kv_heads: int, head_dim: int, hidden_size: int) -> Profile:
    """The drafter graph's inputs (engine_dir.DRAFTER_INPUT_NAMES, then its 2 layers' cache). A step
    appends at most a tree's depth + 1 committed rows (opt: a whole tree's width, which bounds it); a
    prefill every prompt row (max: a whole context). The runtime binds the drafter cache whole, as the
    decoder's (its capacity), and the graph masks past each sequence's committed rows."""
    from medusa_trt.engine_dir import DRAFTER_INPUT_NAMES, past_names

    b, seq = limits.max_batch_size, limits.max_seq_len
    batch, new = (1, b, b), (1, min(limits.tree, seq), seq)
    past = (1, max(1, seq // 2), limits.max_past)
    dims = dict(zip(DRAFTER_INPUT_NAMES, ((batch, new, (hidden_size,) * 3), (batch, new), (batch, new), (batch,),
                                          (batch, new, new), (batch,)), strict=True))
    dims.update({name: (batch, (num_kv_heads,) * 3, past, (head_dim,) * 3) for name in past_names(2)})
    return {name: _min_opt_max(*spec) for name, spec in dims.items()}


def heads_profile(limits: Limits, hidden_size: int) -> Profile:
    """The heads engine runs one row per sequence in a decoding step; the runtime splits larger
    requests (every row of a prefill) into chunks of the max."""
    from medusa_trt.engine_dir import HEADS_INPUT

    b = limits.max_batch_size
    rows = b * limits.tree
    return {HEADS_INPUT: ((1, hidden_size), (b, hidden_size), (rows, hidden_size))}


# -- TensorRT ------------------------------------------------------------------------------------


def require_tensorrt():
    """The tensorrt module, or a BuildError naming the extra to install."""
    try:
        import tensorrt as trt
    except ImportError as e:
        raise BuildError(f"--backend tensorrt needs TensorRT, which is not importable here ({e}): "
                         f"{EXTRA_HINT} on a machine with an NVIDIA GPU") from None
    check_tensorrt_version(trt.__version__)
    return trt


def check_tensorrt_version(version: str) -> None:
    problem = tensorrt_version_problem(version)
    if problem:
        raise BuildError(problem)


def create_network(trt, builder):
    """An empty strongly typed network: every tensor keeps the type the ONNX graph gives it. TensorRT
    10.x makes one on request (the STRONGLY_TYPED creation flag); 11.x makes no other kind and has
    deprecated the flag, so it gets none."""
    major = int(trt.__version__.split(".")[0])
    if major >= 11:
        return builder.create_network()
    return builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))


def require_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        raise BuildError(f"--backend tensorrt builds for the GPU it runs on, and torch {torch.__version__} sees "
                         f"no CUDA device here; run medusa-build on a machine with an NVIDIA GPU ({EXTRA_HINT})")


def _logger(trt):
    return trt.Logger(trt.Logger.WARNING)


def build_serialized(trt, onnx_path: Path, profile: Profile, *, tf32: bool):
    """Parses `onnx_path` (from its file, so external data resolves) into a strongly typed network
    and builds it with one optimization profile; returns the serialized engine (IHostMemory)."""
    logger = _logger(trt)
    builder = trt.Builder(logger)
    network = create_network(trt, builder)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise BuildError(f"{onnx_path}: TensorRT {trt.__version__} cannot parse it: {errors}")
    names = {network.get_input(i).name for i in range(network.num_inputs)}
    if names != set(profile):
        raise BuildError(f"{onnx_path}: network inputs {sorted(names)} differ from the profile's {sorted(profile)}")
    config = builder.create_builder_config()
    if not tf32:
        config.clear_flag(trt.BuilderFlag.TF32)
    opt_profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in profile.items():
        opt_profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(opt_profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise BuildError(f"{onnx_path}: TensorRT {trt.__version__} failed to build an engine (its log above says why)")
    return serialized


def check_attention_options(opts: BuildOptions) -> str:
    """The attention mode, after checking it against the common options (--attention, --opset)."""
    trt = backend_options(opts, TrtOptions)
    trt.check()
    mode = trt.mode
    if mode == "plugin" and opts.attention not in (None, "attention23"):
        raise BuildError(f"--attention {opts.attention} with --trt-attention plugin: the plugin replaces the "
                         "attention23 form's Attention nodes; drop --attention or use --trt-attention native")
    if opts.opset is not None and opts.opset < 23 and mode == "plugin":
        raise BuildError(f"--opset {opts.opset}: the tree-attention plugin rewrite needs the opset-23 Attention "
                         "form (--opset 23)")
    return mode


def resolve_trt_dtype(opts: BuildOptions, config: dict) -> str:
    dtype = opts.dtype or config["dtype"]
    if dtype not in DTYPES:
        raise BuildError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    return dtype


@dataclass(frozen=True)
class TrtOnnx:
    """The ONNX graphs a TensorRT build parses, and what the engine.json part says about them."""

    decoder: Path  # the graph rank0.engine is built from (rewritten for the plugin, or as exported)
    heads: Path | None
    drafter: Path | None  # a drafter with a cache of its own (Amphista): its graph, in place of heads
    exported: object  # onnx.export.ExportResult
    plugin_nodes: int  # 0 with --trt-attention native
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int


def export_for_tensorrt(opts: BuildOptions, mode: str, dtype: str, onnx_dir: Path) -> TrtOnnx:
    """Exports the checkpoint's decoder and heads graphs into `onnx_dir` and, for the plugin, rewrites
    the decoder's attention nodes (rewrite.py). Needs no TensorRT: runs on any machine."""
    from medusa_trt.engines.onnx.export import DEFAULT_OPSET, export_onnx
    from medusa_trt.modeling import MedusaModel

    model = MedusaModel.from_checkpoint(opts.checkpoint, dtype=dtype)
    cfg = model.cfg
    try:
        # A drafter with a cache reads every prompt row of a prefill that computes the last row's
        # logits only, as on the ONNX Runtime engine (engine.json hidden_all_rows).
        exported = export_onnx(model, onnx_dir / "model.onnx", attention=opts.attention or "attention23",
                               opset=opts.opset or DEFAULT_OPSET, committed_prefix=False,
                               hidden_all_rows=model.drafter.has_cache)
    except ValueError as e:
        raise BuildError(str(e)) from None
    del model
    decoder, plugin_nodes = exported.path, 0
    if mode == "plugin":
        from medusa_trt.engines.trt.rewrite import RewriteError, rewrite_onnx_file

        try:
            rewritten = rewrite_onnx_file(exported.path, windows=cfg.windows)
        except RewriteError as e:
            raise BuildError(f"{exported.path}: {e}") from None
        decoder, plugin_nodes = rewritten.path, len(rewritten.plugin_nodes)
    return TrtOnnx(decoder, exported.heads_path, exported.drafter_path, exported, plugin_nodes, cfg.num_layers,
                   cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size)


def build_tensorrt(opts: BuildOptions, config: dict, workdir: Path) -> dict:
    """The BUILDERS entry for --backend tensorrt (see the module docstring)."""
    mode = check_attention_options(opts)
    dtype = resolve_trt_dtype(opts, config)
    limits = limits_for(opts, config)
    trt = require_tensorrt()
    require_gpu()
    if mode == "plugin":
        try:
            import onnx_graphsurgeon  # noqa: F401
        except ImportError:
            raise BuildError(f"--backend tensorrt rewrites the ONNX graph with onnx-graphsurgeon, which is not "
                             f"installed: {EXTRA_HINT}") from None

    import torch

    opts.device = "cuda"  # engine.json's device: TensorRT engines run on the GPU only
    steps = ["export ONNX", "register plugin", "build decoder", "build drafter"]
    bar = progress_bar(len(steps), opts.progress, "medusa-build")
    onnx_dir = workdir / ONNX_DIR
    keep_onnx = backend_options(opts, TrtOptions).keep_onnx
    try:
        bar.set_postfix_str(steps[0])
        graphs = export_for_tensorrt(opts, mode, dtype, onnx_dir)
        bar.update()
        bar.set_postfix_str(steps[1])
        plugin_info = None
        if mode == "plugin":
            from medusa_trt.runtime.trt.tree_attention.plugin import (
                PLUGIN_ID,
                PLUGIN_VERSION,
                register_plugin,
            )

            try:
                register_plugin()
            except (ImportError, RuntimeError) as e:
                raise BuildError(str(e)) from None
            plugin_info = {"id": PLUGIN_ID, "version": PLUGIN_VERSION, "aot": True, "nodes": graphs.plugin_nodes,
                           "packed_mask": "computed in the graph from new_mask (engines/trt/rewrite.py)"}
        bar.update()
        bar.set_postfix_str(steps[2])
        tf32 = dtype != "float32"
        profile = decoder_profile(limits, graphs.num_layers, graphs.num_kv_heads, graphs.head_dim)
        (workdir / ENGINE_FILE).write_bytes(build_serialized(trt, graphs.decoder, profile, tf32=tf32))
        bar.update()
        bar.set_postfix_str(steps[3])
        heads = drafter = None
        if graphs.drafter is not None:
            drafter = drafter_profile(limits, graphs.num_kv_heads, graphs.head_dim, graphs.hidden_size)
            (workdir / DRAFTER_ENGINE_FILE).write_bytes(build_serialized(trt, graphs.drafter, drafter, tf32=tf32))
        elif graphs.heads is not None:
            heads = heads_profile(limits, graphs.hidden_size)
            (workdir / HEADS_ENGINE_FILE).write_bytes(build_serialized(trt, graphs.heads, heads, tf32=tf32))
        bar.update()
        onnx_files = sorted(p.name for p in onnx_dir.glob("*")) if keep_onnx else []
    finally:
        bar.close()
        if not keep_onnx:
            shutil.rmtree(onnx_dir, ignore_errors=True)

    exported = graphs.exported
    major, minor = torch.cuda.get_device_capability()
    part = {
        "dtype": dtype,
        "tensorrt": {
            "engine": ENGINE_FILE,
            "heads_engine": HEADS_ENGINE_FILE if heads is not None else None,
            # A drafter with a cache of its own: its engine in place of the heads', and the decoder's
            # hidden output holds every new row (runtime/trt/backend.py reads both).
            **({"drafter": (config.get("medusa_trt") or {}).get("drafter"), "drafter_engine": DRAFTER_ENGINE_FILE,
                "hidden_all_rows": True} if drafter is not None else {}),
            "attention": mode,
            "onnx_attention_form": exported.attention,
            "plugin": plugin_info,
            "strongly_typed": True,
            "tf32": tf32,
            "version": trt.__version__,
            "compute_capability": f"{major}.{minor}",
            "inputs": list(exported.input_names),
            "outputs": list(exported.output_names),
            "profiles": {"decoder": _json_profile(profile), "heads": _json_profile(heads) if heads else None,
                         **({"drafter": _json_profile(drafter)} if drafter else {})},
            "onnx": {"opset": exported.opset, "external_data": exported.external_data, "kept": keep_onnx,
                     "files": [f"{ONNX_DIR}/{name}" for name in onnx_files]},
        },
    }
    quant = config.get("quantization") or {}
    if quant.get("quant_algo") or quant.get("kv_cache_quant_algo"):
        part["quantization"] = {
            "quant_algo": quant.get("quant_algo"), "kv_cache_quant_algo": quant.get("kv_cache_quant_algo"),
            "exclude_modules": quant.get("exclude_modules"),
            "tensorrt": "explicit per-tensor float8e4m3fn QuantizeLinear/DequantizeLinear from the ONNX export, "
                        "built as written in a strongly typed network",
        }
    return part


def _json_profile(profile: Profile) -> dict:
    return {name: {"min": list(lo), "opt": list(opt), "max": list(hi)} for name, (lo, opt, hi) in profile.items()}
