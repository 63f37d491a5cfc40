"""medusa-triton: write a Triton Inference Server model repository for an engine.

Two layouts:
- our engines (ONNX Runtime, TensorRT) and merged checkpoints: one Python-backend model,
  `<name>/config.pbtxt` + `<name>/1/model.py`, where model.py delegates to
  medusa_trt.serving.triton_model (so the serving logic is a normal, testable module);
- TensorRT-LLM engines: the tensorrtllm_backend layout (ensemble / preprocessing / tensorrt_llm /
  postprocessing), with `medusa_choices` in brace form and `decoding_mode` "medusa"; the pre- and
  postprocessing models are our own self-contained model.py files (transformers' AutoTokenizer).

Every repository is written to a temporary directory beside the target and renamed into place, so
a failed or interrupted write never leaves a half-written repository where Triton would load it.
This module only writes text: no torch, no tritonclient.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from medusa_trt.checkpoint import validate_config
from medusa_trt.dynamic_spec import read_dynamic
from medusa_trt.engine_dir import ENGINE_JSON, MAX_BATCH_SIZE, EngineError, read_engine
from medusa_trt.errors import MedusaTrtError, read_json_object
from medusa_trt.outputs import atomic_output_dir
from medusa_trt.runtime.config import acceptance_setting_problem
from medusa_trt.runtime.dynamic import dynamic_tree
from medusa_trt.tree import (
    CANDIDATE_TOPK,
    DEFAULT_TREE,
    TreeError,
    check_trtllm_ranks,
    read_tree,
    tree_for_engine,
    tree_to_brace,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


class RepoError(MedusaTrtError):
    """A repository that cannot be written; the message names the path or value and what was expected."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # Triton data type, e.g. "TYPE_INT32"
    dims: tuple[int, ...]  # without the batch dimension (every model here has max_batch_size > 0)
    optional: bool = False
    scalar: bool = False  # `reshape: { shape: [ ] }`: the backend gets [B], not [B, 1] (tensorrtllm_backend)
    ragged: bool = False  # `allow_ragged_batch`: requests of other lengths batch together (tensorrtllm_backend)


# The Python-backend model's interface: tensorrtllm_backend's ensemble names where one exists (its
# max_tokens, top_k and end_id are INT32; ours are INT64, below). triton_model reads these same specs
# to check requests.
MODEL_INPUTS = (
    # The prompt: raw text (text_input), or chat turns rendered with the model's chat template
    # (messages: JSON [{"role": ..., "content": ...}, ...]); a request sends exactly one of them.
    TensorSpec("text_input", "TYPE_STRING", (1,), optional=True),
    TensorSpec("messages", "TYPE_STRING", (1,), optional=True),
    # INT64 (also top_k and end_id): Triton's HTTP/JSON front end wraps an INT32 value beyond 2**31
    # (5000000000 arrives as 705032704) before the model sees it; as INT64 every value a client can
    # send arrives as sent and the model checks it (max_output_len, the vocabulary).
    TensorSpec("max_tokens", "TYPE_INT64", (1,)),
    TensorSpec("medusa_choices", "TYPE_STRING", (1,), optional=True),
    TensorSpec("temperature", "TYPE_FP32", (1,), optional=True),
    TensorSpec("acceptance", "TYPE_STRING", (1,), optional=True),
    TensorSpec("posterior_threshold", "TYPE_FP32", (1,), optional=True),
    TensorSpec("posterior_alpha", "TYPE_FP32", (1,), optional=True),
    TensorSpec("top_k", "TYPE_INT64", (1,), optional=True),  # sample acceptance
    TensorSpec("top_p", "TYPE_FP32", (1,), optional=True),  # sample acceptance
    TensorSpec("seed", "TYPE_UINT64", (1,), optional=True),  # sample acceptance: row r draws from seed + r
    TensorSpec("end_id", "TYPE_INT64", (1,), optional=True),
    TensorSpec("stop_words", "TYPE_STRING", (-1,), optional=True),
    TensorSpec("stream", "TYPE_BOOL", (1,), optional=True),
)
MODEL_OUTPUTS = (
    TensorSpec("text_output", "TYPE_STRING", (1,)),
    TensorSpec("output_ids", "TYPE_INT32", (-1,)),  # -1 padded: to the longest row, and to >= 2 values (a list)
    TensorSpec("acceptance_rate", "TYPE_FP32", (1,)),
    TensorSpec("total_accepted_draft_tokens", "TYPE_INT32", (1,)),
    TensorSpec("total_draft_tokens", "TYPE_INT32", (1,)),
    TensorSpec("tokens_per_step", "TYPE_FP32", (1,)),
)

MODEL_PY = '''"""Triton Python-backend entry point written by medusa-triton.

The serving logic lives in medusa_trt.serving.triton_model; this file only makes Triton find it.
"""

try:
    from medusa_trt.serving.triton_model import TritonPythonModel  # noqa: F401
except ImportError as err:
    raise ImportError(
        f"{__file__}: cannot import medusa_trt ({err}). Triton's Python stub takes its sys.path from "
        "the environment that started tritonserver: start it with the virtualenv that has medusa-trt "
        "installed first on PATH (medusa-serve does this)."
    ) from err
'''


@dataclass(frozen=True)
class EngineInfo:
    """What a repository needs to know about an engine, read from its metadata without loading it."""

    directory: Path
    kind: str  # "onnxruntime", "tensorrt", "tensorrt-llm" or "checkpoint"
    num_heads: int
    max_draft_len: int
    max_seq_len: int
    max_batch_size: int | None  # None: no limit recorded (a checkpoint runs any batch)
    tree: list[list[int]] | str | None = None  # the tree the engine records (medusa-build --tree; str: dynamic:N)
    tree_source: str | None = None


def read_engine_info(engine_dir: str | Path) -> EngineInfo:
    """Reads engine.json (our engines), config.json of a merged checkpoint, or the config.json
    trtllm-build writes (pretrained_config + build_config)."""
    d = Path(engine_dir)
    if not d.is_dir():
        raise RepoError(f"{d}: engine directory not found (expected a medusa-build engine dir, a merged "
                        "checkpoint or a TensorRT-LLM engine dir)")
    if (d / ENGINE_JSON).exists():
        try:
            e = read_engine(d)
        except EngineError as err:
            raise RepoError(str(err)) from None
        limits = e["limits"]
        return EngineInfo(d.resolve(), e["backend"], e["medusa"]["num_heads"], limits["max_draft_len"],
                          limits["max_seq_len"], limits["max_batch_size"], e["medusa"].get("tree"),
                          e["medusa"].get("tree_source"))
    if not (d / "config.json").is_file():
        raise RepoError(f"{d}: neither engine.json nor config.json found (expected a medusa-build engine "
                        "dir, a merged checkpoint or a TensorRT-LLM engine dir)")
    c = _read_json(d / "config.json")
    if "pretrained_config" in c and "build_config" in c:  # trtllm-build output
        pre, build = c["pretrained_config"], c["build_config"]
        heads = int(pre.get("num_medusa_heads") or 0)
        draft = int(build.get("max_draft_len") or pre.get("max_draft_len") or 0)
        if heads == 0 or draft == 0:
            raise RepoError(f"{d / 'config.json'}: TensorRT-LLM engine without Medusa heads "
                            f"(num_medusa_heads={heads}, max_draft_len={draft}); build it with "
                            "--speculative_decoding_mode medusa")
        return EngineInfo(d.resolve(), "tensorrt-llm", heads, draft,
                          int(build.get("max_seq_len") or pre.get("max_position_embeddings") or 0),
                          int(build["max_batch_size"]) if build.get("max_batch_size") else None)
    if c.get("architecture") != "MedusaForCausalLM":
        raise RepoError(f"{d / 'config.json'}: architecture {c.get('architecture')!r} is neither a merged "
                        "checkpoint ('MedusaForCausalLM') nor a TensorRT-LLM engine config")
    validate_config(c, d / "config.json")  # the checks every command that loads a checkpoint makes
    return EngineInfo(d.resolve(), "checkpoint", int(c.get("num_medusa_heads") or 0),
                      int(c.get("max_draft_len") or 63), int(c["max_position_embeddings"]), None)


def write_triton_repo(
    engine_dir: str | Path, out_dir: str | Path, *, model_name: str = "medusa", max_batch_size: int | None = None,
    medusa_choices: object = None, decoupled: bool = False, acceptance: str = "greedy", temperature: float = 0.7,
    posterior_threshold: float = 0.09, posterior_alpha: float = 0.3, max_input_len: int | None = None,
    max_output_len: int | None = None, max_queue_delay_us: int = 1000, instance_count: int = 1,
    device: str | None = None, dtype: str | None = None, intra_op_threads: int = 0,
    tokenizer_dir: str | Path | None = None, force: bool = False, engine_dir_as: str | Path | None = None,
) -> Path:
    """Writes the repository that serves `engine_dir`; returns out_dir.

    Our engines and merged checkpoints get the Python-backend model; a TensorRT-LLM engine gets the
    tensorrtllm_backend layout (write_trtllm_triton_repo), so `medusa-build --triton-repo` needs one
    call whatever it built. `medusa_choices` (any form tree.parse_medusa_choices accepts; default: the
    engine's own, see default_tree) is the default tree; requests may send their own. `engine_dir_as`: the
    path the model loads the engine from, when `engine_dir` is where it is being written (medusa-build's
    temp dir)."""
    info = read_engine_info(engine_dir)
    if info.kind == "tensorrt-llm":
        return write_trtllm_triton_repo(info.directory, out_dir, tokenizer_dir or info.directory, medusa_choices,
                                        max_batch_size=max_batch_size, decoupled=decoupled, force=force)
    if tokenizer_dir is not None and Path(tokenizer_dir).resolve() != info.directory:
        raise RepoError(f"--tokenizer-dir {tokenizer_dir}: the Python-backend model reads the tokenizer from "
                        f"the engine dir {info.directory}; a separate tokenizer is for TensorRT-LLM engines only")
    _check_tokenizer(info.directory)
    if not _MODEL_NAME.fullmatch(model_name):
        raise RepoError(f"model name {model_name!r}: expected letters, digits, '_', '.' or '-'")
    batch = _check_batch(max_batch_size, info)
    tree = default_tree(medusa_choices, info)[0]
    if isinstance(tree, str):
        check_dynamic(tree, info)
    # A request's prompt + max_tokens must fit max_seq_len (the model checks each); a tree's depth
    # needs no room of its own: the decoder cuts the last steps' trees (StepTree.within_room).
    room = info.max_seq_len
    max_input_len = room - 1 if max_input_len is None else max_input_len
    max_output_len = room - 1 if max_output_len is None else max_output_len
    for name, value in (("max_input_len", max_input_len), ("max_output_len", max_output_len)):
        if not 1 <= value < room:
            raise RepoError(f"{name} {value}: expected 1..{room - 1} ({info.directory} allows "
                            f"{info.max_seq_len} positions)")
    if acceptance not in ("greedy", "typical", "sample"):
        raise RepoError(f"acceptance {acceptance!r}: expected 'greedy', 'typical' or 'sample'")
    if acceptance == "sample" and not temperature > 0:
        raise RepoError(f"temperature {temperature} with acceptance 'sample': expected > 0 (use acceptance 'greedy')")
    if bad := acceptance_setting_problem(temperature, posterior_threshold, posterior_alpha):
        raise RepoError(f"{bad[0]} {bad[1]}: expected a finite value {bad[2]}")
    if instance_count < 1 or max_queue_delay_us < 0 or intra_op_threads < 0:
        raise RepoError(f"instance_count {instance_count}, max_queue_delay_us {max_queue_delay_us}, "
                        f"intra_op_threads {intra_op_threads}: expected >= 1, >= 0, >= 0")
    params = {
        "engine_dir": str(Path(engine_dir_as).resolve() if engine_dir_as is not None else info.directory),
        "medusa_choices": tree if isinstance(tree, str) else tree_to_brace(tree),
        "acceptance": acceptance,
        "temperature": repr(float(temperature)),
        "posterior_threshold": repr(float(posterior_threshold)),
        "posterior_alpha": repr(float(posterior_alpha)),
        "max_input_len": str(max_input_len),
        "max_output_len": str(max_output_len),
        "device": device or "",  # empty: the engine's own device
        "dtype": dtype or "",  # empty: the checkpoint's dtype
        "intra_op_threads": str(intra_op_threads),  # 0: the library default
    }
    config = "\n".join([
        f"name: {_q(model_name)}",
        'backend: "python"',
        f"max_batch_size: {batch}",
        # Requests that arrive while a batch decodes queue up and form the next batch; the delay
        # only matters for requests arriving together at an idle server.
        f"dynamic_batching {{\n  max_queue_delay_microseconds: {max_queue_delay_us}\n}}",
        f"model_transaction_policy {{\n  decoupled: {'true' if decoupled else 'false'}\n}}",
        # Ragged: Triton's batcher otherwise batches only requests whose inputs have equal shapes;
        # our execute() reads each request on its own anyway. (It still batches only requests that
        # carry the same set of optional inputs: measured with this server, not configurable.)
        _tensors("input", MODEL_INPUTS, ragged=True),
        _tensors("output", MODEL_OUTPUTS),
        # One instance owns the engine; more instances mean more copies of the weights.
        f"instance_group [\n  {{\n    count: {instance_count}\n    kind: KIND_CPU\n  }}\n]",
        _parameters(params),
    ]) + "\n"

    def fill(root: Path) -> None:
        (root / model_name / "1").mkdir(parents=True)
        (root / model_name / "config.pbtxt").write_text(config)
        (root / model_name / "1" / "model.py").write_text(MODEL_PY)

    return _write_atomically(Path(out_dir), fill, force, (info.directory, engine_dir_as))


# --- TensorRT-LLM (tensorrtllm_backend layout) ---------------------------------------------------

ENSEMBLE_INPUTS = (
    TensorSpec("text_input", "TYPE_STRING", (1,)),
    TensorSpec("max_tokens", "TYPE_INT32", (1,)),
    TensorSpec("end_id", "TYPE_INT32", (1,), optional=True),
    TensorSpec("pad_id", "TYPE_INT32", (1,), optional=True),
    TensorSpec("stop_words", "TYPE_STRING", (-1,), optional=True),
    TensorSpec("bad_words", "TYPE_STRING", (-1,), optional=True),
    TensorSpec("stream", "TYPE_BOOL", (1,), optional=True),
    TensorSpec("temperature", "TYPE_FP32", (1,), optional=True),
    TensorSpec("top_k", "TYPE_INT32", (1,), optional=True),
    TensorSpec("top_p", "TYPE_FP32", (1,), optional=True),
)
ENSEMBLE_OUTPUTS = (
    TensorSpec("text_output", "TYPE_STRING", (-1,)),
    TensorSpec("acceptance_rate", "TYPE_FP32", (1,)),
    TensorSpec("total_accepted_draft_tokens", "TYPE_INT32", (1,)),
    TensorSpec("total_draft_tokens", "TYPE_INT32", (1,)),
)
PRE_INPUTS = (
    TensorSpec("QUERY", "TYPE_STRING", (1,)),
    TensorSpec("REQUEST_OUTPUT_LEN", "TYPE_INT32", (1,)),
    TensorSpec("END_ID", "TYPE_INT32", (1,), optional=True),
    TensorSpec("PAD_ID", "TYPE_INT32", (1,), optional=True),
    TensorSpec("STOP_WORDS_DICT", "TYPE_STRING", (-1,), optional=True),
    TensorSpec("BAD_WORDS_DICT", "TYPE_STRING", (-1,), optional=True),
)
PRE_OUTPUTS = (
    TensorSpec("INPUT_ID", "TYPE_INT32", (-1,)),
    TensorSpec("REQUEST_INPUT_LEN", "TYPE_INT32", (1,)),
    TensorSpec("REQUEST_OUTPUT_LEN", "TYPE_INT32", (1,)),
    TensorSpec("STOP_WORDS_IDS", "TYPE_INT32", (2, -1)),
    TensorSpec("BAD_WORDS_IDS", "TYPE_INT32", (2, -1)),
    TensorSpec("OUT_END_ID", "TYPE_INT32", (1,)),
    TensorSpec("OUT_PAD_ID", "TYPE_INT32", (1,)),
    TensorSpec("RETURN_PERF_METRICS", "TYPE_BOOL", (1,)),  # always true: the acceptance outputs need it
)
TRTLLM_INPUTS = (
    TensorSpec("input_ids", "TYPE_INT32", (-1,), ragged=True),  # ragged as in tensorrtllm_backend's template
    # Scalars reshaped as tensorrtllm_backend's tensorrt_llm/config.pbtxt template does; without it the
    # backend sees [B, 1] input_lengths and its batch split rejects requests of more than one row.
    TensorSpec("input_lengths", "TYPE_INT32", (1,), scalar=True),
    TensorSpec("request_output_len", "TYPE_INT32", (1,)),
    TensorSpec("end_id", "TYPE_INT32", (1,), optional=True, scalar=True),
    TensorSpec("pad_id", "TYPE_INT32", (1,), optional=True, scalar=True),
    TensorSpec("stop_words_list", "TYPE_INT32", (2, -1), optional=True, ragged=True),
    TensorSpec("bad_words_list", "TYPE_INT32", (2, -1), optional=True, ragged=True),
    TensorSpec("streaming", "TYPE_BOOL", (1,), optional=True),
    TensorSpec("temperature", "TYPE_FP32", (1,), optional=True, scalar=True),
    TensorSpec("runtime_top_k", "TYPE_INT32", (1,), optional=True, scalar=True),
    TensorSpec("runtime_top_p", "TYPE_FP32", (1,), optional=True, scalar=True),
    TensorSpec("return_perf_metrics", "TYPE_BOOL", (1,), optional=True, scalar=True),  # as the return_* flags
)
TRTLLM_OUTPUTS = (
    TensorSpec("output_ids", "TYPE_INT32", (-1, -1)),  # [beam, tokens]
    TensorSpec("sequence_length", "TYPE_INT32", (-1,)),  # [beam]
    TensorSpec("acceptance_rate", "TYPE_FP32", (1,)),
    TensorSpec("total_accepted_draft_tokens", "TYPE_INT32", (1,)),
    TensorSpec("total_draft_tokens", "TYPE_INT32", (1,)),
)
POST_INPUTS = (
    TensorSpec("TOKENS_BATCH", "TYPE_INT32", (-1, -1)),
    TensorSpec("SEQUENCE_LENGTH", "TYPE_INT32", (-1,)),
)
POST_OUTPUTS = (TensorSpec("OUTPUT", "TYPE_STRING", (-1,)),)

# Ensemble wiring: (model, {model input: ensemble tensor}, {model output: ensemble tensor}).
# Names starting with "_" are internal tensors between steps.
ENSEMBLE_STEPS = (
    ("preprocessing",
     {"QUERY": "text_input", "REQUEST_OUTPUT_LEN": "max_tokens", "END_ID": "end_id", "PAD_ID": "pad_id",
      "STOP_WORDS_DICT": "stop_words", "BAD_WORDS_DICT": "bad_words"},
     {"INPUT_ID": "_INPUT_ID", "REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN",
      "REQUEST_OUTPUT_LEN": "_REQUEST_OUTPUT_LEN", "STOP_WORDS_IDS": "_STOP_WORDS_IDS",
      "BAD_WORDS_IDS": "_BAD_WORDS_IDS", "OUT_END_ID": "_END_ID", "OUT_PAD_ID": "_PAD_ID",
      "RETURN_PERF_METRICS": "_RETURN_PERF_METRICS"}),
    ("tensorrt_llm",
     {"input_ids": "_INPUT_ID", "input_lengths": "_REQUEST_INPUT_LEN", "request_output_len": "_REQUEST_OUTPUT_LEN",
      "end_id": "_END_ID", "pad_id": "_PAD_ID", "stop_words_list": "_STOP_WORDS_IDS",
      "bad_words_list": "_BAD_WORDS_IDS", "streaming": "stream", "temperature": "temperature",
      "runtime_top_k": "top_k", "runtime_top_p": "top_p", "return_perf_metrics": "_RETURN_PERF_METRICS"},
     {"output_ids": "_TOKENS_BATCH", "sequence_length": "_SEQUENCE_LENGTH", "acceptance_rate": "acceptance_rate",
      "total_accepted_draft_tokens": "total_accepted_draft_tokens", "total_draft_tokens": "total_draft_tokens"}),
    ("postprocessing",
     {"TOKENS_BATCH": "_TOKENS_BATCH", "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH"},
     {"OUTPUT": "text_output"}),
)


def write_trtllm_triton_repo(
    engine_dir: str | Path, out_dir: str | Path, tokenizer_dir: str | Path, medusa_choices: object = None, *,
    max_batch_size: int | None = None, decoupled: bool = False, max_queue_delay_us: int = 0,
    kv_cache_free_gpu_mem_fraction: float = 0.9, force: bool = False,
) -> Path:
    """Writes ensemble / preprocessing / tensorrt_llm / postprocessing for a TensorRT-LLM engine.

    `decoupled` makes tensorrt_llm decoupled, which streaming (`stream` true) needs. The tree is
    validated against the engine's head count when its config.json records one, and written fully
    expanded in brace form, the spelling tensorrtllm_backend parses."""
    engine = Path(engine_dir)
    if not engine.is_dir():
        raise RepoError(f"{engine}: TensorRT-LLM engine directory not found")
    try:
        info: EngineInfo | None = read_engine_info(engine)
    except RepoError:
        info = None  # a bare engine dir (rank0.engine + a config we do not know): nothing to validate against
    if info is not None and info.kind not in ("tensorrt-llm",):
        raise RepoError(f"{engine}: a {info.kind} engine, not TensorRT-LLM; write_triton_repo serves it with "
                        "the Python backend")
    tokenizer = Path(tokenizer_dir).resolve()
    _check_tokenizer(tokenizer)
    batch = _check_batch(max_batch_size, info)
    tree = _default_tree(medusa_choices, info)
    if isinstance(tree, str):
        raise RepoError(f"default tree {tree!r} for the TensorRT-LLM engine {engine}: TensorRT-LLM verifies static "
                        "trees only; expected a list of paths or a preset")
    try:
        check_trtllm_ranks(tree, f"default tree for the TensorRT-LLM engine {engine}")
    except TreeError as err:
        raise RepoError(str(err)) from None
    if not 0 <= kv_cache_free_gpu_mem_fraction <= 1:
        raise RepoError(f"kv_cache_free_gpu_mem_fraction {kv_cache_free_gpu_mem_fraction}: expected 0..1")
    dynamic = f"dynamic_batching {{\n  max_queue_delay_microseconds: {max_queue_delay_us}\n}}"
    cpu_instance = "instance_group [\n  {\n    count: 1\n    kind: KIND_CPU\n  }\n]"

    def python_model(name: str, inputs, outputs) -> str:
        return "\n".join([f"name: {_q(name)}", 'backend: "python"', f"max_batch_size: {batch}", dynamic,
                          _tensors("input", inputs, ragged=True), _tensors("output", outputs), cpu_instance,
                          _parameters({"tokenizer_dir": str(tokenizer)})]) + "\n"

    trtllm = "\n".join([
        'name: "tensorrt_llm"',
        'backend: "tensorrtllm"',
        f"max_batch_size: {batch}",
        f"model_transaction_policy {{\n  decoupled: {'true' if decoupled else 'false'}\n}}",
        dynamic,
        _tensors("input", TRTLLM_INPUTS),
        _tensors("output", TRTLLM_OUTPUTS),
        cpu_instance,  # the backend places the engine on the GPU itself
        _parameters({
            "gpt_model_type": "inflight_fused_batching",
            "gpt_model_path": str(engine.resolve()),
            "decoding_mode": "medusa",
            "medusa_choices": tree_to_brace(tree),
            "max_beam_width": "1",  # Medusa verifies one sequence per request
            "batch_scheduler_policy": "guaranteed_no_evict",
            "kv_cache_free_gpu_mem_fraction": repr(float(kv_cache_free_gpu_mem_fraction)),
            "exclude_input_in_output": "true",  # postprocessing detokenizes the new tokens only
            # The backend reads these three without a default while it loads (model_instance_state.cc,
            # getGuidedDecodingConfigFromParams): absent, the model fails to load. Empty: no guided decoding.
            "tokenizer_dir": str(tokenizer),
            "guided_decoding_backend": "",
            "xgrammar_tokenizer_info_path": "",
        }),
    ]) + "\n"
    ensemble = "\n".join([
        'name: "ensemble"',
        'platform: "ensemble"',
        f"max_batch_size: {batch}",
        _tensors("input", ENSEMBLE_INPUTS),
        _tensors("output", ENSEMBLE_OUTPUTS),
        _ensemble_scheduling(ENSEMBLE_STEPS),
    ]) + "\n"
    configs = {
        "preprocessing": python_model("preprocessing", PRE_INPUTS, PRE_OUTPUTS),
        "tensorrt_llm": trtllm,
        "postprocessing": python_model("postprocessing", POST_INPUTS, POST_OUTPUTS),
        "ensemble": ensemble,
    }
    here = Path(__file__).parent
    sources = {"preprocessing": here / "trtllm_preprocessing.py", "postprocessing": here / "trtllm_postprocessing.py"}

    def fill(root: Path) -> None:
        for name, text in configs.items():
            (root / name / "1").mkdir(parents=True)
            (root / name / "config.pbtxt").write_text(text)
        for name, source in sources.items():  # self-contained files: the TensorRT-LLM image lacks medusa_trt
            shutil.copyfile(source, root / name / "1" / "model.py")

    return _write_atomically(Path(out_dir), fill, force, (engine, tokenizer_dir))


# --- helpers -------------------------------------------------------------------------------------

def _read_json(path: Path) -> dict:
    return read_json_object(path, RepoError)


def _check_tokenizer(directory: Path) -> None:
    if not any((directory / f).is_file() for f in TOKENIZER_FILES):
        raise RepoError(f"{directory}: no tokenizer (expected one of {', '.join(TOKENIZER_FILES)}); the server "
                        "tokenizes text_input with it")


def _check_batch(max_batch_size: int | None, info: EngineInfo | None) -> int:
    limit = info.max_batch_size if info else None
    batch = max_batch_size if max_batch_size is not None else (limit or 8)
    if batch < 1 or batch > (limit or MAX_BATCH_SIZE):
        raise RepoError(f"max_batch_size {batch}: expected 1..{limit or MAX_BATCH_SIZE}"
                        + (f" (the engine {info.directory} was built for {limit})" if limit else ""))
    return batch


def default_tree(medusa_choices: object, info: EngineInfo | None) -> tuple[list[list[int]] | str, str]:
    """The repository's default tree and where it came from: `medusa_choices`, else the tree the
    engine records (medusa-build --tree), else DEFAULT_TREE cut to the engine."""
    if medusa_choices is not None:
        return _default_tree(medusa_choices, info), str(medusa_choices)
    if info is not None and info.tree:
        return _default_tree(info.tree, info), f"{info.tree_source or 'the tree'} recorded in the engine"
    if info is not None and info.num_heads:
        cut = [list(p) for p in tree_for_engine(info.num_heads, info.max_draft_len).nodes]
        return cut, f"{DEFAULT_TREE} cut to the engine (it records no tree: medusa-build --tree)"
    return _default_tree(DEFAULT_TREE, info), DEFAULT_TREE


def check_dynamic(spec: str, info: EngineInfo) -> None:
    """Refuses a "dynamic:N" default that the engine and its drafter cannot fill."""
    try:
        dynamic_tree(spec, info.num_heads, CANDIDATE_TOPK, info.max_draft_len)
    except TreeError as err:
        raise RepoError(f"default tree for {info.directory}: {err}") from None


def _default_tree(medusa_choices: object, info: EngineInfo | None) -> list[list[int]] | str:
    """The nodes of a static default tree, or a "dynamic:N" spec as it is (checked by check_dynamic)."""
    spec = DEFAULT_TREE if medusa_choices is None else medusa_choices
    try:
        parsed = read_dynamic(spec)
        if parsed is not None:  # a tree file's spec as its text, the slot cost it records kept
            return str(parsed)
        if info is None:  # no head count known: check the shape only
            return read_tree(spec, None)
        return read_tree(spec, info.num_heads, info.max_draft_len)
    except TreeError as err:
        where = f" for {info.directory} ({info.num_heads} heads, max_draft_len {info.max_draft_len})" if info else ""
        raise RepoError(f"default tree{where}: {err}") from None


def _write_atomically(out: Path, fill: Callable[[Path], None], force: bool, inputs: tuple) -> Path:
    """fill(tmp) writes the repository into a fresh temp dir beside `out`, renamed into place; `out`
    must not be or hold `inputs` (the engine it serves), which replacing it would delete."""
    if out.exists() and not force:
        raise RepoError(f"{out}: already exists (pass force=True / --force to replace it)")
    with atomic_output_dir(out, force, RepoError, inputs) as tmp:
        fill(tmp)
    return out


def _q(text: str) -> str:
    """A protobuf text-format string literal."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    return f'"{escaped}"'


def _tensors(key: str, specs: Sequence[TensorSpec], ragged: bool = False) -> str:
    items = []
    for s in specs:
        lines = [f"    name: {_q(s.name)}", f"    data_type: {s.dtype}", f"    dims: [ {', '.join(map(str, s.dims))} ]"]
        if s.scalar:
            lines.append("    reshape: { shape: [ ] }")
        if s.optional:
            lines.append("    optional: true")
        if ragged or s.ragged:
            lines.append("    allow_ragged_batch: true")
        items.append("  {\n" + "\n".join(lines) + "\n  }")
    return f"{key} [\n" + ",\n".join(items) + "\n]"


def _parameters(params: dict[str, str]) -> str:
    return "\n".join(f"parameters {{\n  key: {_q(k)}\n  value: {{\n    string_value: {_q(v)}\n  }}\n}}"
                     for k, v in params.items())


def _ensemble_scheduling(steps) -> str:
    blocks = []
    for model, inputs, outputs in steps:
        maps = [f"      input_map {{\n        key: {_q(k)}\n        value: {_q(v)}\n      }}" for k, v in inputs.items()]
        maps += [f"      output_map {{\n        key: {_q(k)}\n        value: {_q(v)}\n      }}" for k, v in outputs.items()]
        blocks.append(f"    {{\n      model_name: {_q(model)}\n      model_version: -1\n" + "\n".join(maps) + "\n    }")
    return "ensemble_scheduling {\n  step [\n" + ",\n".join(blocks) + "\n  ]\n}"
