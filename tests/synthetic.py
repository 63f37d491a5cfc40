"""Tiny real checkpoints for tests, the demo and benchmarks.

Bases are made by transformers' own model classes (random weights, `save_pretrained`), heads are
written the way each producer writes them (docs/formats.md section 1), and a small real tokenizer is
saved next to them. Nothing is downloaded.
"""

from __future__ import annotations

import json
import math
import shutil
import string
from pathlib import Path

import torch

from medusa_trt.safetensors_io import SafetensorsWriter

ARCHS = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
         "mistral": ("MistralConfig", "MistralForCausalLM"),
         "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}
WEIGHTS_FORMATS = ("safetensors", "sharded", "bin", "sharded_bin")
HEAD_FORMATS = ("medusa_v1", "medusa_v2", "medusa2_full", "modelopt")  # Medusa's; "amphista" too (make_amphista)
BOS, EOS = 1, 2
# Bases with a sliding window far shorter than the tests' sequences (make_base's extra_config):
# Mistral slides in every layer; Qwen2 from max_window_layers on, so layer 0 attends to all and
# layer 1 to the window, both kinds of layer in one model.
WINDOW = 8
SLIDING_WINDOW_CONFIGS = {
    "mistral": {"sliding_window": WINDOW},
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
}


def make_tokenizer(vocab_size: int):
    """A real fast tokenizer over a fixed alphabet (one token per character, Metaspace words).

    Its 72 tokens fit any vocab >= 72; ids above them exist in the model but are never produced.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    alphabet = ["\u2581", *string.ascii_lowercase, *string.ascii_uppercase, *string.digits, *".,!?'-"]
    tokens = specials + alphabet
    if len(tokens) > vocab_size:
        raise ValueError(f"vocab {vocab_size} is too small for the {len(tokens)}-token synthetic tokenizer")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", BOS)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="</s>")


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights with O(1) activations, so logits are well separated (no near-ties under argmax),
    and non-trivial norms and biases, so a mapping mistake in either shows up."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


def make_base(directory: str | Path, arch: str = "llama", *, hidden_size: int = 64, layers: int = 2,
              heads: int = 4, kv_heads: int = 2, vocab: int = 256, intermediate: int = 128,
              tied: bool = False, rope_scaling: dict | None = None, weights_format: str = "safetensors",
              dtype: torch.dtype = torch.float32, seed: int = 0, max_position_embeddings: int = 512,
              extra_config: dict | None = None) -> Path:
    """A tiny random Llama/Mistral/Qwen2 model saved like the Hub's, with a tokenizer. `extra_config`:
    more config keys (a sliding window: {"sliding_window": 8}, Qwen2's "use_sliding_window", ...)."""
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r}: expected one of {', '.join(ARCHS)}")
    if weights_format not in WEIGHTS_FORMATS:
        raise ValueError(f"weights_format {weights_format!r}: expected one of {', '.join(WEIGHTS_FORMATS)}")
    directory = Path(directory)
    config_cls, model_cls = (getattr(transformers, n) for n in ARCHS[arch])
    kwargs = dict(hidden_size=hidden_size, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, vocab_size=vocab, intermediate_size=intermediate,
                  tie_word_embeddings=tied, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=EOS,
                  max_position_embeddings=max_position_embeddings)
    if rope_scaling is not None:
        kwargs["rope_scaling"] = rope_scaling
    config = config_cls(**kwargs, **(extra_config or {}))
    torch.manual_seed(seed)
    model = model_cls(config)
    _randomize(model, seed)
    model = model.to(dtype).eval()

    if weights_format in ("safetensors", "sharded"):
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        shard = total // 3 if weights_format == "sharded" else "50GB"
        model.save_pretrained(directory, max_shard_size=shard)
    else:
        # transformers 5 writes safetensors only; older releases wrote torch.save'd state dicts.
        model.config.save_pretrained(directory)
        model.generation_config.save_pretrained(directory)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        if tied:
            state.pop("lm_head.weight", None)
        if weights_format == "bin":
            torch.save(state, directory / "pytorch_model.bin")
        else:
            names = list(state)
            parts = [names[: len(names) // 2], names[len(names) // 2:]]
            weight_map = {}
            for i, part in enumerate(parts):
                file = f"pytorch_model-{i + 1:05d}-of-{len(parts):05d}.bin"
                torch.save({k: state[k] for k in part}, directory / file)
                weight_map.update(dict.fromkeys(part, file))
            _write_json(directory / "pytorch_model.bin.index.json",
                        {"metadata": {"total_size": sum(t.nbytes for t in state.values())},
                         "weight_map": weight_map})
    make_tokenizer(vocab).save_pretrained(directory)
    return directory


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def _read_json(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


def base_lm_head(base_dir: str | Path) -> torch.Tensor:
    """The base model's output matrix (its embedding when tied), read from its files."""
    from medusa_trt.converter.hf_base import TensorSource, find_weight_files

    files = find_weight_files(Path(base_dir))
    if files is None:
        raise FileNotFoundError(f"{base_dir}: no weight files")
    src = TensorSource.open(files)
    try:
        name = "lm_head.weight" if "lm_head.weight" in src else "model.embed_tokens.weight"
        return src.read(name).clone()
    finally:
        src.close()


def head_tensors(base_dir: str | Path, *, num_heads: int = 4, num_layers: int = 1, seed: int = 1,
                 trivial: bool = False, with_lm_head: bool = True,
                 dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Medusa head weights with FasterDecoding keys: {h}.{l}.linear.weight/bias, {h}.{L}.weight."""
    cfg = _read_json(Path(base_dir) / "config.json")
    d, vocab = cfg["hidden_size"], cfg["vocab_size"]
    lm = base_lm_head(base_dir) if trivial and with_lm_head else None
    dtype = dtype or (lm.dtype if lm is not None else getattr(torch, cfg.get("dtype") or "float32"))
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for h in range(num_heads):
        for layer in range(num_layers):
            if trivial:  # upstream initializes ResBlocks at zero: x + silu(0) = x
                w, b = torch.zeros(d, d), torch.zeros(d)
            else:
                w, b = torch.randn(d, d, generator=g) / math.sqrt(d), 0.1 * torch.randn(d, generator=g)
            out[f"{h}.{layer}.linear.weight"] = w.to(dtype)
            out[f"{h}.{layer}.linear.bias"] = b.to(dtype)
        if with_lm_head:
            w = lm.clone() if trivial else torch.randn(vocab, d, generator=g) / math.sqrt(d)
            out[f"{h}.{num_layers}.weight"] = w.to(dtype)
    return out


def make_heads(target: str | Path, fmt: str, base_dir: str | Path, *, num_heads: int = 4,
               num_layers: int = 1, seed: int = 1, trivial: bool = False,
               config_num_heads: int | None = None, dtype: torch.dtype | None = None,
               fp8: bool = False) -> Path:
    """Write Medusa heads in format `fmt` the way its producer does; returns the --heads path.

    medusa_v1: torch.save'd state dict `medusa_lm_head.pt` (or `.safetensors` when `target` ends
    so) + config.json without model_type. medusa_v2: safetensors without per-head lm_head +
    config `version: "2"`. medusa2_full / modelopt: a copy of the base dir with `medusa_head.` /
    `medusa_heads.` tensors added and the config extended; `fp8` (modelopt only) stores the
    linears as float8_e4m3fn with weight_scale / input_scale, as ModelOpt's FP8 export does.
    `config_num_heads` writes a different head count into the config (published v1 configs
    under-report it).
    """
    from safetensors.torch import save_file

    if fmt not in (*HEAD_FORMATS, "amphista"):
        raise ValueError(f"fmt {fmt!r}: expected one of {', '.join(HEAD_FORMATS)}, amphista")
    base_dir, target = Path(base_dir), Path(target)
    if fmt == "amphista":
        return make_amphista(target, base_dir, num_heads=num_heads, seed=seed)
    tensors = head_tensors(base_dir, num_heads=num_heads, num_layers=num_layers, seed=seed,
                           trivial=trivial, with_lm_head=fmt != "medusa_v2", dtype=dtype)
    said_heads = config_num_heads if config_num_heads is not None else num_heads

    if fmt in ("medusa_v1", "medusa_v2"):
        if target.suffix in (".pt", ".safetensors"):
            directory, file = target.parent, target
        else:
            directory = target
            file = target / ("medusa_lm_head.pt" if fmt == "medusa_v1" else "medusa_lm_head.safetensors")
        directory.mkdir(parents=True, exist_ok=True)
        if file.suffix == ".pt":
            torch.save(tensors, file)
        else:
            save_file(tensors, file, metadata={"format": "pt"})
        config = {"medusa_num_heads": said_heads, "medusa_num_layers": num_layers,
                  "base_model_name_or_path": str(base_dir)}
        if fmt == "medusa_v2":
            config["version"] = "2"
        _write_json(directory / "config.json", config)
        return target

    if fp8 and fmt != "modelopt":
        raise ValueError("fp8 heads exist only in the modelopt format")
    prefix = "medusa_head." if fmt == "medusa2_full" else "medusa_heads."
    extra: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        if fp8 and key.endswith("linear.weight"):
            scale = (t.float().abs().max() / 448).clamp(min=1e-12).reshape(1)
            extra[prefix + key] = (t.float() / scale).to(torch.float8_e4m3fn)
            extra[prefix + key.replace(".weight", ".weight_scale")] = scale
            extra[prefix + key.replace(".weight", ".input_scale")] = torch.ones(1)
        else:
            extra[prefix + key] = t
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(base_dir, target)
    _add_tensors(target, extra)
    config = _read_json(target / "config.json")
    if fmt == "medusa2_full":
        config.update(medusa_num_heads=said_heads, medusa_num_layers=num_layers)
    else:
        config["medusa"] = {"num_medusa_heads": said_heads, "num_medusa_layers": num_layers}
    _write_json(target / "config.json", config)
    return target


def make_amphista(target: str | Path, base_dir: str | Path, *, num_heads: int = 4, seed: int = 1,
                  draft_vocab: list[int] | None = None, sal_intermediate_size: int = 48) -> Path:
    """An Amphista drafter for the base in this project's format (tools/train_drafter.save_amphista),
    random weights away from its identity start so every part shows in its drafts
    (tools/train_drafter.new_amphista)."""
    from medusa_trt.tools.train_drafter import new_amphista, save_amphista

    drafter = new_amphista(base_dir, num_heads, sal_intermediate_size, seed=seed, noise=0.05)
    vocab = None if draft_vocab is None else torch.tensor(draft_vocab)
    save_amphista(drafter, target, base=str(base_dir), vocab=vocab)
    return Path(target)


def _add_tensors(directory: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Add tensors to an HF model dir the way a full-model save would hold them."""
    from safetensors.torch import load_file, save_file

    for index_name, shard in (("model.safetensors.index.json", "model-medusa.safetensors"),
                              ("pytorch_model.bin.index.json", "pytorch_model-medusa.bin")):
        if (directory / index_name).exists():
            if shard.endswith(".safetensors"):
                save_file(tensors, directory / shard, metadata={"format": "pt"})
            else:
                torch.save(tensors, directory / shard)
            index = _read_json(directory / index_name)
            index["weight_map"].update(dict.fromkeys(tensors, shard))
            _write_json(directory / index_name, index)
            return
    if (directory / "model.safetensors").exists():
        state = load_file(directory / "model.safetensors")
        save_file({**state, **tensors}, directory / "model.safetensors", metadata={"format": "pt"})
    else:
        state = torch.load(directory / "pytorch_model.bin", weights_only=True)
        torch.save({**state, **tensors}, directory / "pytorch_model.bin")


def large_base_tensors(*, hidden_size: int, layers: int, heads: int, kv_heads: int, vocab: int,
                       intermediate: int, tied: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    """HF Llama tensor names and shapes, in the order save_pretrained writes them."""
    hd = hidden_size // heads
    names: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden_size))]
    for i in range(layers):
        p = f"model.layers.{i}"
        names += [(f"{p}.input_layernorm.weight", (hidden_size,)),
                  (f"{p}.self_attn.q_proj.weight", (heads * hd, hidden_size)),
                  (f"{p}.self_attn.k_proj.weight", (kv_heads * hd, hidden_size)),
                  (f"{p}.self_attn.v_proj.weight", (kv_heads * hd, hidden_size)),
                  (f"{p}.self_attn.o_proj.weight", (hidden_size, heads * hd)),
                  (f"{p}.post_attention_layernorm.weight", (hidden_size,)),
                  (f"{p}.mlp.gate_proj.weight", (intermediate, hidden_size)),
                  (f"{p}.mlp.up_proj.weight", (intermediate, hidden_size)),
                  (f"{p}.mlp.down_proj.weight", (hidden_size, intermediate))]
    names.append(("model.norm.weight", (hidden_size,)))
    if not tied:
        names.append(("lm_head.weight", (vocab, hidden_size)))
    return names


def make_large_base(directory: str | Path, *, hidden_size: int = 2048, layers: int = 20, heads: int = 16,
                    kv_heads: int = 8, vocab: int = 32000, intermediate: int = 5632,
                    dtype: torch.dtype = torch.float16, shard_bytes: int = 500_000_000, seed: int = 0,
                    progress: bool = True) -> Path:
    """A Llama base of realistic size written shard by shard, never whole in memory.

    The defaults give about 2.15 GB in float16. Weights are random: good for timing and memory
    figures, meaningless as a model.
    """
    from tqdm import tqdm

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = large_base_tensors(hidden_size=hidden_size, layers=layers, heads=heads, kv_heads=kv_heads,
                                 vocab=vocab, intermediate=intermediate)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensors:
        nbytes = math.prod(shape) * dtype.itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    g = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    total = sum(math.prod(s) * dtype.itemsize for _, s in tensors)
    with tqdm(total=total, unit="B", unit_scale=True, desc="synthetic base", disable=not progress) as bar:
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            plan = [(name, dtype, shape) for name, shape in shard]
            with SafetensorsWriter(directory / file, plan) as writer:
                for name, shape in shard:
                    if name.endswith("norm.weight"):
                        t = 1 + 0.1 * torch.randn(shape, generator=g)
                    else:
                        t = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
                    bar.update(writer.write(name, t.to(dtype)))
                    weight_map[name] = file
    _write_json(directory / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": weight_map})
    dtype_name = str(dtype).removeprefix("torch.")
    _write_json(directory / "config.json", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": dtype_name,
        "hidden_size": hidden_size, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": hidden_size // heads, "vocab_size": vocab,
        "intermediate_size": intermediate, "hidden_act": "silu", "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": False, "bos_token_id": BOS, "eos_token_id": EOS})
    make_tokenizer(vocab).save_pretrained(directory)
    return directory
