"""medusa-convert: every head format and base layout, weight mapping, TP, and bad input."""

from __future__ import annotations

import json
import logging
import math
import os
import pathlib
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from synthetic import HEAD_FORMATS

from medusa_trt.checkpoint import (
    REQUIRED_CONFIG_KEYS,
    expected_tensors,
    load_checkpoint,
    merge_ranks,
    rank_file,
    validate_checkpoint,
)
from medusa_trt.cli.convert import main
from medusa_trt.converter.hf_base import ConvertError
from medusa_trt.converter.merge import convert
from medusa_trt.safetensors_io import SafetensorsFile

ARCHS = ["llama", "mistral", "qwen2"]


def hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF dir, read with the official loaders (an oracle independent of ours)."""
    out: dict[str, torch.Tensor] = {}
    for p in sorted(directory.glob("*.safetensors")):
        out.update(load_file(p))
    for p in sorted(directory.glob("*.bin")):
        out.update(torch.load(p, weights_only=True))
    return out


def head_source(heads: Path) -> dict[str, torch.Tensor]:
    """Head tensors with FasterDecoding keys ({h}.{l}.linear.weight ...), whatever the format."""
    if heads.is_file():
        return load_file(heads) if heads.suffix == ".safetensors" else torch.load(heads, weights_only=True)
    for name in ("medusa_lm_head.safetensors", "medusa_lm_head.pt"):
        if (heads / name).exists():
            return head_source(heads / name)
    raw = hf_weights(heads)
    for prefix in ("medusa_heads.", "medusa_head."):
        found = {k[len(prefix):]: v for k, v in raw.items() if k.startswith(prefix)}
        if found:
            return found
    raise AssertionError(f"no heads in {heads}")


def merged(out: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    config = json.loads((out / "config.json").read_text())
    return config, load_file(out / "rank0.safetensors")


def check_mapping(out: Path, base: Path, heads: Path, dtype: torch.dtype | None = None) -> None:
    """Every output tensor equals its HF / head source, cast to the output dtype."""
    config, w = merged(out)
    src = hf_weights(base)
    hd = head_source(heads)
    dtype = dtype or w["transformer.ln_f.weight"].dtype

    def same(name: str, expected: torch.Tensor) -> None:
        assert w[name].dtype == dtype, name
        assert torch.equal(w[name], expected.to(dtype)), name

    same("transformer.vocab_embedding.weight", src["model.embed_tokens.weight"])
    for i in range(config["num_hidden_layers"]):
        p, q = f"transformer.layers.{i}", f"model.layers.{i}"
        a = f"{q}.self_attn"
        same(f"{p}.attention.qkv.weight", torch.cat([src[f"{a}.{x}_proj.weight"] for x in "qkv"]))
        if config["attn_bias"]:
            same(f"{p}.attention.qkv.bias", torch.cat([src[f"{a}.{x}_proj.bias"] for x in "qkv"]))
        same(f"{p}.attention.dense.weight", src[f"{a}.o_proj.weight"])
        same(f"{p}.mlp.fc.weight", src[f"{q}.mlp.gate_proj.weight"])
        same(f"{p}.mlp.gate.weight", src[f"{q}.mlp.up_proj.weight"])
        same(f"{p}.mlp.proj.weight", src[f"{q}.mlp.down_proj.weight"])
        same(f"{p}.input_layernorm.weight", src[f"{q}.input_layernorm.weight"])
        same(f"{p}.post_layernorm.weight", src[f"{q}.post_attention_layernorm.weight"])
    same("transformer.ln_f.weight", src["model.norm.weight"])
    base_lm = src.get("lm_head.weight", src["model.embed_tokens.weight"])
    same("lm_head.weight", base_lm)
    n_layers = config["num_medusa_layers"]
    for h in range(config["num_medusa_heads"]):
        for layer in range(n_layers):
            for param in ("weight", "bias"):
                same(f"medusa_heads.{h}.medusa_layers.{layer}.linear.{param}",
                     hd[f"{h}.{layer}.linear.{param}"])
        same(f"medusa_heads.{h}.lm_head.weight", hd.get(f"{h}.{n_layers}.weight", base_lm))


def check_layout(out: Path) -> dict:
    """config keys, names/shapes of docs/formats.md section 2, official loader on every rank."""
    config = json.loads((out / "config.json").read_text())
    for key in REQUIRED_CONFIG_KEYS + ("sliding_window", "bos_token_id", "eos_token_id",
                                       "tie_word_embeddings", "medusa_trt"):
        assert key in config, key
    assert set(config["medusa_trt"]) == {"version", "base", "heads", "head_format", "heads_have_lm_head",
                                         "base_model_type", "source_dtype"}
    assert config["architecture"] == "MedusaForCausalLM"
    assert config["logits_dtype"] == "float32" and config["position_embedding_type"] == "rope_gpt_neox"
    assert config["quantization"] == {"quant_algo": None, "kv_cache_quant_algo": None, "exclude_modules": None}
    assert validate_checkpoint(out) == []
    specs = expected_tensors(config)
    for r in range(config["mapping"]["tp_size"]):
        tensors = load_file(rank_file(out, r))
        assert set(tensors) == {s.name for s in specs}
    assert (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists()
    assert not list(out.parent.glob(f".{out.name}.tmp-*"))
    return config


# ----------------------------------------------------------------------------------------------
# formats
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt", HEAD_FORMATS)
def test_every_head_format_on_every_arch(tmp_path, tiny_base, tiny_heads, arch, fmt):
    base = tiny_base(arch)
    heads = tiny_heads(fmt, base, num_heads=3, num_layers=2)
    out = tmp_path / "out"
    summary = convert(base, heads, out, progress=False)
    config = check_layout(out)
    check_mapping(out, base, heads)
    assert summary.head_format == fmt and config["medusa_trt"]["head_format"] == fmt
    assert (config["num_medusa_heads"], config["num_medusa_layers"]) == (3, 2)
    assert config["medusa_trt"]["heads_have_lm_head"] == (fmt != "medusa_v2")
    assert config["model_type"] == ("qwen2" if arch == "qwen2" else "llama")
    assert config["medusa_trt"]["base_model_type"] == arch
    assert config["attn_bias"] == (arch == "qwen2")
    assert config.get("qwen_type") == ("qwen2" if arch == "qwen2" else None)
    assert config["sliding_window"] == (4096 if arch == "mistral" else None)
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["max_draft_len"] == 63 and config["mapping"] == {"world_size": 1, "tp_size": 1, "pp_size": 1}
    assert config["dtype"] == "float32" and config["vocab_size"] == 256 and config["head_size"] == 16


@pytest.mark.parametrize("weights_format", ["safetensors", "sharded", "bin", "sharded_bin"])
def test_base_weight_layouts(tmp_path, tiny_base, tiny_heads, weights_format):
    base = tiny_base("llama", weights_format=weights_format)
    expected = {"safetensors": "model.safetensors", "sharded": "model.safetensors.index.json",
                "bin": "pytorch_model.bin", "sharded_bin": "pytorch_model.bin.index.json"}[weights_format]
    assert (base / expected).exists()
    heads = tiny_heads("medusa_v1", base)
    convert(base, heads, tmp_path / "out", progress=False)
    check_layout(tmp_path / "out")
    check_mapping(tmp_path / "out", base, heads)


@pytest.mark.parametrize("fmt", ["medusa2_full", "modelopt"])
def test_full_model_dirs_as_base(tmp_path, tiny_base, tiny_heads, fmt):
    base = tiny_base("llama", weights_format="sharded")
    full = tiny_heads(fmt, base)
    convert(full, None, tmp_path / "a", progress=False)  # heads found inside --base
    convert(full, full, tmp_path / "b", progress=False)  # --heads naming the base dir itself
    for out in (tmp_path / "a", tmp_path / "b"):
        check_layout(out)
        check_mapping(out, base, full)
        assert json.loads((out / "config.json").read_text())["medusa_trt"]["head_format"] == fmt


def test_v1_safetensors_file_and_bin_base_with_full_model(tmp_path, tiny_base, tiny_heads):
    base = tiny_base("qwen2", weights_format="bin")
    heads = tiny_heads("medusa_v1", base, file_name="medusa_lm_head.safetensors")
    assert heads.is_file()
    convert(base, heads, tmp_path / "a", progress=False)
    check_mapping(tmp_path / "a", base, heads)
    full = tiny_heads("medusa2_full", base)
    convert(full, None, tmp_path / "b", progress=False)
    check_mapping(tmp_path / "b", base, full)


def test_heads_given_as_file_or_dir(tmp_path, tiny_base, tiny_heads):
    base = tiny_base()
    heads_dir = tiny_heads("medusa_v1", base)
    convert(base, heads_dir / "medusa_lm_head.pt", tmp_path / "a", progress=False)
    convert(base, heads_dir, tmp_path / "b", progress=False)
    assert merged(tmp_path / "a")[1].keys() == merged(tmp_path / "b")[1].keys()


def test_tied_embeddings(tmp_path, tiny_base, tiny_heads):
    for arch in ("llama", "qwen2"):
        base = tiny_base(arch, tied=True)
        assert "lm_head.weight" not in hf_weights(base)
        heads = tiny_heads("medusa_v2", base)
        out = tmp_path / arch
        convert(base, heads, out, progress=False)
        config, w = merged(out)
        assert config["tie_word_embeddings"] is True
        assert torch.equal(w["lm_head.weight"], w["transformer.vocab_embedding.weight"])
        assert torch.equal(w["medusa_heads.0.lm_head.weight"], w["lm_head.weight"])
        check_mapping(out, base, heads)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.mark.parametrize("scaling, expected", [
    (LLAMA3, {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}),
    ({"rope_type": "linear", "factor": 2.0}, {"type": "linear", "factor": 2.0}),
])
def test_rope_scaling_both_config_forms(tmp_path, tiny_base, tiny_heads, scaling, expected):
    base = tiny_base("llama", rope_scaling=scaling)
    assert "rope_parameters" in json.loads((base / "config.json").read_text())  # transformers 5 form
    heads = tiny_heads("medusa_v1", base)
    convert(base, heads, tmp_path / "new", progress=False)
    config = json.loads((tmp_path / "new/config.json").read_text())
    assert config["rotary_scaling"] == expected and config["rotary_base"] == 10000.0

    # The older form: rope_theta at top level, rope_scaling with "type".
    legacy = tmp_path / "legacy"
    shutil.copytree(base, legacy)
    cfg = json.loads((legacy / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = 5e5
    cfg["rope_scaling"] = {("type" if k == "rope_type" else k): v for k, v in params.items() if k != "rope_theta"}
    (legacy / "config.json").write_text(json.dumps(cfg))
    convert(legacy, heads, tmp_path / "old", progress=False)
    config = json.loads((tmp_path / "old/config.json").read_text())
    assert config["rotary_scaling"] == expected and config["rotary_base"] == 5e5


def test_a_rope_theta_inside_rope_scaling_is_the_one_transformers_reads(tmp_path):
    """An older config whose rope_scaling holds its own rope_theta: transformers takes it over the
    top-level one (or the default), so the converter does."""
    from transformers import AutoConfig

    from medusa_trt.converter.hf_base import normalize_rope

    base = tmp_path / "config.json"
    for top in ({}, {"rope_theta": 1e6}):
        cfg = {"model_type": "llama", **top, "rope_scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}}
        base.write_text(json.dumps(cfg))
        hf = AutoConfig.from_pretrained(tmp_path).rope_parameters
        assert normalize_rope(cfg, base) == (hf["rope_theta"], {"type": "linear", "factor": 2.0}) and hf["rope_theta"] == 5e5


def test_a_single_weight_file_beside_an_index_is_the_one_transformers_loads(tmp_path, tiny_base, tiny_heads):
    """A base dir with both model.safetensors and an index naming other shards (a re-saved model):
    transformers loads model.safetensors, so the merged weights are its."""
    from transformers import AutoModelForCausalLM

    base = _copy_base(tiny_base, tmp_path)
    state = load_file(base / "model.safetensors")
    save_file({k: v + 1 for k, v in state.items()}, base / "model-00001-of-00001.safetensors")
    (base / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "model-00001-of-00001.safetensors" for k in state}}))
    convert(base, tiny_heads("medusa_v1", tiny_base("llama")), tmp_path / "out", progress=False)
    _, w = merged(tmp_path / "out")
    hf = AutoModelForCausalLM.from_pretrained(base).model.embed_tokens.weight
    assert torch.equal(w["transformer.vocab_embedding.weight"], hf) and torch.equal(hf, state["model.embed_tokens.weight"])


def test_rope_scaling_beside_rope_parameters_as_transformers_reads_it(tmp_path, tiny_base, tiny_heads, capsys):
    """A transformers 5 config (rope_parameters) with a rope_scaling block added, as model cards tell
    users to: transformers applies rope_scaling whole (convert_rope_params_to_dict), so the
    converter does too, and refuses the one case where that would silently drop a theta."""
    from transformers import AutoConfig

    base = tmp_path / "base"
    shutil.copytree(tiny_base("llama"), base)
    heads = tiny_heads("medusa_v1", tiny_base("llama"))
    cfg = json.loads((base / "config.json").read_text())
    assert cfg["rope_parameters"]["rope_type"] == "default"
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}
    (base / "config.json").write_text(json.dumps(cfg))
    hf = AutoConfig.from_pretrained(base).rope_parameters
    convert(base, heads, tmp_path / "out", progress=False)
    config = json.loads((tmp_path / "out/config.json").read_text())
    assert config["rotary_scaling"] == {"type": hf["rope_type"], "factor": hf["factor"]} == {"type": "linear", "factor": 4.0}
    assert config["rotary_base"] == hf["rope_theta"]

    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}
    (base / "config.json").write_text(json.dumps(cfg))
    msg = _cli_error(["--base", str(base), "--heads", str(heads), "--out", str(tmp_path / "yarn")], capsys)
    assert "config.json" in msg and "'yarn'" in msg

    cfg["rope_parameters"]["rope_theta"] = 5e5  # transformers would use 10000 with the scaling
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}
    (base / "config.json").write_text(json.dumps(cfg))
    msg = _cli_error(["--base", str(base), "--heads", str(heads), "--out", str(tmp_path / "theta")], capsys)
    assert "rope_parameters.rope_theta 500000.0" in msg and "10000.0" in msg
    assert not (tmp_path / "yarn").exists() and not (tmp_path / "theta").exists()


def test_sliding_window_as_transformers_reads_it(tmp_path, tiny_base):
    """Which layers slide, from each form of a base config, as transformers' config classes decide:
    Qwen2 from layer_types, else from max_window_layers, only with use_sliding_window; Mistral in
    every layer; Llama never. A malformed layer_types is one error naming the file."""
    from medusa_trt.converter.hf_base import ConvertError, base_config, read_base

    def window_of(arch: str, **changes) -> tuple:
        base = tmp_path / f"{arch}-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(tiny_base(arch), base)
        cfg = json.loads((base / "config.json").read_text())
        cfg.update(changes)
        cfg = {k: v for k, v in cfg.items() if v is not None}
        (base / "config.json").write_text(json.dumps(cfg))
        out = base_config(read_base(base))
        return out["sliding_window"], out.get("layer_types")

    sliding, full = "sliding_attention", "full_attention"
    assert window_of("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1,
                     layer_types=None) == (8, [full, sliding])
    assert window_of("qwen2", use_sliding_window=True, sliding_window=8, layer_types=[sliding, full]) == (
        8, [sliding, full])
    assert window_of("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0,
                     layer_types=None) == (8, None)  # every layer slides
    assert window_of("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=2,
                     layer_types=None) == (None, None)  # none does
    assert window_of("qwen2", use_sliding_window=False, sliding_window=8) == (None, None)
    assert window_of("mistral", sliding_window=8) == (8, None)
    assert window_of("llama", sliding_window=8) == (None, None)
    with pytest.raises(ConvertError, match=r"config.json: layer_types .*for each of the 2 layers"):
        window_of("qwen2", use_sliding_window=True, sliding_window=8, layer_types=[sliding])


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_keys_a_config_leaves_out_are_transformers_defaults(tmp_path, tiny_base, arch):
    """A config.json without `sliding_window` or `max_position_embeddings` gets what transformers'
    config class gives it (MistralConfig: a 4096 window, 131072 positions; Qwen2Config: 32768)."""
    from transformers import AutoConfig

    from medusa_trt.converter.hf_base import base_config, read_base

    base = tmp_path / arch
    shutil.copytree(tiny_base(arch), base)
    cfg = json.loads((base / "config.json").read_text())
    for key in ("sliding_window", "max_position_embeddings"):
        cfg.pop(key, None)
    (base / "config.json").write_text(json.dumps(cfg))
    out, hf = base_config(read_base(base)), AutoConfig.from_pretrained(base)
    assert out["max_position_embeddings"] == hf.max_position_embeddings
    window = hf.sliding_window if arch == "mistral" else None  # Qwen2's applies only with use_sliding_window
    assert out["sliding_window"] == window and (arch != "mistral" or window == 4096)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_output_dtype(tmp_path, tiny_base, tiny_heads, dtype):
    base = tiny_base("llama")
    heads = tiny_heads("medusa_v1", base, dtype=torch.float16)  # heads saved in fp16, as upstream does
    convert(base, heads, tmp_path / "out", dtype=dtype, progress=False)
    config = check_layout(tmp_path / "out")
    assert config["dtype"] == dtype and config["medusa_trt"]["source_dtype"] == "float32"
    check_mapping(tmp_path / "out", base, heads, getattr(torch, dtype))


def test_default_dtype_follows_the_base(tmp_path, tiny_base, tiny_heads):
    base = tiny_base("mistral", dtype=torch.bfloat16)
    heads = tiny_heads("medusa_v2", base)
    summary = convert(base, heads, tmp_path / "out", progress=False)
    assert summary.dtype == "bfloat16"
    check_mapping(tmp_path / "out", base, heads, torch.bfloat16)


def test_under_reported_head_count_warns_with_both_numbers(tmp_path, tiny_base, tiny_heads, caplog):
    base = tiny_base()
    heads = tiny_heads("medusa_v1", base, num_heads=5, config_num_heads=2)
    with caplog.at_level(logging.WARNING, logger="medusa_trt"):
        summary = convert(base, heads, tmp_path / "out", progress=False)
    assert summary.num_heads == 5
    warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warning) == 1 and "medusa_num_heads is 2" in warning[0] and "hold 5 heads" in warning[0]


def test_modelopt_fp8_heads_are_dequantized(tmp_path, tiny_base, tiny_heads):
    base = tiny_base()
    heads = tiny_heads("modelopt", base, fp8=True)
    convert(base, heads, tmp_path / "out", progress=False)
    _, w = merged(tmp_path / "out")
    src = hf_weights(heads)
    q, scale = src["medusa_heads.1.0.linear.weight"], src["medusa_heads.1.0.linear.weight_scale"]
    assert q.dtype == torch.float8_e4m3fn
    assert torch.equal(w["medusa_heads.1.medusa_layers.0.linear.weight"], q.float() * scale)


def test_trivial_heads_copy_the_base_lm_head(tmp_path, tiny_base, tiny_heads):
    base = tiny_base()
    heads = tiny_heads("medusa_v1", base, trivial=True)
    convert(base, heads, tmp_path / "out", progress=False)
    _, w = merged(tmp_path / "out")
    assert not w["medusa_heads.3.medusa_layers.0.linear.weight"].any()
    assert torch.equal(w["medusa_heads.3.lm_head.weight"], w["lm_head.weight"])


def test_force_replaces_and_load_checkpoint_round_trip(tmp_path, tiny_base, tiny_heads):
    base = tiny_base()
    heads = tiny_heads("medusa_v1", base)
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    convert(base, heads, out, force=True, max_draft_len=15, progress=False)
    assert not (out / "old.txt").exists()
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~_umask())
    config, weights = load_checkpoint(out)
    assert config["max_draft_len"] == 15
    _, w = merged(out)
    assert weights.keys() == w.keys() and all(torch.equal(weights[k], w[k]) for k in w)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ----------------------------------------------------------------------------------------------
# tensor parallelism
# ----------------------------------------------------------------------------------------------

TP_BASE = dict(vocab=251, heads=4, kv_heads=2)  # vocab divisible by neither 2 nor 4


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:  # x [S, H, D], neox-style halves
    s, d = x.shape[0], x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = torch.arange(s, dtype=torch.float32)[:, None] * inv[None]  # [S, D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


def _attention(x, qkv_w, qkv_b, dense_w, nq, nkv, hs, theta):
    """Causal GQA self-attention of one (local) group of heads; returns its o_proj partial sum."""
    qkv = x @ qkv_w.T + (qkv_b if qkv_b is not None else 0)
    q, k, v = qkv.split([nq * hs, nkv * hs, nkv * hs], dim=-1)
    s = x.shape[0]
    q, k, v = _rope(q.view(s, nq, hs), theta), _rope(k.view(s, nkv, hs), theta), v.view(s, nkv, hs)
    k, v = k.repeat_interleave(nq // nkv, dim=1), v.repeat_interleave(nq // nkv, dim=1)
    scores = torch.einsum("shd,thd->hst", q, k) / math.sqrt(hs)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hst,thd->shd", scores.softmax(-1), v).reshape(s, nq * hs)
    return out @ dense_w.T


def _mlp(x, fc, gate, proj):
    return (F.silu(x @ fc.T) * (x @ gate.T)) @ proj.T


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_shards_merge_back_and_simulated_tp_forward_matches(tmp_path, tiny_base, tiny_heads, arch, tp):
    base = tiny_base(arch, **TP_BASE)
    heads = tiny_heads("medusa_v1", base, num_layers=2)
    convert(base, heads, tmp_path / "tp1", progress=False)
    convert(base, heads, tmp_path / "tpn", tp_size=tp, progress=False)
    config = check_layout(tmp_path / "tpn")
    assert config["mapping"] == {"world_size": tp, "tp_size": tp, "pp_size": 1}
    _, full = merged(tmp_path / "tp1")
    ranks = [load_file(rank_file(tmp_path / "tpn", r)) for r in range(tp)]

    # Recombining the shards gives back the unsharded weights exactly (vocab padding aside).
    for name, w in full.items():
        m = merge_ranks(name, [r[name] for r in ranks], config)
        assert torch.equal(m[: w.shape[0]], w), name
        assert not m[w.shape[0]:].any(), name
    assert ranks[0]["lm_head.weight"].shape[0] == -(-251 // tp)
    assert ranks[0]["transformer.layers.0.attention.qkv.weight"].shape[0] == (4 // tp + 2 * max(2 // tp, 1)) * 16

    # A simulated TP forward: per-rank partial sums after dense/proj, gathered column outputs.
    nq, nkv, hs, theta = 4, 2, 16, config["rotary_base"]
    x = torch.randn(7, config["hidden_size"], generator=torch.Generator().manual_seed(0))
    p = "transformer.layers.1"
    bias = f"{p}.attention.qkv.bias"
    ref_attn = _attention(x, full[f"{p}.attention.qkv.weight"], full.get(bias),
                          full[f"{p}.attention.dense.weight"], nq, nkv, hs, theta)
    tp_attn = sum(_attention(x, r[f"{p}.attention.qkv.weight"], r.get(bias), r[f"{p}.attention.dense.weight"],
                             nq // tp, max(nkv // tp, 1), hs, theta) for r in ranks)
    torch.testing.assert_close(tp_attn, ref_attn, atol=1e-5, rtol=0)
    ref_mlp = _mlp(x, full[f"{p}.mlp.fc.weight"], full[f"{p}.mlp.gate.weight"], full[f"{p}.mlp.proj.weight"])
    tp_mlp = sum(_mlp(x, r[f"{p}.mlp.fc.weight"], r[f"{p}.mlp.gate.weight"], r[f"{p}.mlp.proj.weight"])
                 for r in ranks)
    torch.testing.assert_close(tp_mlp, ref_mlp, atol=1e-5, rtol=0)

    # A Medusa head: column-parallel ResBlocks gathered each layer, vocab-parallel logits.
    def head(weights_of, gather):
        h = x
        for layer in range(2):
            pre = f"medusa_heads.2.medusa_layers.{layer}.linear"
            h = h + F.silu(gather([h @ w[f"{pre}.weight"].T + w[f"{pre}.bias"] for w in weights_of]))
        return gather([h @ w["medusa_heads.2.lm_head.weight"].T for w in weights_of])[:, :251]

    torch.testing.assert_close(head(ranks, lambda parts: torch.cat(parts, -1)),
                               head([full], lambda parts: parts[0]), atol=1e-5, rtol=0)


def test_tp_that_does_not_divide_the_heads_is_an_error(tmp_path, tiny_base, tiny_heads, capsys):
    base = tiny_base("llama", **TP_BASE)
    heads = tiny_heads("medusa_v1", base)
    msg = _cli_error(["--base", str(base), "--heads", str(heads), "--out", str(tmp_path / "o"),
                      "--tp-size", "3"], capsys)
    assert "--tp-size 3" in msg and "num_attention_heads 4" in msg
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------------------------
# bad input: one line on stderr, exit code 2, nothing at --out
# ----------------------------------------------------------------------------------------------

def _cli_error(argv: list[str], capsys) -> str:
    capsys.readouterr()  # drop what fixtures printed while building checkpoints
    assert main([*argv, "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("medusa-convert: error: "), err
    return err[0]


def _copy_base(tiny_base, tmp_path, **kw) -> Path:
    dst = tmp_path / "base"
    shutil.copytree(tiny_base("llama", **kw), dst)
    return dst


def _edit_config(directory: Path, **changes) -> None:
    cfg = json.loads((directory / "config.json").read_text())
    cfg.update(changes)
    (directory / "config.json").write_text(json.dumps(cfg))


BAD_INPUTS = ["missing_base", "base_without_config", "base_without_weights", "missing_shard", "missing_heads",
              "heads_dir_empty", "unknown_arch", "yarn_rope", "head_hidden_mismatch", "head_vocab_mismatch",
              "truncated_safetensors", "garbage_header", "unplaceable_head_key", "missing_bias",
              "unplaceable_base_key", "fp8_base_without_scale", "base_head_shape", "nonempty_out", "out_contains_base",
              "heads_pt_not_a_pickle", "base_bin_random_bytes", "index_shard_not_a_name", "base_is_a_file",
              "out_is_a_symlink", "heads_dir_with_two_drafters"]


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input(tmp_path, tiny_base, tiny_heads, capsys, case):
    base = tiny_base("llama")
    heads = tiny_heads("medusa_v1", base)
    out = tmp_path / "out"
    expect: list[str]
    if case == "missing_base":
        base = tmp_path / "nope"
        expect = [str(base), "not found"]
    elif case == "base_without_config":
        base = _copy_base(tiny_base, tmp_path)
        (base / "config.json").unlink()
        expect = [str(base / "config.json"), "not found"]
    elif case == "base_without_weights":
        base = _copy_base(tiny_base, tmp_path)
        (base / "model.safetensors").unlink()
        expect = [str(base), "no weights found"]
    elif case == "missing_shard":
        base = tmp_path / "base"
        shutil.copytree(tiny_base("llama", weights_format="sharded"), base)
        next(base.glob("model-00002-*.safetensors")).unlink()
        expect = ["model.safetensors.index.json", "model-00002-", "missing"]
    elif case == "missing_heads":
        heads = tmp_path / "heads.pt"
        expect = [str(heads), "not found"]
    elif case == "heads_dir_empty":
        heads = tmp_path / "empty"
        heads.mkdir()
        expect = [str(heads), "no Medusa head file"]
    elif case == "unknown_arch":
        base = _copy_base(tiny_base, tmp_path)
        _edit_config(base, architectures=["GPT2LMHeadModel"], model_type="gpt2")
        expect = [str(base / "config.json"), "'GPT2LMHeadModel'", "LlamaForCausalLM"]
    elif case == "heads_dir_with_two_drafters":
        heads = tmp_path / "heads"
        shutil.copytree(tiny_heads("amphista", base), heads)
        shutil.copy(tiny_heads("medusa_v1", base) / "medusa_lm_head.pt", heads)
        expect = [str(heads), "amphista.safetensors and medusa_lm_head.pt", "one drafter"]
    elif case == "base_is_a_file":
        base = tiny_base("llama") / "config.json"
        expect = [str(base), "--base is a file", "model directory or a .gguf file"]
    elif case == "out_is_a_symlink":  # the rename would replace the link, not fill its target
        (tmp_path / "target").mkdir()
        out.symlink_to(tmp_path / "target")
        expect = [str(out), "--out is a symbolic link"]
    elif case == "heads_pt_not_a_pickle":  # torch's unpickler raised KeyError on it
        heads = tmp_path / "medusa_lm_head.pt"
        heads.write_bytes(b"hello world")
        expect = [str(heads), "cannot read as a PyTorch checkpoint", "torch.save"]
    elif case == "base_bin_random_bytes":
        base = _copy_base(tiny_base, tmp_path)
        (base / "model.safetensors").unlink()
        (base / "pytorch_model.bin").write_bytes(random.Random(0).randbytes(4096))
        expect = [str(base / "pytorch_model.bin"), "cannot read as a PyTorch checkpoint"]
    elif case == "index_shard_not_a_name":
        base = tmp_path / "base"
        shutil.copytree(tiny_base("llama", weights_format="sharded"), base)
        index = json.loads((base / "model.safetensors.index.json").read_text())
        index["weight_map"]["lm_head.weight"] = 5
        (base / "model.safetensors.index.json").write_text(json.dumps(index))
        expect = ["model.safetensors.index.json", "weight_map['lm_head.weight'] is 5", "shard file"]
    elif case == "yarn_rope":
        base = _copy_base(tiny_base, tmp_path)
        _edit_config(base, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
        expect = [str(base / "config.json"), "'yarn'"]
    elif case == "head_hidden_mismatch":
        heads = tiny_heads("medusa_v1", tiny_base("llama", hidden_size=32, heads=2, kv_heads=1))
        expect = [str(heads), "'0.0.linear.weight'", "[32, 32]", "hidden_size 64"]
    elif case == "head_vocab_mismatch":
        heads = tiny_heads("medusa_v1", tiny_base("llama", vocab=300))
        expect = [str(heads), "vocab 300", "vocab_size 256"]
    elif case == "truncated_safetensors":
        base = _copy_base(tiny_base, tmp_path)
        f = base / "model.safetensors"
        f.write_bytes(f.read_bytes()[:-1000])
        expect = [str(f), "truncated"]
    elif case == "garbage_header":
        heads = tmp_path / "medusa_lm_head.safetensors"
        heads.write_bytes(struct_header(b"{garbage") + bytes(64))
        expect = [str(heads), "not valid JSON"]
    elif case == "unplaceable_head_key":
        state = torch.load(heads / "medusa_lm_head.pt", weights_only=True)
        state["0.0.extra.weight"] = torch.zeros(2)
        heads = tmp_path / "medusa_lm_head.pt"
        torch.save(state, heads)
        expect = [str(heads), "'0.0.extra.weight'", "cannot place"]
    elif case == "missing_bias":
        state = torch.load(heads / "medusa_lm_head.pt", weights_only=True)
        del state["2.0.linear.bias"]
        heads = tmp_path / "medusa_lm_head.pt"
        torch.save(state, heads)
        expect = [str(heads), "head 2 layer 0", "2.0.linear.bias"]
    elif case == "unplaceable_base_key":
        base = _copy_base(tiny_base, tmp_path)
        state = load_file(base / "model.safetensors")
        state["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
        save_file(state, base / "model.safetensors")
        expect = [str(base / "model.safetensors"), "'model.layers.0.self_attn.q_norm.weight'", "cannot place"]
    elif case == "fp8_base_without_scale":  # its codes cast as they are would be weights ~1000x off
        base = _copy_base(tiny_base, tmp_path)
        state = load_file(base / "model.safetensors")
        state["model.layers.0.mlp.down_proj.weight"] = state["model.layers.0.mlp.down_proj.weight"].to(torch.float8_e4m3fn)
        save_file(state, base / "model.safetensors")
        expect = [str(base / "model.safetensors"), "'model.layers.0.mlp.down_proj.weight'", "float8_e4m3fn and no scale"]
    elif case == "base_head_shape":
        base = _copy_base(tiny_base, tmp_path)
        _edit_config(base, intermediate_size=96)
        expect = ["'model.layers.0.mlp.gate_proj.weight'", "[128, 64]", "expected [96, 64]"]
    elif case == "nonempty_out":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
        expect = [str(out), "not empty", "--force"]
    elif case == "out_contains_base":
        base = _copy_base(tiny_base, tmp_path)
        out = tmp_path
        expect = [str(out), "must not be or contain the input"]
    existed = sorted(p.name for p in out.iterdir()) if out.exists() else None
    args = ["--base", str(base), "--out", str(out)] + (["--heads", str(heads)] if heads else [])
    msg = _cli_error(args + (["--force"] if case == "out_contains_base" else []), capsys)
    for part in expect:
        assert part in msg, (part, msg)
    if existed is not None:
        assert sorted(p.name for p in out.iterdir()) == existed  # --out untouched
    else:
        assert not out.exists()
    assert not list(out.parent.glob(".out.tmp-*"))


def struct_header(raw: bytes) -> bytes:
    return len(raw).to_bytes(8, "little") + raw


class _Marker:
    """Unpickling this would write a file: proof that the converter never executes pickles."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (pathlib.Path.write_text, (self.path, "pickle code ran"))


@pytest.mark.parametrize("where", ["heads", "base"])
def test_pickle_with_code_is_refused_and_never_executed(tmp_path, tiny_base, tiny_heads, capsys, where):
    base = tiny_base("llama")
    heads = tiny_heads("medusa_v1", base)
    marker = tmp_path / "executed.txt"
    if where == "heads":
        state = torch.load(heads / "medusa_lm_head.pt", weights_only=True)
        state["0.0.linear.bias"] = _Marker(marker)
        heads = tmp_path / "medusa_lm_head.pt"
        torch.save(state, heads)
        bad = heads
    else:
        base = _copy_base(tiny_base, tmp_path, weights_format="bin")
        state = torch.load(base / "pytorch_model.bin", weights_only=True)
        state["extra"] = _Marker(marker)
        torch.save(state, base / "pytorch_model.bin")
        bad = base / "pytorch_model.bin"
    msg = _cli_error(["--base", str(base), "--heads", str(heads), "--out", str(tmp_path / "out")], capsys)
    assert str(bad) in msg and "refused to unpickle" in msg
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_pickle_of_non_tensor_values_is_refused(tmp_path, tiny_base, capsys):
    base = tiny_base("llama")
    heads = tmp_path / "medusa_lm_head.pt"
    torch.save({"0.0.linear.weight": 3}, heads)
    msg = _cli_error(["--base", str(base), "--heads", str(heads), "--out", str(tmp_path / "out")], capsys)
    assert str(heads) in msg and "'0.0.linear.weight' holds a int, expected a tensor" in msg


def test_convert_error_is_raised_by_the_python_api(tmp_path, tiny_base):
    with pytest.raises(ConvertError, match="base model directory not found"):
        convert(tmp_path / "nope", None, tmp_path / "out", progress=False)
    with pytest.raises(ConvertError, match="no Medusa head tensors"):
        convert(tiny_base(), None, tmp_path / "out", progress=False)


def test_console_script_in_a_subprocess(tmp_path, tiny_base, tiny_heads):
    base = tiny_base("qwen2")
    heads = tiny_heads("medusa_v2", base)
    script = Path(sys.executable).parent / "medusa-convert"  # the installed console script
    launcher = [str(script)] if script.exists() else [sys.executable, "-m", "medusa_trt.cli.convert"]
    cmd = [*launcher, "--base", str(base), "--heads", str(heads),
           "--out", str(tmp_path / "out"), "--dtype", "float16", "--tp-size", "2"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "medusa_v2: 4 heads x 1 layer(s), base lm_head" in run.stdout and "MB/s" in run.stdout
    check_layout(tmp_path / "out")
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        f"medusa-convert: error: {tmp_path / 'out'}: --out exists and is not empty; pass --force to replace it"]
    with SafetensorsFile(rank_file(tmp_path / "out", 1)) as f:
        assert f.info("lm_head.weight").dtype == torch.float16


@pytest.mark.parametrize("vocab, expected", [
    ("all", "must be a list of token ids"),
    (list(range(8)), "has 8 ids; expected at least 16"),
    (list(range(15)) + [3], "holds token id 3 more than once; expected each id once"),
    (list(range(16)) + [10**6], "holds token id 1000000, outside the vocabulary; expected ids in 0.."),
])
def test_bad_draft_vocab_is_refused(tmp_path, tiny_base, tiny_heads, vocab, expected):
    heads = tmp_path / "heads"
    shutil.copytree(tiny_heads("medusa_v2", tiny_base("llama")), heads)
    config = json.loads((heads / "config.json").read_text())
    (heads / "config.json").write_text(json.dumps(config | {"draft_vocab": vocab}))
    with pytest.raises(ConvertError, match=r"config\.json: draft_vocab " + expected.replace("(", r"\(").replace(")", r"\)")):
        convert(tiny_base("llama"), heads, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
