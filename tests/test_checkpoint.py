"""medusa_trt.checkpoint: TP split/merge rules, expected tensors, checkpoint validation."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from medusa_trt.checkpoint import (
    ModelConfig,
    check_tp,
    expected_tensors,
    load_checkpoint,
    merge_ranks,
    rank_file,
    rank_shape,
    shard_tensor,
    tp_rule,
    validate_checkpoint,
    validate_config,
    write_checkpoint,
)
from medusa_trt.errors import CheckpointError
from tests.test_safetensors_io import same_bits, sample_tensor

# ----------------------------------------------------------------------------------------------
# tensor parallelism
# ----------------------------------------------------------------------------------------------

def _config(nq=4, nkv=2, hs=8, d=None, inter=48, vocab=51, layers=1, heads=2, medusa_layers=1, tp=1,
            attn_bias=True, dtype="float32") -> dict:
    d = d or nq * hs
    return {"hidden_size": d, "num_attention_heads": nq, "num_key_value_heads": nkv, "head_size": hs,
            "intermediate_size": inter, "vocab_size": vocab, "num_hidden_layers": layers,
            "num_medusa_heads": heads, "num_medusa_layers": medusa_layers, "attn_bias": attn_bias,
            "mlp_bias": False, "dtype": dtype, "mapping": {"world_size": tp, "tp_size": tp, "pp_size": 1},
            "quantization": {"quant_algo": None, "kv_cache_quant_algo": None, "exclude_modules": None}}


def _random_weights(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    one = dict(config, mapping={"world_size": 1, "tp_size": 1, "pp_size": 1})
    return {s.name: torch.randn(s.shape, generator=g) for s in expected_tensors(one)}


def test_split_rules_by_name():
    assert tp_rule("transformer.layers.3.attention.qkv.weight") == "qkv"
    assert tp_rule("transformer.layers.3.attention.qkv.bias") == "qkv"
    assert tp_rule("transformer.layers.3.attention.dense.weight") == "row"
    assert tp_rule("transformer.layers.0.mlp.proj.weight") == "row"
    assert tp_rule("transformer.layers.0.mlp.fc.weight") == "column"
    assert tp_rule("transformer.layers.0.mlp.gate.weight") == "column"
    assert tp_rule("medusa_heads.2.medusa_layers.0.linear.bias") == "column"
    assert tp_rule("lm_head.weight") == "vocab"
    assert tp_rule("medusa_heads.2.lm_head.weight") == "vocab"
    for name in ("transformer.vocab_embedding.weight", "transformer.ln_f.weight",
                 "transformer.layers.0.input_layernorm.weight", "transformer.layers.0.post_layernorm.weight",
                 "transformer.layers.0.attention.qkv.weights_scaling_factor"):
        assert tp_rule(name) == "replicate", name


def test_qkv_shards_duplicate_kv_heads_when_fewer_than_ranks():
    cfg = _config(nq=4, nkv=2, hs=1, tp=4)
    # rows: q0 q1 q2 q3 | k0 k1 | v0 v1 -> values 0..7
    qkv = torch.arange(8.0)
    shards = [shard_tensor("transformer.layers.0.attention.qkv.bias", qkv, cfg, r) for r in range(4)]
    assert [s.tolist() for s in shards] == [[0, 4, 6], [1, 4, 6], [2, 5, 7], [3, 5, 7]]
    assert torch.equal(merge_ranks("transformer.layers.0.attention.qkv.bias", shards, cfg), qkv)
    shards[1] = torch.tensor([1.0, 9.0, 6.0])
    with pytest.raises(CheckpointError, match="duplicated KV head differs between rank 0 and rank 1"):
        merge_ranks("transformer.layers.0.attention.qkv.bias", shards, cfg)


def test_vocab_is_zero_padded_to_a_multiple_of_tp():
    cfg = _config(vocab=5, tp=4)
    w = torch.arange(10.0).reshape(5, 2)
    shards = [shard_tensor("lm_head.weight", w, cfg, r) for r in range(4)]
    assert all(s.shape == (2, 2) for s in shards)
    merged = merge_ranks("lm_head.weight", shards, cfg)
    assert merged.shape == (8, 2) and torch.equal(merged[:5], w) and not merged[5:].any()


@settings(max_examples=60, deadline=None)
@given(nkv=st.sampled_from([1, 2, 4, 8]), group=st.sampled_from([1, 2, 4]), tp=st.sampled_from([1, 2, 4, 8]),
       hs=st.sampled_from([2, 4]), vocab=st.integers(9, 40), seed=st.integers(0, 1000))
def test_shard_then_merge_gives_back_every_tensor(nkv, group, tp, hs, vocab, seed):
    nq = nkv * group
    if nq % tp or (nkv % tp and tp % nkv):
        return
    cfg = _config(nq=nq, nkv=nkv, hs=hs, inter=8 * tp, vocab=vocab, tp=tp, d=max(nq * hs, tp))
    cfg["hidden_size"] = -(-cfg["hidden_size"] // tp) * tp
    check_tp(cfg)
    weights = _random_weights(cfg, seed)
    specs = {s.name: s for s in expected_tensors(cfg)}
    for name, w in weights.items():
        shards = [shard_tensor(name, w, cfg, r) for r in range(tp)]
        for r, s in enumerate(shards):
            assert tuple(s.shape) == rank_shape(specs[name], cfg, r), name
        merged = merge_ranks(name, shards, cfg)
        assert torch.equal(merged[: w.shape[0]], w), name
        assert not merged[w.shape[0]:].any(), name


@pytest.mark.parametrize("nq, nkv, inter, tp, message", [
    (4, 2, 48, 3, "tp_size 3 does not divide num_attention_heads 4"),
    (8, 4, 48, 8, None),
    (12, 6, 48, 4, "num_key_value_heads 6: one must divide the other"),
    (4, 4, 50, 4, "does not divide intermediate_size 50"),
])
def test_check_tp(nq, nkv, inter, tp, message):
    cfg = _config(nq=nq, nkv=nkv, inter=inter, tp=tp)
    if message is None:
        check_tp(cfg)
    else:
        with pytest.raises(CheckpointError, match=message):
            check_tp(cfg)


# ----------------------------------------------------------------------------------------------
# whole checkpoints
# ----------------------------------------------------------------------------------------------

def _full_config(**kw) -> dict:
    cfg = _config(**kw)
    cfg.update(architecture="MedusaForCausalLM", logits_dtype="float32", model_type="llama",
               position_embedding_type="rope_gpt_neox", max_position_embeddings=64, hidden_act="silu",
               rotary_base=10000.0, rotary_scaling=None, norm_epsilon=1e-6, use_parallel_embedding=False,
               embedding_sharding_dim=0, max_draft_len=63)
    return cfg


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_write_then_load_checkpoint(tmp_path, tp):
    cfg = _full_config(tp=tp, vocab=51)
    weights = _random_weights(cfg)
    write_checkpoint(tmp_path, cfg, weights)
    assert validate_checkpoint(tmp_path) == []
    config, loaded = load_checkpoint(tmp_path)
    assert config == cfg
    assert list(loaded) == [s.name for s in expected_tensors(cfg)]
    for name, w in weights.items():
        assert torch.equal(loaded[name][: w.shape[0]], w), name
    for r in range(tp):
        load_file(rank_file(tmp_path, r))  # the official loader accepts every rank file


def test_validate_reports_missing_unknown_and_misshapen_tensors(tmp_path):
    cfg = _full_config()
    weights = _random_weights(cfg)
    write_checkpoint(tmp_path, cfg, weights)
    broken = load_file(tmp_path / "rank0.safetensors")
    del broken["transformer.ln_f.weight"]
    broken["transformer.extra"] = torch.zeros(1)
    broken["lm_head.weight"] = torch.zeros(3, 3)
    save_file(broken, tmp_path / "rank0.safetensors")
    problems = validate_checkpoint(tmp_path, strict=False)
    assert "rank0.safetensors: missing tensor 'transformer.ln_f.weight'" in problems
    assert "rank0.safetensors: unexpected tensor 'transformer.extra'" in problems
    assert any("'lm_head.weight' is torch.float32[3, 3], expected torch.float32[51, 32]" in p for p in problems)
    with pytest.raises(CheckpointError, match=f"{tmp_path}: invalid checkpoint"):
        load_checkpoint(tmp_path)


def test_validate_reports_config_problems(tmp_path):
    cfg = _full_config(tp=2)
    write_checkpoint(tmp_path, cfg, _random_weights(cfg))
    (tmp_path / "rank1.safetensors").unlink()
    assert validate_checkpoint(tmp_path, strict=False) == ["rank1.safetensors is missing"]
    del cfg["rotary_base"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="lacks keys \\['rotary_base'\\]"):
        validate_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="config.json: not found"):
        validate_checkpoint(tmp_path / "nowhere")


def test_layer_types_name_each_layer(tmp_path):
    """config.json layer_types (which layers use sliding_window): one known kind per layer, or refused
    by name; ModelConfig gives each layer its window."""
    cfg = _full_config(tp=1)
    layers = cfg["num_hidden_layers"]
    for bad in (["sliding_attention"] * (layers + 1), ["local"] * layers):
        with pytest.raises(CheckpointError, match=r"layer_types has \d+ entries.*for each of the"):
            validate_config(cfg | {"layer_types": bad}, tmp_path / "config.json")
    kinds = ["full_attention"] + ["sliding_attention"] * (layers - 1)
    validate_config(cfg | {"sliding_window": 5, "layer_types": kinds}, tmp_path / "config.json")
    assert ModelConfig.from_checkpoint_config(cfg | {"sliding_window": 5, "layer_types": kinds}).windows == (
        None, *[5] * (layers - 1))
    assert ModelConfig.from_checkpoint_config(cfg | {"sliding_window": 5}).windows == (5,) * layers
    assert ModelConfig.from_checkpoint_config(cfg).windows == (None,) * layers


def test_fp8_checkpoint_round_trip_with_duplicated_kv_heads(tmp_path):
    cfg = _full_config(tp=4, nq=4, nkv=2)
    cfg["quantization"] = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                           "exclude_modules": ["lm_head", "*medusa_heads*"]}
    weights = {s.name: sample_tensor(s.dtype, s.shape) for s in expected_tensors(dict(cfg, mapping={"tp_size": 1}))}
    weights = {n: (w.abs() + 0.1 if n.endswith("scaling_factor") else w) for n, w in weights.items()}
    write_checkpoint(tmp_path, cfg, weights)
    _, loaded = load_checkpoint(tmp_path)
    for name, w in weights.items():
        assert same_bits(loaded[name][: w.shape[0]], w), name


def test_expected_tensors_with_fp8():
    cfg = _config(layers=1, heads=1)
    cfg["quantization"] = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                           "exclude_modules": ["lm_head", "*medusa_heads*"]}
    specs = {s.name: s for s in expected_tensors(cfg)}
    assert specs["transformer.layers.0.attention.qkv.weight"].dtype == torch.float8_e4m3fn
    assert specs["transformer.layers.0.attention.qkv.bias"].dtype == torch.float32
    assert specs["transformer.layers.0.mlp.fc.weights_scaling_factor"].shape == (1,)
    assert specs["transformer.layers.0.attention.kv_cache_scaling_factor"].dtype == torch.float32
    assert specs["medusa_heads.0.medusa_layers.0.linear.weight"].dtype == torch.float32
    assert "medusa_heads.0.medusa_layers.0.linear.weights_scaling_factor" not in specs
    assert math.prod(specs["lm_head.weight"].shape) == cfg["vocab_size"] * cfg["hidden_size"]
