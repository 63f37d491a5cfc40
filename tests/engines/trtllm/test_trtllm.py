"""medusa-build --backend tensorrt-llm: the trtllm-build command line for several checkpoints, the
checkpoint layout against TensorRT-LLM's naming and shape rules (docs/formats.md section 2, written out
here independently of medusa_trt.checkpoint), and the wrapper around the trtllm-build process.

TensorRT-LLM is not installable here: the process tests run a stand-in `trtllm-build` executable
(a script that records its arguments and writes what trtllm-build writes), which exercises our side
of the boundary (finding the tool, streaming its output, failures, engine.json); a GPU session runs
the real one (see test_real_trtllm_build).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import stat
import sys

import pytest
import torch
from synthetic import SLIDING_WINDOW_CONFIGS, WINDOW

from medusa_trt.checkpoint import expected_tensors, rank_file, rank_shape, read_config
from medusa_trt.cli import build as build_cli
from medusa_trt.converter.merge import convert
from medusa_trt.converter.quantize import QuantOptions
from medusa_trt.engines.build import build_engine
from medusa_trt.engines.options import BuildError, BuildOptions
from medusa_trt.engines.trtllm.build import (
    SUPPORTED_TRTLLM,
    TrtllmOptions,
    check_trtllm_version,
    installed_trtllm_version,
    trtllm_build_command,
)
from medusa_trt.safetensors_io import SafetensorsFile

CALIB = "the quick brown fox jumps over a lazy dog\nMedusa heads guess what comes next\n42 times, really\n"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_base, tiny_heads):
    """checkpoint(name) -> merged checkpoint dir for one of the CASES below (converted once)."""
    cases = {
        "fp16": dict(arch="llama", dtype="float16"),
        "bf16-tp2": dict(arch="llama", dtype="bfloat16", tp_size=2),
        "qwen2-fp16": dict(arch="qwen2", dtype="float16"),
        "fp32-tp4": dict(arch="llama", tp_size=4),  # 2 KV heads < 4 ranks: duplicated
        "fp8-kv8": dict(arch="llama", dtype="float16", quant=dict(quantize="fp8", kv_cache_dtype="fp8")),
        "fp8-tp2": dict(arch="llama", dtype="bfloat16", tp_size=2, quant=dict(quantize="fp8")),
        "fp8-heads": dict(arch="llama", dtype="float16", quant=dict(quantize="fp8", quantize_heads=True)),
        "kv8": dict(arch="llama", dtype="float16", quant=dict(kv_cache_dtype="fp8")),  # float linears
        "draft10": dict(arch="llama", dtype="float16", max_draft_len=10),
    }
    cache = {}
    calib = tmp_path_factory.mktemp("calib") / "calib.txt"
    calib.write_text(CALIB)

    def get(name: str):
        if name not in cache:
            case = dict(cases[name])
            base = tiny_base(case.pop("arch"))
            quant = case.pop("quant", None)
            out = tmp_path_factory.mktemp(f"trtllm-{name}") / "ckpt"
            convert(base, tiny_heads("medusa_v1", base), out, progress=False,
                    quant=QuantOptions(calib_data=calib, **quant) if quant else None, **case)
            cache[name] = out
        return cache[name]

    return get


def _cmd(ckpt, tmp_path, **options) -> list[str]:
    opts = BuildOptions(checkpoint=ckpt, out=tmp_path / "engine", backend="tensorrt-llm", **options)
    return trtllm_build_command(ckpt, tmp_path / "engine", read_config(ckpt), opts)


def _flags(cmd: list[str]) -> dict[str, str]:
    assert cmd[0] == "trtllm-build"
    args = cmd[1:]
    assert len(args) % 2 == 0 and all(a.startswith("--") for a in args[::2]), cmd
    flags = dict(zip(args[::2], args[1::2], strict=True))
    assert len(flags) == len(args) // 2, f"a flag is repeated: {cmd}"
    return flags


def test_command_fp16(checkpoint, tmp_path):
    ckpt = checkpoint("fp16")
    flags = _flags(_cmd(ckpt, tmp_path, max_batch_size=8))
    assert flags == {
        "--checkpoint_dir": str(ckpt), "--output_dir": str(tmp_path / "engine"),
        "--speculative_decoding_mode": "medusa", "--max_draft_len": "63",
        "--max_batch_size": "8", "--max_seq_len": "512", "--max_input_len": str(512 - 64),
        "--gpt_attention_plugin": "float16", "--gemm_plugin": "float16",
    }


def test_command_bf16_tp2_limits(checkpoint, tmp_path):
    ckpt = checkpoint("bf16-tp2")
    flags = _flags(_cmd(ckpt, tmp_path, max_batch_size=16, max_seq_len=256, backend_options=TrtllmOptions(max_input_len=100, workers=8)))
    assert flags["--gpt_attention_plugin"] == flags["--gemm_plugin"] == "bfloat16"
    assert (flags["--max_batch_size"], flags["--max_seq_len"], flags["--max_input_len"]) == ("16", "256", "100")
    assert flags["--workers"] == "2"  # one engine per rank: no more workers than the world size
    assert "--use_fp8_context_fmha" not in flags and "--max_num_tokens" not in flags


def test_command_max_draft_len_follows_the_checkpoint(checkpoint, tmp_path):
    ckpt = checkpoint("draft10")
    assert read_config(ckpt)["max_draft_len"] == 10
    flags = _flags(_cmd(ckpt, tmp_path))
    assert flags["--max_draft_len"] == "10" and flags["--max_input_len"] == str(512 - 11)
    assert _flags(_cmd(ckpt, tmp_path, max_draft_len=10))["--max_draft_len"] == "10"
    with pytest.raises(BuildError, match="--max-draft-len 20 differs from the checkpoint's max_draft_len 10"):
        _cmd(ckpt, tmp_path, max_draft_len=20)


def test_command_fp8(checkpoint, tmp_path):
    # FP8 linears + FP8 KV cache: no cuBLAS GEMM plugin at larger batches (the tuning guide's advice),
    # the FP8 GEMM plugin at small ones, FP8 context attention since the KV cache is FP8 too.
    ckpt = checkpoint("fp8-kv8")
    quant = read_config(ckpt)["quantization"]
    assert (quant["quant_algo"], quant["kv_cache_quant_algo"]) == ("FP8", "FP8")
    large = _flags(_cmd(ckpt, tmp_path, max_batch_size=8))
    assert "--gemm_plugin" not in large and large["--use_fp8_context_fmha"] == "enable"
    assert large["--gpt_attention_plugin"] == "float16"
    small = _flags(_cmd(ckpt, tmp_path, max_batch_size=4))
    assert small["--gemm_plugin"] == "fp8"
    # Off is said, not left out: later releases turn FP8 context attention on for FP8 checkpoints.
    off = _flags(_cmd(ckpt, tmp_path, backend_options=TrtllmOptions(fp8_context_fmha=False)))
    assert off["--use_fp8_context_fmha"] == "disable"
    # FP8 linears with a float KV cache: no FP8 context attention.
    tp2 = _flags(_cmd(checkpoint("fp8-tp2"), tmp_path, max_batch_size=2))
    assert tp2["--gemm_plugin"] == "fp8" and tp2["--use_fp8_context_fmha"] == "disable"
    assert tp2["--gpt_attention_plugin"] == "bfloat16"
    # An FP8 KV cache with float linears: paged context attention off, which TensorRT-LLM refuses
    # to build with this pair ("FP8 Paged Context FMHA only works with fp8 quantization workflow").
    kv8 = checkpoint("kv8")
    quant = read_config(kv8)["quantization"]
    assert (quant["quant_algo"], quant["kv_cache_quant_algo"]) == (None, "FP8")
    kv = _flags(_cmd(kv8, tmp_path))
    assert kv["--use_paged_context_fmha"] == "disable" and "--use_fp8_context_fmha" not in kv
    assert kv["--gemm_plugin"] == "float16"
    assert "--use_paged_context_fmha" not in large and "--use_paged_context_fmha" not in tp2


def test_command_long_context_and_errors(checkpoint, tmp_path):
    ckpt = checkpoint("fp16")
    config = read_config(ckpt)
    config["max_position_embeddings"] = 32768
    opts = BuildOptions(checkpoint=ckpt, out=tmp_path / "e", backend="tensorrt-llm")
    flags = _flags(trtllm_build_command(ckpt, tmp_path / "e", config, opts))
    # A whole prompt must fit one step without chunked context: the token budget grows with it.
    assert flags["--max_input_len"] == flags["--max_num_tokens"] == str(32768 - 64)
    extra = ["--use_paged_context_fmha", "enable"]
    cmd = trtllm_build_command(ckpt, tmp_path / "e", config, BuildOptions(
        checkpoint=ckpt, out=tmp_path / "e", backend_options=TrtllmOptions(trtllm_args=tuple(extra))))
    assert cmd[-2:] == extra
    with pytest.raises(BuildError, match="TensorRT-LLM builds the checkpoint's dtype"):
        _cmd(ckpt, tmp_path, dtype="bfloat16")
    with pytest.raises(BuildError, match="--max-input-len 600: expected 1..512"):
        _cmd(ckpt, tmp_path, backend_options=TrtllmOptions(max_input_len=600))
    no_heads = dict(config, num_medusa_heads=0)
    with pytest.raises(BuildError, match="num_medusa_heads 0"):
        trtllm_build_command(ckpt, tmp_path / "e", no_heads, opts)


# -- checkpoint layout: docs/formats.md section 2, written out independently -------------------------


def trtllm_layout(config: dict, rank: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor of rank `rank` with its shape and dtype, from the rules of docs/formats.md section 2 alone."""
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[config["dtype"]]
    d, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    nq, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    hs = d // nq
    tp = config["mapping"]["tp_size"]
    kv_per_rank = nkv // tp if nkv >= tp else 1  # fewer KV heads than ranks: duplicated, one per rank
    vocab_rows = -(-vocab // tp)  # zero-padded to a multiple of tp, then split
    quant = config["quantization"] or {}
    excluded = quant.get("exclude_modules") or []
    fp8 = quant.get("quant_algo") == "FP8"
    out = {}

    def linear(prefix, shape, bias=False):
        quantized = fp8 and not any(fnmatch.fnmatchcase(prefix, p) for p in excluded)
        out[f"{prefix}.weight"] = (shape, torch.float8_e4m3fn if quantized else dtype)
        if bias:
            out[f"{prefix}.bias"] = (shape[:1], dtype)
        if quantized:
            out[f"{prefix}.weights_scaling_factor"] = ((1,), torch.float32)
            out[f"{prefix}.activation_scaling_factor"] = ((1,), torch.float32)

    out["transformer.vocab_embedding.weight"] = ((vocab, d), dtype)
    for i in range(config["num_hidden_layers"]):
        p = f"transformer.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = ((d,), dtype)
        out[f"{p}.post_layernorm.weight"] = ((d,), dtype)
        linear(f"{p}.attention.qkv", ((nq // tp + 2 * kv_per_rank) * hs, d), bias=config["attn_bias"])
        linear(f"{p}.attention.dense", (d, nq * hs // tp))
        linear(f"{p}.mlp.fc", (inter // tp, d))
        linear(f"{p}.mlp.gate", (inter // tp, d))
        linear(f"{p}.mlp.proj", (d, inter // tp))
        if quant.get("kv_cache_quant_algo") == "FP8":
            out[f"{p}.attention.kv_cache_scaling_factor"] = ((1,), torch.float32)
    out["transformer.ln_f.weight"] = ((d,), dtype)
    out["lm_head.weight"] = ((vocab_rows, d), dtype)
    for h in range(config["num_medusa_heads"]):
        for layer in range(config["num_medusa_layers"]):
            linear(f"medusa_heads.{h}.medusa_layers.{layer}.linear", (d // tp, d), bias=True)
        out[f"medusa_heads.{h}.lm_head.weight"] = ((vocab_rows, d), dtype)
    return out


@pytest.mark.parametrize("name", ["fp16", "qwen2-fp16", "bf16-tp2", "fp32-tp4", "fp8-kv8", "fp8-tp2", "fp8-heads"])
def test_checkpoint_layout_follows_trtllm_rules(checkpoint, name):
    ckpt = checkpoint(name)
    config = read_config(ckpt)
    tp = config["mapping"]["tp_size"]
    assert config["architecture"] == "MedusaForCausalLM" and config["logits_dtype"] == "float32"
    assert config["position_embedding_type"] == "rope_gpt_neox"
    assert config["mapping"] == {"world_size": tp, "tp_size": tp, "pp_size": 1}
    assert config["num_medusa_heads"] == 4 and config["num_medusa_layers"] == 1 and config["max_draft_len"] >= 1
    if config["model_type"] == "qwen2":
        assert config["qwen_type"] == "qwen2" and config["attn_bias"]
    quant = config["quantization"]
    if quant["quant_algo"] == "FP8":
        # Never quantized: lm_head, embeddings, norms; the heads unless asked.
        for module in ("lm_head", "transformer.vocab_embedding", "transformer.ln_f", "medusa_heads.0.lm_head"):
            assert any(fnmatch.fnmatchcase(module, p) for p in quant["exclude_modules"]), module
        heads_excluded = any(fnmatch.fnmatchcase("medusa_heads.0.medusa_layers.0.linear", p)
                             for p in quant["exclude_modules"])
        assert heads_excluded == (name != "fp8-heads")

    specs = expected_tensors(config)
    for rank in range(tp):
        want = trtllm_layout(config, rank)
        with SafetensorsFile(rank_file(ckpt, rank)) as f:
            got = {n: (tuple(f.info(n).shape), f.info(n).dtype) for n in f.keys()}
        assert got == want, f"rank {rank}: {sorted(set(got) ^ set(want))}"
        # medusa_trt.checkpoint's own rules agree with the independent ones.
        assert {s.name: (rank_shape(s, config, rank), s.dtype) for s in specs} == want
    assert not rank_file(ckpt, tp).exists()


def test_tp4_duplicates_kv_heads(checkpoint):
    """2 KV heads over 4 ranks: ranks 0-1 hold KV head 0, ranks 2-3 KV head 1 (docs/formats.md section 2: duplicated
    before splitting), while each rank holds its own query head."""
    ckpt = checkpoint("fp32-tp4")
    config = read_config(ckpt)
    hs = config["hidden_size"] // config["num_attention_heads"]
    name = "transformer.layers.0.attention.qkv.weight"
    shards = []
    for rank in range(4):
        with SafetensorsFile(rank_file(ckpt, rank)) as f:
            shards.append(f.read(name).split([hs, hs, hs]))  # q (1 head), k (1 head), v (1 head)
    for a, b in ((0, 1), (2, 3)):
        assert torch.equal(shards[a][1], shards[b][1]) and torch.equal(shards[a][2], shards[b][2])
    assert not torch.equal(shards[0][1], shards[2][1])
    assert not torch.equal(shards[0][0], shards[1][0])


# -- the trtllm-build process -------------------------------------------------------------------------

STAND_IN = '''\
#!{python}
"""Stand-in for trtllm-build: records its arguments, writes what trtllm-build writes."""
import json, os, sys
args = sys.argv[1:]
flags = dict(zip(args[::2], args[1::2]))
out = flags["--output_dir"]
ckpt = json.load(open(os.path.join(flags["--checkpoint_dir"], "config.json")))
print("[TRT-LLM] [I] building", flush=True)
if os.environ.get("STAND_IN_FAIL"):
    print("[TRT-LLM] [E] out of memory", flush=True)
    sys.exit(3)
for r in range(ckpt["mapping"]["world_size"]):
    open(os.path.join(out, f"rank{{r}}.engine"), "wb").write(b"engine")
build = {{"max_batch_size": int(flags["--max_batch_size"]), "max_seq_len": int(flags["--max_seq_len"]),
         "max_input_len": int(flags["--max_input_len"]), "max_draft_len": int(flags["--max_draft_len"]),
         "speculative_decoding_mode": flags["--speculative_decoding_mode"]}}
json.dump({{"version": "stand-in", "pretrained_config": ckpt, "build_config": build}},
          open(os.path.join(out, "config.json"), "w"))
json.dump(args, open(os.path.join(out, "args.json"), "w"))
print("[TRT-LLM] [I] done", flush=True)
'''


@pytest.fixture
def stand_in(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "trtllm-build"
    exe.write_text(STAND_IN.format(python=sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def test_build_runs_trtllm_build(checkpoint, stand_in, tmp_path, monkeypatch, capfd):
    from medusa_trt.serving.triton_repo import read_engine_info

    ckpt = checkpoint("bf16-tp2")
    monkeypatch.setenv("PATH", f"{stand_in.parent}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "engine"
    build_engine(BuildOptions(checkpoint=ckpt, out=out, backend="tensorrt-llm", max_batch_size=4))
    err = capfd.readouterr().err
    assert "[TRT-LLM] [I] building" in err and "[TRT-LLM] [I] done" in err  # streamed through
    args = _flags(["trtllm-build", *json.loads((out / "args.json").read_text())])
    # Built in the temp dir beside --out (renamed at the end), from the checkpoint's absolute path.
    assert args.pop("--output_dir").startswith(str(tmp_path / ".engine.tmp-"))
    expected = _flags(_cmd(ckpt.resolve(), tmp_path, max_batch_size=4))
    expected.pop("--output_dir")
    assert args == expected and args["--checkpoint_dir"] == str(ckpt.resolve())
    # Engine files at the top of the engine dir, as tensorrtllm_backend's gpt_model_path wants them.
    assert (out / "rank0.engine").is_file() and (out / "rank1.engine").is_file() and (out / "config.json").is_file()
    engine = json.loads((out / "engine.json").read_text())
    assert engine["backend"] == "tensorrt-llm" and engine["device"] == "cuda" and engine["dtype"] == "bfloat16"
    section = engine["tensorrt_llm"]
    assert section["engines"] == ["rank0.engine", "rank1.engine"] and section["world_size"] == 2
    assert section["run_with"] == "mpirun -n 2" and section["command"][0] == str(stand_in)
    assert section["build_config"]["max_draft_len"] == 63
    assert {"rank0.engine", "rank1.engine", "config.json", "trtllm-build.log"} <= set(engine["artifacts"])
    assert (out / "tokenizer.json").is_file() or (out / "tokenizer_config.json").is_file()
    info = read_engine_info(out)
    assert (info.kind, info.num_heads, info.max_draft_len, info.max_batch_size) == ("tensorrt-llm", 4, 63, 4)


def test_build_failure_and_missing_tool(checkpoint, stand_in, tmp_path, monkeypatch, capsys):
    ckpt = checkpoint("fp16")
    out = tmp_path / "engine"
    monkeypatch.setenv("STAND_IN_FAIL", "1")
    with pytest.raises(BuildError, match=r"exited with status 3: \[TRT-LLM\] \[E\] out of memory"):
        build_engine(BuildOptions(checkpoint=ckpt, out=out, backend="tensorrt-llm", progress=False,
                                  backend_options=TrtllmOptions(trtllm_build=str(stand_in))))
    assert not out.exists() and not list(tmp_path.glob(".engine.tmp-*"))
    assert "out of memory" in (tmp_path / "engine.trtllm-build.log").read_text()

    # Not on PATH: one clear line naming the extra, exit 2, nothing written.
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    code = build_cli.main(["--checkpoint", str(ckpt), "--out", str(out), "--backend", "tensorrt-llm", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "trtllm-build" in err and "pip install 'medusa-trt[tensorrt-llm]'" in err
    assert not out.exists()


def test_sliding_window_is_refused(tiny_merged, tmp_path, capsys):
    """trtllm-build has no window option: a Mistral with a window shorter than the engine's positions
    is refused, one line, exit 2, before any trtllm-build is looked for; at --max-seq-len of the
    window no position reaches past it, and the command is built."""
    ckpt = tiny_merged("mistral", base_kwargs={"extra_config": SLIDING_WINDOW_CONFIGS["mistral"]})
    out = tmp_path / "engine"
    capsys.readouterr()
    code = build_cli.main(["--checkpoint", str(ckpt), "--out", str(out), "--backend", "tensorrt-llm", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"sliding_window {WINDOW}" in err and "--backend tensorrt" in err
    assert not out.exists() and not list(tmp_path.glob(".engine.tmp-*"))
    config = read_config(ckpt)
    with pytest.raises(BuildError, match=f"sliding_window {WINDOW} is shorter than the engine's 512 positions"):
        trtllm_build_command(ckpt, out, config, BuildOptions(checkpoint=ckpt, out=out))
    cmd = trtllm_build_command(ckpt, out, config, BuildOptions(checkpoint=ckpt, out=out, max_seq_len=WINDOW))
    assert cmd[cmd.index("--max_seq_len") + 1] == str(WINDOW)


def _fake_installed_trtllm(site, version: str) -> None:
    """A tensorrt-llm distribution's metadata, as pip leaves it in site-packages."""
    info = site / f"tensorrt_llm-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: tensorrt-llm\nVersion: {version}\n")


def test_tensorrt_llm_without_trtllm_build_is_refused(checkpoint, stand_in, tmp_path, monkeypatch, capsys):
    """An installed TensorRT-LLM from after its TensorRT backend was removed (found through its
    distribution metadata on sys.path, as importlib.metadata finds any): one line naming the installed
    version, the supported range and --backend tensorrt, exit 2, even with a trtllm-build on PATH."""
    ckpt = checkpoint("fp16")
    monkeypatch.setenv("PATH", f"{stand_in.parent}{os.pathsep}{os.environ['PATH']}")
    site = tmp_path / "site"
    _fake_installed_trtllm(site, "1.4.0rc1")
    monkeypatch.syspath_prepend(str(site))
    assert installed_trtllm_version() == "1.4.0rc1"
    out = tmp_path / "engine"
    code = build_cli.main(["--checkpoint", str(ckpt), "--out", str(out), "--backend", "tensorrt-llm", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "TensorRT-LLM 1.4.0rc1" in err and SUPPORTED_TRTLLM in err and "--backend tensorrt," in err
    assert not out.exists() and not list(tmp_path.glob(".engine.tmp-*"))
    for ok in ("0.20.0", "1.0.0", "1.2.1", None):
        check_trtllm_version(ok)
    for bad in ("1.3.0rc29", "2.0.0", "0.19.0"):
        with pytest.raises(BuildError, match=re.escape(f"TensorRT-LLM {bad} is installed")):
            check_trtllm_version(bad)


@pytest.mark.skipif(shutil.which("trtllm-build") is None or not torch.cuda.is_available(),
                    reason="needs TensorRT-LLM's trtllm-build and a GPU")
def test_real_trtllm_build(checkpoint, tmp_path):
    for name in ("fp16", "bf16-tp2"):
        out = tmp_path / name
        build_engine(BuildOptions(checkpoint=checkpoint(name), out=out, backend="tensorrt-llm", max_batch_size=2,
                                  max_seq_len=256, progress=False))
        built = json.loads((out / "config.json").read_text())
        assert built["build_config"]["max_draft_len"] == 63
        assert built["build_config"].get("speculative_decoding_mode") in ("medusa", 4, "SpeculativeDecodingMode.MEDUSA")
        assert (out / "rank0.engine").stat().st_size > 0
