"""The tree-attention kernel as a TensorRT plugin, compiled ahead of time.

`register_plugin()` registers "medusa::tree_attention" with TensorRT's Python plugin API
(`tensorrt.plugin`, TensorRT >= 10.9): a shape/dtype descriptor, an `aot_impl` that compiles the
Triton kernel to PTX for the building GPU and describes its launch with symbolic shapes, and an
`autotune` that offers the three float dtypes and one tactic per tile config in
`kernel.TUNING_CONFIGS`. TensorRT times the tactics and embeds the chosen kernel in the engine, so
running the engine needs no Python (nor Triton).

Plugin node (for the ONNX rewrite): op type PLUGIN_NAME, attributes from `onnx_node_attributes`:
`plugin_namespace` = PLUGIN_NAMESPACE, `aot` = 1 (use the AOT implementation), `scale` (float: the
softmax scale, 0.0 for 1/sqrt(D)) and `window` (int: the layer's sliding window, 0 for none; both
compiled into the kernel, and TensorRT's Python plugins accept no attribute defaults, so the node
must carry them). Inputs in order: q [B, Hq, T, D], k [B, Hkv, P+T, D], v [B, Hkv, P+T, D] (all one float dtype),
past_lens [B] int32, packed_mask [T, W] or [B, T, W] int32, positions [B, T] int32 (the new tokens'
positions, read only with a window); one output [B, Hq, T, D] in q's dtype.
D must be a build-time constant; B, T and P may be dynamic. Semantics: kernel.py's docstring.

Everything except `register_plugin` runs without TensorRT, so the compile step and the launch
arguments are tested on a CPU-only machine (triton compiles PTX for a named GPU without one).
"""

import math
import re
from dataclasses import dataclass

from medusa_trt.runtime.trt.tree_attention.kernel import TUNING_CONFIGS, TileConfig, head_block, jit_kernel

PLUGIN_NAMESPACE = "medusa"
PLUGIN_NAME = "tree_attention"
PLUGIN_VERSION = "1"  # tensorrt.plugin registers every Python plugin as version "1"
PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{PLUGIN_NAME}"
INPUT_NAMES = ("q", "k", "v", "past_lens", "packed_mask", "positions")
SCALE_ATTR = "scale"
WINDOW_ATTR = "window"

# Tactic t (1-based: TensorRT reserves 0 for "no custom tactic") runs TUNING_CONFIGS[t - 1].
TACTICS = tuple(range(1, len(TUNING_CONFIGS) + 1))
DEFAULT_TACTIC = 2  # 32 x 64 tiles: a fair choice for T <= 64 when TensorRT does not time tactics
# Used instead of a tactic whose kernel needs more shared memory than a launch may take (Triton
# stages K/V tiles there: float32 with D=128 and 64 x 128 tiles wants ~229 KB). At most 41 KB.
FALLBACK_CONFIG = TileConfig(16, 32, 4, 1)
# CUDA launches a kernel with at most 48 KB of dynamic shared memory unless the kernel was opted in
# to more (cudaFuncAttributeMaxDynamicSharedMemorySize). TensorRT's AOT launcher takes the bytes as
# a launch parameter and does not document whether it opts in, and no GPU run here has shown it; so
# a kernel stays within the portable 48 KB (float16 with D=128: tactic 1 only; D=64: tactics 1, 2
# and 4) until one does.
PORTABLE_SHARED_MEM = 48 * 1024

# Kernel parameters after the six input pointers and before the output pointer, in order (the
# AOT launch passes them as int32 expressions of the input shapes). sm_scale and WINDOW are compiled in.
INT_ARG_NAMES = (
    "n_tree", "past_cap", "group",
    "stride_qb", "stride_qh", "stride_qt",
    "stride_kb", "stride_kh", "stride_ks",
    "stride_vb", "stride_vh", "stride_vs",
    "stride_mb", "stride_mt",
    "stride_ob", "stride_oh", "stride_ot",
)  # fmt: skip
_POINTER_NAMES = ("Q", "K", "V", "PastLens", "Mask", "Positions", "Out")
_TRITON_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def onnx_node_attributes(scale: float | None = None, window: int | None = None) -> dict:
    """Attributes for an ONNX node of op type PLUGIN_NAME that TensorRT's ONNX parser maps to this
    plugin's AOT implementation; scale None means 1/sqrt(D), window None no sliding window."""
    return {
        "plugin_namespace": PLUGIN_NAMESPACE,
        "aot": True,
        SCALE_ATTR: 0.0 if scale is None else float(scale),
        WINDOW_ATTR: int(window or 0),
    }


@dataclass(frozen=True)
class CompiledKernel:
    name: str  # the PTX entry point
    ptx: str
    num_warps: int
    shared_mem: int  # bytes of dynamic shared memory to launch with


def int_args(q_dims, k_dims, mask_dims) -> list:
    """The kernel's int arguments for contiguous q/k/v/mask/out of these dims.

    Dims may be ints or TensorRT shape expressions: only `*`, `//` and `-` with the dim on the left
    are used, which both support, so the CPU tests check the very list the plugin hands TensorRT.
    """
    _, n_heads, n_tree, head_dim = q_dims
    _, n_kv_heads, seq, _ = k_dims
    words = mask_dims[-1]
    return [
        n_tree, seq - n_tree, n_heads // n_kv_heads,
        n_heads * n_tree * head_dim, n_tree * head_dim, head_dim,
        n_kv_heads * seq * head_dim, seq * head_dim, head_dim,
        n_kv_heads * seq * head_dim, seq * head_dim, head_dim,
        (n_tree * words) if len(mask_dims) == 3 else 0, words,
        n_heads * n_tree * head_dim, n_tree * head_dim, head_dim,
    ]  # fmt: skip


def launch_grid(q_dims, k_dims, block_m: int) -> tuple:
    """(row tiles, kv heads, batch), as in kernel.triton_tree_attention; ints or shape expressions."""
    batch, n_heads, n_tree, _ = q_dims
    n_kv_heads = k_dims[1]
    rows = (n_heads // n_kv_heads) * n_tree
    return (rows + (block_m - 1)) // block_m, n_kv_heads, batch


def compile_kernel(
    dtype: str, head_dim: int, scale: float | None, config: TileConfig, target_sm: int, window: int = 0
) -> CompiledKernel:
    """Compiles the kernel to PTX for sm_<target_sm> (no GPU needed), with `scale` and `window` baked in.

    dtype is "float32", "float16" or "bfloat16"; scale None or <= 0 means 1/sqrt(head_dim); window 0
    means no sliding window.
    """
    if dtype not in _TRITON_DTYPES:
        raise ValueError(f"dtype {dtype!r}, expected one of {sorted(_TRITON_DTYPES)}")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = jit_kernel()
    ty = _TRITON_DTYPES[dtype]
    signature = {name: "i32" for name in INT_ARG_NAMES}
    signature.update({p: f"*{ty}" for p in ("Q", "K", "V", "Out")})
    signature.update(PastLens="*i32", Mask="*i32", Positions="*i32")
    constants = {
        "sm_scale": 1.0 / math.sqrt(head_dim) if scale is None or scale <= 0 else float(scale),
        "HEAD_DIM": head_dim,
        "BLOCK_D": head_block(head_dim),
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        "UPCAST": False,
        "DOT_PRECISION": "ieee" if dtype == "float32" else "tf32",  # as kernel.dot_precision
        "WINDOW": int(window),
    }
    signature.update(dict.fromkeys(constants, "constexpr"))
    signature = {name: signature[name] for name in fn.arg_names}  # kernel parameter order

    # Divisibility hints let triton vectorize loads: TensorRT buffers are 256-byte aligned, and
    # strides that are multiples of D are multiples of 16 when D is.
    hinted = set(_POINTER_NAMES)
    if head_dim % 16 == 0:
        hinted |= {n for n in INT_ARG_NAMES if n.startswith(("stride_q", "stride_k", "stride_v", "stride_o"))}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in hinted}

    target = GPUTarget("cuda", int(target_sm), 32)
    # fp fusion stated explicitly: it is triton's current default, and 3.9 warns when it is left unset.
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages, "enable_fp_fusion": True}
    compiled = triton.compile(
        ASTSource(fn, signature, constexprs=constants, attrs=attrs), target=target, options=options
    )
    meta = compiled.metadata
    if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
        raise RuntimeError(
            f"{meta.name} needs Triton scratch memory, which a TensorRT AOT launch cannot provide"
        )
    return CompiledKernel(
        name=meta.name,
        ptx=_drop_unused_trailing_params(
            compiled.asm["ptx"], meta.name, len(INT_ARG_NAMES) + len(_POINTER_NAMES)
        ),
        num_warps=meta.num_warps,
        shared_mem=meta.shared,
    )


def launch_kernel(dtype: str, head_dim: int, sm_scale: float | None, config: TileConfig, sm: int, window: int,
                  device_limit: int | None = None) -> tuple[TileConfig, CompiledKernel]:
    """The tactic's kernel, or FALLBACK_CONFIG's when it needs more dynamic shared memory than a launch
    may take: PORTABLE_SHARED_MEM, or the device's opt-in limit where that is lower (e.g. float16
    with D=128 and 32 x 64 tiles, 52 KB)."""
    kernel = compile_kernel(dtype, head_dim, sm_scale, config, sm, window)
    if kernel.shared_mem > min(PORTABLE_SHARED_MEM, device_limit or PORTABLE_SHARED_MEM):
        config = FALLBACK_CONFIG
        kernel = compile_kernel(dtype, head_dim, sm_scale, config, sm, window)
    return config, kernel


def _drop_unused_trailing_params(ptx: str, entry: str, n_args: int) -> str:
    """Removes parameters triton appends after the kernel's own (scratch-buffer pointers, Triton >=
    3.3) when the body never reads them.

    TensorRT launches an AOT kernel with exactly inputs + int args + outputs; a PTX entry that
    declares more parameters would make the driver read kernel-argument slots TensorRT never filled.
    """
    start = ptx.index(f".entry {entry}(")
    open_paren = ptx.index("(", start)
    close_paren = ptx.index(")", open_paren)
    params = [p.strip() for p in ptx[open_paren + 1 : close_paren].split(",") if p.strip()]
    if len(params) <= n_args:
        return ptx
    extra = params[n_args:]
    body = ptx[close_paren:]
    for decl in extra:
        name = decl.split()[-1]
        if re.search(rf"\b{re.escape(name)}\b", body):
            raise RuntimeError(
                f"PTX entry {entry}: trailing parameter {name} is used; cannot launch it from TensorRT"
            )
    kept = ",\n\t".join(params[:n_args])
    return ptx[: open_paren + 1] + "\n\t" + kept + "\n" + ptx[close_paren:]


_REGISTERED: dict[str, str] = {}


def register_plugin(target_sm: int | None = None) -> str:
    """Registers "medusa::tree_attention" with TensorRT (idempotent); returns the plugin id.

    target_sm: the GPU architecture to compile for as major*10+minor (default: the current CUDA
    device's, which is the GPU TensorRT builds for).
    """
    if PLUGIN_ID in _REGISTERED:
        return PLUGIN_ID
    try:
        import tensorrt as trt
        import tensorrt.plugin as trtp
    except ImportError as err:
        raise ImportError(
            "the tree-attention TensorRT plugin needs TensorRT >= 10.9: pip install medusa-trt[tensorrt]"
        ) from err
    if not hasattr(trtp, "aot_impl"):
        raise ImportError(
            f"TensorRT {trt.__version__} has no tensorrt.plugin.aot_impl; the tree-attention plugin needs "
            "TensorRT >= 10.9: pip install -U medusa-trt[tensorrt]"
        )
    try:
        import triton  # noqa: F401  (needed to compile the kernel while TensorRT builds)
    except ImportError as err:
        raise ImportError(
            "the tree-attention TensorRT plugin compiles its kernel with triton: pip install triton"
        ) from err

    trt_dtypes = {trt.float32: "float32", trt.float16: "float16", trt.bfloat16: "bfloat16"}

    @trtp.register(PLUGIN_ID)
    def tree_attention_desc(
        q: trtp.TensorDesc,
        k: trtp.TensorDesc,
        v: trtp.TensorDesc,
        past_lens: trtp.TensorDesc,
        packed_mask: trtp.TensorDesc,
        positions: trtp.TensorDesc,
        scale: float,
        window: int,
    ) -> trtp.TensorDesc:
        return q.like()

    @trtp.autotune(PLUGIN_ID)
    def tree_attention_autotune(q, k, v, past_lens, packed_mask, positions, outputs
                                ) -> list[trtp.AutoTuneCombination]:
        floats = "FP32|FP16|BF16"
        return [
            trtp.AutoTuneCombination(
                f"{floats}, {floats}, {floats}, INT32, INT32, INT32, {floats}", "LINEAR", TACTICS
            )
        ]

    @trtp.aot_impl(PLUGIN_ID)
    def tree_attention_aot(
        q, k, v, past_lens, packed_mask, positions, scale: float, window: int, outputs, tactic: int
    ) -> tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymIntExprs]:
        if q.dtype not in trt_dtypes:
            raise ValueError(f"{PLUGIN_ID}: q dtype {q.dtype}, expected float32, float16 or bfloat16")
        head_dim_expr = q.shape_expr[3]
        if not head_dim_expr.is_constant:
            raise ValueError(f"{PLUGIN_ID}: the head size (q dim 3) must be a build-time constant")
        head_dim = head_dim_expr.constant_value()
        config = TUNING_CONFIGS[(tactic if tactic in TACTICS else DEFAULT_TACTIC) - 1]
        sm = target_sm if target_sm is not None else _current_sm()
        config, kernel = launch_kernel(trt_dtypes[q.dtype], head_dim, scale, config, sm, window,
                                       _shared_mem_limit() if target_sm is None else None)

        q_dims, k_dims, mask_dims = q.shape_expr, k.shape_expr, packed_mask.shape_expr
        params = trtp.KernelLaunchParams()
        params.grid_x, params.grid_y, params.grid_z = launch_grid(q_dims, k_dims, config.block_m)
        params.block_x = kernel.num_warps * 32
        params.shared_mem = kernel.shared_mem
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in int_args(q_dims, k_dims, mask_dims)])
        return kernel.name, kernel.ptx, params, extra

    _REGISTERED[PLUGIN_ID] = PLUGIN_ID
    return PLUGIN_ID


def _shared_mem_limit() -> int | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return getattr(
        torch.cuda.get_device_properties(torch.cuda.current_device()), "shared_memory_per_block_optin", None
    )


def _current_sm() -> int:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(f"{PLUGIN_ID}: no CUDA device to compile for; pass register_plugin(target_sm=...)")
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor
