"""medusa-build's dispatcher: merged checkpoint -> engine directory, one builder per backend.

What every backend shares lives here: checkpoint validation, the atomic directory write (a temp
dir beside --out, renamed at the end), the tokenizer copy, checksums and `engine.json`. A backend
is one function in BUILDERS that writes its artifacts into the temp dir and returns its part of
engine.json: engines/ort/build.py, engines/trt/build.py, engines/trtllm/build.py, each beside its
options dataclass; they import the options, BuildError, the limits and the progress bar from
engines/options.py, not from here.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import platform
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from medusa_trt import datastore
from medusa_trt.checkpoint import check_finite_weights, read_config, validate_checkpoint
from medusa_trt.engine_dir import (
    DEVICES,
    ENGINE_FORMAT_VERSION,
    ENGINE_JSON,
    MAX_BATCH_SIZE,
    artifact_checksums,
    required_features,
    sha256_file,
    validate_engine,
)
from medusa_trt.engines.options import BuildError, BuildOptions, limits_for
from medusa_trt.engines.ort.build import build_onnxruntime
from medusa_trt.engines.trt.build import build_tensorrt
from medusa_trt.engines.trtllm.build import build_trtllm
from medusa_trt.errors import CheckpointError
from medusa_trt.outputs import atomic_output_dir, check_output_dir
from medusa_trt.tree import MAX_DRAFT_LEN

log = logging.getLogger(__name__)

_CHECKPOINT_ONLY = ("config.json",)  # checkpoint files that are not copied into the engine


@dataclass(frozen=True)
class BuildResult:
    out: Path
    engine: dict  # the engine.json written
    seconds: float


# A builder gets the options, the validated checkpoint config and the temp engine dir; it writes its
# artifacts there and returns its engine.json entries (at least "dtype").
Builder = Callable[[BuildOptions, dict, Path], dict]


BUILDERS: dict[str, Builder] = {
    "onnxruntime": build_onnxruntime,
    "tensorrt": build_tensorrt,
    "tensorrt-llm": build_trtllm,
}


def check_options(opts: BuildOptions, config: dict) -> None:
    if opts.backend not in BUILDERS:
        raise BuildError(f"--backend {opts.backend!r}: expected one of {', '.join(BUILDERS)}")
    if opts.device not in DEVICES:
        raise BuildError(f"--device {opts.device!r}: expected one of {', '.join(DEVICES)}")
    path = opts.checkpoint / "config.json"
    if config.get("architecture") != "MedusaForCausalLM":
        raise BuildError(f"{path}: architecture {config.get('architecture')!r} is not a merged checkpoint "
                         "(expected 'MedusaForCausalLM'; run medusa-convert first)")
    drafter = (config.get("medusa_trt") or {}).get("drafter", "medusa")
    # Which backends build which drafter: TensorRT-LLM knows Medusa heads only; ONNX Runtime and
    # TensorRT build a drafter with its own cache (Amphista) from its drafter graph.
    if drafter != "medusa" and opts.backend == "tensorrt-llm":
        raise BuildError(f"{path}: drafter {drafter!r}: --backend tensorrt-llm cannot build it (TensorRT-LLM has "
                         f"no {drafter.capitalize()} drafter); use --backend onnxruntime or tensorrt")
    quant = config.get("quantization") or {}  # its algorithms checked by validate_checkpoint
    from medusa_trt.engines.onnx.attention import MIN_OPSET
    from medusa_trt.engines.onnx.export import DEFAULT_OPSET

    if opts.opset is not None and not MIN_OPSET <= opts.opset <= DEFAULT_OPSET:  # before the checkpoint loads
        raise BuildError(f"--opset {opts.opset}: expected {MIN_OPSET}..{DEFAULT_OPSET}")
    if (quant.get("quant_algo") or quant.get("kv_cache_quant_algo")) and opts.opset is not None and opts.opset < 19:
        raise BuildError(f"--opset {opts.opset}: an FP8 checkpoint ({path}) needs opset >= 19 "
                         "(float8 QuantizeLinear/DequantizeLinear)")
    given = opts.backend_options
    if given is not None and given.backend != opts.backend:
        raise BuildError(f"--backend {opts.backend}: backend options {type(given).__name__} are for --backend "
                         f"{given.backend}")
    for name, most in (("max_batch_size", MAX_BATCH_SIZE), ("max_seq_len", None), ("max_draft_len", MAX_DRAFT_LEN)):
        value = getattr(opts, name)
        if value is not None and not (value >= 1 and (most is None or value <= most)):
            raise BuildError(f"--{name.replace('_', '-')} {value}: expected "
                             + ("a positive integer" if most is None else f"an integer in 1..{most}"))
    max_pos = int(config["max_position_embeddings"])
    if opts.max_seq_len is not None and opts.max_seq_len > max_pos:
        raise BuildError(f"--max-seq-len {opts.max_seq_len} exceeds the model's max_position_embeddings "
                         f"{max_pos} ({path})")


def build_engine(opts: BuildOptions, also: Callable[[Path], None] | None = None) -> BuildResult:
    """Validates the checkpoint, builds the engine in a temp dir and renames it to opts.out.
    `also(tmp)` writes another output from the finished engine while it is still in its temp dir
    (medusa-build --triton-repo): if it fails, no engine appears either."""
    start = time.perf_counter()
    opts.checkpoint, opts.out = Path(opts.checkpoint), Path(opts.out)
    _refuse_hf_model_dir(opts.checkpoint)
    try:
        validate_checkpoint(opts.checkpoint)
        config = read_config(opts.checkpoint)
        check_finite_weights(opts.checkpoint)  # every backend, before any work (trtllm-build reads the files itself)
    except CheckpointError as e:
        raise BuildError(str(e)) from None
    check_options(opts, config)
    tree = recorded_tree(opts, config)
    check_output_dir(opts.out, opts.force, BuildError, (opts.checkpoint, opts.datastore))
    # The datastore's text is read (and refused) before any engine work; indexed into the temp dir.
    sequences = (datastore.read_source(opts.datastore, opts.checkpoint, config["vocab_size"])
                 if opts.datastore is not None else None)
    if sequences is not None:
        _datastore_advice(opts, sum(len(s) for s in sequences))

    with atomic_output_dir(opts.out, opts.force, BuildError, (opts.checkpoint, opts.datastore)) as tmp:
        backend_part = BUILDERS[opts.backend](opts, config, tmp)
        _copy_tokenizer(opts.checkpoint, tmp, (config.get("medusa_trt") or {}).get("base_model_type")
                        or config.get("model_type"))
        if sequences is not None:
            datastore.save(datastore.build(sequences), tmp / datastore.FILE, source=str(opts.datastore))
        engine = engine_json(opts, config, backend_part, tmp, time.perf_counter() - start)
        if tree is not None:
            engine["medusa"].update(tree=tree[0], tree_source=tree[1])
        validate_engine(engine, opts.out / ENGINE_JSON)  # the writer obeys the schema its readers check
        (tmp / ENGINE_JSON).write_text(json.dumps(engine, indent=2) + "\n")
        if also is not None:
            also(tmp)
    return BuildResult(opts.out, engine, time.perf_counter() - start)


def _refuse_hf_model_dir(checkpoint: Path) -> None:
    """A Hugging Face model dir passed as --checkpoint: say what to run, rather than list the merged
    checkpoint's keys it lacks (an HF config.json has `architectures`, a merged one `architecture`)."""
    path = checkpoint / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # validate_checkpoint names what is wrong with it
    if isinstance(config, dict) and "architecture" not in config and "architectures" in config:
        raise BuildError(f"{checkpoint}: a Hugging Face model directory, not a merged checkpoint; run medusa-convert "
                         f"first (medusa-convert --base {checkpoint} --heads HEADS --out merged/), then medusa-build "
                         "--checkpoint merged/")


def _datastore_advice(opts: BuildOptions, tokens: int) -> None:
    """What the measurements say about this datastore (it is built anyway: decoding stays exact)."""
    if tokens < datastore.PAYS_FROM:
        log.warning("--datastore %s: %d tokens; datastores under %d tokens measured no gain, as the drafter and the "
                    "prompt's n-grams already propose most of what they hold (docs/benchmarks/issue-35-amphista.md, t)",
                    opts.datastore, tokens, datastore.PAYS_FROM)
    if getattr(opts.backend_options, "weights", None) == "int4":
        log.warning("--datastore with --weights int4: an int4 step verifies one chain, and a datastore measured "
                    "0.96-0.98x there (docs/benchmarks/issue-35-amphista.md, s)")


def recorded_tree(opts: BuildOptions, config: dict) -> tuple[list[list[int]] | str, str] | None:
    """opts.tree as the engine records it: its nodes (prefixes added, checked against the heads and
    max_draft_len before any work), or "dynamic:N" for trees chosen per step, and its source (a
    file's name, a preset's name or "given")."""
    if opts.tree is None:
        return None
    from medusa_trt.dynamic_spec import read_dynamic
    from medusa_trt.runtime.dynamic import dynamic_tree
    from medusa_trt.tree import TreeError, candidate_topk, read_tree

    heads = int(config.get("num_medusa_heads") or 0)
    if heads == 0:
        raise BuildError(f"--tree: {opts.checkpoint} has no Medusa heads to draft a tree with")
    limit = limits_for(opts, config).max_draft_len
    try:
        parsed = read_dynamic(opts.tree)
        if parsed is not None:
            if opts.backend == "tensorrt-llm":
                raise TreeError(f"{opts.tree!r}: TensorRT-LLM engines verify static trees only; expected a list of "
                                "paths or a preset")
            dynamic_tree(parsed.text, heads, candidate_topk(int(config["vocab_size"])), limit)  # fits the engine
            spec = str(parsed)
            return spec, "per-step trees" if spec == str(opts.tree).strip() else f"{Path(str(opts.tree)).name}: {spec}"
        nodes = read_tree(opts.tree, heads, limit, int(config["vocab_size"]))
    except TreeError as e:
        raise BuildError(f"--tree: {e}") from None
    spec = str(opts.tree) if isinstance(opts.tree, (str, Path)) else "given"
    source = Path(spec).name if Path(spec).suffix in (".json", ".yaml", ".yml") else spec
    return nodes, source if len(source) <= 80 else "given"


def engine_json(opts: BuildOptions, config: dict, backend_part: dict, workdir: Path, seconds: float) -> dict:
    heads = int(config["num_attention_heads"])
    limits = limits_for(opts, config)
    engine = {
        "format_version": ENGINE_FORMAT_VERSION,
        # The optional features a reader must know to run this engine (engine_dir.KNOWN_FEATURES).
        "requires": required_features(backend_part),
        "backend": opts.backend,
        "device": opts.device,
        "dtype": backend_part.pop("dtype"),
        "model": {
            "model_type": config.get("model_type"),
            "vocab_size": int(config["vocab_size"]),
            "hidden_size": int(config["hidden_size"]),
            "intermediate_size": int(config["intermediate_size"]),
            "num_layers": int(config["num_hidden_layers"]),
            "num_heads": heads,
            "num_kv_heads": int(config.get("num_key_value_heads") or heads),
            "head_dim": int(config.get("head_size") or int(config["hidden_size"]) // heads),
            "max_position_embeddings": int(config["max_position_embeddings"]),
            # Built into the graphs; recorded so a reader can tell (docs/formats.md section 2).
            "sliding_window": config.get("sliding_window"),
            "layer_types": config.get("layer_types"),
        },
        "medusa": {
            "num_heads": int(config.get("num_medusa_heads") or 0),
            "num_layers": int(config.get("num_medusa_layers") or 0),
            "max_draft_len": limits.max_draft_len,
        },
        "limits": asdict(limits),
        **backend_part,
        "eos_token_id": config.get("eos_token_id"),
        # The HF model_type the tokenizer belongs to: transformers picks the tokenizer class from it
        # when tokenizer_config.json names a generic class, and the engine dir has no config.json.
        "tokenizer": {"model_type": (config.get("medusa_trt") or {}).get("base_model_type") or config.get("model_type")},
        "checkpoint": {
            "path": str(opts.checkpoint.resolve()),
            "dtype": config.get("dtype"),
            "config_sha256": sha256_file(opts.checkpoint / "config.json"),
        },
        "artifacts": artifact_checksums(workdir),
        "tools": tool_versions(),
        "build": {"seconds": round(seconds, 3), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "options": _paths_as_text(asdict(opts))},
    }
    return engine


def _paths_as_text(value):
    """The options with every Path (the backend's own options hold some too) as a string, for JSON."""
    if isinstance(value, dict):
        return {k: _paths_as_text(v) for k, v in value.items()}
    return str(value) if isinstance(value, Path) else value


def tool_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for dist in ("medusa-trt", "torch", "onnx", "onnxruntime", "onnxruntime-gpu", "onnxscript", "transformers"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def _copy_tokenizer(checkpoint: Path, workdir: Path, model_type: str | None) -> None:
    """Everything in the checkpoint that is not weights or its config: tokenizer, generation config.

    A tokenizer_config.json may name a generic class (TokenizersBackend), which transformers replaces
    by the class of the model config's model_type (Qwen2Tokenizer, which tokenizes differently). An
    engine dir has no HF config.json, so the tokenizer is saved again as that class loads it: plain
    `AutoTokenizer.from_pretrained(engine_dir)` then gives the ids the engine's own loader gives."""
    for path in sorted(checkpoint.iterdir()):
        if path.is_file() and path.name not in _CHECKPOINT_ONLY and not path.name.endswith(".safetensors"):
            shutil.copy2(path, workdir / path.name)
    if not model_type or not (workdir / "tokenizer_config.json").is_file():
        return
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.for_model(model_type)
    except ValueError:  # a model_type this transformers does not know: the files stay as they are
        return
    AutoTokenizer.from_pretrained(str(workdir), config=config).save_pretrained(str(workdir))

