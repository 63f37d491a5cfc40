"""Opening a merged checkpoint or an engine directory as a runtime backend, and its tokenizer."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from medusa_trt import datastore
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
    backend = _open_backend(Path(directory), dtype, device, ort_options)
    # What a decode defaults to (decoding.GenerationConfig): the engine's tree and stop tokens.
    directory = Path(directory)
    tree, source, listed = None, None, True
    if (directory / ENGINE_JSON).exists():
        engine = read_engine(directory)
        tree = engine["medusa"].get("tree") or None
        if isinstance(tree, list):
            tree = tuple(tuple(p) for p in tree)
        source = engine["medusa"].get("tree_source")
        listed = datastore.FILE in engine["artifacts"]  # and so size-checked with the engine's other files
    backend.info = replace(backend.info, tree=tree, tree_source=source, stop_token_ids=stop_tokens(directory))
    path = directory / datastore.FILE
    if path.is_file():
        if not listed:
            raise EngineError(f"{path}: not in engine.json's artifacts (this engine was built without it); expected "
                              "a datastore of the engine's own build: rebuild with medusa-build --datastore, or remove it")
        store = datastore.load(path)
        datastore.check_vocab(int(store.tokens.max(initial=0)), backend.info.vocab_size, str(path))
        backend.datastore = store
    return backend


def _open_backend(directory: Path, dtype: str | None, device: str | None,
                  ort_options: OrtSessionOptions | None) -> Backend:
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


# Tokens chat templates end a turn with (ChatML, Llama 3, Phi-3, Gemma): a decode stops at the one its
# model's template uses, or it runs on into turns of its own invention.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


def _ids(value) -> list[int]:
    """A config's eos_token_id: an id, a list of ids or null."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def _json_or_empty(path: Path) -> dict:
    """A tokenizer or generation config file, {} where absent or unreadable (then it names no stops)."""
    import json

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def chat_template_text(directory: str | Path) -> str:
    """The chat template a model dir ships (tokenizer_config.json or chat_template.jinja), "" if none."""
    directory = Path(directory)
    template = _json_or_empty(directory / "tokenizer_config.json").get("chat_template") or ""
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        template = " ".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    if not template and (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text(encoding="utf-8", errors="replace")
    return str(template)


def stop_tokens(directory: str | Path, tokenizer=None) -> tuple[int, ...]:
    """Where a decode of this model stops: the EOS ids of its config (int or list), of its
    generation_config.json and of its tokenizer, and the end-of-turn token its chat template uses.
    Read from the files alone (no tokenizer needed); `tokenizer` adds its eos_token_id."""
    directory = Path(directory)
    ids: set[int] = set()
    if (directory / ENGINE_JSON).exists():
        ids.update(_ids(read_engine(directory).get("eos_token_id")))
    elif (directory / "config.json").is_file():
        ids.update(_ids(_merged_config(directory).get("eos_token_id")))
    ids.update(_ids(_json_or_empty(directory / "generation_config.json").get("eos_token_id")))
    # Token strings -> ids through tokenizer.json's added tokens (the special tokens live there).
    added = {t.get("content"): t.get("id") for t in _json_or_empty(directory / "tokenizer.json").get("added_tokens") or []
             if isinstance(t, dict)}
    eos = _json_or_empty(directory / "tokenizer_config.json").get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    template = chat_template_text(directory)
    for name in (eos, *(t for t in END_OF_TURN_TOKENS if t in template)):
        ids.update(_ids(added.get(name)))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))
