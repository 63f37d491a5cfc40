"""PyTorch reference model: a Llama-family decoder plus its drafter (Medusa heads; medusa_trt/drafters/).

It reads the merged checkpoint's own weight names (the TensorRT-LLM layout: fused qkv, `mlp.fc` is
HF gate_proj, `mlp.gate` is HF up_proj) so every backend is checked against one model that loads the
exact bytes they build from. Everything a tree verify needs is explicit in `forward`: position ids
(tree nodes share positions by depth), a boolean attention mask over [past + new] keys (causal for a
prompt, the tree mask for a verify step), and the past key/values. The module holds no cache state,
which keeps it exportable to ONNX as one graph. A sliding window (Mistral, Qwen2's upper layers)
is a second mask, the first cut to the window by position (`sliding_window_mask`).

The model is float only. Quantized forms (an FP8 checkpoint's, medusa-build's int4) are modules that
medusa_trt.fp8 and medusa_trt.quant swap in, computing what the engines' quantized ops compute; the model offers the
seams they plug into (Linear submodules, `DecoderLayer.kv_cache`, the slots named in MedusaModel).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from medusa_trt.checkpoint import (
    CONFIG_DTYPES,
    LM_HEAD,
    LN_F,
    VOCAB_EMBEDDING,
    ModelConfig,
    layer_prefix,
    medusa_linear_prefix,
    medusa_lm_head,
)
from medusa_trt.drafters import make_drafter
from medusa_trt.layers import (  # noqa: F401 - the layer math, re-exported for the engines' exporters
    DecoderLayer,
    RMSNorm,
    apply_rope,
    attention,
    attention_with_past,
    rope_inv_freq,
    sliding_window_mask,
)


class MedusaModel(nn.Module):
    """Base decoder + drafter. See `forward` for the contract every backend reproduces."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.vocab_embedding = nn.Embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.ln_f = RMSNorm(d, cfg.norm_eps)
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        self.drafter = make_drafter(cfg)  # what proposes the next tree's tokens (medusa_trt/drafters/)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.ln_f.weight.dtype  # not the embedding's: int4 and int8 engines hold it as int8

    def draft(self, hidden: torch.Tensor, next_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The drafter's logits [H, B, S, V] float32 at hidden [B, S, d] (final normed hidden states)
        and next_tokens [B, S] (the token chosen after each row; drafters that read them need them)."""
        return self.drafter(hidden, next_tokens, self.lm_head, self.vocab_embedding)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        past_keys: torch.Tensor,
        past_values: torch.Tensor,
        logit_positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`forward_hidden` with the drafter applied at every row (for a drafter that reads only hidden
        states): logits [B, K, V] f32, medusa_logits [H, B, K, V] f32, present keys/values of the new
        tokens [L, B, Hkv, S, D]."""
        logits, h, new_k, new_v = self.forward_hidden(
            input_ids, position_ids, attention_mask, past_keys, past_values, logit_positions
        )
        return logits, self.draft(h), new_k, new_v

    def forward_hidden(
        self,
        input_ids: torch.Tensor,  # [B, S] int64
        position_ids: torch.Tensor,  # [B, S] int64, absolute positions (tree nodes: prefix length + depth)
        attention_mask: torch.Tensor,  # [B, S, P+S] bool, True = may attend
        past_keys: torch.Tensor,  # [L, B, Hkv, P, D]
        past_values: torch.Tensor,  # [L, B, Hkv, P, D]
        logit_positions: torch.Tensor | None = None,  # [B, K] int64: rows of S to produce logits for
        window_mask=None,  # the sliding-window layers' mask; None: from attention_mask and the positions
        all_hidden: bool = False,  # the hidden state of every row [B, S, d], whatever logit_positions asks
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns logits [B, K, V] f32, the final normed hidden state [B, K, d] at the same rows (what
        the drafter reads), and the NEW tokens' present keys/values [L, B, Hkv, S, D] (the caller
        owns the cache and decides where they go). K = S when `logit_positions` is None; prompts
        pass their last position to skip the [S, V] products nobody reads. The drafter is separate
        (`draft`) because a decoding step needs it at the committed rows only, known after
        verification.

        Layers with a sliding window (cfg.layer_window) attend through `window_mask`. By default it
        is attention_mask cut to the window, past key j taken to be position j (every backend keeps
        a sequence's committed tokens at their positions) and new key j at position_ids[:, j]; the
        export passes its own for masks of another layout (engines/onnx/attention.py: PlacedMask)."""
        x = self.vocab_embedding(input_ids)
        freqs = position_ids[..., None].float() * self.inv_freq  # [B, S, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, S, D]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        windows = self.cfg.windows
        if window_mask is None and any(windows):
            b, p = input_ids.shape[0], past_keys[0].shape[-2]  # a stacked tensor or a tuple of layers
            key_positions = torch.cat([torch.arange(p, device=position_ids.device).expand(b, p), position_ids], 1)
            window_mask = sliding_window_mask(attention_mask, position_ids, key_positions, self.cfg.sliding_window)
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            mask = window_mask if windows[i] else attention_mask
            x, k, v = layer(x, cos, sin, mask, past_keys[i], past_values[i])
            new_k.append(k)
            new_v.append(v)
        h_all = h = self.ln_f(x)
        if logit_positions is not None:
            h = torch.gather(h_all, 1, logit_positions[..., None].expand(-1, -1, h_all.shape[-1]))
        logits = self.lm_head(h).float()
        # cat + view rather than stack: one Concat in an exported graph instead of an Unsqueeze per layer.
        shape = (len(new_k), *new_k[0].shape)
        return logits, h_all if all_hidden else h, torch.cat(new_k).view(shape), torch.cat(new_v).view(shape)

    def empty_cache(self, batch: int, length: int = 0, device: torch.device | str | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, length, cfg.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=device), torch.zeros(shape, dtype=self.dtype, device=device)

    # -- loading -------------------------------------------------------------------------------

    @classmethod
    def from_weights(cls, config: dict, weights: dict[str, torch.Tensor], dtype: str | None = None) -> MedusaModel:
        """Builds the model from a merged checkpoint's config and full (unsharded) weights."""
        cfg = ModelConfig.from_checkpoint_config(config)
        torch_dtype = CONFIG_DTYPES[dtype or cfg.dtype]
        with torch.device("meta"):
            model = cls(cfg)
        state = _to_module_names(cfg, weights)
        if cfg.quantization:
            # An FP8 checkpoint's modules (docs/formats.md section 2) are fp8.py's: it swaps them in,
            # on the meta device like the rest, and names their tensors. fp8 imports no modeling
            # code, so this call makes no import cycle.
            from medusa_trt.fp8 import load_fp8

            with torch.device("meta"):
                load_fp8(model, weights, state)
        model.load_state_dict(state, assign=True, strict=True)
        model.inv_freq = rope_inv_freq(cfg)
        if cfg.draft_vocab:
            model.drafter.set_draft_vocab(cfg.draft_vocab, model.lm_head.weight)
        return model.to(torch_dtype).eval()

    @classmethod
    def from_checkpoint(cls, path: str | Path, dtype: str | None = None) -> MedusaModel:
        """`dtype` overrides the compute dtype; FP8 weights and their float32 scales stay as stored."""
        from medusa_trt.checkpoint import load_checkpoint

        config, weights = load_checkpoint(path)
        return cls.from_weights(config, weights, dtype)


def _to_module_names(cfg: ModelConfig, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """TensorRT-LLM checkpoint names -> this module's parameter names (lm_heads unpadded)."""
    v = cfg.vocab_size
    out = {
        "vocab_embedding.weight": w[VOCAB_EMBEDDING],
        "ln_f.weight": w[LN_F],
        "lm_head.weight": w[LM_HEAD][:v],
    }
    for i in range(cfg.num_layers):
        src, dst = f"{layer_prefix(i)}.", f"layers.{i}."
        names = {"input_layernorm.weight": "input_layernorm.weight", "post_layernorm.weight": "post_layernorm.weight",
                 "attention.qkv.weight": "qkv.weight", "attention.dense.weight": "dense.weight",
                 "mlp.fc.weight": "fc.weight", "mlp.gate.weight": "gate.weight", "mlp.proj.weight": "proj.weight"}
        if cfg.qkv_bias:
            names["attention.qkv.bias"] = "qkv.bias"
        out.update({dst + b: w[src + a] for a, b in names.items()})
    if cfg.drafter != "medusa":  # its tensors are its own parameters (drafters.drafter_tensors)
        prefix = cfg.drafter + "."
        out.update({"drafter." + k[len(prefix):]: t for k, t in w.items() if k.startswith(prefix)})
        return out
    H, L = cfg.num_medusa_heads, cfg.num_medusa_layers
    if H:
        def stacked(param: str) -> torch.Tensor:  # [H, L, ...]
            return torch.stack([torch.stack([w[f"{medusa_linear_prefix(h, j)}.{param}"] for j in range(L)])
                                for h in range(H)])

        out["drafter.w"] = stacked("weight")
        out["drafter.b"] = stacked("bias")
        out["drafter.lm_heads"] = torch.stack(
            [w.get(medusa_lm_head(h), w[LM_HEAD])[:v] for h in range(H)]
        )
    else:
        d = cfg.hidden_size
        out.update({"drafter.w": torch.zeros(0, L, d, d), "drafter.b": torch.zeros(0, L, d),
                    "drafter.lm_heads": torch.zeros(0, v, d)})
    return out
