"""convert(): base + heads -> merged checkpoint, streamed tensor by tensor into a temporary dir."""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from medusa_trt import __version__
from medusa_trt.checkpoint import (
    CONFIG_DTYPES,
    DEFAULT_MAX_DRAFT_LEN,
    CheckpointWriter,
    check_tp,
    expected_tensors,
)
from medusa_trt.converter.gguf import find_gguf, read_gguf_base
from medusa_trt.converter.heads import (
    MedusaHeads,
    amphista_pieces,
    draft_vocab,
    find_heads,
    head_keys_in,
    head_pieces,
)
from medusa_trt.converter.hf_base import (
    BaseModel,
    ConvertError,
    base_config,
    base_pieces,
    default_out_dtype,
    read_base,
    source_dtype,
)
from medusa_trt.converter.quantize import EXCLUDED_HEADS as EXCLUDED_HEADS_PATTERN
from medusa_trt.converter.quantize import QuantOptions, fp8_tensors, quantization_block
from medusa_trt.errors import CheckpointError
from medusa_trt.outputs import atomic_output_dir, check_output_dir
from medusa_trt.tree import MAX_DRAFT_LEN

log = logging.getLogger("medusa_trt.converter")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja",
                   "chat_template.json", "generation_config.json")


@dataclass
class ConvertSummary:
    out: Path
    head_format: str
    num_heads: int
    num_layers: int
    heads_have_lm_head: bool
    base_model_type: str
    dtype: str
    tp_size: int
    weight_bytes: int  # rank*.safetensors
    total_bytes: int  # everything in the output dir
    seconds: float
    quantization: str | None = None  # e.g. "FP8 linears, FP8 KV cache"
    calib_samples: int = 0
    calib_tokens: int = 0

    @property
    def mb_per_s(self) -> float:
        return self.weight_bytes / 1e6 / max(self.seconds, 1e-9)

    def __str__(self) -> str:
        rows = [
            ("output", str(self.out)),
            ("heads", f"{self.head_format}: {self.num_heads} heads "
                      # an Amphista drafter has no per-head layers: its two adaptation layers are shared
                      + ("over 2 adaptation layers, " if self.head_format == "amphista" else
                         f"x {self.num_layers} layer(s), ")
                      + f"{'own' if self.heads_have_lm_head else 'base'} lm_head"),
            ("base", self.base_model_type),
            ("dtype / tp", f"{self.dtype} / {self.tp_size} rank(s)"),
            *([("quantized", f"{self.quantization}; calibrated on {self.calib_samples} samples, "
                             f"{self.calib_tokens} tokens")] if self.quantization else []),
            ("size", f"{self.total_bytes / 1e6:.1f} MB"),
            ("time", f"{self.seconds:.2f} s ({self.mb_per_s:.1f} MB/s)"),
        ]
        return "\n".join(f"  {k:<11} {v}" for k, v in rows)


def build_config(base: BaseModel, heads: MedusaHeads, *, dtype: str, tp_size: int,
                 max_draft_len: int) -> dict:
    arch = base_config(base)
    config = {
        "architecture": "MedusaForCausalLM",
        "dtype": dtype,
        "logits_dtype": "float32",
        "model_type": arch.pop("model_type"),
    }
    if "qwen_type" in arch:
        config["qwen_type"] = arch.pop("qwen_type")
    config.update(arch)
    config.update({
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None, "exclude_modules": None},
        "mapping": {"world_size": tp_size, "tp_size": tp_size, "pp_size": 1},
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "max_draft_len": max_draft_len,
        "num_medusa_heads": heads.num_heads,
        "num_medusa_layers": heads.num_layers,
        "medusa_trt": {
            "version": __version__,
            "base": str(base.dir.resolve()),
            "heads": str(heads.path.resolve()),
            "head_format": heads.format,
            "heads_have_lm_head": heads.has_lm_head,
            "base_model_type": base.model_type,
            "source_dtype": source_dtype(base),
            **({"gguf": base.gguf} if base.gguf else {}),
        },
    })
    if heads.amphista is not None:  # its shape beside the base's (drafters.make_drafter reads it)
        config["num_medusa_layers"] = 0
        config["medusa_trt"].update(drafter="amphista", amphista=heads.amphista)
    vocab = draft_vocab(heads, config["vocab_size"])
    if vocab is not None:
        config["medusa_trt"]["draft_vocab"] = vocab
    return config


def convert(base: str | Path, heads: str | Path | None, out: str | Path, *, dtype: str | None = None,
            tp_size: int = 1, max_draft_len: int = DEFAULT_MAX_DRAFT_LEN, force: bool = False,
            progress: bool = True, quant: QuantOptions | None = None) -> ConvertSummary:
    """Merge an HF base model and Medusa heads into a TensorRT-LLM checkpoint at `out`.

    `heads` may be None when the base dir itself holds the heads (Medusa-2 / ModelOpt full
    models). `quant` asks for FP8 (converter/quantize.py): the merged weights are then calibrated
    on `quant.calib_data` with the PyTorch reference before being written quantized. Raises
    ConvertError on bad input; `out` is then left as it was.
    """
    from medusa_trt.calibration.fp8 import DEFAULT_CALIB_SAMPLES, CalibrationError, read_texts

    start = time.perf_counter()
    base_dir, out = Path(base), Path(out)
    heads_path = Path(heads) if heads is not None else None
    quant = quant or QuantOptions()
    if dtype is not None and dtype not in CONFIG_DTYPES:
        raise ConvertError(f"--dtype {dtype!r}: expected one of {', '.join(CONFIG_DTYPES)}")
    if not 1 <= max_draft_len <= MAX_DRAFT_LEN:
        raise ConvertError(f"--max-draft-len {max_draft_len}: expected an integer in 1..{MAX_DRAFT_LEN}")
    quant.check()
    check_output_dir(out, force, ConvertError, (base_dir, heads_path))
    texts = None
    if quant.active:  # a missing or empty file fails here, before any weight is read
        try:
            texts = read_texts(quant.calib_data, quant.calib_samples or DEFAULT_CALIB_SAMPLES)
        except CalibrationError as e:
            raise ConvertError(str(e)) from None

    gguf = find_gguf(base_dir)  # a GGUF file, or a dir holding one, as llama.cpp users have
    base_model = read_gguf_base(gguf) if gguf is not None else read_base(base_dir)
    medusa: MedusaHeads | None = None
    try:
        base_config(base_model)  # validates every config.json field before the heads are matched to it
        medusa = find_heads(heads_path, base_model)
        if medusa.amphista is not None and quant.quantize_heads:
            raise ConvertError(f"{medusa.path}: --quantize-heads quantizes Medusa ResBlocks; an Amphista drafter "
                               "stays in the model dtype in an FP8 checkpoint (drop --quantize-heads)")
        out_dtype = dtype or default_out_dtype(base_model)
        config = build_config(base_model, medusa, dtype=out_dtype, tp_size=tp_size,
                              max_draft_len=max_draft_len)
        try:
            check_tp(config)
        except CheckpointError as e:
            raise ConvertError(f"--tp-size {tp_size}: {e} ({base_model.config_path})") from None
        pieces = base_pieces(base_model, config, head_keys_in(base_model.weights))
        pieces.update(amphista_pieces(medusa, config) if medusa.amphista is not None
                      else head_pieces(medusa, base_model, config))
        for name, piece in pieces.items():
            piece.check(name)
        planned = {s.name for s in expected_tensors(config)}
        if planned != set(pieces):  # a converter bug, not bad input
            raise RuntimeError(f"planned tensors differ from the checkpoint layout: "
                               f"{sorted(planned ^ set(pieces))[:5]}")

        def load(name: str):
            return pieces[name].load(CONFIG_DTYPES[out_dtype])

        calib = None
        if quant.active:
            load, calib = _calibrated(base_model, config, pieces, quant, texts, progress)

        with atomic_output_dir(out, force, ConvertError, (base_dir, heads_path)) as tmp:
            _write(tmp, config, load, progress)
            if base_model.tokenizer is not None:
                base_model.tokenizer.save_pretrained(tmp)
            else:
                for name in TOKENIZER_FILES:
                    if (base_dir / name).is_file():
                        shutil.copy2(base_dir / name, tmp / name)
    finally:
        base_model.weights.close()
        if medusa is not None:
            medusa.close()

    weight_bytes = sum(p.stat().st_size for p in out.glob("rank*.safetensors"))
    return ConvertSummary(out=out, head_format=medusa.format, num_heads=medusa.num_heads,
                          num_layers=medusa.num_layers, heads_have_lm_head=medusa.has_lm_head,
                          base_model_type=base_model.model_type, dtype=out_dtype, tp_size=tp_size,
                          weight_bytes=weight_bytes,
                          total_bytes=sum(p.stat().st_size for p in out.iterdir() if p.is_file()),
                          seconds=time.perf_counter() - start,
                          quantization=_describe(config) if quant.active else None,
                          calib_samples=len(calib.samples) if calib else 0,
                          calib_tokens=calib.num_tokens if calib else 0)


def _describe(config: dict) -> str:
    q = config["quantization"]
    parts = ["FP8 linears" + (" (Medusa heads included)" if EXCLUDED_HEADS_PATTERN not in q["exclude_modules"]
                              else "")] if q["quant_algo"] == "FP8" else []
    if q["kv_cache_quant_algo"] == "FP8":
        parts.append("FP8 KV cache")
    return ", ".join(parts)


def _calibrated(base: BaseModel, config: dict, pieces: dict, quant: QuantOptions, texts: list[str],
                progress: bool):
    """Load the unquantized merged weights, calibrate the reference model on them, and return the
    writer's tensor source for the quantized `config` (updated in place) with the calibration data.

    Unlike the plain conversion, the whole model is in memory at once: calibration runs it.
    """
    from medusa_trt.calibration.fp8 import CalibrationError, calibrate, tokenize
    from medusa_trt.modeling import MedusaModel

    try:
        data = tokenize(texts, base.dir, path=quant.calib_data, seq_len=quant.calib_seq_len,
                        max_positions=int(config["max_position_embeddings"]))
    except CalibrationError as e:
        raise ConvertError(str(e)) from None
    dtype = CONFIG_DTYPES[config["dtype"]]
    weights = {}
    with tqdm(total=len(pieces), unit="tensor", desc="loading for calibration", disable=not progress,
              leave=False) as bar:
        for name, piece in pieces.items():
            weights[name] = piece.load(dtype)
            bar.update()
    model = MedusaModel.from_weights(config, weights)  # config still unquantized here
    amax = calibrate(model, data, heads=quant.quantize_heads, kv_cache=quant.kv_cache_dtype == "fp8",
                     progress=progress)
    del model
    config["quantization"] = quantization_block(quant)
    config["medusa_trt"]["calibration"] = {
        "data": str(Path(quant.calib_data).resolve()), "samples": len(data.samples), "tokens": data.num_tokens,
        "seq_len": quant.calib_seq_len, "model": "medusa_trt reference, unquantized merged weights, "
                                                 f"{config['dtype']}"}
    log.info("calibrated on %d samples (%d tokens) from %s", len(data.samples), data.num_tokens, quant.calib_data)
    return fp8_tensors(config, weights, amax), data


def _write(tmp: Path, config: dict, load: Callable[[str], object], progress: bool) -> None:
    """`load(name)` gives each full tensor; without quantization it reads it from the sources then,
    so one output tensor (with its sources) is alive at a time: this bounds peak memory."""
    with CheckpointWriter(tmp, config) as writer:
        with tqdm(total=writer.nbytes_data, unit="B", unit_scale=True, desc="medusa-convert",
                  disable=not progress, leave=False) as bar:
            for name in writer.names:
                bar.update(writer.add(name, load(name)))
