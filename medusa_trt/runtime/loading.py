"""Opening a merged checkpoint or an engine directory as a runtime backend, and its tokenizer."""

from __future__ import annotations

from pathlib import Path

from medusa_trt.engine_dir import ENGINE_JSON, EngineError, read_engine
from medusa_trt.errors import read_json_object
from medusa_trt.runtime.backend import Backend
from medusa_trt.runtime.ort.session import OrtSessionOptions
from medusa_trt.runtime.torch_backend import TorchBackend


def _merged_config(directory: Path) -> dict:
    """config.json of a merged checkpoint (validated by checkpoint.read_config)."""
    from medusa_trt.checkpoint import read_config

    return read_config(directory)


def load_backend(directory: str | Path, dtype: str | None = None, device: str | None = None,
                 ort_options: OrtSessionOptions | None = None) -> Backend:
    """An engine dir (engine.json) opens its engine; a merged checkpoint opens the PyTorch reference
    (on `device`: cpu by default, or cuda). `ort_options`: an ONNX Runtime engine's intra-op threads
    (default: one per core this process may use) and spinning (for cores the engine has to itself;
    see runtime/ort/session.py: session_options), for every one of its sessions."""
    directory = Path(directory)
    threads = ort_options.threads if ort_options else None
    if threads is not None and threads < 1:
        raise EngineError(f"threads {threads}: expected a positive number (or none: one per core)")
    if not directory.is_dir():
        raise EngineError(f"{directory}: not a directory; expected an engine directory or a merged checkpoint")
    if (directory / ENGINE_JSON).exists():
        kind = read_engine(directory)["backend"]
        if kind == "onnxruntime":
            from medusa_trt.runtime.ort.backend import OrtBackend

            return OrtBackend(directory, device=device, options=ort_options)
        if kind == "tensorrt":
            from medusa_trt.runtime.trt.backend import TensorRTBackend

            return TensorRTBackend(directory)
        raise EngineError(f"{directory / ENGINE_JSON}: backend {kind!r} has no Python runtime here "
                          "(serve a TensorRT-LLM engine with medusa-triton + tritonserver)")
    if not (directory / "config.json").exists():
        raise EngineError(f"{directory}: neither engine.json nor config.json found (expected an engine or merged "
                          "checkpoint)")
    config = _merged_config(directory)
    if config.get("architecture") != "MedusaForCausalLM":
        raise EngineError(
            f"{directory / 'config.json'}: architecture {config.get('architecture')!r} is not a merged checkpoint "
            "(expected 'MedusaForCausalLM'; run medusa-convert first)"
        )
    from medusa_trt.checkpoint import DEFAULT_MAX_DRAFT_LEN
    from medusa_trt.modeling import MedusaModel

    if device not in (None, "cpu"):  # before the weights load: a wrong device fails at once
        import torch

        if device != "cuda" or not torch.cuda.is_available():
            raise EngineError(f"device {device!r}: the PyTorch reference runs on 'cpu', or 'cuda' where torch "
                              f"sees a GPU (torch {torch.__version__} sees {torch.cuda.device_count()})")
    model = MedusaModel.from_checkpoint(directory, dtype=dtype)
    if device == "cuda":
        model = model.to(device)
    return TorchBackend(model, max_draft_len=config.get("max_draft_len", DEFAULT_MAX_DRAFT_LEN))


def tokenizer_model_type(directory: str | Path) -> str | None:
    """The HF model_type whose tokenizer an engine dir, merged checkpoint or HF model dir uses."""
    directory = Path(directory)
    if (directory / ENGINE_JSON).exists():
        engine = read_engine(directory)
        return (engine.get("tokenizer") or {}).get("model_type") or engine["model"].get("model_type")
    if (directory / "config.json").is_file():
        config = read_json_object(directory / "config.json", what="model config.json")
        return (config.get("medusa_trt") or {}).get("base_model_type") or config.get("model_type")
    return None


def load_tokenizer(directory: str | Path):
    """AutoTokenizer with the config class of the model's HF model_type: when tokenizer_config.json
    names a generic class, transformers picks the tokenizer from the model config, and an engine dir
    has none; passing the same config makes an engine, its checkpoint and its HF base tokenize alike."""
    from transformers import AutoConfig, AutoTokenizer

    model_type = tokenizer_model_type(directory)
    kwargs = {}
    if model_type:
        try:
            kwargs["config"] = AutoConfig.for_model(model_type)
        except ValueError:  # a model_type this transformers does not know: its own choice
            pass
    try:
        return AutoTokenizer.from_pretrained(str(directory), **kwargs)
    except Exception as e:  # transformers raises many types here; one clear message is what users need
        raise EngineError(f"{directory}: cannot load the tokenizer ({' '.join(str(e).split())})") from e


def stop_tokens(directory: str | Path, tokenizer) -> tuple[int, ...]:
    """EOS ids from the model config (int or list) and the tokenizer."""
    ids: set[int] = set()
    directory = Path(directory)
    if (directory / ENGINE_JSON).exists():
        eos = read_engine(directory).get("eos_token_id")
    elif (directory / "config.json").is_file():
        eos = _merged_config(directory).get("eos_token_id")
    else:
        eos = None
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))
