"""The reference model against transformers' own classes on the same weights (oracle), and its
Medusa heads against the math applied directly to the source head file."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from synthetic import SLIDING_WINDOW_CONFIGS, WINDOW
from transformers import AutoModelForCausalLM

from medusa_trt.drafters.medusa import resblocks, stacked_linear
from medusa_trt.fp8 import FP8HeadLinears, dequantize_fp8, fp8_scale, quantize_fp8
from medusa_trt.modeling import MedusaModel

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
VARIANTS = {
    "llama-gqa": ("llama", {}),
    "llama-mha-tied": ("llama", {"kv_heads": 4, "tied": True}),
    "llama-rope-llama3": ("llama", {"rope_scaling": LLAMA3}),
    "llama-rope-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    # Windows of 8 keys, 80-token sequences: most keys are outside a late query's window.
    "mistral-window": ("mistral", {"extra_config": SLIDING_WINDOW_CONFIGS["mistral"]}),
    "qwen2-window": ("qwen2", {"extra_config": SLIDING_WINDOW_CONFIGS["qwen2"]}),
}


def causal(b: int, s: int, past: int = 0) -> torch.Tensor:
    return torch.ones(s, past + s, dtype=torch.bool).tril(past)[None].expand(b, -1, -1)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_base_logits_match_transformers(variant, tiny_base, tiny_merged):
    arch, kwargs = VARIANTS[variant]
    hf = AutoModelForCausalLM.from_pretrained(tiny_base(arch, **kwargs)).eval()
    model = MedusaModel.from_checkpoint(tiny_merged(arch, base_kwargs=kwargs))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (3, 80), generator=g)  # long enough for llama3 scaling to bite
    pos = torch.arange(80)[None].expand(3, -1)
    with torch.no_grad():
        ref = hf(ids).logits
        keys, values = model.empty_cache(3)
        logits, medusa, k, v = model(ids, pos, causal(3, 80), keys, values)
        assert (logits - ref).abs().max() <= 1e-4
        assert medusa.shape == (4, 3, 80, 256) and k.shape == (2, 3, model.cfg.num_kv_heads, 80, 16)
        # Incremental: a 70-token prefill, then 10 tokens on its cache, then 1 more on both.
        _, _, k1, v1 = model(ids[:, :70], pos[:, :70], causal(3, 70), keys, values)
        step, _, k2, v2 = model(ids[:, 70:79], pos[:, 70:79], causal(3, 9, 70), k1, v1)
        assert (step - ref[:, 70:79]).abs().max() <= 1e-4
        last, _, _, _ = model(ids[:, 79:], pos[:, 79:], causal(3, 1, 79), torch.cat([k1, k2], 3),
                              torch.cat([v1, v2], 3))
        assert (last - ref[:, 79:]).abs().max() <= 1e-4


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_tree_nodes_see_the_sliding_window_of_their_position(arch, tiny_base, tiny_merged):
    """A verify step past the window: every tree node's logits equal transformers' at the last token
    of prefix + the node's path, so a node at depth d sees the keys its position sees in a plain
    decode (the window moves with the depth), and the merged config names the windowed layers."""
    kwargs = {"extra_config": SLIDING_WINDOW_CONFIGS[arch]}
    hf = AutoModelForCausalLM.from_pretrained(tiny_base(arch, **kwargs)).eval()
    model = MedusaModel.from_checkpoint(tiny_merged(arch, base_kwargs=kwargs))
    assert model.cfg.windows == ((WINDOW, WINDOW) if arch == "mistral" else (None, WINDOW))
    paths = [(), (0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)]  # () is the root
    mask = torch.tensor([[a == b[:len(a)] for a in paths] for b in paths])  # node i sees its ancestors
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, 256, (1, 3 * WINDOW), generator=g)
    tokens = torch.randint(0, 256, (1, len(paths)), generator=g)
    p = prefix.shape[1]
    with torch.no_grad():
        keys, values = model.empty_cache(1)
        _, _, k, v = model(prefix, torch.arange(p)[None], causal(1, p), keys, values)
        pos = torch.tensor([[p + len(path) for path in paths]])
        logits, _, _, _ = model(tokens, pos, torch.cat([torch.ones(len(paths), p, dtype=torch.bool), mask], 1)[None],
                                k, v)
        for i, path in enumerate(paths):
            chain = [j for j, q in enumerate(paths) if q == path[:len(q)]]  # the root .. the node
            ref = hf(torch.cat([prefix, tokens[:, chain]], 1)).logits[0, -1]
            assert (logits[0, i] - ref).abs().max() <= 1e-4, path


def test_logit_positions_select_rows(tiny_merged):
    model = MedusaModel.from_checkpoint(tiny_merged("llama"))
    ids = torch.randint(0, 256, (2, 12))
    pos = torch.arange(12)[None].expand(2, -1)
    keys, values = model.empty_cache(2)
    with torch.no_grad():
        full, medusa, _, _ = model(ids, pos, causal(2, 12), keys, values)
        some, medusa_some, _, _ = model(ids, pos, causal(2, 12), keys, values, torch.tensor([[11], [4]]))
    # Same rows; matmuls of other shapes may round differently in the last bits.
    torch.testing.assert_close(some[:, 0], torch.stack([full[0, 11], full[1, 4]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(medusa_some[:, :, 0], torch.stack([medusa[:, 0, 11], medusa[:, 1, 4]], 1),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("fmt", ["medusa_v1", "medusa_v2", "medusa2_full", "modelopt"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_medusa_heads_match_source_file(fmt, arch, tiny_base, tiny_heads, tiny_merged):
    """Round trip: merged checkpoint in the reference model == transformers hidden state + the head
    math applied to the tensors of the source head file (base lm_head for v2 heads)."""
    base = tiny_base(arch)
    src = _read_heads(tiny_heads(fmt, base))
    hf = AutoModelForCausalLM.from_pretrained(base).eval()
    model = MedusaModel.from_checkpoint(tiny_merged(arch, fmt))
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        h = hf.model(ids).last_hidden_state
        keys, values = model.empty_cache(2)
        _, medusa, _, _ = model(ids, torch.arange(9)[None].expand(2, -1), causal(2, 9), keys, values)
    for k in range(4):
        x = h + F.silu(F.linear(h, src[f"{k}.0.linear.weight"], src[f"{k}.0.linear.bias"]))
        lm = src.get(f"{k}.1.weight", hf.lm_head.weight)
        assert (medusa[k] - F.linear(x, lm)).abs().max() <= 1e-4, f"head {k}"


def _plain_heads(x: torch.Tensor, weights, biases) -> torch.Tensor:
    """The Medusa ResBlocks written out: per head, per layer, x <- x + silu(x W^T + b)."""
    out = []
    for h in range(len(weights)):
        z = x[h]
        for w, b in zip(weights[h], biases[h], strict=True):
            z = z + (z @ w.T + b) * torch.sigmoid(z @ w.T + b)
        out.append(z)
    return torch.stack(out)


def test_resblocks_forms_match_a_plain_loop():
    """The one head implementation in each form its callers use (stacked for the model and training,
    2-D per head for the export and the per-head tools, layers split in two as the export does, FP8)
    against the math written out."""
    g = torch.Generator().manual_seed(0)
    heads, layers, d = 3, 2, 8
    x = torch.randn(heads, 2, 5, d, generator=g, dtype=torch.float64)
    w = torch.randn(heads, layers, d, d, generator=g, dtype=torch.float64) / d**0.5
    b = torch.randn(heads, layers, d, generator=g, dtype=torch.float64)
    expected = _plain_heads(x, w, b)
    stacked = stacked_linear(w, b)
    torch.testing.assert_close(resblocks(x, stacked, range(layers)), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(resblocks(resblocks(x, stacked, range(1)), stacked, range(1, layers)), expected,
                               rtol=0, atol=1e-12)
    for h in range(heads):
        per_head = resblocks(x[h], lambda z, layer, h=h: F.linear(z, w[h, layer], b[h, layer]), range(layers))
        torch.testing.assert_close(per_head, expected[h], rtol=0, atol=1e-12)

    # FP8: inputs quantized-dequantized with the activation scale, weights dequantized, per head and layer.
    fp8 = FP8HeadLinears(heads, layers, d)
    w32, x32, b32 = w.float(), x.float(), b.float()
    for h in range(heads):
        for layer in range(layers):
            fp8.weights_scaling_factor[h, layer] = fp8_scale(w32[h, layer].abs().max())[0]
            fp8.activation_scaling_factor[h, layer] = 0.01 * (1 + h + layer)
            fp8.weight[h, layer] = quantize_fp8(w32[h, layer], fp8.weights_scaling_factor[h, layer])
    out = []
    for h in range(heads):
        z = x32[h]
        for layer in range(layers):
            zq = dequantize_fp8(quantize_fp8(z, fp8.activation_scaling_factor[h, layer]),
                                fp8.activation_scaling_factor[h, layer])
            y = zq @ dequantize_fp8(fp8.weight[h, layer], fp8.weights_scaling_factor[h, layer]).T + b32[h, layer]
            z = z + F.silu(y)
        out.append(z)
    torch.testing.assert_close(resblocks(x32, stacked_linear(None, b32, fp8), range(layers)), torch.stack(out),
                               rtol=1e-6, atol=1e-5)


def _read_heads(path) -> dict[str, torch.Tensor]:
    """Head tensors with FasterDecoding keys, read straight from the file as its producer wrote it."""
    from safetensors.torch import load_file

    if path.is_file():
        return torch.load(path, weights_only=True) if path.suffix == ".pt" else load_file(path)
    if (path / "medusa_lm_head.pt").exists():
        return torch.load(path / "medusa_lm_head.pt", weights_only=True)
    if (path / "medusa_lm_head.safetensors").exists():
        return load_file(path / "medusa_lm_head.safetensors")
    out = {}
    for f in path.glob("*.safetensors"):
        for k, v in load_file(f).items():
            for prefix in ("medusa_head.", "medusa_heads."):
                if k.startswith(prefix):
                    out[k[len(prefix):]] = v.float()
    return out


def test_tensor_parallel_checkpoint_loads_to_the_same_model(tiny_merged):
    one = MedusaModel.from_checkpoint(tiny_merged("llama"))
    two = MedusaModel.from_checkpoint(tiny_merged("llama", tp_size=2))
    for (name, a), (_, b) in zip(one.state_dict().items(), two.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_float16_checkpoint_runs_close_to_float32(tiny_merged):
    """fp16 weights + fp16 activations (fp32 softmax): |diff| well under the logit scale."""
    ref = MedusaModel.from_checkpoint(tiny_merged("llama"))
    half = MedusaModel.from_checkpoint(tiny_merged("llama", dtype="float16"))
    assert half.dtype == torch.float16
    ids = torch.randint(0, 256, (1, 16))
    pos = torch.arange(16)[None]
    with torch.no_grad():
        a = ref(ids, pos, causal(1, 16), *ref.empty_cache(1))[0]
        b = half(ids, pos, causal(1, 16), *half.empty_cache(1))[0]
    assert (a - b).abs().max() <= 0.05 * a.abs().max()


def test_the_model_imports_no_quantization_code():
    """modeling.py is the float model: importing it loads no quant.py or fp8.py, and it holds no copy of
    the numerics (they swap their modules into a model; the loader calls fp8.py for a checkpoint's block)."""
    code = ("import sys, medusa_trt.modeling as m; assert 'medusa_trt.quant' not in sys.modules; "
            "assert 'medusa_trt.fp8' not in sys.modules; "
            "assert not [n for n in dir(m) if 'int4' in n.lower() or 'fp8' in n.lower()]")
    subprocess.run([sys.executable, "-c", code], check=True)
