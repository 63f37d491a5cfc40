"""convert(): base + heads -> merged checkpoint, streamed tensor by tensor into a temporary dir."""

from __future__ import annotations

import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from medusa_trt import __version__
from medusa_trt.checkpoint import CONFIG_DTYPES, CheckpointError, CheckpointWriter, check_tp
from medusa_trt.converter.heads import MedusaHeads, find_heads, head_keys_in, head_pieces
from medusa_trt.converter.hf_base import (
    BaseModel,
    ConvertError,
    base_config,
    base_pieces,
    default_out_dtype,
    read_base,
    same_dir,
    source_dtype,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja",
                   "chat_template.json", "generation_config.json")
DEFAULT_MAX_DRAFT_LEN = 63


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

    @property
    def mb_per_s(self) -> float:
        return self.weight_bytes / 1e6 / max(self.seconds, 1e-9)

    def __str__(self) -> str:
        rows = [
            ("output", str(self.out)),
            ("heads", f"{self.head_format}: {self.num_heads} heads x {self.num_layers} layer(s), "
                      f"{'own' if self.heads_have_lm_head else 'base'} lm_head"),
            ("base", self.base_model_type),
            ("dtype / tp", f"{self.dtype} / {self.tp_size} rank(s)"),
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
        },
    })
    return config


def _check_out(out: Path, force: bool, inputs: list[Path]) -> None:
    if out.exists() and not out.is_dir():
        raise ConvertError(f"{out}: --out exists and is not a directory")
    if out.exists() and any(out.iterdir()) and not force:
        raise ConvertError(f"{out}: --out exists and is not empty; pass --force to replace it")
    for src in inputs:
        if same_dir(out, src) or src.resolve().is_relative_to(out.resolve()):
            raise ConvertError(f"{out}: --out must not be or contain the input {src}")


def convert(base: str | Path, heads: str | Path | None, out: str | Path, *, dtype: str | None = None,
            tp_size: int = 1, max_draft_len: int = DEFAULT_MAX_DRAFT_LEN, force: bool = False,
            progress: bool = True) -> ConvertSummary:
    """Merge an HF base model and Medusa heads into a TensorRT-LLM checkpoint at `out`.

    `heads` may be None when the base dir itself holds the heads (Medusa-2 / ModelOpt full
    models). Raises ConvertError on bad input; `out` is then left as it was.
    """
    start = time.perf_counter()
    base_dir, out = Path(base), Path(out)
    heads_path = Path(heads) if heads is not None else None
    if dtype is not None and dtype not in CONFIG_DTYPES:
        raise ConvertError(f"--dtype {dtype!r}: expected one of {', '.join(CONFIG_DTYPES)}")
    if max_draft_len < 1:
        raise ConvertError(f"--max-draft-len {max_draft_len}: expected a positive integer")
    _check_out(out, force, [p for p in (base_dir, heads_path) if p is not None and p.exists()])

    base_model = read_base(base_dir)
    medusa: MedusaHeads | None = None
    try:
        medusa = find_heads(heads_path, base_model)
        out_dtype = dtype or default_out_dtype(base_model)
        config = build_config(base_model, medusa, dtype=out_dtype, tp_size=tp_size,
                              max_draft_len=max_draft_len)
        try:
            check_tp(config)
        except CheckpointError as e:
            raise ConvertError(f"--tp-size {tp_size}: {e} ({base_model.config_path})") from None
        pieces = base_pieces(base_model, config, head_keys_in(base_model.weights))
        pieces.update(head_pieces(medusa, base_model, config))
        for name, piece in pieces.items():
            piece.check(name)

        out.parent.mkdir(parents=True, exist_ok=True)
        # Beside --out so the final rename stays on one filesystem; mkdir (unlike mkdtemp) leaves
        # the usual umask permissions on what becomes the output directory.
        tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:12]}"
        tmp.mkdir()
        try:
            _write(tmp, config, pieces, CONFIG_DTYPES[out_dtype], progress)
            for name in TOKENIZER_FILES:
                if (base_dir / name).is_file():
                    shutil.copy2(base_dir / name, tmp / name)
            if out.exists():
                shutil.rmtree(out)
            tmp.rename(out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
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
                          seconds=time.perf_counter() - start)


def _write(tmp: Path, config: dict, pieces: dict, dtype, progress: bool) -> None:
    with CheckpointWriter(tmp, config) as writer:
        if set(writer.names) != set(pieces):  # a converter bug, not bad input
            raise RuntimeError(f"planned tensors differ from the checkpoint layout: "
                               f"{sorted(set(writer.names) ^ set(pieces))[:5]}")
        with tqdm(total=writer.nbytes_data, unit="B", unit_scale=True, desc="medusa-convert",
                  disable=not progress, leave=False) as bar:
            for name in writer.names:
                # One output tensor (with its sources) is alive at a time: this bounds peak memory.
                bar.update(writer.add(name, pieces[name].load(dtype)))
