"""Shared fixtures: tiny real checkpoints, built once per run and cached by their arguments.

Factories rather than plain fixtures so tests can ask for exactly the variant they need
(`tiny_base("qwen2", tied=True)`); callers must treat the returned directories as read-only.
Under pytest-xdist the workers share what they build (see _built_once).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from filelock import FileLock
from synthetic import make_base, make_heads

from medusa_trt import tree as medusa_tree
from medusa_trt.converter.merge import convert

# The fixtures are tiny: intra-op threads only add sync overhead, and on a 2-core machine shared
# with another process they make every small matmul wait (measured: 6x slower decodes).
torch.set_num_threads(1)


# The files that take minutes on a 2-core machine (engines, the real model, a tritonserver of their
# own), longest first. make test runs whole files per worker (--dist loadfile), and xdist hands them
# out in collection order (with its --loadscope-reorder off, below: that one puts the files with the
# most tests first, which sent the 6-minute test_real_model, 3 tests, last): long files first keep
# one worker from running a long file alone at the end while the other has nothing left.
SLOW_FILES = (
    "tests/test_real_model.py",
    "tests/engines/ort/test_amphista_engine.py",
    "tests/runtime/test_ort_backend.py",
    "tests/runtime/test_int4_decoding.py",
    "tests/cli/test_first_hour.py",
    "tests/engines/trt/test_rewrite.py",
    "tests/tools/test_parity.py",
    "tests/tools/test_train_heads.py",
    "tests/serving/test_triton_server.py",
    "tests/engines/trt/test_rewrite_window.py",
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's --loadscope-reorder, on by default
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order


@pytest.fixture(autouse=True)
def _tree_warnings_said_anew():
    """medusa_trt.tree says each tree warning once per process (functools.cache); a test asserting
    that it is said must not depend on whether an earlier test in the same worker said it first
    (test_amphista_engine's 6-node tree and test_int4_decoding's have the same main chain)."""
    medusa_tree._warn_chain.cache_clear()
    medusa_tree._warn_prefixes.cache_clear()


def _key(*args, **kwargs) -> str:
    return json.dumps([args, kwargs], sort_keys=True, default=str)


def _built_once(tmp_path_factory, kind: str, key: str, build: Callable[[Path], Path]) -> Path:
    """What `build(folder)` makes in an empty folder (the path it returns), built once per run for `key`.

    Without xdist: a fresh temp folder of this session. Under xdist (make test: two workers, whole
    files each) every worker would otherwise build its own copy of the same engines, and an ONNX
    export takes ~40 s on the CI's 2 cores; so the workers share a folder under their common
    basetemp parent (this run's own), keyed by `key`, and whichever asks first builds while the
    other waits on the lock. The builds are deterministic, so which worker built one does not
    matter, and its paths (engine.json records the checkpoint's) are the same for every worker."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return build(tmp_path_factory.mktemp(kind))
    folder = tmp_path_factory.getbasetemp().parent / "shared" / f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    folder.mkdir(parents=True, exist_ok=True)
    work, done = folder / "work", folder / "done"  # done: the built path, relative to work
    with FileLock(folder / "lock"):
        if not done.exists():
            shutil.rmtree(work, ignore_errors=True)  # left by a worker that died while building it
            work.mkdir()
            done.write_text(str(build(work).relative_to(work)))
    return work / done.read_text()


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory):
    """tiny_base(arch="llama", **make_base kwargs) -> Path of an HF model dir."""
    cache: dict[str, Path] = {}

    def make(arch: str = "llama", **kwargs) -> Path:
        key = _key(arch, **kwargs)
        if key not in cache:
            cache[key] = _built_once(tmp_path_factory, f"base-{arch}", key,
                                     lambda folder: make_base(folder / "model", arch, **kwargs))
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_heads(tmp_path_factory):
    """tiny_heads(fmt, base_dir, **make_heads kwargs) -> the --heads path (file or dir)."""
    cache: dict[str, Path] = {}

    def make(fmt: str, base_dir: Path, *, file_name: str | None = None, **kwargs) -> Path:
        key = _key(fmt, str(base_dir), file_name, **kwargs)
        if key not in cache:
            cache[key] = _built_once(tmp_path_factory, f"heads-{fmt}", key, lambda folder: make_heads(
                folder / "heads" / file_name if file_name else folder / "heads", fmt, base_dir, **kwargs))
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

            def build(folder: Path) -> Path:
                convert(base, heads, folder / "ckpt", dtype=dtype, tp_size=tp_size, progress=False)
                return folder / "ckpt"

            cache[key] = _built_once(tmp_path_factory, f"merged-{arch}-{fmt}", key, build)
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
            checkpoint = tiny_merged(arch, base_kwargs=base_kwargs)

            def build(folder: Path) -> Path:
                build_engine(BuildOptions(checkpoint=checkpoint, out=folder / "engine", progress=False, **options))
                return folder / "engine"

            cache[key] = _built_once(tmp_path_factory, f"engine-{arch}", key, build)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def small_amphista(tmp_path_factory, tiny_base):
    """A small base (vocab 72, hidden 32) with a 3-head Amphista drafter trained on its own greedy
    continuations: drafts get accepted, so the drafter's cache is appended with several committed
    rows in a step (tests/runtime/test_sampling.py, tests/test_amphista.py)."""
    from transformers import AutoModelForCausalLM

    from medusa_trt.modeling import MedusaModel
    from medusa_trt.runtime.torch_backend import TorchBackend
    from medusa_trt.tools.distill import Sample
    from medusa_trt.tools.train_drafter import TrainOptions, new_amphista, save_amphista, train_drafter
    from medusa_trt.tools.train_heads import greedy_continuations, hidden_states

    base = tiny_base("llama", vocab=72, hidden_size=32, intermediate=64, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(base).eval()
    rng = random.Random(0)
    seqs = greedy_continuations(hf, [[rng.randrange(3, 72) for _ in range(6)] for _ in range(64)], 48)
    samples = [Sample(s, 6, h[: len(s) - 1]) for s, h in zip(seqs, hidden_states(hf, seqs), strict=True)]
    drafter = new_amphista(base, num_heads=3, sal_intermediate_size=64, seed=0)
    train_drafter(drafter, "amphista", samples, hf.lm_head.weight.detach(), hf.get_input_embeddings(),
                  torch.arange(72), TrainOptions(steps=150, lr=3e-3, batch_samples=16, seed=0), progress=False)
    root = tmp_path_factory.mktemp("small_amphista")
    save_amphista(drafter, root / "drafter", base=str(base), vocab=None)
    convert(base, root / "drafter", root / "ckpt", progress=False)
    return SimpleNamespace(hf=hf, ckpt=root / "ckpt", backend=TorchBackend(MedusaModel.from_checkpoint(root / "ckpt")))


@pytest.fixture(scope="session")
def distilled(tmp_path_factory, tiny_base):
    """distilled(arch): a base with Medusa heads fitted (self-distillation, a few seconds) to the base's
    own greedy continuations, converted by medusa-convert. Heads that predict make the acceptance
    path run, not only the bonus token."""
    cache = {}

    def make(arch: str = "llama"):
        if arch not in cache:
            from transformers import AutoModelForCausalLM

            from medusa_trt.modeling import MedusaModel
            from medusa_trt.runtime.torch_backend import TorchBackend
            from medusa_trt.tools.train_heads import greedy_continuations, save_heads, train_heads

            base = tiny_base(arch)
            hf = AutoModelForCausalLM.from_pretrained(base).eval()
            rng = random.Random(100)
            train = [[rng.randrange(3, 256) for _ in range(6)] for _ in range(96)]  # tests/runtime/test_decoding.py: prompts
            # llama's heads carry the acceptance-rate and fused-step tests (250 steps); the other
            # archs need heads that get drafts accepted at all (asserted in the batch-4 test): 100.
            steps = 250 if arch == "llama" else 100
            state = train_heads(hf, greedy_continuations(hf, train, 64), num_heads=4, steps=steps, batch_tokens=2048, progress=False)
            root = tmp_path_factory.mktemp(f"distilled-{arch}")
            save_heads(state, root / "heads", base, num_heads=4, num_layers=1)
            convert(base, root / "heads", root / "ckpt", progress=False)
            cache[arch] = SimpleNamespace(hf=hf, ckpt=root / "ckpt", backend=TorchBackend(MedusaModel.from_checkpoint(root / "ckpt")))
        return cache[arch]

    return make
