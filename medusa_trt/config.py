"""ModelConfig: what the reference model, its drafter and the quantizers read of a merged
checkpoint's config.json. Its own module so that the model, the drafters and the checkpoint layer
all import it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

# config.json `layer_types` values (HF's names): which layers use `sliding_window`.
SLIDING_ATTENTION, FULL_ATTENTION = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class ModelConfig:
    """What the reference model, its drafter and the quantizers read of a merged checkpoint's config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"type": "llama3"|"linear", "factor", ...} or None
    norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    qkv_bias: bool = False
    num_medusa_heads: int = 0
    num_medusa_layers: int = 1
    sliding_window: int | None = None  # keys a query sees, itself included (transformers' sliding_window)
    # Which layers use the window, HF's names per layer ("sliding_attention" / "full_attention"):
    # Qwen2 slides only in layers >= max_window_layers. None: every layer does (Mistral).
    layer_types: tuple[str, ...] | None = None
    dtype: str = "float32"
    quantization: dict | None = None  # the checkpoint's block: quant_algo, kv_cache_quant_algo, exclude_modules
    # Token ids the heads draft from (their logits elsewhere are drafters.base.OUTSIDE_DRAFT_LOGIT):
    # a vocabulary subset set by head training makes a step's head logits cost V'/V of the full lm_head.
    draft_vocab: tuple[int, ...] | None = None
    drafter: str = "medusa"  # the drafter's kind (medusa_trt/drafters/: DRAFTERS)
    drafter_options: dict | None = None  # its own config block (medusa_trt.<kind>), e.g. Amphista's shape

    @classmethod
    def from_checkpoint_config(cls, cfg: dict) -> ModelConfig:
        """Reads the merged checkpoint's config.json (TensorRT-LLM key names)."""
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_size") or cfg["hidden_size"] // heads,
            rope_theta=float(cfg.get("rotary_base", 10000.0)),
            rope_scaling=cfg.get("rotary_scaling"),
            norm_eps=float(cfg.get("norm_epsilon", 1e-6)),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            qkv_bias=bool(cfg.get("attn_bias", cfg.get("model_type") == "qwen2")),
            num_medusa_heads=cfg.get("num_medusa_heads", 0),
            num_medusa_layers=cfg.get("num_medusa_layers", 1),
            sliding_window=cfg.get("sliding_window"),
            layer_types=tuple(cfg["layer_types"]) if cfg.get("layer_types") else None,
            dtype=cfg.get("dtype", "float32"),
            quantization=cfg.get("quantization"),
            draft_vocab=tuple(cfg["medusa_trt"]["draft_vocab"]) if (cfg.get("medusa_trt") or {}).get("draft_vocab")
            else None,
            drafter=(cfg.get("medusa_trt") or {}).get("drafter", "medusa"),
            drafter_options=(cfg.get("medusa_trt") or {}).get((cfg.get("medusa_trt") or {}).get("drafter", "medusa")),
        )


    def layer_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer`, or None when it attends to every earlier position."""
        if self.sliding_window is None or (self.layer_types and self.layer_types[layer] != SLIDING_ATTENTION):
            return None
        return self.sliding_window

    @property
    def windows(self) -> tuple[int | None, ...]:
        """layer_window of every layer, in layer order."""
        return tuple(self.layer_window(i) for i in range(self.num_layers))
