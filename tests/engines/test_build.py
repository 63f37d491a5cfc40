"""medusa-build's dispatcher (engines/build.py): engine.json, checkpoint and option errors, the
atomic write, and backend options that do not belong to the backend."""

from __future__ import annotations

import json
import shutil

import pytest

from medusa_trt.cli import build as build_cli
from medusa_trt.engine_dir import ENGINE_FORMAT_VERSION, sha256_file
from medusa_trt.engines.build import build_engine
from medusa_trt.engines.onnx.attention import DEFAULT_ATTENTION
from medusa_trt.engines.options import BuildError, BuildOptions
from medusa_trt.engines.trt.build import TrtOptions


def test_engine_json(ort_engine, tiny_merged):
    engine_dir = ort_engine("llama")
    engine = json.loads((engine_dir / "engine.json").read_text())
    config = json.loads((tiny_merged("llama") / "config.json").read_text())
    assert engine["backend"] == "onnxruntime" and engine["device"] == "cpu" and engine["dtype"] == "float32"
    assert engine["model"]["num_layers"] == config["num_hidden_layers"]
    assert engine["model"]["num_kv_heads"] == config["num_key_value_heads"]
    assert engine["medusa"] == {"num_heads": config["num_medusa_heads"], "num_layers": config["num_medusa_layers"],
                                "max_draft_len": config["max_draft_len"]}
    assert engine["limits"]["max_seq_len"] == config["max_position_embeddings"]
    assert engine["onnx"]["opset"] == 23 and engine["onnx"]["attention"] == DEFAULT_ATTENTION
    assert engine["eos_token_id"] == config["eos_token_id"]
    assert engine["checkpoint"]["path"] == str(tiny_merged("llama").resolve())
    assert {"torch", "onnx", "onnxruntime", "onnxscript", "medusa-trt"} <= set(engine["tools"])
    files = {p.name for p in engine_dir.iterdir()}
    assert files == set(engine["artifacts"]) | {"engine.json"}
    assert {"model.onnx", "tokenizer.json"} <= files and "config.json" not in files
    for name, info in engine["artifacts"].items():
        assert sha256_file(engine_dir / name) == info["sha256"]


def test_build_cli_bad_inputs(tmp_path, tiny_merged, capsys):
    ckpt = tiny_merged("llama")
    missing = tmp_path / "nothing"
    assert build_cli.main(["--checkpoint", str(missing), "--out", str(tmp_path / "e"), "--quiet"]) == 2
    assert "config.json" in capsys.readouterr().err

    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    (broken / "rank0.safetensors").write_bytes(b"\0" * 16)
    assert build_cli.main(["--checkpoint", str(broken), "--out", str(tmp_path / "e"), "--quiet"]) == 2
    assert "rank0.safetensors" in capsys.readouterr().err

    for backend, needle in [("tensorrt", "tensorrt"), ("tensorrt-llm", "tensorrt")]:
        assert build_cli.main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "e"), "--backend", backend,
                               "--quiet"]) == 2
        assert needle in capsys.readouterr().err

    assert build_cli.main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "e"), "--dtype", "bfloat16",
                           "--quiet"]) == 2
    assert "bfloat16" in capsys.readouterr().err
    assert build_cli.main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "e"), "--max-seq-len", "99999",
                           "--quiet"]) == 2
    assert "max_position_embeddings" in capsys.readouterr().err
    assert not any(tmp_path.glob(".e.tmp-*")) and not (tmp_path / "e").exists()

    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    assert build_cli.main(["--checkpoint", str(ckpt), "--out", str(existing), "--quiet"]) == 2
    assert "--force" in capsys.readouterr().err
    assert (existing / "keep.txt").read_text() == "mine"


def test_build_is_atomic(tmp_path, tiny_merged, monkeypatch):
    """A failing export leaves --out as it was and no temp dir behind."""
    from medusa_trt.engines import build

    out = tmp_path / "engine"
    out.mkdir()
    (out / "engine.json").write_text("{}")

    def explode(*args, **kwargs):
        raise RuntimeError("export failed")

    monkeypatch.setitem(build.BUILDERS, "onnxruntime", explode)
    with pytest.raises(RuntimeError, match="export failed"):
        build_engine(BuildOptions(checkpoint=tiny_merged("llama"), out=out, force=True, progress=False))
    assert (out / "engine.json").read_text() == "{}"
    assert [p.name for p in tmp_path.iterdir()] == ["engine"]


@pytest.mark.parametrize(("key", "value"), [("kv_cache_quant_algo", "INT8"), ("quant_algo", "W4A16_AWQ")])
def test_build_refuses_quantization_it_cannot_build(tmp_path, tiny_merged, key, value):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_merged("llama"), ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization"][key] = value
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(BuildError, match=rf"config\.json: quantization\.{key}: '{value}'; expected one of 'FP8'"):
        build_engine(BuildOptions(checkpoint=ckpt, out=tmp_path / "e", progress=False))
    assert not (tmp_path / "e").exists()


def test_backend_options_of_another_backend_are_refused(tmp_path, tiny_merged, capsys):
    """Options belong to one backend: build_engine refuses another backend's, and medusa-build
    --weights int4 with another backend says only onnxruntime builds int4 engines."""
    with pytest.raises(BuildError, match="--backend onnxruntime: backend options TrtOptions are for --backend tensorrt"):
        build_engine(BuildOptions(checkpoint=tiny_merged("llama"), out=tmp_path / "e", progress=False,
                                  backend_options=TrtOptions(keep_onnx=True)))
    assert build_cli.main(["--checkpoint", str(tiny_merged("llama")), "--out", str(tmp_path / "e"), "--backend",
                           "tensorrt", "--weights", "int4", "--quiet"]) == 2
    assert "--weights int4: only --backend onnxruntime builds int4 engines" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()
    assert ENGINE_FORMAT_VERSION == 8


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_plain_transformers_loads_the_engine_tokenizer_the_engine_uses(ort_engine, tiny_base, arch):
    """AutoTokenizer.from_pretrained(engine_dir), with no model config.json beside it, gives the ids
    of the base's own tokenizer (a Qwen2 base's tokenizer_config names a generic class that
    transformers swaps for Qwen2Tokenizer only when it sees the model config)."""
    from transformers import AutoTokenizer

    from medusa_trt.runtime.loading import load_tokenizer

    text = "Hello world, the quick Brown fox 123!  two  spaces"
    want = AutoTokenizer.from_pretrained(str(tiny_base(arch))).encode(text)
    engine = ort_engine(arch)
    assert AutoTokenizer.from_pretrained(str(engine)).encode(text) == want
    assert load_tokenizer(engine).encode(text) == want
