"""What the benchmark scripts share, so that no script imports another.

- prompts: the held-out prompts as every SmolLM2 benchmark feeds them (chat in the chat template,
  code as it is), the float32 HF dir the peers and the references start from, and the one error type
  for bad input (exit 2);
- timing: median times and round-robin rounds (the calls take turns, so load from other processes
  spreads over all of them: figures are ratios taken side by side);
- engine steps: one decode or tree step with a given number of committed tokens, on an ONNX Runtime
  engine;
- random models: the 10M and 100M-parameter Llama models and engines that bench_onnx.py and
  investigations/bench_onnx_sweeps.py measure (cached under their --workdir).

A script in benchmarks/ imports this as `common` (its own folder is first on sys.path); one in
benchmarks/investigations/ puts benchmarks/ on sys.path first. Package modules are imported inside
the functions, so a script's --help does not load torch or ONNX Runtime.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from medusa_trt.tools.demo import ASSETS

# The model's held-out prompts, as the demo reads them.
DEFAULT_PROMPTS = ASSETS / "prompts_heldout.jsonl"
REPO = Path(__file__).resolve().parents[1]


class BenchInputError(ValueError):
    """Bad input (a file, a directory, an option); exit 2."""


# -- prompts and the reference model ---------------------------------------------------------


def float32_hf_dir(gguf: Path, workdir: Path, prog: str) -> Path:
    """The float32 HF dir dequantized from the GGUF, the reference every system starts from (cached
    under workdir/hf)."""
    hf_dir = workdir / "hf"
    if not (hf_dir / "config.json").is_file():
        print(f"{prog}: dequantizing {gguf} -> {hf_dir} (float32)", file=sys.stderr)
        # In a child process: torch's multi-threaded ops start an OpenMP pool that a forked process
        # cannot use, and bench_peers forks its peers after this; with the dequantization done here,
        # the first int4 engine's parallel torch op in a peer hung for good (2026-11-27).
        code = ("import sys; from pathlib import Path; from medusa_trt.converter.gguf import write_hf_dir; "
                "write_hf_dir(Path(sys.argv[1]), Path(sys.argv[2]))")
        r = subprocess.run([sys.executable, "-c", code, str(gguf), str(hf_dir)], stderr=subprocess.PIPE, text=True)
        if r.returncode:
            last = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
            raise BenchInputError(last.split(": ", 1)[-1] if "Error: " in last else last)
    return hf_dir


@dataclass
class Prompt:
    text: str  # as fed to every tokenizer: chat prompts rendered with the chat template
    kind: str  # "code" | "chat"
    ids: list[int]


def read_prompts(path: Path, tokenizer, limit: int | None = None) -> list[Prompt]:
    """.jsonl lines {"text": ..., "kind": "code"|"chat"}; a chat text is rendered with the tokenizer's
    chat template (one user turn, generation prompt added) unless it already is (it holds the
    template's special tokens, as scripts/train_smollm2_drafters.py writes them); code is continued as
    it is."""
    if not path.is_file():
        raise BenchInputError(f"{path}: prompts file not found")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            text, kind = rec["text"], rec["kind"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise BenchInputError(f"{path}:{n}: expected a JSON object with 'text' and 'kind' ({e})") from None
        if kind not in ("code", "chat") or not isinstance(text, str) or not text:
            raise BenchInputError(f"{path}:{n}: kind {kind!r} / text {text!r:.40}: expected 'code' or 'chat' "
                                  "and a non-empty text")
        if kind == "chat" and not any(t in text for t in tokenizer.all_special_tokens):
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False)
        # The chat template writes its special tokens itself; code gets what the tokenizer adds.
        ids = tokenizer.encode(text, add_special_tokens=kind == "code")
        prompts.append(Prompt(text, kind, ids))
    if limit:  # an even share of both kinds, in file order
        code = [p for p in prompts if p.kind == "code"]
        chat = [p for p in prompts if p.kind == "chat"]
        prompts = code[: (limit + 1) // 2] + chat[: limit // 2]
    if not prompts:
        raise BenchInputError(f"{path}: no prompts")
    return prompts


# -- timing ----------------------------------------------------------------------------------


def median_time(fn, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def round_robin(calls: dict, rounds: int, inner: int = 3) -> dict:
    """Median and min over `rounds` of each call's median-of-`inner` time (ms), the calls taking
    turns so that load from other processes spreads over all of them."""
    for fn in calls.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            samples[name].append(median_time(fn, inner, warmup=0))
    return {name: {"median_ms": round(statistics.median(t) * 1e3, 3), "min_ms": round(min(t) * 1e3, 3)}
            for name, t in samples.items()}


# -- engine steps ----------------------------------------------------------------------------


def ort_backend(engine_dir: Path, threads: int):
    from medusa_trt.runtime.ort.backend import OrtBackend
    from medusa_trt.runtime.ort.session import OrtSessionOptions

    return OrtBackend(engine_dir, options=OrtSessionOptions(threads=threads))


def tree_inputs(slots: int, num_heads: int):
    """Position offsets and mask of the default tree cut to `slots` slots."""
    import torch

    from medusa_trt.tree import DEFAULT_TREE, build_tree, read_tree

    nodes = read_tree(DEFAULT_TREE, num_heads)[: slots - 1]
    if not nodes:
        return torch.zeros(1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool)
    tree = build_tree(nodes, num_heads, 63)
    return torch.tensor(tree.position_offsets), torch.tensor(tree.attention_mask)


def step_inputs(backend, batch: int, slots: int, past: int):
    """A decode (slots=1) or tree step with `past` committed entries in every sequence."""
    import torch

    offsets, mask = tree_inputs(slots, max(backend.info.num_medusa_heads, 4))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, backend.info.vocab_size, (batch, slots), generator=g)
    return ids, (past + offsets)[None].expand(batch, -1), mask[None].expand(batch, -1, -1)


def prepared(backend, batch: int, slots: int, past: int, capacity: int | None = None):
    """A callable running one step on `backend`, with `past` committed entries per sequence."""
    import torch

    ids, pos, mask = step_inputs(backend, batch, slots, past)
    capacity = capacity or past + slots

    def step():
        if backend.keys.shape[1] != batch or backend.keys.shape[3] != capacity:
            backend.start(batch, capacity)
            backend.lengths = torch.full((batch,), past)
        return backend.forward(ids, pos, mask)

    return step


_CACHES: dict = {}


def step_call(backend, batch: int, slots: int, committed: int, capacity: int):
    """One decoder forward (no heads) with its own cache (swapped in at each call: a few dozen numpy
    views), `committed` tokens in every sequence of a cache allocated for `capacity`."""
    import torch

    from medusa_trt.runtime.backend import zero_cache

    ids, pos, mask = step_inputs(backend, batch, slots, committed)
    key = (batch, capacity, backend.num_layers, backend.num_kv_heads, backend.head_dim, backend.dtype)
    if key not in _CACHES:  # one per shape, shared by every call (an in-place engine writes at `committed`, unread)
        _CACHES[key] = zero_cache(backend.num_layers, batch, backend.num_kv_heads, capacity, backend.head_dim,
                                  backend.dtype, "cpu")
    keys, values = _CACHES[key]
    # The backend's cache object for this cache (an in-place one binds it once: runtime/ort/cache.py).
    cache = backend.cache_mode(keys, values, backend._past_names)

    def step():
        backend.keys, backend.values, backend.cache = keys, values, cache
        backend.lengths = torch.full((batch,), committed)
        return backend.forward(ids, pos, mask, with_heads=False)

    return step


# -- random models ---------------------------------------------------------------------------

SIZES = {  # base parameters: 9.8M and 100.1M (untied embeddings); 4 Medusa heads of 1 layer on top
    "10M": dict(hidden_size=256, layers=6, heads=4, kv_heads=2, intermediate=768, vocab=10000),
    "100M": dict(hidden_size=768, layers=12, heads=12, kv_heads=4, intermediate=2048, vocab=16000),
}


def random_models(workdir: Path, size: str) -> dict[str, Path]:
    """HF base, merged checkpoint with heads, base-only checkpoint, and an engine for each (cached)."""
    from medusa_trt.checkpoint import load_checkpoint, write_checkpoint
    from medusa_trt.converter.merge import convert
    from medusa_trt.engines.build import build_engine
    from medusa_trt.engines.options import BuildOptions
    sys.path.insert(0, str(REPO / "tests"))  # the test fixtures' model factories
    from synthetic import make_base, make_heads

    root = workdir / size
    paths = {name: root / name for name in ("base", "heads", "merged", "merged-base", "engine", "engine-base")}
    if not (paths["base"] / "config.json").is_file():
        print(f"[{size}] making the random base and heads", file=sys.stderr)
        make_base(paths["base"], "llama", max_position_embeddings=2048, **SIZES[size])
        make_heads(paths["heads"], "medusa_v1", paths["base"], num_heads=4)
    if not (paths["merged"] / "config.json").is_file():
        convert(paths["base"], paths["heads"], paths["merged"], progress=False, force=True)
    if not (paths["merged-base"] / "config.json").is_file():
        config, weights = load_checkpoint(paths["merged"])
        config = {**config, "num_medusa_heads": 0}
        write_checkpoint(paths["merged-base"], config, {k: v for k, v in weights.items() if not k.startswith("medusa")})
    for ckpt, engine in (("merged", "engine"), ("merged-base", "engine-base")):
        if _stale(paths[engine]):
            print(f"[{size}] medusa-build {paths[ckpt]} -> {paths[engine]}", file=sys.stderr)
            build_engine(BuildOptions(checkpoint=paths[ckpt], out=paths[engine], force=True, max_seq_len=2048))
    return paths


def _stale(engine_dir: Path) -> bool:
    """No engine yet, or one of another engine format or attention form than today's default."""
    from medusa_trt.engine_dir import ENGINE_FORMAT_VERSION
    from medusa_trt.engines.onnx.attention import DEFAULT_ATTENTION

    path = engine_dir / "engine.json"
    if not path.is_file():
        return True
    engine = json.loads(path.read_text())
    return engine.get("format_version") != ENGINE_FORMAT_VERSION or engine["onnx"]["attention"] != DEFAULT_ATTENTION


def param_count(ckpt: Path) -> int:
    import numpy as np

    from medusa_trt.safetensors_io import SafetensorsFile

    with SafetensorsFile(ckpt / "rank0.safetensors") as f:
        return sum(int(np.prod(f.info(n).shape)) for n in f.keys())
