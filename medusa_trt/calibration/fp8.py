"""FP8 calibration: the largest input magnitude of every quantized Linear, and of K/V for an FP8 cache.

The model run is our PyTorch reference (`MedusaModel`) on the merged, not yet quantized weights in
the output dtype, rather than the Hugging Face base:

- its Linears are the checkpoint's own (fused qkv, fc = HF gate_proj, gate = HF up_proj), so each
  recorded range belongs to exactly one tensor the converter writes, with no name mapping to get
  wrong, and the Medusa ResBlocks are there too (`--quantize-heads`) for every head format;
- it computes in the dtype the engine will compute in, so the ranges include that rounding;
- the keys it records are post-RoPE, which is what a KV cache holds.

Like ModelOpt's max calibration, the model runs unquantized while ranges are recorded (each layer
sees the inputs of the full-precision model), and each range is a max over every token of every
sample. Samples run whole (no padding, so no pad token's activations pollute a range); samples of
equal length are batched.

Range names are TensorRT-LLM module names: `transformer.layers.{i}.attention.qkv`,
`...attention.dense`, `...mlp.fc`, `...mlp.gate`, `...mlp.proj`, `medusa_heads.{h}.medusa_layers.{l}.linear`,
and `transformer.layers.{i}.attention.kv_cache` for max(|K|, |V|).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from medusa_trt.checkpoint import layer_prefix, medusa_linear_prefix
from medusa_trt.errors import MedusaTrtError

log = logging.getLogger("medusa_trt.calibration")

DEFAULT_CALIB_SAMPLES = 512  # as ModelOpt's default calib_size
BATCH_SIZE = 8


class CalibrationError(MedusaTrtError):
    """Calibration data that cannot be used; the message names the file, the sample and the limit."""


@dataclass(frozen=True)
class CalibrationData:
    path: Path
    samples: list[list[int]]  # token ids, BOS included when the tokenizer adds one

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.samples)


def read_texts(path: str | Path, num_samples: int = DEFAULT_CALIB_SAMPLES) -> list[str]:
    """The first `num_samples` samples of a .txt (one per non-empty line) or .jsonl (`text` field) file."""
    from medusa_trt.data import DataError, read_samples

    if num_samples < 1:
        raise CalibrationError(f"--calib-samples {num_samples}: expected a positive integer")
    try:
        texts = read_samples(path)
    except DataError as e:
        raise CalibrationError(str(e)) from None
    if len(texts) < num_samples:
        log.info("%s: %d samples, fewer than --calib-samples %d; using all of them", path, len(texts), num_samples)
    return texts[:num_samples]


def tokenize(texts: Sequence[str], tokenizer_dir: str | Path, *, path: str | Path, max_positions: int,
             seq_len: int | None = None) -> CalibrationData:
    """Token ids of each text with the model's tokenizer, cut to `seq_len` tokens when given.

    Without `seq_len` samples are used whole, and one longer than the model's context
    (`max_positions`) is an error rather than a silent cut: ranges measured past the positions the
    model was trained on describe activations it will never see.
    """
    from transformers import AutoTokenizer

    if seq_len is not None and not 1 <= seq_len <= max_positions:
        raise CalibrationError(f"--calib-seq-len {seq_len}: expected 1..{max_positions} (the model's "
                               f"max_position_embeddings)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError) as e:
        raise CalibrationError(f"{tokenizer_dir}: cannot load the base model's tokenizer to tokenize "
                               f"{path} ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    samples = []
    for n, text in enumerate(texts, 1):
        ids = list(tokenizer(text)["input_ids"])
        if seq_len is not None:
            ids = ids[:seq_len]
        elif len(ids) > max_positions:
            raise CalibrationError(f"{path}: sample {n} has {len(ids)} tokens, more than the model's "
                                   f"max_position_embeddings {max_positions}; shorten it or pass "
                                   f"--calib-seq-len to cut samples")
        if ids:
            samples.append(ids)
    if not samples:
        raise CalibrationError(f"{path}: no sample has any token after tokenization")
    return CalibrationData(Path(path), samples)


def _batches(samples: list[list[int]], batch_size: int) -> list[list[int]]:
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, s in enumerate(samples):
        by_len[len(s)].append(i)
    return [idx[j:j + batch_size] for _, idx in sorted(by_len.items()) for j in range(0, len(idx), batch_size)]


@torch.inference_mode()
def calibrate(model, data: CalibrationData, *, heads: bool = False, kv_cache: bool = False,
              progress: bool = True, batch_size: int = BATCH_SIZE) -> dict[str, float]:
    """Max |input| of every decoder Linear (and of the Medusa ResBlock linears with `heads`, of K and V
    with `kv_cache`) of an unquantized `MedusaModel` over `data`, by TensorRT-LLM module name."""
    from tqdm import tqdm

    from medusa_trt.fp8 import FP8Linear

    if any(isinstance(m, FP8Linear) for m in model.modules()) or model.drafter.fp8 is not None:
        raise ValueError("calibrate() needs the unquantized model: ranges of an already quantized one "
                         "would describe its rounding, not the model")
    amax: dict[str, torch.Tensor] = {}

    def record(name: str, x: torch.Tensor) -> None:
        m = x.detach().abs().max().float()
        amax[name] = torch.maximum(amax[name], m) if name in amax else m

    hooks = []
    for i, layer in enumerate(model.layers):
        p = layer_prefix(i)
        for attr, name in (("qkv", "attention.qkv"), ("dense", "attention.dense"), ("fc", "mlp.fc"),
                           ("gate", "mlp.gate"), ("proj", "mlp.proj")):
            hooks.append(getattr(layer, attr).register_forward_pre_hook(
                lambda _m, args, n=f"{p}.{name}": record(n, args[0])))
        if kv_cache:  # DecoderLayer returns (x, k, v) with k after RoPE: what the cache stores
            hooks.append(layer.register_forward_hook(
                lambda _m, _args, out, n=f"{p}.attention.kv_cache": record(n, torch.stack(out[1:]))))
    finals: list[torch.Tensor] = []
    if heads:  # (hooks must return None: a forward hook's return value replaces the output)
        hooks.append(model.ln_f.register_forward_hook(lambda _m, _args, out: finals.append(out)))
    try:
        with tqdm(total=len(data.samples), unit="sample", desc="calibrating", disable=not progress,
                  leave=False) as bar:
            for idx in _batches(data.samples, batch_size):
                ids = torch.tensor([data.samples[i] for i in idx])  # [B, S]
                b, s = ids.shape
                pos = torch.arange(s)[None].expand(b, -1)
                mask = torch.ones(s, s, dtype=torch.bool).tril()[None].expand(b, -1, -1)
                keys, values = model.empty_cache(b)
                # Logits at the last position only: nobody reads the others, and [S, V] is the costliest product.
                model.forward_hidden(ids, pos, mask, keys, values, torch.full((b, 1), s - 1))
                if heads:
                    _record_heads(model, finals.pop(), record)
                bar.update(len(idx))
    finally:
        for h in hooks:
            h.remove()
    return {name: float(v) for name, v in amax.items()}


def _record_heads(model, h: torch.Tensor, record) -> None:
    """The inputs of each Medusa ResBlock linear at every position: layer 0 reads the final normed
    hidden state h, layer l the output of layer l-1 (the heads' math, MedusaModel.medusa_heads)."""
    import torch.nn.functional as F

    from medusa_trt.drafters.medusa import resblocks

    cfg = model.cfg
    for head in range(cfg.num_medusa_heads):
        def linear(x: torch.Tensor, layer: int, head: int = head) -> torch.Tensor:
            record(medusa_linear_prefix(head, layer), x)
            return F.linear(x, model.drafter.w[head, layer], model.drafter.b[head, layer])

        resblocks(h, linear, range(cfg.num_medusa_layers))
