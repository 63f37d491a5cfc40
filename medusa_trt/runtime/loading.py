"""Opening a merged checkpoint or an engine directory as a runtime backend."""

from __future__ import annotations

import json
from pathlib import Path

from medusa_trt.runtime.backend import Backend, TorchBackend


def load_backend(directory: str | Path, dtype: str | None = None, device: str | None = None,
                 threads: int | None = None) -> Backend:
    """An engine dir (engine.json) opens its engine; a merged checkpoint opens the PyTorch reference.
    `threads`: ONNX Runtime intra-op threads (default: one per core this process may use)."""
    directory = Path(directory)
    if (directory / "engine.json").is_file():
        engine = json.loads((directory / "engine.json").read_text())
        kind = engine.get("backend")
        if kind == "onnxruntime":
            from medusa_trt.runtime.ort_backend import OrtBackend

            return OrtBackend(directory, device=device, threads=threads)
        if kind == "tensorrt":
            from medusa_trt.runtime.trt_backend import TensorRTBackend

            return TensorRTBackend(directory)
        raise ValueError(f"{directory / 'engine.json'}: backend {kind!r} has no Python runtime here")
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{directory}: neither engine.json nor config.json found (expected an engine or merged checkpoint)")
    config = json.loads(config_path.read_text())
    if config.get("architecture") != "MedusaForCausalLM":
        raise ValueError(
            f"{config_path}: architecture {config.get('architecture')!r} is not a merged checkpoint "
            "(expected 'MedusaForCausalLM'; run medusa-convert first)"
        )
    from medusa_trt.modeling import MedusaModel

    model = MedusaModel.from_checkpoint(directory, dtype=dtype)
    return TorchBackend(model, max_draft_len=config.get("max_draft_len", 63))


def load_tokenizer(directory: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except Exception as e:  # transformers raises many types here; one clear message is what users need
        raise ValueError(f"{directory}: cannot load the tokenizer ({e})") from e


def stop_tokens(directory: str | Path, tokenizer) -> tuple[int, ...]:
    """EOS ids from the model config (int or list) and the tokenizer."""
    ids: set[int] = set()
    for name in ("config.json", "engine.json"):
        path = Path(directory) / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))
