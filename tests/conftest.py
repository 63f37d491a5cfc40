"""Shared fixtures: tiny real checkpoints, built once per session and cached by their arguments.

Factories rather than plain fixtures so tests can ask for exactly the variant they need
(`tiny_base("qwen2", tied=True)`); callers must treat the returned directories as read-only.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from synthetic import make_base, make_heads

from medusa_trt import tree as medusa_tree
from medusa_trt.converter.merge import convert

# The fixtures are tiny: intra-op threads only add sync overhead, and on a 2-core machine shared
# with another process they make every small matmul wait (measured: 6x slower decodes).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _tree_warnings_said_anew():
    """medusa_trt.tree says each tree warning once per process (functools.cache); a test asserting
    that it is said must not depend on whether an earlier test in the same worker said it first
    (test_amphista_engine's 6-node tree and test_int4_decoding's have the same main chain)."""
    medusa_tree._warn_chain.cache_clear()
    medusa_tree._warn_prefixes.cache_clear()


def _key(*args, **kwargs) -> str:
    return json.dumps([args, kwargs], sort_keys=True, default=str)


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory):
    """tiny_base(arch="llama", **make_base kwargs) -> Path of an HF model dir."""
    cache: dict[str, Path] = {}

    def make(arch: str = "llama", **kwargs) -> Path:
        key = _key(arch, **kwargs)
        if key not in cache:
            cache[key] = make_base(tmp_path_factory.mktemp(f"base-{arch}") / "model", arch, **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_heads(tmp_path_factory):
    """tiny_heads(fmt, base_dir, **make_heads kwargs) -> the --heads path (file or dir)."""
    cache: dict[str, Path] = {}

    def make(fmt: str, base_dir: Path, *, file_name: str | None = None, **kwargs) -> Path:
        key = _key(fmt, str(base_dir), file_name, **kwargs)
        if key not in cache:
            target = tmp_path_factory.mktemp(f"heads-{fmt}") / "heads"
            if file_name:
                target = target / file_name
            cache[key] = make_heads(target, fmt, base_dir, **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_merged(tmp_path_factory, tiny_base, tiny_heads):
    """tiny_merged(arch="llama", fmt="medusa_v1", tp_size=1, dtype=None, base_kwargs=None,
    heads_kwargs=None) -> Path of a merged checkpoint made by medusa-convert."""
    cache: dict[str, Path] = {}

    def make(arch: str = "llama", fmt: str = "medusa_v1", *, tp_size: int = 1, dtype: str | None = None,
             base_kwargs: dict | None = None, heads_kwargs: dict | None = None) -> Path:
        key = _key(arch, fmt, tp_size, dtype, base_kwargs, heads_kwargs)
        if key not in cache:
            base = tiny_base(arch, **(base_kwargs or {}))
            heads = tiny_heads(fmt, base, **(heads_kwargs or {}))
            out = tmp_path_factory.mktemp(f"merged-{arch}-{fmt}") / "ckpt"
            convert(base, heads, out, dtype=dtype, tp_size=tp_size, progress=False)
            cache[key] = out
        return cache[key]

    return make


@pytest.fixture(scope="session")
def ort_engine(tmp_path_factory, tiny_merged):
    """ort_engine(arch="llama", base_kwargs=None, **BuildOptions fields) -> Path of an ONNX Runtime
    engine dir built by medusa-build from tiny_merged(arch, base_kwargs=base_kwargs). Exports take
    seconds, so each variant is built once."""
    from medusa_trt.engines.build import build_engine
    from medusa_trt.engines.options import BuildOptions

    cache: dict[str, Path] = {}

    def make(arch: str = "llama", base_kwargs: dict | None = None, **options) -> Path:
        key = _key(arch, base_kwargs, **options)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"engine-{arch}") / "engine"
            checkpoint = tiny_merged(arch, base_kwargs=base_kwargs)
            build_engine(BuildOptions(checkpoint=checkpoint, out=out, progress=False, **options))
            cache[key] = out
        return cache[key]

    return make
