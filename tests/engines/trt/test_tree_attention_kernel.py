"""Tree attention: the Triton kernel against the PyTorch reference, the reference against SDPA, and the
TensorRT plugin's launch description.

Without a GPU the kernel runs in triton's interpreter. Triton fixes compile-vs-interpret once, when
it is first imported, from TRITON_INTERPRET, so this module sets the variable before importing
triton (only on a machine without CUDA). If triton was already imported in compiled
mode by an earlier test module, the kernel tests here skip and `test_kernel_in_fresh_process` runs
them in a new interpreter instead. With a GPU, the same tests run the compiled kernel on CUDA.
"""

import importlib.util
import math
import os
import random
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HAVE_TRITON = importlib.util.find_spec("triton") is not None

if HAVE_TRITON and DEVICE == "cpu" and "triton" not in sys.modules:
    # Left set: the interpreter also consults it while running (modules it imports lazily check it).
    os.environ["TRITON_INTERPRET"] = "1"
    import triton  # noqa: F401  (first import: fixes interpreter mode for this process)

from medusa_trt.runtime.trt.tree_attention import kernel, plugin  # noqa: E402
from medusa_trt.runtime.trt.tree_attention.kernel import (  # noqa: E402
    dense_mask_from_packed,
    reference_tree_attention,
    tree_attention,
    triton_tree_attention,
)

KERNEL_RUNS_HERE = HAVE_TRITON and (
    kernel.interpreter_active() if DEVICE == "cpu" else not kernel.interpreter_active()
)
needs_kernel = pytest.mark.skipif(
    not KERNEL_RUNS_HERE,
    reason="triton missing, or imported earlier in the wrong mode (test_kernel_in_fresh_process covers it)",
)

# Tolerances, kernel vs reference. Both read the same rounded inputs and accumulate in float32, so
# before the final cast they differ only by summation order (~1e-6 relative). The cast to a 16-bit
# output can then flip one rounding step (one ulp: 2**-10 relative for float16, 2**-7 for bfloat16),
# and on a GPU the kernel also rounds the probabilities to the value dtype before the P @ V product
# (flash-attention practice), worth about one more ulp. Hence two ulps relative, with the same
# absolute floor for outputs near zero. float32: 1e-5, the summation-order noise with margin.
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


# ---------------------------------------------------------------------------------------------
# Trees and packed masks, built here from ancestor relations (independent of medusa_trt.tree)
# ---------------------------------------------------------------------------------------------


def random_tree(n_tree: int, rng: random.Random, max_depth: int = 4, max_rank: int = 4) -> list[tuple]:
    """A prefix-closed set of n_tree paths (the root is ()), sorted by (depth, path) = slot order."""
    paths = {()}
    while len(paths) < n_tree:
        parent = rng.choice(sorted(paths))
        rank = sum(1 for p in paths if len(p) == len(parent) + 1 and p[:-1] == parent)
        if len(parent) < max_depth and rank < max_rank:
            paths.add(parent + (rank,))
    return sorted(paths, key=lambda p: (len(p), p))


def ancestor_mask(paths: list[tuple]) -> torch.Tensor:
    """[T, T] bool: slot i may attend slot j iff path j is a prefix of path i (root, ancestors, self)."""
    return torch.tensor([[pi[: len(pj)] == pj for pj in paths] for pi in paths])


def pack(allowed: torch.Tensor, words: int | None = None) -> torch.Tensor:
    """[T, T] bool -> [T, W] int32: bit j % 32 of word j // 32 of row i set when allowed[i, j]."""
    n_tree = allowed.shape[0]
    words = words or (n_tree + 31) // 32
    out = []
    for row in allowed.tolist():
        packed = [0] * words
        for j, ok in enumerate(row):
            if ok:
                packed[j // 32] |= 1 << (j % 32)
        out.append([w - (1 << 32) if w >= 1 << 31 else w for w in packed])  # as signed int32
    return torch.tensor(out, dtype=torch.int32)


def make_inputs(batch, n_heads, n_kv_heads, head_dim, n_tree, past_cap, dtype, per_batch, seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    seq = past_cap + n_tree
    q = torch.randn(batch, n_heads, n_tree, head_dim, generator=gen)
    k = torch.randn(batch, n_kv_heads, seq, head_dim, generator=gen)
    v = torch.randn(batch, n_kv_heads, seq, head_dim, generator=gen)
    lens = [rng.randint(0, past_cap) for _ in range(batch)]
    if past_cap:
        lens[0] = rng.randint(0, past_cap - 1)  # at least one sequence with holes
    for b, n in enumerate(lens):  # holes hold garbage that must never be read
        k[b, :, n:past_cap] = float("nan")
        v[b, :, n:past_cap] = float("nan")
    if per_batch:
        mask = torch.stack([pack(ancestor_mask(random_tree(n_tree, rng))) for _ in range(batch)])
    else:
        mask = pack(ancestor_mask(random_tree(n_tree, rng)))
    past_lens = torch.tensor(lens, dtype=torch.int32)
    return [t.to(DEVICE) for t in (q.to(dtype), k.to(dtype), v.to(dtype), past_lens, mask)]


def tree_positions(past_lens: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """[B, T] int32: each slot's position, its sequence's past length + its depth (the ancestors it
    sees, itself excluded) under a [T, T] or [B, T, T] ancestor mask."""
    depth = allowed.long().sum(-1) - 1
    return (past_lens.long()[:, None] + depth.expand(len(past_lens), -1)).to(torch.int32)


def assert_matches_reference(q, k, v, past_lens, mask, scale=None, positions=None, window=0):
    out = triton_tree_attention(q, k, v, past_lens, mask, scale, positions, window)
    ref = reference_tree_attention(q, k, v, past_lens, mask, scale, positions, window)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCES[q.dtype])


# ---------------------------------------------------------------------------------------------
# Kernel vs reference
# ---------------------------------------------------------------------------------------------

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# Sparse cover of B {1,3} x heads {4/4, 8/2} x D {16,32,64} x T {1,5,33,64} x P {0,7,40} x dtypes x
# shared/per-sequence masks; every value of every axis appears at least once.
KERNEL_CASES = [
    # B, Hq, Hkv, D, T, P, dtype, per-sequence mask
    (1, 4, 4, 16, 1, 0, F32, False),
    (3, 8, 2, 32, 5, 7, F32, True),
    (3, 4, 4, 64, 33, 40, F32, False),
    (1, 8, 2, 16, 64, 40, F32, True),
    (3, 8, 2, 64, 64, 7, F16, False),
    (3, 4, 4, 32, 1, 7, F16, True),
    (1, 4, 4, 32, 33, 0, BF16, True),
    (3, 8, 2, 16, 5, 40, BF16, False),
]


@needs_kernel
@pytest.mark.parametrize("batch,n_heads,n_kv_heads,head_dim,n_tree,past_cap,dtype,per_batch", KERNEL_CASES)
def test_kernel_matches_reference(batch, n_heads, n_kv_heads, head_dim, n_tree, past_cap, dtype, per_batch):
    inputs = make_inputs(
        batch, n_heads, n_kv_heads, head_dim, n_tree, past_cap, dtype, per_batch, seed=n_tree
    )
    assert_matches_reference(*inputs)


@needs_kernel
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_kernel_causal_prefill(dtype):
    # A prompt chunk after a cached prefix: lower-triangular mask over 33 new tokens (two words).
    q, k, v, past_lens, _ = make_inputs(3, 8, 2, 32, 33, 7, dtype, False, seed=5)
    causal = pack(torch.ones(33, 33, dtype=torch.bool).tril()).to(DEVICE)
    assert_matches_reference(q, k, v, past_lens, causal, scale=0.3)


# B, Hq, Hkv, D, T, P, dtype, per-sequence mask, window: windows that cut inside a key block, skip
# whole past blocks (P = 40, 32-key blocks under the interpreter), see only the key itself (1), and
# reach past every key (no effect).
WINDOW_CASES = [
    (3, 8, 2, 32, 9, 40, F32, True, 5),
    (3, 4, 4, 16, 33, 40, F32, False, 12),
    (1, 8, 2, 64, 5, 7, F16, False, 1),
    (3, 8, 2, 16, 17, 40, BF16, True, 64),
]


@needs_kernel
@pytest.mark.parametrize("batch,n_heads,n_kv_heads,head_dim,n_tree,past_cap,dtype,per_batch,window", WINDOW_CASES)
def test_kernel_sliding_window_matches_reference(batch, n_heads, n_kv_heads, head_dim, n_tree, past_cap, dtype,
                                                 per_batch, window):
    q, k, v, past_lens, mask = make_inputs(batch, n_heads, n_kv_heads, head_dim, n_tree, past_cap, dtype,
                                           per_batch, seed=window)
    positions = tree_positions(past_lens.cpu(), dense_mask_from_packed(mask.cpu(), n_tree)).to(DEVICE)
    assert_matches_reference(q, k, v, past_lens, mask, positions=positions, window=window)


@needs_kernel
def test_kernel_views_extra_words_and_empty_rows():
    batch, n_heads, n_kv_heads, head_dim, n_tree, past_cap = 2, 4, 2, 32, 33, 7
    q, k, v, _, _ = make_inputs(batch, n_heads, n_kv_heads, head_dim, n_tree, past_cap, F32, False, seed=9)
    past_lens = torch.tensor([past_cap, 0], dtype=torch.int32, device=DEVICE)  # full past; no past
    k, v = k.nan_to_num(), v.nan_to_num()
    k[1, :, :past_cap] = v[1, :, :past_cap] = float("nan")
    # q as the transpose of a [B, T, H, D] projection; k/v as the front of a longer cache buffer.
    q_view = q.transpose(1, 2).contiguous().transpose(1, 2)
    cache_k = torch.full((batch, n_kv_heads, past_cap + n_tree + 16, head_dim), float("nan"), device=DEVICE)
    cache_v = cache_k.clone()
    cache_k[:, :, : past_cap + n_tree] = k
    cache_v[:, :, : past_cap + n_tree] = v
    k_view, v_view = cache_k[:, :, : past_cap + n_tree], cache_v[:, :, : past_cap + n_tree]
    # W = 3 > ceil(33 / 32): the spare word is all ones and must be ignored. Row 4 of sequence 1 allows
    # no key at all (and that sequence has no past): its output is defined as zeros.
    allowed = torch.stack([ancestor_mask(random_tree(n_tree, random.Random(s))) for s in range(batch)])
    allowed[1, 4] = False
    mask = torch.stack([pack(a, words=3) for a in allowed])
    mask[..., 2] = -1
    mask = mask.to(DEVICE)
    assert_matches_reference(q_view, k_view, v_view, past_lens, mask)
    out = triton_tree_attention(q_view, k_view, v_view, past_lens, mask)
    assert torch.equal(out[1, :, 4], torch.zeros_like(out[1, :, 4]))


def test_tree_attention_dispatch_matches_reference():
    # tree_attention picks the kernel or the reference by device and triton mode; same answer either way.
    inputs = make_inputs(1, 4, 4, 16, 5, 7, F32, False, seed=1)
    torch.testing.assert_close(tree_attention(*inputs), reference_tree_attention(*inputs), **TOLERANCES[F32])


@pytest.mark.skipif(KERNEL_RUNS_HERE or not HAVE_TRITON, reason="the kernel tests run in this process")
def test_kernel_in_fresh_process():
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "test_kernel_ and not fresh"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# Reference vs an independent implementation, and the packed-mask format
# ---------------------------------------------------------------------------------------------


def test_pack_roundtrip_including_bit_31():
    paths = random_tree(64, random.Random(3))
    allowed = ancestor_mask(paths)
    packed = pack(allowed)
    assert (packed < 0).any(), "some row should set bit 31 of a word (slot 31 or 63 attended)"
    assert torch.equal(dense_mask_from_packed(packed, 64), allowed)
    # Row 0 (the root) sees only itself: word 0 == 1, the rest 0.
    assert packed[0].tolist() == [1, 0]


@pytest.mark.parametrize("n_heads,n_kv_heads,n_tree,past_cap", [(4, 4, 5, 7), (8, 2, 33, 40)])
def test_reference_matches_sdpa(n_heads, n_kv_heads, n_tree, past_cap):
    q, k, v, past_lens, mask = (
        t.cpu() for t in make_inputs(3, n_heads, n_kv_heads, 32, n_tree, past_cap, F32, True, seed=2)
    )
    ref = reference_tree_attention(q, k, v, past_lens, mask)
    # SDPA gets the dense mask built from the tree relation directly, and zero-filled holes (the NaN
    # garbage would poison its P @ V even where masked).
    past_ok = torch.arange(past_cap)[None, :] < past_lens[:, None].long()
    tree_ok = dense_mask_from_packed(mask, n_tree)
    allowed = torch.cat([past_ok[:, None, :].expand(-1, n_tree, -1), tree_ok], dim=-1)[:, None]  # [B,1,T,S]
    k0, v0 = (torch.nan_to_num(t, nan=0.0) for t in (k, v))
    expected = F.scaled_dot_product_attention(q, k0, v0, attn_mask=allowed, enable_gqa=True)
    torch.testing.assert_close(ref, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 4, 9])
def test_reference_sliding_window_matches_sdpa_per_query(window):
    """Each tree slot through SDPA on exactly the keys it sees, listed by position: the valid past at
    positions > its position - window, and its ancestors (root to itself) likewise."""
    q, k, v, past_lens, mask = (t.cpu() for t in make_inputs(3, 8, 2, 32, 9, 20, F32, True, seed=window))
    allowed = dense_mask_from_packed(mask, 9)
    positions = tree_positions(past_lens, allowed)
    ref = reference_tree_attention(q, k, v, past_lens, mask, positions=positions, window=window)
    for b in range(3):
        for i in range(9):
            low = int(positions[b, i]) - window  # keys at positions > low
            keys = [j for j in range(int(past_lens[b])) if j > low]
            keys += [20 + j for j in range(9) if allowed[b, i, j] and int(positions[b, j]) > low]
            expected = F.scaled_dot_product_attention(q[b:b + 1, :, i:i + 1], k[b:b + 1, :, keys],
                                                      v[b:b + 1, :, keys], enable_gqa=True)
            torch.testing.assert_close(ref[b:b + 1, :, i:i + 1], expected, atol=1e-5, rtol=1e-5)


def test_reference_causal_prefill_matches_sdpa():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 40, 16, generator=gen) for _ in range(3))
    causal = pack(torch.ones(40, 40, dtype=torch.bool).tril())
    ref = reference_tree_attention(q, k, v, torch.zeros(2, dtype=torch.int32), causal, scale=0.2)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2)
    torch.testing.assert_close(ref, expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Input errors name the value
# ---------------------------------------------------------------------------------------------


def _bad(**changes):
    q, k, v, past_lens, mask = make_inputs(2, 4, 2, 16, 33, 7, F32, False, seed=0)
    args = dict(q=q, k=k, v=v, past_lens=past_lens, packed_mask=mask)
    args.update({name: fn(args) for name, fn in changes.items()})
    return args


@pytest.mark.parametrize(
    "args,message",
    [
        (_bad(packed_mask=lambda a: a["packed_mask"][:, :1]), "W=1"),
        (_bad(k=lambda a: a["k"][..., :8], v=lambda a: a["v"][..., :8]), "(2, 2, 40, 8)"),
        (_bad(v=lambda a: a["v"][:, :, :-1]), "(2, 2, 39, 16)"),
        (_bad(q=lambda a: a["q"][:, :3]), "query heads 3"),
        (_bad(past_lens=lambda a: torch.tensor([1, 8], dtype=torch.int32)), "[1, 8]"),
        (_bad(past_lens=lambda a: a["past_lens"][:1]), "past_lens: shape (1,)"),
        (_bad(packed_mask=lambda a: a["packed_mask"].long()), "torch.int64"),
        (_bad(packed_mask=lambda a: a["packed_mask"][None].expand(3, -1, -1)), "batch 3"),
        (_bad(k=lambda a: a["k"].half(), v=lambda a: a["v"].half()), "dtypes differ"),
        (_bad(window=lambda a: 4), "positions: None, expected [2, 33]"),
        (_bad(window=lambda a: -1), "window -1"),
    ],
)
@pytest.mark.parametrize("fn", [reference_tree_attention, triton_tree_attention], ids=["reference", "triton"])
def test_bad_inputs_raise_value_error(args, message, fn):
    if fn is triton_tree_attention and not HAVE_TRITON:
        pytest.skip("triton missing")
    args = {name: t.cpu() if isinstance(t, torch.Tensor) else t for name, t in args.items()}
    with pytest.raises(ValueError, match=re.escape(message)):
        fn(**args)


# ---------------------------------------------------------------------------------------------
# TensorRT plugin: launch description (no TensorRT needed), compile, registration
# ---------------------------------------------------------------------------------------------


def test_plugin_int_args_follow_kernel_signature_and_strides():
    import inspect

    params = list(inspect.signature(kernel._tree_attention_fwd).parameters)
    assert params[:6] == ["Q", "K", "V", "PastLens", "Mask", "Positions"]
    scalars = [p for p in params[6 : params.index("Out")] if p != "sm_scale"]
    assert tuple(scalars) == plugin.INT_ARG_NAMES
    for per_batch in (False, True):
        q, k, v, _, mask = make_inputs(3, 8, 2, 32, 5, 7, F32, per_batch, seed=0)
        expected = [5, 7, 4, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3]]
        expected += [mask.stride(0) if per_batch else 0, mask.stride(-2), *q.stride()[:3]]
        assert plugin.int_args(tuple(q.shape), tuple(k.shape), tuple(mask.shape)) == expected
    assert plugin.launch_grid((3, 8, 5, 32), (3, 2, 12, 32), block_m=16) == (2, 2, 3)  # 4 * 5 rows -> 2 tiles


def test_drop_unused_trailing_params():
    ptx = ".visible .entry f(\n\t.param .u64 f_param_0,\n\t.param .u32 f_param_1,\n\t.param .u64 f_param_2\n)\n{\n"
    body = "\tld.param.b64 %rd1, [f_param_0];\n\tld.param.b32 %r1, [f_param_1];\n}\n"
    stripped = plugin._drop_unused_trailing_params(ptx + body, "f", 2)
    assert "f_param_2" not in stripped and "f_param_1" in stripped
    with pytest.raises(RuntimeError, match="f_param_1"):
        plugin._drop_unused_trailing_params(ptx + body, "f", 1)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton missing")
def test_plugin_kernel_compiles_to_ptx():
    # Compiled mode needs a process whose triton was imported without the interpreter; no GPU needed.
    script = textwrap.dedent(
        """
        import sys
        from medusa_trt.runtime.trt.tree_attention import plugin
        from medusa_trt.runtime.trt.tree_attention.kernel import TUNING_CONFIGS
        assert "triton" not in sys.modules, "importing the plugin module must not import triton"
        for dtype, head_dim, sm, config, window in [("float16", 128, 90, TUNING_CONFIGS[1], 0),
                                                    ("bfloat16", 64, 80, TUNING_CONFIGS[0], 4096),
                                                    ("float32", 80, 80, TUNING_CONFIGS[3], 0)]:
            kernel = plugin.compile_kernel(dtype, head_dim, None, config, sm, window)
            entry = kernel.ptx[kernel.ptx.index(".entry " + kernel.name):]
            params = entry[: entry.index(")")].count(".param")
            assert params == 6 + len(plugin.INT_ARG_NAMES) + 1, (dtype, params)
            assert f".target sm_{sm}" in kernel.ptx, dtype
            assert kernel.num_warps == config.num_warps
            print(dtype, kernel.name, params, kernel.shared_mem)
        # A launch takes at most the portable 48 KB of dynamic shared memory (PORTABLE_SHARED_MEM):
        # float16 with D=128 and 32 x 64 tiles stages 52 KB, so the fallback tiles run instead.
        wide = plugin.compile_kernel("float16", 128, None, TUNING_CONFIGS[1], 90, 0)
        assert wide.shared_mem > plugin.PORTABLE_SHARED_MEM, wide.shared_mem
        config, kernel = plugin.launch_kernel("float16", 128, None, TUNING_CONFIGS[1], 90, 0)
        assert config == plugin.FALLBACK_CONFIG and kernel.shared_mem <= plugin.PORTABLE_SHARED_MEM
        assert plugin.launch_kernel("float16", 64, None, TUNING_CONFIGS[1], 90, 0)[0] == TUNING_CONFIGS[1]
        assert plugin.launch_kernel("float16", 64, None, TUNING_CONFIGS[1], 90, 0, 16384)[0] == plugin.FALLBACK_CONFIG
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="tensorrt is installed")
def test_register_plugin_without_tensorrt_names_the_extra():
    with pytest.raises(ImportError, match=r"pip install medusa-trt\[tensorrt\]"):
        plugin.register_plugin(target_sm=90)


def test_register_plugin():
    trt = pytest.importorskip("tensorrt")
    assert plugin.register_plugin(target_sm=90) == "medusa::tree_attention"
    assert plugin.register_plugin(target_sm=90) == plugin.PLUGIN_ID  # idempotent
    creator = trt.get_plugin_registry().get_creator(
        plugin.PLUGIN_NAME, plugin.PLUGIN_VERSION, plugin.PLUGIN_NAMESPACE
    )
    assert creator is not None


@pytest.mark.parametrize("window", [0, 6])
def test_plugin_engine_matches_reference(window):
    trt = pytest.importorskip("tensorrt")
    if not torch.cuda.is_available():
        pytest.skip("building a TensorRT engine needs a GPU")
    import tensorrt.plugin as trtp

    from medusa_trt.engines.trt.build import create_network

    plugin.register_plugin()
    inputs = make_inputs(3, 8, 2, 64, 33, 40, F16, True, seed=4)  # NaN in the holes, as before
    inputs.append(tree_positions(inputs[3].cpu(), dense_mask_from_packed(inputs[4].cpu(), 33)).to(DEVICE))
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = create_network(trt, builder)
    types = [trt.float16, trt.float16, trt.float16, trt.int32, trt.int32, trt.int32]
    tensors = [
        network.add_input(n, ty, tuple(t.shape))
        for n, ty, t in zip(plugin.INPUT_NAMES, types, inputs, strict=True)
    ]
    layer = network.add_plugin(trtp.op.medusa.tree_attention(*tensors, scale=0.0, window=window), aot=True)
    layer.get_output(0).name = "out"
    network.mark_output(layer.get_output(0))
    serialized = builder.build_serialized_network(network, builder.create_builder_config())
    assert serialized is not None, "engine build failed"
    engine = trt.Runtime(logger).deserialize_cuda_engine(serialized)
    context = engine.create_execution_context()
    out = torch.empty_like(inputs[0])
    for name, t in zip(plugin.INPUT_NAMES, inputs, strict=True):
        context.set_tensor_address(name, t.data_ptr())
    context.set_tensor_address("out", out.data_ptr())
    stream = torch.cuda.current_stream()
    assert context.execute_async_v3(stream.cuda_stream)
    stream.synchronize()
    ref = reference_tree_attention(*inputs[:5], positions=inputs[5], window=window)
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCES[F16])
    assert math.isfinite(out.float().abs().max().item())
