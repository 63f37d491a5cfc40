"""medusa-build --backend tensorrt-llm: `trtllm-build` on the merged checkpoint, engine.json around it
(options: TrtllmOptions).

The merged checkpoint already is a TensorRT-LLM checkpoint (MedusaForCausalLM, docs/formats.md section
2), so the build is one `trtllm-build` run. `trtllm_build_command` decides its flags from the
checkpoint config and the medusa-build options (a pure function, tested without TensorRT-LLM):

- `--speculative_decoding_mode medusa --max_draft_len N`: N is the checkpoint's max_draft_len, which
  TensorRT-LLM's Medusa model also reads from config.json; a different --max-draft-len is refused
  rather than building an engine whose two values disagree (reconvert with medusa-convert instead).
- batch and length limits: `--max_batch_size`, `--max_seq_len` (default: max_position_embeddings),
  `--max_input_len` (default: max_seq_len minus one tree, so any prompt that leaves room for one
  verify step fits) and, when that exceeds TensorRT-LLM's default token budget of 8192,
  `--max_num_tokens` equal to it (a whole prompt must fit one step without chunked context).
- `--gpt_attention_plugin <dtype>`: the checkpoint's dtype; older TensorRT-LLM releases default
  it to float16, which a bfloat16 checkpoint must not get.
- GEMMs: float checkpoints use `--gemm_plugin <dtype>` (cuBLASLt, recommended for float16/bfloat16
  by TensorRT-LLM's tuning guide). FP8 checkpoints (quant_algo FP8) leave the GEMM plugin off,
  as that guide recommends, except for small batches (max_batch_size <= 4), where it recommends
  the FP8 GEMM plugin (`--gemm_plugin fp8`) for latency.
- FP8 linears (quant_algo FP8): `--use_fp8_context_fmha enable` with an FP8 KV cache (FP8 context
  attention; Hopper or newer; TrtllmOptions.fp8_context_fmha), `disable` otherwise, always said:
  later releases turn it on by default for FP8 checkpoints. An FP8 KV cache with float linears:
  `--use_paged_context_fmha disable`, which those releases also default on and then refuse to build
  ("FP8 Paged Context FMHA only works with fp8 quantization workflow"). The KV cache dtype itself
  comes from the checkpoint's quantization block, not from a flag.
- tensor parallelism: trtllm-build writes one `rank{N}.engine` per rank of the checkpoint's
  mapping (world_size = tp_size * pp_size); `--workers` builds that many in parallel when the
  machine has the GPUs (TrtllmOptions.workers, default 1). Running it takes `mpirun -n world_size`.

Which TensorRT-LLM: trtllm-build and the Medusa TensorRT engine exist up to the 1.2 releases
(SUPPORTED_TRTLLM; 1.2.1 is the last final release with them). TensorRT-LLM's main branch removed its
TensorRT engine backend in July 2026 (PRs #15763, #15918: no trtllm-build, no checkpoint conversion,
Medusa trees with them), so the 1.3 release candidates and later cannot build this engine; an
installed one is refused by version before anything runs (check_trtllm_version). This project's
`--backend tensorrt` is the maintained TensorRT path for Medusa trees.

What trtllm-build cannot express is refused rather than built wrong: a sliding window (Mistral,
Qwen2 with use_sliding_window) shorter than the engine's max_seq_len. trtllm-build has no
attention-window option; the window is a run-time setting of TensorRT-LLM's executor
(max_attention_window_size), which an engine directory does not carry.

The engine directory is trtllm-build's --output_dir itself: `config.json` and `rank{N}.engine` at
its top, which is where tensorrtllm_backend's `gpt_model_path` (medusa_trt.serving.triton_repo)
looks for them; engine.json and the tokenizer sit beside them.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from medusa_trt.checkpoint import CONFIG_DTYPES
from medusa_trt.engines.options import BackendOptions, BuildError, BuildOptions, backend_options

log = logging.getLogger(__name__)

TRTLLM_BUILD = "trtllm-build"
EXTRA_HINT = "pip install 'medusa-trt[tensorrt-llm]'"
DEFAULT_MAX_NUM_TOKENS = 8192  # trtllm-build's default --max_num_tokens
FP8_GEMM_PLUGIN_MAX_BATCH = 4  # the tuning guide's "small batch" for --gemm_plugin fp8
CHECKPOINT_DTYPES = tuple(CONFIG_DTYPES)
# TensorRT-LLM releases that ship trtllm-build with Medusa (pyproject's extra states the same range).
MIN_TRTLLM, MAX_TRTLLM = (0, 20), (1, 3)  # MAX exclusive: 1.3 lost the TensorRT engine backend
SUPPORTED_TRTLLM = ">=0.20,<1.3"


@dataclass(frozen=True)
class TrtllmOptions(BackendOptions):
    """medusa-build's TensorRT-LLM options (--max-input-len; the others for callers of build_engine)."""

    backend: ClassVar[str] = "tensorrt-llm"

    max_input_len: int | None = None  # --max-input-len; None: max_seq_len minus one tree
    fp8_context_fmha: bool = True  # --use_fp8_context_fmha enable for FP8 linears with an FP8 KV cache
    workers: int = 1  # trtllm-build --workers (at most the checkpoint's world size)
    trtllm_args: tuple[str, ...] = ()  # passed to trtllm-build after the flags chosen here
    trtllm_build: str | None = None  # the trtllm-build executable; None: trtllm-build on PATH


def trtllm_build_command(checkpoint_dir: str | Path, out_dir: str | Path, config: dict, opts: BuildOptions,
                         executable: str = TRTLLM_BUILD) -> list[str]:
    """The trtllm-build command line for this checkpoint config and these options (see the module
    docstring for each flag). Raises BuildError for options TensorRT-LLM cannot honour."""
    path = Path(checkpoint_dir) / "config.json"
    dtype = config.get("dtype")
    if dtype not in CHECKPOINT_DTYPES:
        raise BuildError(f"{path}: dtype {dtype!r}, expected one of {', '.join(CHECKPOINT_DTYPES)}")
    if opts.dtype is not None and opts.dtype != dtype:
        raise BuildError(f"--dtype {opts.dtype}: TensorRT-LLM builds the checkpoint's dtype ({dtype}, {path}); "
                         f"reconvert with medusa-convert --dtype {opts.dtype}")
    heads = int(config.get("num_medusa_heads") or 0)
    if heads < 1:
        raise BuildError(f"{path}: num_medusa_heads {heads}; --speculative_decoding_mode medusa needs Medusa heads")
    draft = int(config.get("max_draft_len") or 0)
    if draft < 1:
        raise BuildError(f"{path}: max_draft_len {config.get('max_draft_len')!r}, expected a positive integer")
    if opts.max_draft_len is not None and opts.max_draft_len != draft:
        raise BuildError(f"--max-draft-len {opts.max_draft_len} differs from the checkpoint's max_draft_len {draft} "
                         f"({path}), which TensorRT-LLM's Medusa model reads too; reconvert with medusa-convert "
                         f"--max-draft-len {opts.max_draft_len}")
    llm = backend_options(opts, TrtllmOptions)
    max_seq_len = opts.max_seq_len or int(config["max_position_embeddings"])
    window = config.get("sliding_window")
    if window is not None and window < max_seq_len:  # shorter sequences never reach past the window
        raise BuildError(f"{path}: sliding_window {window} is shorter than the engine's {max_seq_len} positions, "
                         "and trtllm-build has no attention-window option (TensorRT-LLM applies one at run time "
                         f"only), so the engine would attend past it; pass --max-seq-len {window}, or build with "
                         "--backend tensorrt or onnxruntime, which apply the window")
    max_input_len = llm.max_input_len or max(1, max_seq_len - (draft + 1))
    if not 1 <= max_input_len <= max_seq_len:
        raise BuildError(f"--max-input-len {max_input_len}: expected 1..{max_seq_len} (--max-seq-len)")
    quant = config.get("quantization") or {}
    fp8 = quant.get("quant_algo") == "FP8"
    fp8_kv = quant.get("kv_cache_quant_algo") == "FP8"

    cmd = [
        executable,
        "--checkpoint_dir", str(checkpoint_dir),
        "--output_dir", str(out_dir),
        "--speculative_decoding_mode", "medusa",
        "--max_draft_len", str(draft),
        "--max_batch_size", str(opts.max_batch_size),
        "--max_seq_len", str(max_seq_len),
        "--max_input_len", str(max_input_len),
        "--gpt_attention_plugin", dtype,
    ]
    if max_input_len > DEFAULT_MAX_NUM_TOKENS:
        cmd += ["--max_num_tokens", str(max_input_len)]
    if not fp8:
        cmd += ["--gemm_plugin", dtype]
    elif opts.max_batch_size <= FP8_GEMM_PLUGIN_MAX_BATCH:
        cmd += ["--gemm_plugin", "fp8"]
    if fp8:
        cmd += ["--use_fp8_context_fmha", "enable" if fp8_kv and llm.fp8_context_fmha else "disable"]
    elif fp8_kv:
        cmd += ["--use_paged_context_fmha", "disable"]
    workers = int(llm.workers or 1)
    if workers > 1:
        cmd += ["--workers", str(min(workers, world_size(config)))]
    cmd += [str(a) for a in llm.trtllm_args or ()]
    return cmd


def world_size(config: dict) -> int:
    mapping = config.get("mapping") or {}
    tp, pp = int(mapping.get("tp_size", 1)), int(mapping.get("pp_size", 1))
    return int(mapping.get("world_size", tp * pp))


def installed_trtllm_version() -> str | None:
    """The installed tensorrt-llm distribution's version, None when it is not installed as a package
    (a trtllm-build on PATH may still come from a source build)."""
    try:
        return importlib.metadata.version("tensorrt-llm")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_trtllm_version(version: str | None) -> None:
    """Raises BuildError when TensorRT-LLM `version` has no trtllm-build with Medusa (SUPPORTED_TRTLLM)."""
    if version is None:
        return
    parts = tuple(int(p) for p in re.findall(r"\d+", version)[:2])
    if MIN_TRTLLM <= parts < MAX_TRTLLM:
        return
    why = ("which has no trtllm-build (TensorRT-LLM removed its TensorRT engine backend, Medusa with it, in "
           "July 2026)" if parts >= MAX_TRTLLM else "older than this project supports")
    raise BuildError(f"TensorRT-LLM {version} is installed, {why}; --backend tensorrt-llm needs tensorrt-llm "
                     f"{SUPPORTED_TRTLLM} ({EXTRA_HINT}), or build with --backend tensorrt, this project's "
                     "TensorRT engine with Medusa trees")


def find_trtllm_build(opts: BuildOptions) -> str:
    given = backend_options(opts, TrtllmOptions).trtllm_build
    found = shutil.which(given or TRTLLM_BUILD)
    if found is None:
        what = f"{given!r} (TrtllmOptions.trtllm_build)" if given else f"'{TRTLLM_BUILD}' on PATH"
        raise BuildError(f"--backend tensorrt-llm runs trtllm-build, but {what} was not found: {EXTRA_HINT} "
                         "on a machine with an NVIDIA GPU (or put trtllm-build on PATH)")
    return found


def run_streaming(cmd: list[str], log_path: Path, echo: bool = True) -> int:
    """Runs `cmd`, copying its merged stdout/stderr line by line to our stderr (when `echo`) and to
    `log_path` as it comes; returns its exit status. An interrupt stops the child too."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # trtllm-build is Python: line-buffer its logging
    with open(log_path, "w") as log_file, subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env
    ) as proc:
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                log_file.write(line)
                if echo:
                    sys.stderr.write(line)
                    sys.stderr.flush()
        except BaseException:
            proc.kill()
            raise
        return proc.wait()


def build_trtllm(opts: BuildOptions, config: dict, workdir: Path) -> dict:
    """The BUILDERS entry for --backend tensorrt-llm (see the module docstring)."""
    opts.device = "cuda"  # engine.json's device: TensorRT-LLM engines run on the GPU only
    # The checkpoint and the options first (bad input is named whatever is installed), then the
    # installed TensorRT-LLM, then its trtllm-build.
    cmd = trtllm_build_command(opts.checkpoint.resolve(), workdir.resolve(), config, opts)
    check_trtllm_version(installed_trtllm_version())
    cmd[0] = find_trtllm_build(opts)
    log_path = workdir / "trtllm-build.log"
    log.info("running %s", " ".join(cmd))
    status = run_streaming(cmd, log_path, echo=opts.progress)
    if status != 0:
        # The temp engine dir is removed on failure: keep the log beside --out.
        kept = opts.out.parent / f"{opts.out.name}.trtllm-build.log"
        shutil.copyfile(log_path, kept)
        tail = log_path.read_text().strip().splitlines()[-1:] or ["(no output)"]
        raise BuildError(f"trtllm-build exited with status {status}: {tail[0].strip()} (whole log: {kept})")
    size = world_size(config)
    engines = [f"rank{r}.engine" for r in range(size)]
    missing = [name for name in engines if not (workdir / name).is_file()]
    if missing or not (workdir / "config.json").is_file():
        raise BuildError(f"trtllm-build succeeded but wrote no {', '.join(missing) or 'config.json'} in its "
                         f"--output_dir; expected config.json and {', '.join(engines)}")
    built = json.loads((workdir / "config.json").read_text())
    build_config = built.get("build_config") or {}
    quant = config.get("quantization") or {}
    part = {
        "dtype": config["dtype"],
        "tensorrt_llm": {
            "engines": engines,
            "config": "config.json",
            "world_size": size,
            "tp_size": int((config.get("mapping") or {}).get("tp_size", 1)),
            "run_with": f"mpirun -n {size}" if size > 1 else None,
            "command": cmd,
            "log": log_path.name,
            "build_config": {k: build_config.get(k) for k in (
                "max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens", "max_draft_len",
                "speculative_decoding_mode") if k in build_config},
            "version": built.get("version"),
        },
    }
    if quant.get("quant_algo") or quant.get("kv_cache_quant_algo"):
        part["quantization"] = {key: quant.get(key) for key in ("quant_algo", "kv_cache_quant_algo", "exclude_modules")}
    return part
