"""The ONNX Runtime backend: the Backend interface against the PyTorch backend, and whole greedy
decodes against transformers' own generate()."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from synthetic import SLIDING_WINDOW_CONFIGS, WINDOW

from medusa_trt.cli import run as run_cli
from medusa_trt.engine_dir import EngineError
from medusa_trt.modeling import MedusaModel
from medusa_trt.runtime.decoding import GenerationConfig, decode
from medusa_trt.runtime.loading import load_backend, load_tokenizer
from medusa_trt.runtime.ort.backend import OrtBackend
from medusa_trt.runtime.ort.cache import BoundCache, ReturnedCache
from medusa_trt.runtime.torch_backend import TorchBackend

PROMPTS = ("The quick brown fox", "Medusa heads draft a tree of candidates", "Hi")
NEW_TOKENS = 48


@pytest.fixture(scope="session")
def hf_greedy(tiny_base):
    """Per prompt, the tokens transformers' generate(do_sample=False) emits on the base weights."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(arch: str, prompts: list[list[int]], base_kwargs: dict | None = None) -> list[list[int]]:
        key = (arch, repr(base_kwargs))
        if key not in cache:
            cache[key] = AutoModelForCausalLM.from_pretrained(tiny_base(arch, **(base_kwargs or {})),
                                                              dtype=torch.float32).eval()
        model = cache[key]
        out = []
        for p in prompts:
            ids = torch.tensor([p])
            with torch.no_grad():
                seq = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=NEW_TOKENS, min_new_tokens=0, eos_token_id=None,
                                     pad_token_id=0)
            out.append(seq[0, len(p):].tolist())
        return out

    return get


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_greedy_equals_transformers(ort_engine, hf_greedy, arch):
    engine_dir = ort_engine(arch)
    backend = load_backend(engine_dir)
    assert isinstance(backend, OrtBackend)
    tok = load_tokenizer(engine_dir)
    prompts = [tok.encode(t) for t in PROMPTS]
    expected = hf_greedy(arch, prompts)
    assert all(len(e) == NEW_TOKENS for e in expected)
    for use_medusa in (False, True):
        cfg = GenerationConfig(max_new_tokens=NEW_TOKENS, use_medusa=use_medusa, stop_token_ids=())  # as generate: no EOS
        result = decode(backend, prompts, cfg)
        assert result.tokens == expected, f"use_medusa={use_medusa}"


@pytest.mark.parametrize("arch,attention", [("mistral", None), ("qwen2", None), ("qwen2", "row_exact_f32")])
def test_greedy_past_the_sliding_window_equals_transformers(ort_engine, tiny_merged, hf_greedy, arch, attention):
    """A base with a window of 8 keys (Qwen2: in its second layer only), prompts and 48 new tokens
    far past it: plain and Medusa greedy (the fused step and the two-call step) on the engine, and
    plain greedy on the reference, emit transformers' tokens. The default attention form, and a
    form that writes new keys into the cache in place."""
    base_kwargs = {"extra_config": SLIDING_WINDOW_CONFIGS[arch]}
    engine_dir = ort_engine(arch, base_kwargs=base_kwargs, **({"attention": attention} if attention else {}))
    engine = json.loads((engine_dir / "engine.json").read_text())
    assert engine["model"]["sliding_window"] == WINDOW
    assert engine["onnx"]["cache_in_place"] == (attention == "row_exact_f32")
    tok = load_tokenizer(engine_dir)
    prompts = [tok.encode(t) for t in PROMPTS]
    expected = hf_greedy(arch, prompts, base_kwargs)
    reference = TorchBackend(MedusaModel.from_checkpoint(tiny_merged(arch, base_kwargs=base_kwargs)))
    # stop_token_ids=(): transformers' generate runs with eos_token_id=None
    assert decode(reference, prompts, GenerationConfig(max_new_tokens=NEW_TOKENS, use_medusa=False,
                                                       stop_token_ids=())).tokens == expected
    backend = load_backend(engine_dir)
    for use_medusa, fused in ((False, None), (True, backend.fused_step_topk), (True, None)):
        backend.fused_step_topk = fused
        result = decode(backend, prompts, GenerationConfig(max_new_tokens=NEW_TOKENS, use_medusa=use_medusa,
                                                           stop_token_ids=()))
        assert result.tokens == expected, f"use_medusa={use_medusa} fused={fused}"


@pytest.mark.parametrize("use_binding", [False, True], ids=["session.run", "iobinding"])
def test_interface_matches_torch_backend(ort_engine, tiny_merged, use_binding):
    """Random forward/commit/keep sequences give the same logits on both backends, through the
    CPU path and through the IOBinding path CUDA uses (exercised here on the CPU)."""
    ort = OrtBackend(ort_engine("llama"))
    ort.cache_mode = BoundCache if use_binding else ReturnedCache
    ref = TorchBackend(MedusaModel.from_checkpoint(tiny_merged("llama")))
    g = torch.Generator().manual_seed(3)
    for b in (ort, ref):
        b.start(3, 40)
    lens = torch.tensor([5, 2, 4])
    ids = torch.randint(0, 256, (3, 5), generator=g)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()[None] & (torch.arange(5)[None, :] < lens[:, None])[:, None]
    steps = [(ids, torch.arange(5).expand(3, 5), mask, (lens - 1)[:, None], torch.arange(5).expand(3, 5), lens)]
    for _ in range(3):
        s = 4
        new_mask = torch.rand(3, s, s, generator=g) > 0.5
        new_mask |= torch.eye(s, dtype=torch.bool)
        counts = torch.randint(1, s + 1, (3,), generator=g)
        slots = torch.stack([torch.randperm(s, generator=g) for _ in range(3)])
        steps.append((torch.randint(0, 256, (3, s), generator=g), None, new_mask, None, slots, counts))
    for ids, pos, mask, logit_positions, slots, counts in steps:
        if pos is None:
            pos = ort.lengths[:, None] + torch.arange(ids.shape[1])
        outs = [b.forward(ids, pos, mask, logit_positions) for b in (ort, ref)]
        for a, r in zip(outs[0], outs[1], strict=True):
            assert a.shape == r.shape
            torch.testing.assert_close(a, r, atol=1e-4, rtol=0)
        for b in (ort, ref):
            b.commit(slots, counts)
        assert torch.equal(ort.lengths, ref.lengths)
    for b in (ort, ref):
        b.keep(torch.tensor([2, 0]))
    ids = torch.randint(0, 256, (2, 1), generator=g)
    a, r = (b.forward(ids, ort.lengths[:, None], torch.ones(2, 1, 1, dtype=torch.bool)) for b in (ort, ref))
    torch.testing.assert_close(a[0], r[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(a[1], r[1], atol=1e-4, rtol=0)


def test_outputs_are_not_reused(ort_engine):
    """Bound output buffers are fresh per step: logits a caller kept do not change under it."""
    backend = OrtBackend(ort_engine("llama"))
    backend.start(1, 8)
    one = torch.ones(1, 1, 1, dtype=torch.bool)
    first, _ = backend.forward(torch.tensor([[5]]), torch.tensor([[0]]), one)
    kept = first.clone()
    backend.commit(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long))
    backend.forward(torch.tensor([[9]]), torch.tensor([[1]]), one)
    assert torch.equal(first, kept)


@pytest.mark.parametrize("use_binding", [False, True], ids=["session.run", "iobinding"])
@pytest.mark.parametrize("batch", [1, 2])
def test_commit_of_zero_tokens_keeps_nothing(ort_engine, tiny_merged, use_binding, batch):
    """A finished or empty row commits zero tokens: legal on every backend and batch size, the
    lengths stay, and the next step's logits are those of the unchanged cache."""
    ort = OrtBackend(ort_engine("llama"))
    ort.cache_mode = BoundCache if use_binding else ReturnedCache
    ref = TorchBackend(MedusaModel.from_checkpoint(tiny_merged("llama")))
    ids = torch.tensor([[5, 7, 9]] * batch)
    mask = torch.ones(batch, 3, 3, dtype=torch.bool).tril()
    for b in (ort, ref):
        b.start(batch, 16)
        b.forward(ids, torch.arange(3).expand(batch, 3), mask)
        b.commit(torch.arange(3).expand(batch, 3), torch.full((batch,), 3))
        b.forward(torch.tensor([[11, 12]] * batch), torch.tensor([[3, 4]] * batch), mask[:, :2, :2])
        b.commit(torch.zeros(batch, 2, dtype=torch.long), torch.zeros(batch, dtype=torch.long))
        assert b.lengths.tolist() == [3] * batch
    outs = [b.forward(torch.tensor([[13]] * batch), torch.tensor([[3]] * batch), mask[:, :1, :1]) for b in (ort, ref)]
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-4, rtol=0)


def test_limits_and_errors(ort_engine):
    engine_dir = ort_engine("llama")
    backend = OrtBackend(engine_dir)
    limits = json.loads((engine_dir / "engine.json").read_text())["limits"]
    assert backend.info.max_batch_size == limits["max_batch_size"]  # what serving cuts groups at
    with pytest.raises(ValueError, match="max_batch_size"):
        backend.start(limits["max_batch_size"] + 1, 8)
    backend.start(1, 4)
    with pytest.raises(ValueError, match="overflow"):
        backend.forward(torch.zeros(1, 5, dtype=torch.long), torch.arange(5)[None], torch.ones(1, 5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="max_seq_len"):
        backend.forward(torch.zeros(1, 1, dtype=torch.long), torch.tensor([[limits["max_seq_len"]]]),
                        torch.ones(1, 1, 1, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="commit"):
        backend.commit(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long))


def test_missing_provider_is_an_error(ort_engine):
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers() and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(EngineError, match="cuda"):
        OrtBackend(ort_engine("llama"), device="cuda")
    with pytest.raises(EngineError, match="'tpu'"):
        OrtBackend(ort_engine("llama"), device="tpu")


def test_bad_engine_dir(tmp_path, ort_engine):
    with pytest.raises(EngineError, match="engine.json"):
        OrtBackend(tmp_path)
    (tmp_path / "engine.json").write_text(json.dumps({"backend": "tensorrt"}))
    with pytest.raises(EngineError, match="'tensorrt'"):
        OrtBackend(tmp_path)
    engine = json.loads((ort_engine("llama") / "engine.json").read_text())
    (tmp_path / "engine.json").write_text(json.dumps(engine))
    with pytest.raises(EngineError, match="model.onnx: missing"):
        OrtBackend(tmp_path)
    copy = tmp_path / "copy"
    shutil.copytree(ort_engine("llama"), copy)
    (copy / "model.onnx").write_bytes(b"not a protobuf")
    with pytest.raises(EngineError, match="model.onnx: 14 bytes, engine.json records"):  # sizes are checked
        OrtBackend(copy)
    shutil.copyfile(ort_engine("llama") / "model.onnx", copy / "model.onnx")
    data = bytearray((copy / "model.onnx").read_bytes())
    data[-1] ^= 1  # same size, one bit: the digest catches it
    (copy / "model.onnx").write_bytes(bytes(data))
    with pytest.raises(EngineError, match="model.onnx: sha256 differs"):
        OrtBackend(copy)


def test_medusa_run_engine(ort_engine, capsys):
    assert run_cli.main(["--engine", str(ort_engine("llama")), "--prompt", "Hello there", "--max-new-tokens", "12",
                         "--json"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[0])
    assert line["new_tokens"] <= 12 and line["steps"] >= 1


def test_engine_without_heads(tmp_path, tiny_merged):
    """A base-only checkpoint builds and decodes plainly (its medusa_logits output has 0 heads)."""
    from medusa_trt.checkpoint import load_checkpoint, write_checkpoint
    from medusa_trt.engines.build import build_engine
    from medusa_trt.engines.options import BuildOptions

    config, weights = load_checkpoint(tiny_merged("llama"))
    write_checkpoint(tmp_path / "ckpt", {**config, "num_medusa_heads": 0},
                     {k: v for k, v in weights.items() if not k.startswith("medusa_heads")})
    build_engine(BuildOptions(checkpoint=tmp_path / "ckpt", out=tmp_path / "engine", progress=False))
    backend = OrtBackend(tmp_path / "engine")
    reference = TorchBackend(MedusaModel.from_checkpoint(tmp_path / "ckpt"))
    cfg = GenerationConfig(max_new_tokens=16, use_medusa=False)
    prompts = [[1, 5, 9, 30], [1, 7]]
    assert decode(backend, prompts, cfg).tokens == decode(reference, prompts, cfg).tokens
    backend.start(1, 4)
    _, medusa = backend.forward(torch.tensor([[5]]), torch.tensor([[0]]), torch.ones(1, 1, 1, dtype=torch.bool))
    assert medusa.shape == (0, 1, 1, 256)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_engine_tokenizes_like_its_checkpoint_and_hf_base(arch, tiny_base, tiny_merged, ort_engine):
    """The tokenizer config names a generic class, so transformers picks the class from the model
    config's model_type; the engine dir has no config.json, and engine.json's tokenizer.model_type
    must give the same class (Qwen2 differed on the trailing spaces before it did)."""
    from transformers import AutoTokenizer

    from medusa_trt.runtime.loading import load_tokenizer

    text = "def main(argv):\n    "
    hf = AutoTokenizer.from_pretrained(str(tiny_base(arch)))  # what a transformers user gets
    engine, ckpt = load_tokenizer(ort_engine(arch)), load_tokenizer(tiny_merged(arch))
    assert type(engine) is type(ckpt) is type(hf)
    assert engine.encode(text) == ckpt.encode(text) == hf.encode(text)
