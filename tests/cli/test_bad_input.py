"""Bad input and faults, one table for every CLI and the Triton model: each case must end in exit
code 2 with ONE line `prog: error: ...` that names the bad thing, no traceback, and nothing left
behind (no --out, no .tmp-*/.old-* dirs). The CLIs run in-process through main(argv); SIGTERM
needs a real process."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from medusa_trt.cli import bench, check
from medusa_trt.cli import build as build_cli
from medusa_trt.cli import convert as convert_cli
from medusa_trt.cli import run as run_cli
from medusa_trt.cli import train_heads as train
from medusa_trt.cli import triton as triton_cli
from medusa_trt.cli import tune_tree as tune_cli
from medusa_trt.cli.serve import main as serve_main

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Ctx:
    tmp: Path
    base: Path
    heads: Path
    ckpt: Path
    engine: Path

    @property
    def out(self) -> Path:
        return self.tmp / "out"

    def copy(self, src: Path, name: str) -> Path:
        dst = self.tmp / name
        shutil.copytree(src, dst)
        return dst

    def edit_json(self, src: Path, name: str, file: str, edit: Callable[[dict], object]) -> Path:
        """A copy of `src` whose `file` (JSON) is edited; edit returns the new object or None to keep it."""
        d = self.copy(src, name)
        data = json.loads((d / file).read_text())
        new = edit(data)
        (d / file).write_text(json.dumps(data if new is None else new))
        return d

    def write(self, name: str, content: str | bytes) -> Path:
        p = self.tmp / name
        p.write_bytes(content if isinstance(content, bytes) else content.encode())
        return p


def _set(path: str, value):
    """edit function: data[a][b] = value for path 'a.b'."""
    def edit(data):
        keys = path.split(".")
        obj = data
        for k in keys[:-1]:
            obj = obj[k]
        obj[keys[-1]] = value
    return edit


def _delete(key: str):
    return lambda data: data.pop(key) and None


def _poison(src: Path, ctx: Ctx, name: str, file: str, value: float) -> Path:
    d = ctx.copy(src, name)
    path = next(d.glob(file))
    tensors = load_file(path)
    key = sorted(k for k in tensors if tensors[k].is_floating_point())[0]
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[3] = value
    save_file(tensors, path, metadata={"format": "pt"})
    return d


def _poison_heads(ctx: Ctx) -> Path:
    """A copy of the medusa_v1 heads (a torch state dict file) with one Inf."""
    import torch

    d = ctx.copy(ctx.heads, "h")
    path = next(d.rglob("*.pt"))
    state = torch.load(path, weights_only=True)
    key = sorted(k for k in state if state[k].is_floating_point())[0]
    state[key] = state[key].clone()
    state[key].view(-1)[1] = float("inf")
    torch.save(state, path)
    return d


def _trtllm_engine(ctx: Ctx) -> Path:
    """What trtllm-build leaves (its config.json; the engines cannot be built here)."""
    d = ctx.tmp / "trtllm"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "pretrained_config": {"architecture": "MedusaForCausalLM", "num_medusa_heads": 4, "max_draft_len": 63},
        "build_config": {"max_batch_size": 8, "max_seq_len": 512, "max_draft_len": 63}}))
    return d


def _engine_dir_with(ctx: Ctx, edit) -> Path:
    return ctx.edit_json(ctx.engine, "eng", "engine.json", edit)


def _flip_byte(ctx: Ctx) -> Path:
    d = ctx.copy(ctx.engine, "eng")
    data = bytearray((d / "model.onnx").read_bytes())
    data[-1] ^= 1
    (d / "model.onnx").write_bytes(bytes(data))
    return d


def _wrong_digest(ctx: Ctx) -> Path:
    def edit(data):
        data["artifacts"]["tokenizer.json"]["sha256"] = "0" * 64
    return _engine_dir_with(ctx, edit)


def _truncate(ctx: Ctx) -> Path:
    d = ctx.copy(ctx.ckpt, "ck")
    f = d / "rank0.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return d


def _file(ctx: Ctx) -> Path:
    return ctx.write("a_file", "keep me")


def _ckpt_with(key, value):
    return lambda c: c.edit_json(c.ckpt, "ck", "config.json", _set(key, value))


def _base_with(key, value):
    return lambda c: c.edit_json(c.base, "b", "config.json", _set(key, value))


RUN = ("medusa-run", run_cli.main)
CONVERT = ("medusa-convert", convert_cli.main)
BUILD = ("medusa-build", build_cli.main)
CHECK = ("medusa-check", check.main)
TRITON = ("medusa-triton", triton_cli.main)
TUNE = ("medusa-tune-tree", tune_cli.main)
BENCH = ("medusa-bench", bench.main)
TRAIN = ("medusa-train-heads", train.main)


def convert_args(c: Ctx, base=None, heads=None, out=None, *extra):
    return ["--base", str(base or c.base), "--heads", str(heads or c.heads), "--out", str(out or c.out), "--quiet",
            *extra]


def build_args(c: Ctx, ckpt=None, out=None, *extra):
    return ["--checkpoint", str(ckpt or c.ckpt), "--out", str(out or c.out), "--quiet", *extra]


def run_args(c: Ctx, src=None, *extra, prompt="Hello"):
    return ["--engine", str(src or c.engine), "--prompt", prompt, "--max-new-tokens", "4", *extra]


def run_ckpt_args(c: Ctx, src=None, *extra):
    return ["--checkpoint", str(src or c.ckpt), "--prompt", "Hello", "--max-new-tokens", "4", *extra]


YAML_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n" \
            "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\nmedusa_choices: [*c, *c, *c]\n"

def _bad_draft_vocab(c: Ctx) -> Path:
    """A merged checkpoint whose recorded draft vocabulary names id 300 of a 256-token vocabulary."""
    return _ckpt_with("medusa_trt.draft_vocab", [*range(16), 300])(c)


DRAFT_VOCAB_ERROR = ["config.json", "medusa_trt.draft_vocab", "token id 300", "0..255"]


def _int_weights(c: Ctx) -> Path:
    """A copy of the base whose lm_head holds int32 codes where float weights belong."""
    d = c.copy(c.base, "b")
    tensors = load_file(d / "model.safetensors")
    name = next(n for n in sorted(tensors) if n.endswith("down_proj.weight"))
    tensors[name] = (tensors[name] * 1000).to(dtype=__import__("torch").int32)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    return d


def _deep_header(c: Ctx) -> Path:
    """A copy of the checkpoint whose safetensors header is JSON nested past the parser's stack."""
    d = c.copy(c.ckpt, "ck")
    header = b"[" * 100000
    (d / "rank0.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    return d


def _garbage_graph(c: Ctx) -> Path:
    """A copy of the engine whose model.onnx is garbage, its digest re-recorded (so the graph's own
    reading, not the digest check, must say so)."""
    from medusa_trt.engine_dir import artifact_checksums

    d = _engine_dir_with(c, lambda data: None)
    (d / "model.onnx").write_bytes(b"\x08\xff" * 64)
    data = json.loads((d / "engine.json").read_text())
    (d / "engine.json").write_text(json.dumps(data | {"artifacts": artifact_checksums(d)}))
    return d

# (id, cli, argv(ctx), substrings the error line must hold)
CASES = [
    # -- medusa-convert: HF base config.json, weights, --out --------------------------------------
    ("convert-missing-base", CONVERT, lambda c: convert_args(c, base=c.tmp / "nope"), ["nope"]),
    ("convert-size-as-string", CONVERT, lambda c: convert_args(c, base=_base_with("hidden_size", "64")(c)),
     ["config.json", "hidden_size", "'64'", "integer"]),
    ("convert-negative-max-position", CONVERT,
     lambda c: convert_args(c, base=_base_with("max_position_embeddings", -1)(c)),
     ["config.json", "max_position_embeddings", "-1", "positive"]),
    ("convert-zero-layers", CONVERT, lambda c: convert_args(c, base=_base_with("num_hidden_layers", 0)(c)),
     ["num_hidden_layers", "positive"]),
    ("convert-eps-as-string", CONVERT, lambda c: convert_args(c, base=_base_with("rms_norm_eps", "tiny")(c)),
     ["rms_norm_eps", "'tiny'"]),
    ("convert-rope-theta-as-text", CONVERT, lambda c: convert_args(c, base=_base_with("rope_theta", "10000")(c)),
     ["config.json", "rope_theta", "'10000'", "number"]),
    ("convert-rope-factor-as-text", CONVERT,
     lambda c: convert_args(c, base=_base_with("rope_parameters", {"rope_type": "linear", "factor": "2"})(c)),
     ["config.json", "rope_parameters.factor", "'2'", "number"]),
    ("convert-architectures-not-a-list", CONVERT, lambda c: convert_args(c, base=_base_with("architectures", 5)(c)),
     ["config.json", "architectures", "list"]),
    ("convert-bad-eos", CONVERT, lambda c: convert_args(c, base=_base_with("eos_token_id", "</s>")(c)),
     ["eos_token_id", "token id"]),
    ("convert-config-is-a-list", CONVERT,
     lambda c: convert_args(c, base=c.edit_json(c.base, "b", "config.json", lambda d: [d])),
     ["config.json", "JSON object", "list"]),
    ("convert-config-not-json", CONVERT,
     lambda c: convert_args(c, base=(lambda d: (d / "config.json").write_text("{oops") and d)(c.copy(c.base, "b"))),
     ["config.json", "not valid JSON"]),
    ("convert-config-nested-deep", CONVERT,
     lambda c: convert_args(c, base=(lambda d: (d / "config.json").write_text("[" * 100000) and d)(c.copy(c.base, "b"))),
     ["config.json", "not valid JSON"]),
    ("convert-nan-in-base", CONVERT,
     lambda c: convert_args(c, base=_poison(c.base, c, "b", "model.safetensors", float("nan"))),
     ["model.safetensors", "NaN or Inf", "tensor"]),
    ("convert-inf-in-heads", CONVERT, lambda c: convert_args(c, heads=_poison_heads(c)),
     ["medusa_lm_head.pt", "NaN or Inf", "tensor"]),
    ("convert-out-is-a-file-force", CONVERT, lambda c: convert_args(c, None, None, _file(c), "--force"),
     ["a_file", "not a directory"]),
    ("convert-out-under-a-file", CONVERT, lambda c: convert_args(c, None, None, _file(c) / "sub"),
     ["a_file", "not a directory"]),
    ("convert-max-draft-len-zero", CONVERT, lambda c: convert_args(c, None, None, None, "--max-draft-len", "0"),
     ["--max-draft-len 0"]),
    # -- medusa-build: merged config.json, options, --out -----------------------------------------
    ("build-missing-checkpoint", BUILD, lambda c: build_args(c, c.tmp / "nope"), ["nope"]),
    ("build-vocab-as-string", BUILD, lambda c: build_args(c, _ckpt_with("vocab_size", "many")(c)),
     ["config.json", "vocab_size", "'many'", "integer"]),
    ("build-negative-layers", BUILD, lambda c: build_args(c, _ckpt_with("num_hidden_layers", -2)(c)),
     ["num_hidden_layers", "-2", "positive"]),
    ("build-unknown-dtype", BUILD, lambda c: build_args(c, _ckpt_with("dtype", "float7")(c)),
     ["config.json", "dtype", "float7"]),
    ("build-draft-len-huge-in-config", BUILD, lambda c: build_args(c, _ckpt_with("max_draft_len", 10**12)(c)),
     ["config.json", "max_draft_len", "1000000000000", "at most 1024"]),  # once an allocation of TiB at run time
    ("run-draft-len-huge-in-config", RUN,
     lambda c: ["--checkpoint", str(_ckpt_with("max_draft_len", 10**12)(c)), "--prompt", "hi"],
     ["config.json", "max_draft_len", "at most 1024"]),
    ("build-mapping-is-a-list", BUILD, lambda c: build_args(c, _ckpt_with("mapping", [1])(c)),
     ["config.json", "mapping", "JSON object"]),
    ("build-config-missing", BUILD,
     lambda c: build_args(c, (lambda d: (d / "config.json").unlink() or d)(c.copy(c.ckpt, "ck"))),
     ["config.json", "not found"]),
    ("build-out-is-a-file-force", BUILD, lambda c: build_args(c, None, _file(c), "--force"),
     ["a_file", "not a directory"]),
    ("build-max-batch-zero", BUILD, lambda c: build_args(c, None, None, "--max-batch-size", "0"),
     ["--max-batch-size 0"]),
    ("build-nan-in-checkpoint", BUILD,
     lambda c: build_args(c, _poison(c.ckpt, c, "ck", "rank0.safetensors", float("nan"))),
     ["rank0.safetensors", "tensor", "NaN or Inf"]),
    ("build-inf-in-checkpoint", BUILD,
     lambda c: build_args(c, _poison(c.ckpt, c, "ck", "rank0.safetensors", float("inf"))),
     ["rank0.safetensors", "tensor", "NaN or Inf"]),
    ("build-draft-vocab-beyond-vocab", BUILD, lambda c: build_args(c, _bad_draft_vocab(c)), DRAFT_VOCAB_ERROR),
    # -- medusa-run: engine.json, graphs, digests, run-time values --------------------------------
    ("run-missing-engine", RUN, lambda c: run_args(c, c.tmp / "nope"), ["nope"]),
    ("run-engine-vocab-as-string", RUN, lambda c: run_args(c, _engine_dir_with(c, _set("model.vocab_size", "x"))),
     ["engine.json", "model.vocab_size", "'x'", "integer"]),
    ("run-engine-json-is-a-list", RUN, lambda c: run_args(c, c.edit_json(c.engine, "eng", "engine.json", lambda d: [d])),
     ["engine.json", "JSON object"]),
    ("run-engine-missing-limits", RUN, lambda c: run_args(c, _engine_dir_with(c, _delete("limits"))),
     ["engine.json", "limits", "missing"]),
    ("run-engine-unknown-dtype", RUN, lambda c: run_args(c, _engine_dir_with(c, _set("dtype", "int3"))),
     ["engine.json", "dtype", "int3"]),
    ("run-engine-negative-seq-len", RUN, lambda c: run_args(c, _engine_dir_with(c, _set("limits.max_seq_len", -1))),
     ["limits.max_seq_len", "-1", "positive"]),
    ("run-engine-vocab-disagrees", RUN, lambda c: run_args(c, _engine_dir_with(c, _set("model.vocab_size", 300))),
     ["model.onnx", "vocabulary dim 256", "300"]),
    ("run-engine-layers-disagree", RUN, lambda c: run_args(c, _engine_dir_with(c, _set("model.num_layers", 3))),
     ["model.onnx", "past_key_2", "3 layers"]),
    ("run-tampered-graph", RUN, lambda c: run_args(c, _flip_byte(c)), ["model.onnx", "sha256 differs"]),
    ("run-wrong-recorded-digest", RUN, lambda c: run_args(c, _wrong_digest(c)), ["tokenizer.json", "sha256 differs"]),
    ("run-rank-beyond-vocab", RUN, lambda c: run_args(c, None, "--medusa-choices", "[[0], [300]]"),
     ["rank 300", "vocabulary", "256"]),
    ("run-nan-temperature", RUN, lambda c: run_args(c, None, "--temperature", "nan"), ["--temperature nan", "finite"]),
    ("run-negative-threads", RUN, lambda c: run_args(c, None, "--threads", "-1"), ["--threads -1"]),
    ("run-prompt-not-utf8", RUN, lambda c: run_args(c, prompt=b"caf\xe9".decode("utf-8", "surrogateescape")),
     ["--prompt", "UTF-8"]),
    ("run-prompt-file-not-utf8", RUN,
     lambda c: ["--engine", str(c.engine), "--batch-file", str(c.write("p.txt", b"ok\ncaf\xe9\n"))],
     ["p.txt", "UTF-8"]),
    ("run-prompts-as-json-array", RUN,  # not read as lines ("[", "{", ...)
     lambda c: ["--engine", str(c.engine), "--batch-file", str(c.write("p.json", b'[{"text": "hi"}]'))],
     ["p.json", ".json file is not read as prompts", ".jsonl"]),
    ("build-calibration-as-json-array", BUILD,
     lambda c: build_args(c, None, None, "--weights", "int8", "--calibration", str(c.write("cal.json", b'["hi"]'))),
     ["cal.json", ".json file is not read", ".jsonl"]),
    ("run-empty-medusa-choices", RUN, lambda c: run_args(c, None, "--medusa-choices", ""),
     ["medusa_choices ''", "empty"]),
    ("run-dynamic-zero", RUN, lambda c: run_args(c, None, "--medusa-choices", "dynamic:0"),
     ["dynamic:0", "budget 0", "N >= 1"]),
    ("run-dynamic-negative", RUN, lambda c: run_args(c, None, "--medusa-choices", "dynamic:-3"),
     ["dynamic:-3", "budget -3", "N >= 1"]),
    ("run-dynamic-not-a-number", RUN, lambda c: run_args(c, None, "--medusa-choices", "dynamic:abc"),
     ["dynamic:abc", "'abc' is not an integer"]),
    ("run-dynamic-beyond-heads-topk", RUN, lambda c: run_args(c, None, "--medusa-choices", "dynamic:999"),
     ["dynamic:999", "budget 999", "max_draft_len"]),
    ("run-yaml-alias-bomb", RUN, lambda c: run_args(c, None, "--medusa-choices", str(c.write("t.yaml", YAML_BOMB))),
     ["t.yaml", "aliases"]),
    ("run-json-tree-nested-deep", RUN,
     lambda c: run_args(c, None, "--medusa-choices", str(c.write("t.json", "[" * 60000 + "]" * 60000))),
     ["t.json", "nested 60000 levels"]),
    ("run-tree-file-not-json", RUN, lambda c: run_args(c, None, "--medusa-choices", str(c.write("t.json", "[[0],"))),
     ["t.json", "JSON"]),
    ("run-truncated-checkpoint", RUN, lambda c: run_ckpt_args(c, _truncate(c)), ["rank0.safetensors"]),
    ("run-checkpoint-negative-heads", RUN, lambda c: run_ckpt_args(c, _ckpt_with("num_medusa_heads", -1)(c)),
     ["num_medusa_heads", "-1"]),
    ("run-nan-in-checkpoint", RUN, lambda c: run_ckpt_args(c, _poison(c.ckpt, c, "ck", "rank0.safetensors", float("nan"))),
     ["rank0.safetensors", "tensor", "NaN or Inf"]),
    ("run-draft-vocab-beyond-vocab", RUN, lambda c: run_ckpt_args(c, _bad_draft_vocab(c)), DRAFT_VOCAB_ERROR),
    # -- medusa-check ------------------------------------------------------------------------------
    ("check-wrong-recorded-digest", CHECK, lambda c: ["--engine", str(_wrong_digest(c))],
     ["tokenizer.json", "sha256 differs"]),
    ("check-negative-atol", CHECK, lambda c: ["--engine", str(c.engine), "--atol", "-1"], ["--atol -1"]),
    ("check-prompts-not-utf8", CHECK, lambda c: ["--engine", str(c.engine), "--prompts", str(c.write("p.txt", b"\xff\n"))],
     ["p.txt", "UTF-8"]),
    ("check-draft-vocab-beyond-vocab", CHECK, lambda c: ["--engine", str(c.engine), "--checkpoint", str(_bad_draft_vocab(c))],
     DRAFT_VOCAB_ERROR),
    # -- medusa-triton -----------------------------------------------------------------------------
    ("triton-out-is-a-file-force", TRITON, lambda c: ["--engine", str(c.ckpt), "--out", str(_file(c)), "--force"],
     ["a_file", "not a directory"]),
    ("triton-engine-batch-as-string", TRITON,
     lambda c: ["--engine", str(_engine_dir_with(c, _set("limits.max_batch_size", "4"))), "--out", str(c.out)],
     ["engine.json", "limits.max_batch_size", "'4'"]),
    ("triton-engine-draft-len-huge", TRITON,
     lambda c: ["--engine", str(_engine_dir_with(c, _set("limits.max_draft_len", 10**12))), "--out", str(c.out)],
     ["engine.json", "limits.max_draft_len", "at most 1024"]),
    ("triton-tree-deep", TRITON,
     lambda c: ["--engine", str(c.ckpt), "--out", str(c.out), "--medusa-choices", "[" * 5000],
     ["nested 5000 levels"]),
    ("triton-trtllm-rank-16", TRITON,
     lambda c: ["--engine", str(_trtllm_engine(c)), "--out", str(c.out), "--tokenizer-dir", str(c.ckpt),
                "--medusa-choices", "[[0], [16]]"],
     ["rank 16", "4 bits"]),
    ("triton-draft-vocab-beyond-vocab", TRITON, lambda c: ["--engine", str(_bad_draft_vocab(c)), "--out", str(c.out)],
     DRAFT_VOCAB_ERROR),
    ("serve-invalid-port", ("medusa-serve", serve_main),
     lambda c: ["--repo", str(c.copy(c.ckpt, "repo")), "--http-port", "70000"], ["--http-port 70000", "65535"]),
    # -- medusa-tune-tree, medusa-bench, medusa-train-heads ---------------------------------------
    ("tune-tree-calibration-too-small", TUNE,
     lambda c: ["--engine", str(c.ckpt), "--calib-data", str(c.write("cal.txt", "a\n")), "--out", str(c.out / "t.json"),
                "--max-new-tokens", "1", "--no-measure", "--quiet"],
     ["calibration"]),
    ("tune-tree-draft-vocab-beyond-vocab", TUNE,
     lambda c: ["--engine", str(_bad_draft_vocab(c)), "--prompts", str(c.write("cal.txt", "a b c\n")),
                "--out", str(c.out / "t.json"), "--no-measure", "--quiet"], DRAFT_VOCAB_ERROR),
    ("tune-tree-budget-beyond-the-engine", TUNE,  # was dropped without a word after the tuning
     lambda c: ["--engine", str(c.engine), "--prompts", str(c.write("cal.txt", "a b c\n")), "--out", str(c.out / "t.json"),
                "--budgets", "4,100000", "--quiet"],
     ["--budgets 4,100000", "100000 is beyond", "expected budgets in 1.."]),
    ("tune-tree-prompt-longer-than-the-engine", TUNE,
     lambda c: ["--engine", str(c.engine), "--prompts", str(c.write("cal.txt", "a b c\n" + "a " * 5000 + "\n")),
                "--out", str(c.out / "t.json"), "--quiet"],
     ["cal.txt: prompt 2 has", "max_seq_len"]),
    ("bench-prompt-longer-than-the-engine", BENCH,
     lambda c: ["--engine", str(c.engine), "--prompts", str(c.write("p.txt", "a " * 5000 + "\n")), "--no-hf"],
     ["p.txt: prompt 1 has", "--max-new-tokens 128", "max_seq_len"]),
    ("bench-draft-vocab-beyond-vocab", BENCH,
     lambda c: ["--engine", str(_bad_draft_vocab(c)), "--prompts", str(c.write("p.txt", "a b c\n")), "--no-hf"],
     DRAFT_VOCAB_ERROR),
    ("tune-tree-out-file-exists", TUNE,
     lambda c: ["--engine", str(c.ckpt), "--prompts", str(c.write("cal.txt", "a b c\n")), "--out", str(_file(c)),
                "--no-measure", "--quiet"], ["a_file", "--out exists", "--force"]),
    ("check-json-file-exists", CHECK, lambda c: ["--engine", str(c.engine), "--json", str(_file(c))],
     ["a_file", "--json exists", "--force"]),
    ("bench-json-file-exists", BENCH,
     lambda c: ["--engine", str(c.ckpt), "--prompts", str(c.write("p.txt", "a b c\n")), "--json", str(_file(c))],
     ["a_file", "--json exists", "--force"]),
    ("bench-json-is-a-directory", BENCH,
     lambda c: ["--engine", str(c.ckpt), "--prompts", str(c.write("p.txt", "a b c\n")), "--json", str(c.tmp)],
     ["--json is a directory"]),
    ("bench-prompts-not-utf8", BENCH, lambda c: ["--engine", str(c.ckpt), "--prompts", str(c.write("p.txt", b"\xfe\n"))],
     ["p.txt", "UTF-8"]),
    # -- trees, prompts, tensors and engine.json values the checks above did not reach -------------
    ("run-tree-rank-past-int64", RUN, lambda c: run_args(c, None, "--medusa-choices", "[[0], [99999999999999999999999]]"),
     ["rank 99999999999999999999999", "beyond any vocabulary"]),
    ("build-tree-rank-beyond-vocab", BUILD, lambda c: build_args(c, None, None, "--tree", "[[0], [300]]"),
     ["--tree", "rank 300", "beyond the vocabulary (256 tokens)"]),
    ("run-prompts-lone-surrogate", RUN,
     lambda c: ["--engine", str(c.engine), "--prompts", str(c.write("p.jsonl", '{"text": "ab\\ud800"}\n')),
                "--max-new-tokens", "4"], ["p.jsonl:1", "surrogate"]),
    ("convert-int32-weights", CONVERT, lambda c: convert_args(c, _int_weights(c)),
     ["model.safetensors", "down_proj.weight", "dtype int32", "floating-point"]),
    ("run-checkpoint-header-nested-deep", RUN, lambda c: run_ckpt_args(c, _deep_header(c)),
     ["rank0.safetensors", "nested too deep"]),
    ("run-engine-seq-beyond-its-tables", RUN,
     lambda c: run_args(c, _engine_dir_with(c, _set("limits.max_seq_len", 10**6))),
     ["model.onnx", "rotary tables", "limits.max_seq_len 1000000"]),
    ("run-more-prompts-than-the-batch", RUN,  # checked before the tree line is printed: one line
     lambda c: ["--engine", str(c.engine), "--prompts", str(c.write("p.txt", "a b\n" * 9)), "--max-new-tokens", "2"],
     ["batch 9 exceeds the engine's max_batch_size 8"]),
    ("run-engine-head-dim-edited", RUN, lambda c: run_args(c, _engine_dir_with(c, _set("model.head_dim", 32))),
     ["model.onnx", "past_key_0", "head_dim"]),
    ("run-engine-graph-garbage-rehashed", RUN, lambda c: run_args(c, _garbage_graph(c)),
     ["model.onnx", "not a readable ONNX graph"]),
    ("run-engine-graph-unlisted", RUN,  # was loaded unchecked: its digest no longer in engine.json
     lambda c: run_args(c, _engine_dir_with(c, lambda data: data["artifacts"].pop("model.onnx") and None)),
     ["engine.json", "onnx.file 'model.onnx' is not in artifacts"]),
    ("run-checkpoint-amphista-block-not-object", RUN,
     lambda c: run_ckpt_args(c, _ckpt_with("medusa_trt", {"drafter": "amphista", "amphista": 5})(c)),
     ["config.json", "medusa_trt.amphista 5", "expected an object"]),
    ("run-checkpoint-gelu", RUN, lambda c: run_ckpt_args(c, _ckpt_with("hidden_act", "gelu")(c)),
     ["config.json", "hidden_act", "'gelu'", "'silu'"]),
    ("run-checkpoint-fp4", RUN, lambda c: run_ckpt_args(c, _ckpt_with("quantization.quant_algo", "FP4")(c)),
     ["config.json", "quantization.quant_algo", "'FP4'"]),
    ("run-threads-past-any-cpu", RUN, lambda c: run_args(c, None, "--threads", "99999999999999999999999"),
     ["--threads", "at most 1024"]),
    ("triton-device-unknown", TRITON, lambda c: ["--engine", str(c.engine), "--out", str(c.out), "--device", "tpu"],
     ["--device", "'tpu'", "cuda"]),
    ("triton-queue-delay-past-uint64", TRITON,
     lambda c: ["--engine", str(c.engine), "--out", str(c.out), "--max-queue-delay-us", "99999999999999999999999"],
     ["--max-queue-delay-us", "at most 10**9"]),
    ("serve-workdir-is-a-file", ("medusa-serve", serve_main),
     lambda c: ["--repo", str(c.copy(c.ckpt, "repo")), "--workdir", str(_file(c))], ["a_file", "not a directory"]),
    ("train-base-dtype-int32", TRAIN,
     lambda c: ["--base", str(_base_with("dtype", "int32")(c)), "--data", str(c.write("d.txt", "a b c\n")),
                "--out", str(c.out), "--quiet"], ["config.json", "dtype 'int32'", "float32"]),
    # -- an output never replaces an input, even with --force --------------------------------------
    ("triton-out-is-the-engine", TRITON, lambda c: ["--engine", str(c.copy(c.engine, "e")), "--out", str(c.tmp / "e"),
                                                    "--force"], ["--out must not be or contain the input"]),
    ("build-triton-repo-is-the-checkpoint", BUILD,
     lambda c: build_args(c, None, None, "--triton-repo", str(c.ckpt), "--force"),
     ["--triton-repo must not be or contain the input"]),
    ("build-int4-block-fits-no-linear", BUILD,  # was exit 0: a float graph recorded as int4, loaded by nothing
     lambda c: build_args(c, None, None, "--weights", "int4", "--int4-block-size", "256"),
     ["--int4-block-size 256", "no base Linear's input size (64, 128)", "expected one of [16, 32, 64, 128]"]),
    ("build-int8-float-channels-every-input", BUILD,  # was cut to the width without a word: no int8 left
     lambda c: build_args(c, None, None, "--weights", "int8", "--int8-float-channels", "100000"),
     ["--int8-float-channels 100000", "narrowest int8 Linear has 64 input channels", "expected fewer"]),
    ("build-opset-out-of-range", BUILD, lambda c: build_args(c, None, None, "--opset", "99"),
     ["--opset 99: expected 18..23"]),
    # flags of another backend or weight format: dropped without a word, they built another engine
    ("build-int4-flag-on-a-float-build", BUILD, lambda c: build_args(c, None, None, "--int4-block-size", "64"),
     ["--int4-block-size 64: applies to --weights int4 only"]),
    ("build-int4-offsets-on-an-int8-build", BUILD,
     lambda c: build_args(c, None, None, "--weights", "int8", "--no-int4-offsets"),
     ["--no-int4-offsets: applies to --weights int4 only"]),
    ("build-keep-onnx-on-onnxruntime", BUILD, lambda c: build_args(c, None, None, "--keep-onnx"),
     ["--keep-onnx: applies to --backend tensorrt only"]),
    ("build-no-prepack-on-tensorrt-llm", BUILD,
     lambda c: build_args(c, None, None, "--backend", "tensorrt-llm", "--no-prepack"),
     ["--no-prepack: applies to --backend onnxruntime only"]),
    ("build-triton-repo-inside-the-out", BUILD,  # was exit 0, the repository gone with the replaced --out
     lambda c: build_args(c, None, None, "--triton-repo", str(c.out / "repo")),
     ["repo: --triton-repo inside --out", "expected a directory outside the engine's"]),
    ("check-json-in-the-engine", CHECK,
     lambda c: ["--engine", str(c.copy(c.engine, "e")), "--json", str(c.tmp / "e" / "engine.json"), "--force"],
     ["engine.json", "--json is in the input directory"]),
    ("bench-json-is-the-prompts", BENCH,
     lambda c: ["--engine", str(c.ckpt), "--prompts", str(c.write("p.txt", "a b c\n")), "--json", str(c.tmp / "p.txt"),
                "--force"], ["p.txt", "--json is the input"]),
    ("tune-tree-out-in-the-engine", TUNE,
     lambda c: ["--engine", str(c.copy(c.engine, "e")), "--prompts", str(c.write("cal.txt", "a b c\n")),
                "--out", str(c.tmp / "e" / "tree.json"), "--no-measure", "--quiet"], ["--out is in the input directory"]),
    ("train-out-is-the-base", TRAIN,
     lambda c: ["--base", str(c.copy(c.base, "b")), "--data", str(c.write("d.txt", "a b c\n")), "--out", str(c.tmp / "b"),
                "--force", "--quiet"], ["b/config.json", "is the input"]),
    ("train-data-deep-jsonl", TRAIN,
     lambda c: ["--base", str(c.base), "--data", str(c.write("d.jsonl", "[" * 100000 + "\n")), "--out", str(c.out),
                "--quiet"],
     ["d.jsonl:1", "not valid JSON"]),
]


def exit_code(main: Callable[[list[str]], int], args: list[str]) -> int:
    """main's exit code, whether returned (run_cli) or raised (a flag refused while parsing)."""
    try:
        return main(args)
    except SystemExit as e:
        return e.code


@pytest.fixture(scope="module")
def fixtures(tiny_base, tiny_heads, tiny_merged, ort_engine):
    base = tiny_base("llama")
    return base, tiny_heads("medusa_v1", base), tiny_merged("llama"), ort_engine("llama")


def _leftovers(root: Path) -> list[str]:
    return [p.name for p in root.rglob(".*") if ".tmp-" in p.name or ".old-" in p.name]


@pytest.mark.parametrize("name,cli,argv,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input(name, cli, argv, expected, fixtures, tmp_path, capsys):
    ctx = Ctx(tmp_path, *fixtures)
    args = argv(ctx)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}  # inputs included
    capsys.readouterr()
    prog, main = cli
    assert exit_code(main, args) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{prog}: error: "), err
    assert "Traceback" not in captured.err + captured.out
    for part in expected:
        assert part in err[0], (part, err[0])
    assert "tree file '.'" not in err[0]
    assert not ctx.out.exists() and not _leftovers(tmp_path)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before  # no file is replaced


def test_the_corpus_covers_every_console_script():
    scripts = [line.split("=")[0].strip() for line in (ROOT / "pyproject.toml").read_text().split("[project.scripts]")[1]
               .split("\n\n")[0].strip().splitlines()]
    covered = {c[1][0] for c in CASES}
    assert set(scripts) <= covered and len(CASES) >= 40


# Every command that has a numeric flag refuses the same bad value in the same words while parsing,
# before any work: (flag, bad value, the words, the commands with their other required arguments).
_REQ = {RUN: ["--engine", "e", "--prompt", "x"], BENCH: ["--engine", "e", "--prompts", "p"],
        TUNE: ["--engine", "e", "--prompts", "p", "--out", "t.json"], CHECK: ["--engine", "e"],
        TRAIN: ["--base", "b", "--data", "d", "--out", "o"], TRITON: ["--engine", "e", "--out", "o"],
        BUILD: ["--checkpoint", "c", "--out", "o"], CONVERT: ["--base", "b", "--out", "o"],
        ("medusa-serve", serve_main): ["--repo", "r"]}
FLAGS = [
    ("--threads", "-1", "expected a positive integer", [RUN, BENCH, TUNE, TRAIN]),
    ("--threads", "0", "expected a positive integer", [RUN, BENCH, TUNE, TRAIN]),
    ("--threads", "-1", "expected a non-negative integer", [TRITON]),  # 0 there: torch's own default
    ("--limit", "-1", "expected a positive integer", [BENCH, TUNE]),
    ("--max-new-tokens", "0", "expected a positive integer", [RUN, BENCH, TUNE, CHECK, TRAIN]),
    ("--temperature", "inf", "expected a non-negative finite number", [RUN, BENCH]),
    ("--temperature", "nan", "expected a non-negative finite number", [RUN, BENCH]),
    ("--top-p", "1.5", "expected a number in (0, 1]", [RUN, BENCH]),
    ("--posterior-threshold", "9", "expected a number in (0, 1]", [RUN]),  # epsilon is a probability
    ("--posterior-alpha", "0", "expected a positive finite number", [RUN]),
    ("--seed", "-1", "expected an integer in [0, 2**63)", [RUN, BENCH, TRAIN]),
    ("--max-batch-size", "0", "expected an integer in 1..65536", [BUILD, TRITON]),
    ("--max-batch-size", "1e30", "expected an integer in 1..65536", [BUILD, TRITON]),  # config.pbtxt's int32
    ("--max-batch-size", "65537", "expected an integer in 1..65536", [BUILD, TRITON]),
    ("--max-draft-len", "0", "expected an integer in 1..1024", [BUILD, CONVERT]),
    ("--max-draft-len", "1000000000000", "expected an integer in 1..1024", [BUILD, CONVERT]),
    ("--max-input-len", "-5", "expected a positive integer", [BUILD, TRITON]),
    ("--lr", "inf", "expected a positive finite number", [TRAIN]),
    ("--draft-vocab", "0", "expected a positive integer", [TRAIN]),  # --arch amphista's flags too
    ("--sal-intermediate", "-1", "expected a non-negative integer", [TRAIN]),  # 0: the base's width
    ("--atol", "-1", "expected a non-negative finite number", [CHECK]),
    ("--http-port", "70000", "expected a TCP port", [("medusa-serve", serve_main)]),
]


@pytest.mark.parametrize("flag,value,words,clis", FLAGS, ids=[f"{f[0]}={f[1]}" for f in FLAGS])
def test_a_numeric_flag_is_refused_alike_by_every_command(flag, value, words, clis, capsys):
    for prog, main in clis:
        with pytest.raises(SystemExit) as e:
            main([*_REQ[(prog, main)], flag, value])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1, (prog, err)
        assert err[0].startswith(f"{prog}: error: {flag} {value}: {words}"), (prog, err)


def test_an_output_file_is_replaced_only_with_force_and_whole(fixtures, tmp_path, capsys):
    """--json/--out files follow the rule of output dirs: refused when they exist, replaced with
    --force by a rename (no temp file left), never half-written."""
    ctx = Ctx(tmp_path, *fixtures)
    report = _file(ctx)
    args = ["--engine", str(ctx.engine), "--json", str(report), "--max-new-tokens", "2", "--tree-steps", "1"]
    assert check.main(args) == 2 and report.read_text() == "keep me"
    assert check.main([*args, "--force"]) == 0
    assert json.loads(report.read_text())["passed"] is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_build_writes_the_engine_and_its_triton_repo_or_neither(fixtures, tmp_path, capsys):
    """The engine builds, then its Triton repository fails (the checkpoint has no tokenizer for the
    server): neither --out nor --triton-repo appears, and the error names --out, not a temp dir."""
    ctx = Ctx(tmp_path, *fixtures)
    ckpt = ctx.copy(ctx.ckpt, "ck")
    for f in ckpt.glob("tokenizer*"):
        f.unlink()
    repo = tmp_path / "repo"
    capsys.readouterr()
    assert build_cli.main(build_args(ctx, ckpt, None, "--triton-repo", str(repo))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--triton-repo" in err[0] and "no tokenizer" in err[0], err
    assert f"{ctx.out}: no tokenizer" in err[0] and ".tmp-" not in err[0], err
    assert not ctx.out.exists() and not repo.exists() and not _leftovers(tmp_path)


def test_an_os_error_names_the_out_the_user_gave(fixtures, tmp_path, capsys, monkeypatch):
    """Permission denied inside the temp dir is reported on --out (root ignores chmod: the error is raised)."""
    import medusa_trt.engines.build as build

    ctx = Ctx(tmp_path, *fixtures)

    def denied(opts, config, workdir):
        raise PermissionError(13, "Permission denied", str(workdir / "model.onnx"))

    monkeypatch.setitem(build.BUILDERS, "onnxruntime", denied)
    capsys.readouterr()
    assert build_cli.main(build_args(ctx)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"medusa-build: error: {ctx.out / 'model.onnx'}: Permission denied"], err
    assert not ctx.out.exists() and not _leftovers(tmp_path)


def test_serve_refuses_a_port_in_use(tmp_path, capsys):
    """Another server on --http-port would answer the readiness probe: refused first, one line, exit 2."""
    import socket

    (tmp_path / "repo" / "m").mkdir(parents=True)
    (tmp_path / "repo" / "m" / "config.pbtxt").write_text('name: "m"\n')
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        capsys.readouterr()
        assert serve_main(["--repo", str(tmp_path / "repo"), "--http-port", str(port), "--grpc-port", "0",
                           "--metrics-port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"medusa-serve: error: --http-port {port}: 127.0.0.1:{port} is in use"), err


def test_os_errors_are_one_line(fixtures, tmp_path, capsys, monkeypatch):
    """No space left on device half-way through writing: one line naming the file and the reason."""
    ctx = Ctx(tmp_path, *fixtures)
    import medusa_trt.converter.merge as merge

    def full(src, dst, *a, **k):
        raise OSError(28, "No space left on device", str(dst))

    monkeypatch.setattr(merge.shutil, "copy2", full)
    capsys.readouterr()
    assert convert_cli.main(convert_args(ctx)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left on device" in err[0] and "tokenizer" in err[0], err
    assert not ctx.out.exists() and not _leftovers(tmp_path)


def test_permission_denied_is_one_line(fixtures, tmp_path, capsys, monkeypatch):
    """--out in a directory the user cannot write. Root ignores directory permissions (CI and these
    machines run as root), so there the refusal the OS would give is raised where the temp dir is made."""
    ctx = Ctx(tmp_path, *fixtures)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    if os.geteuid() == 0:
        mkdir = Path.mkdir

        def refused(self, *args, **kwargs):
            if self.parent == locked:
                raise PermissionError(13, "Permission denied", str(self))
            return mkdir(self, *args, **kwargs)

        monkeypatch.setattr(Path, "mkdir", refused)
    try:
        assert build_cli.main(build_args(ctx, None, locked / "engine")) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "Permission denied" in err[0] and "locked" in err[0], err
    finally:
        locked.chmod(0o755)


def test_request_values_are_refused_by_the_triton_model(fixtures):
    """The Triton model's request checks: a NaN temperature, a rank beyond the vocabulary, a tree
    string nested deep; each one RequestError naming the input (Triton returns it to the client)."""
    from medusa_trt.serving.triton_model import ModelSettings, RequestError, load_service, parse_request

    service = load_service(ModelSettings(engine_dir=fixtures[2], medusa_choices="[[0], [1]]", max_input_len=64,
                                         max_output_len=8), decoupled=False)

    def req(**extra):
        out = {"text_input": np.array([[b"Hi"]], dtype=np.object_), "max_tokens": np.array([[4]], dtype=np.int64)}
        out.update(extra)
        return out

    cases = [
        (req(temperature=np.array([[np.nan]], dtype=np.float32), acceptance=np.array([[b"typical"]], dtype=np.object_)),
         "temperature"),
        (req(medusa_choices=np.array([[b"[[0], [999]]"]], dtype=np.object_)), "rank 999"),
        (req(medusa_choices=np.array([[b"[" * 5000]], dtype=np.object_)), "nested 5000 levels"),
        (req(medusa_choices=np.array([[b"dynamic:0"]], dtype=np.object_)), "budget 0; expected dynamic:N with N >= 1"),
        (req(medusa_choices=np.array([[b"dynamic:abc"]], dtype=np.object_)), "budget 'abc' is not an integer"),
        (req(max_tokens=np.array([[-3]], dtype=np.int64)), "max_tokens"),
        ({"text_input": np.zeros((0, 1), dtype=np.object_), "max_tokens": np.zeros((0, 1), dtype=np.int64)},
         "text_input: 0 rows; expected at least one"),
        ({"messages": np.array([[b"[" * 100000]], dtype=np.object_), "max_tokens": np.array([[4]], dtype=np.int64)},
         "messages: JSON nested too deep"),
        ({"text_input": np.array([[b"Hi"], [b"Ho"]], dtype=np.object_), "max_tokens": np.array([[4], [4]], dtype=np.int64),
          "seed": np.array([[2**63 - 1]] * 2, dtype=np.uint64)},
         re.escape("seed (row 0): 9223372036854775807; expected an integer in [0, 2**63 - 2]")),
    ]
    for inputs, message in cases:
        with pytest.raises(RequestError, match=message) as e:
            parse_request(service, inputs)
        assert "\n" not in str(e.value)


_SLOW_WRITE = """
import sys, time
import medusa_trt.converter.merge as merge
import medusa_trt.engines.build as build

def slow(*args, **kwargs):
    print("writing", flush=True)
    time.sleep(60)

merge._write = slow
build.BUILDERS["onnxruntime"] = slow
from medusa_trt.cli.convert import main as convert
from medusa_trt.cli.build import main as build_main
sys.exit((convert if sys.argv[1] == "convert" else build_main)(sys.argv[2:]))
"""


@pytest.mark.parametrize("tool", ["convert", "build"])
def test_sigterm_leaves_nothing_behind(tool, fixtures, tmp_path):
    ctx = Ctx(tmp_path, *fixtures)
    argv = convert_args(ctx) if tool == "convert" else build_args(ctx)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_WRITE, tool, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "writing"
        assert _leftovers(tmp_path)  # the temp dir exists while it writes
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "terminated (SIGTERM)" in lines[0], lines
    assert not ctx.out.exists() and not _leftovers(tmp_path)
