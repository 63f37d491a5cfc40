"""An Amphista drafter end to end on tiny real checkpoints: trained by the recipe's functions on the
base's own greedy text, converted by medusa-convert, built into ONNX Runtime engines (float32, int4, int8),
decoded with output unchanged and drafts equal to the reference's; bad drafter files refused."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from synthetic import EOS, SLIDING_WINDOW_CONFIGS, WINDOW, make_amphista
from transformers import AutoModelForCausalLM

from medusa_trt.checkpoint import ModelConfig
from medusa_trt.cli.build import main as build_main
from medusa_trt.cli.convert import main as convert_main
from medusa_trt.converter.hf_base import ConvertError
from medusa_trt.converter.merge import convert
from medusa_trt.drafters.amphista import Amphista
from medusa_trt.engine_dir import read_engine
from medusa_trt.engines.build import build_engine, check_options
from medusa_trt.engines.options import BuildOptions
from medusa_trt.engines.ort.build import OrtOptions
from medusa_trt.modeling import MedusaModel
from medusa_trt.runtime.decoding import GenerationConfig, decode
from medusa_trt.runtime.loading import load_backend
from medusa_trt.runtime.steps import prefill
from medusa_trt.runtime.torch_backend import TorchBackend
from medusa_trt.tools.distill import Sample
from medusa_trt.tools.parity import reference_model
from medusa_trt.tools.parity_rules import LOGIT_SCALE, int4_bounds
from medusa_trt.tools.train_drafter import TrainOptions, evaluate, save_amphista, train_drafter
from medusa_trt.tools.train_heads import greedy_continuations, hidden_states
from tests.runtime.test_decoding import oracle, prompts

TREE = "[[0], [0, 0], [0, 0, 0], [1], [0, 1], [2]]"


@pytest.fixture(scope="module")
def amphista(tmp_path_factory, tiny_base):
    """A tiny base with an Amphista drafter trained on its own greedy text, merged, and its engines."""
    base = tiny_base("llama")
    hf = AutoModelForCausalLM.from_pretrained(base).eval()
    starts = prompts(7, lengths=[6] * 200)
    seqs = greedy_continuations(hf, starts, 40)
    hs = hidden_states(hf, seqs)
    samples = [Sample(s, 6, h[: len(s) - 1]) for s, h in zip(seqs, hs, strict=True)]
    root = tmp_path_factory.mktemp("amphista")
    hc = hf.config
    raw = json.loads((base / "config.json").read_text())
    mc = ModelConfig(vocab_size=hc.vocab_size, hidden_size=hc.hidden_size, intermediate_size=hc.intermediate_size,
                     num_layers=1, num_heads=hc.num_attention_heads, num_kv_heads=hc.num_key_value_heads,
                     head_dim=hc.hidden_size // hc.num_attention_heads, rope_theta=float(raw.get("rope_theta") or (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
                     drafter="amphista", drafter_options={"num_heads": 4, "sal_intermediate_size": 48})
    drafter = Amphista(mc)
    drafter.reset_identity()
    lm_head = hf.lm_head.weight.detach()
    embed = hf.get_input_embeddings()
    vocab = torch.arange(hc.vocab_size)
    before = evaluate(drafter, "amphista", samples[-16:], lm_head, embed, vocab)
    train_drafter(drafter, "amphista", samples[:-16], lm_head, embed, vocab,
                  TrainOptions(steps=200, lr=3e-3, batch_samples=16, seed=0), progress=False)
    after = evaluate(drafter, "amphista", samples[-16:], lm_head, embed, vocab)
    save_amphista(drafter, root / "drafter", base=str(base), vocab=None)
    convert(base, root / "drafter", root / "ckpt", progress=False)
    engines = {}
    for name, ort in (("float32", OrtOptions()), ("int4", OrtOptions(weights="int4", int4_block_size=32)),
                      ("int8", OrtOptions(weights="int8"))):
        build_engine(BuildOptions(checkpoint=root / "ckpt", out=root / name, progress=False, max_batch_size=4,
                                  backend_options=ort))
        engines[name] = root / name
    return SimpleNamespace(base=base, hf=hf, root=root, ckpt=root / "ckpt", engines=engines, before=before,
                           after=after)


def test_the_recipe_trains_the_drafter_to_predict_the_base(amphista):
    # held-out top-1 against the base's own greedy tokens: well above the identity start
    before, after = [a[0] for a in amphista.before], [a[0] for a in amphista.after]
    assert after[0] > max(0.4, before[0] + 0.1) and sum(after) > sum(before) + 0.2, (before, after)


def test_the_merged_checkpoint_holds_the_drafter_by_name(amphista):
    config = json.loads((amphista.ckpt / "config.json").read_text())
    assert config["medusa_trt"]["drafter"] == "amphista"
    assert config["medusa_trt"]["amphista"]["num_heads"] == 4 and config["num_medusa_heads"] == 4
    names = set(load_file(amphista.ckpt / "rank0.safetensors"))
    assert "amphista.sal2.qkv.weight" in names and "amphista.pos_embed" in names
    assert not any(n.startswith("medusa_heads.") for n in names)


@pytest.mark.parametrize("engine", ["reference", "float32", "int4", "int8"])
def test_greedy_with_amphista_equals_plain_greedy(amphista, engine):
    ps = prompts(11)
    backend = (TorchBackend(MedusaModel.from_checkpoint(amphista.ckpt)) if engine == "reference"
               else load_backend(amphista.engines[engine]))
    cfg = GenerationConfig(max_new_tokens=32, medusa_choices=TREE, stop_token_ids=(EOS,))
    spec = decode(backend, ps, cfg)
    plain = decode(backend, ps, GenerationConfig(max_new_tokens=32, use_medusa=False, stop_token_ids=(EOS,)))
    assert spec.tokens == plain.tokens
    if engine in ("reference", "float32"):  # also transformers' greedy
        assert spec.tokens == [oracle(amphista.hf, p, 32) for p in ps]
    accepted = sum(s.accepted_draft_tokens for s in spec.stats)
    steps = sum(s.steps for s in spec.stats)
    # The trained drafter's drafts are taken (an untrained one's almost never). The int8 engine's
    # text departs from float32's sooner on this 64-wide random base, and its drafts were trained
    # on float32's: 0.33-0.41 of steps there (with float channels and without), 0.54-0.64 elsewhere.
    assert accepted / steps > (0.3 if engine == "int8" else 0.35)


def test_per_step_trees_narrower_than_the_drafters_heads(amphista):
    """dynamic:1 and dynamic:2 on the fused step: it pads each path to the heads' depth (4 + 1 rows),
    which the drafter's cache takes, so a decode's cache holds that many rows beyond the prompt and
    its new tokens, not the tree's 2 or 3 slots (dynamic:1 overflowed it). Also at the engine's
    exact room for the prompt and its new tokens, where the last steps' trees are cut (and the
    drafter's padded rows run past max_seq_len), and batched; there a static tree too."""
    backend = load_backend(amphista.engines["float32"])
    batches = (prompts(14, lengths=[backend.info.max_seq_len - 40, 5]),  # room for 40 tokens, none for a tree
               prompts(13, lengths=[3, 9]))
    plain = [decode(backend, b, GenerationConfig(max_new_tokens=40, use_medusa=False, stop_token_ids=())).tokens
             for b in batches]
    for tree, runs in (("dynamic:1", 2), ("dynamic:2", 2), ("dynamic:8", 1), (TREE, 1)):
        for batch, want in list(zip(batches, plain, strict=True))[:runs]:
            spec = decode(backend, batch, GenerationConfig(max_new_tokens=40, medusa_choices=tree, stop_token_ids=()))
            assert spec.tokens == want, (tree, [len(p) for p in batch])


def test_amphista_on_a_qwen2_base_with_a_sliding_window(tiny_base, tmp_path):
    # The adaptation layers take the base's shape (a Qwen2 base's q/k/v biases), and the base
    # attends within a window of 8 in its second layer, which the prompts and decodes run past
    # (the drafter's own cache keeps every committed row). The engine drafts what the reference
    # drafts (medusa-check), and greedy output stays transformers' own. (A Mistral case, at the
    # fixtures' default window of 4096, never reached its window; tests/runtime/test_ort_backend.py
    # runs Mistral's window.)
    from medusa_trt.tools.parity import run_check

    base = tiny_base("qwen2", extra_config=SLIDING_WINDOW_CONFIGS["qwen2"])
    make_amphista(tmp_path / "drafter", base)
    summary = convert(base, tmp_path / "drafter", tmp_path / "ckpt", progress=False)
    assert "amphista: 4 heads over 2 adaptation layers, base lm_head" in str(summary)
    build_engine(BuildOptions(checkpoint=tmp_path / "ckpt", out=tmp_path / "engine", progress=False,
                              max_batch_size=4, backend_options=OrtOptions()))
    report = run_check(tmp_path / "engine", tmp_path / "ckpt", ["a b c", "hello world again"])
    assert report.passed and any(r.stage.endswith("drafts") for r in report.rows)
    hf = AutoModelForCausalLM.from_pretrained(base).eval()
    ps = prompts(5, lengths=[5, 3 * WINDOW, 9])
    want = [oracle(hf, p, 24) for p in ps]
    backend = load_backend(tmp_path / "engine")
    for tree in ("dynamic:8", TREE):
        got = decode(backend, ps, GenerationConfig(max_new_tokens=24, medusa_choices=tree, stop_token_ids=(EOS,)))
        assert got.tokens == want, tree


@pytest.mark.parametrize("engine", ["float32", "int4"])
def test_the_prefill_computes_the_last_logits_row_only_and_drafts_every_prompt_row(amphista, engine):
    # The decoder graph keeps every row's hidden state (engine.json onnx.hidden_all_rows), so an
    # Amphista prefill needs the lm_head at each prompt's last row only, and the drafter still reads
    # every prompt row: at its slot, behind the left padding of the shorter prompts.
    ps = [p for p in prompts(11) if len(p) > 1][:3]
    assert len({len(p) for p in ps}) > 1  # ragged: padding in front of the shorter prompts
    backend = load_backend(amphista.engines[engine])
    assert backend.info.hidden_all_rows and "hidden_all_rows" in read_engine(amphista.engines[engine])["requires"]
    asked, forward = [], backend.forward
    backend.forward = lambda *a, **k: asked.append(a[3].shape) or forward(*a, **k)
    backend.start(len(ps), 64)
    _, root, drafts = prefill(backend, ps)
    assert asked == [(len(ps), 1)]
    # The reference quantized as the engine is (medusa-check's): its drafter int4 too on the int4 engine.
    ref = TorchBackend(reference_model(amphista.ckpt, read_engine(amphista.engines[engine]), amphista.engines[engine]))
    ref.start(len(ps), 64)
    _, ref_root, ref_drafts = prefill(ref, ps)
    assert torch.equal(root, ref_root)
    if engine == "float32":  # the reference's drafts, every prompt's (a wrong row would move them far)
        torch.testing.assert_close(drafts, ref_drafts, atol=1e-4, rtol=1e-4)
    else:  # medusa-check's int4 rule (tools/parity_rules.py), the drafter's 2 adaptation layers counted as layers
        layers = read_engine(amphista.engines[engine])["model"]["num_layers"] + 2
        p90, most = int4_bounds(layers, max(1.0, ref_drafts.abs().max().item() / LOGIT_SCALE))
        err = (drafts - ref_drafts).abs().flatten()
        assert err.quantile(0.9) <= p90 and err.max() <= most, (err.quantile(0.9), err.max(), p90)


def test_the_engine_drafts_what_the_reference_drafts(amphista):
    ps = prompts(12, lengths=(7, 4, 9))
    outs = {}
    engine = load_backend(amphista.engines["float32"])
    engine.fused_step_topk = None  # the two-call path, whose every step calls draft()
    for name, backend in (("reference", TorchBackend(MedusaModel.from_checkpoint(amphista.ckpt))),
                          ("float32", engine)):
        calls = []
        draft = backend.draft

        def record(rows, counts, after, draft=draft, calls=calls):
            out = draft(rows, counts, after)
            calls.append(out)
            return out

        backend.draft = record
        decode(backend, ps, GenerationConfig(max_new_tokens=24, medusa_choices=TREE, stop_token_ids=()))
        outs[name] = calls
    assert len(outs["reference"]) == len(outs["float32"]) > 5
    for a, b in zip(outs["reference"], outs["float32"], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("engine", ["float32", "int4"])
def test_the_fused_step_drafts_as_the_two_call_path_does(amphista, engine):
    """One call per step (verify, accept, append the accepted path to the drafter's cache, draft the
    next tree): the tokens and every sequence's accepted drafts equal the two-call path's."""
    ps = prompts(15)
    cfg = GenerationConfig(max_new_tokens=32, medusa_choices=TREE)
    fused = load_backend(amphista.engines[engine])
    assert fused.fused_step_topk is not None
    two_call = load_backend(amphista.engines[engine])
    two_call.fused_step_topk = None
    a, b = decode(fused, ps, cfg), decode(two_call, ps, cfg)
    assert a.tokens == b.tokens
    assert [s.accepted_per_depth for s in a.stats] == [s.accepted_per_depth for s in b.stats]


def test_the_drafters_cache_stays_on_the_host_whatever_the_device(amphista):
    """The drafter graph takes its cache as numpy feeds: on a CUDA engine, whose decoder cache lives
    on the device, a drafter cache there would fail its first .numpy() (no GPU here: the decoder
    cache goes to the meta device in its place)."""
    backend = load_backend(amphista.engines["float32"])
    backend.device = "meta"
    backend.cache_mode = lambda keys, values, names: None  # the decoder's binding would read the meta cache
    backend.start(2, 16)
    assert backend.keys.device.type == "meta"
    assert backend.drafter_keys.device.type == backend.drafter_values.device.type == "cpu"


def test_the_fused_step_adapts_the_accepted_rows_only(amphista):
    """The drafter's adaptation layers run over the path's first max(accepted) + 1 rows, the only ones
    a commit can keep: the K/V rows past them come back as zeros, and the decode is unchanged (above)."""
    backend = load_backend(amphista.engines["int4"])
    seen = []
    step = backend.fused_step

    def record(*a, **k):
        out = step(*a, **k)
        seen.append((int(out[1].max()), backend._drafter_pending[0].clone()))
        return out

    backend.fused_step = record
    decode(backend, prompts(15), GenerationConfig(max_new_tokens=32, medusa_choices=TREE))
    cut = [(a, k) for a, k in seen if a + 1 < k.shape[3]]
    assert cut and any(a > 0 for a, _ in seen)
    for a, k in seen:
        assert k[:, :, :, : a + 1].abs().amax() > 0
        assert not k[:, :, :, a + 1 :].any()


def test_sampling_with_amphista_runs_and_repeats_with_its_seed(amphista):
    """Its seed repeats it; another seed, or greedy, gives other text (a sampler that ignored the seed
    or fell back to greedy would pass the first check alone). That it follows the base distribution
    is tests/runtime/test_sampling.py's."""
    from dataclasses import replace

    backend = load_backend(amphista.engines["float32"])
    cfg = GenerationConfig(max_new_tokens=24, medusa_choices=TREE, acceptance="sample", temperature=0.7, seed=5)
    a, b = decode(backend, prompts(13), cfg), decode(backend, prompts(13), cfg)
    assert a.tokens == b.tokens
    assert decode(backend, prompts(13), replace(cfg, seed=6)).tokens != a.tokens
    assert decode(backend, prompts(13), replace(cfg, acceptance="greedy", temperature=0.0)).tokens != a.tokens


def test_tensorrt_llm_refuses_an_amphista_checkpoint(amphista, tmp_path, capsys):
    rc = build_main(["--checkpoint", str(amphista.ckpt), "--out", str(tmp_path / "e"), "--backend", "tensorrt-llm"])
    err = capsys.readouterr().err
    assert rc == 2 and "drafter 'amphista'" in err and "--backend onnxruntime or tensorrt" in err, err
    assert err.count("\n") == 1 and not (tmp_path / "e").exists()
    # TensorRT builds it (tests/engines/trt/test_trt_build.py): the drafter is no reason to refuse.
    config = json.loads((amphista.ckpt / "config.json").read_text())
    check_options(BuildOptions(checkpoint=amphista.ckpt, out=tmp_path / "t", backend="tensorrt"), config)


def _broken(amphista, tmp_path, edit) -> str:
    """convert with a copy of the drafter changed by edit(tensors, config); returns the error line."""
    src = amphista.root / "drafter"
    bad = tmp_path / "drafter"
    shutil.copytree(src, bad)
    tensors = load_file(bad / "amphista.safetensors")
    config = json.loads((bad / "config.json").read_text())
    edit(tensors, config)
    save_file(tensors, bad / "amphista.safetensors")
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConvertError) as e:
        convert(amphista.base, bad, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    return str(e.value)


@pytest.mark.parametrize("case, expect", [
    ("missing", "'sal1.qkv.weight' not found"),
    ("extra", "'sal3.qkv.weight' is not part of an Amphista drafter"),
    ("misshapen", "'fc2.weight' has shape [64, 64], expected [64, 128]"),
    ("hidden", "hidden_size 32 does not match the base hidden_size 64"),
    ("heads", "num_heads 0: expected an integer >= 1"),
    ("nan", "NaN"),
    ("int32", "'fc2.weight' has dtype int32, expected floating-point weights"),
    ("vocab", "vocab_size 300 does not match the base vocab_size"),
    ("block", "amphista [4]: expected an object"),
    # the attention split the adaptation layers were trained with, whose matrices have the same shapes
    # under another split (a base of other head counts and the same width)
    ("attention", "num_attention_heads 8 does not match the base num_attention_heads 4"),
    ("kv", "num_key_value_heads 4 does not match the base num_key_value_heads 2"),
])
def test_a_bad_drafter_is_one_clear_error_and_nothing_is_written(amphista, tmp_path, case, expect):
    def edit(t, c):
        if case == "missing":
            del t["sal1.qkv.weight"]
        elif case == "extra":
            t["sal3.qkv.weight"] = torch.zeros(3)
        elif case == "misshapen":
            t["fc2.weight"] = torch.zeros(64, 64)
        elif case == "hidden":
            c["hidden_size"] = 32
        elif case == "heads":
            c["amphista"]["num_heads"] = 0
        elif case == "nan":
            t["pos_embed"][0, 0] = float("nan")
        elif case == "int32":  # integer codes are not weights: cast, they would be garbage
            t["fc2.weight"] = t["fc2.weight"].mul(1000).to(torch.int32)
        elif case == "vocab":
            c["vocab_size"] = 300
        elif case == "block":
            c["amphista"] = [4]
        elif case == "attention":
            c["num_attention_heads"] = 8
        elif case == "kv":
            c["num_key_value_heads"] = 4

    msg = _broken(amphista, tmp_path, edit)
    assert expect in msg, msg


def test_convert_cli_exit_2_on_a_bad_drafter(amphista, tmp_path, capsys):
    bad = tmp_path / "drafter"
    shutil.copytree(amphista.root / "drafter", bad)
    (bad / "config.json").write_text(json.dumps({"drafter": "eagle"}))
    rc = convert_main(["--base", str(amphista.base), "--heads", str(bad), "--out", str(tmp_path / "out")])
    assert rc == 2 and "drafter 'eagle'" in capsys.readouterr().err


def test_medusa_check_compares_the_drafts_and_catches_a_wrong_drafter(amphista, tmp_path):
    from medusa_trt.tools.parity import run_check

    report = run_check(amphista.engines["float32"], amphista.ckpt, ["a b c", "hello world again"])
    drafts = [r for r in report.rows if r.stage.endswith("drafts")]
    assert report.passed and len(drafts) >= 3 and all(r.output == "medusa_logits" for r in drafts)
    # The same engine against a checkpoint whose drafter differs in one tensor: the drafts fail.
    bad = tmp_path / "ckpt"
    shutil.copytree(amphista.ckpt, bad)
    tensors = load_file(bad / "rank0.safetensors")
    tensors["amphista.pos_embed"] = tensors["amphista.pos_embed"] + 0.5
    save_file(tensors, bad / "rank0.safetensors")
    report = run_check(amphista.engines["float32"], bad, ["a b c", "hello world again"])
    failed = [r for r in report.rows if not r.passed]
    assert not report.passed and failed and all(r.output in ("medusa_logits", "tokens", "draft log-probs", "draft ranks")
                                                for r in failed)
    assert any(r.output == "draft log-probs" for r in failed)  # the fused step's drafter reads the checkpoint's too


def test_a_float_engine_runs_the_drafter_without_an_einsum(amphista):
    """A float engine's drafter products are 2-D MatMuls, whose constant weights ONNX Runtime
    prepacks: its Einsum does not, and the per-head ResBlock as one took 3.3 ms of SmolLM2's float32
    step, a third of the drafter's time (docs/benchmarks/issue-35-amphista.md, af)."""
    import onnx

    for name in ("model_step.onnx", "model_drafter.onnx"):
        ops = [n.op_type for n in onnx.load(amphista.engines["float32"] / name, load_external_data=False).graph.node]
        assert "Einsum" not in ops and ops.count("MatMul") + ops.count("Gemm") >= 4, name


def test_an_int4_engine_holds_the_drafter_as_int4_and_medusa_check_passes_it(amphista):
    """Drafts never change the output, so an int4 build quantizes the drafter with the base: every
    matrix whose input size is a multiple of the block, the logits projection included."""
    import onnx

    from medusa_trt.tools.parity import run_check

    engine = amphista.engines["int4"]
    weights = read_engine(engine)["weights"]
    assert weights["draft_int4"]
    left = sorted(n for n in weights["float_linears"] if n.startswith("amphista."))
    assert left == ["amphista.sal1.proj", "amphista.sal2.proj"]  # their input: the SAL MLP's 48 wide
    graph = onnx.load(engine / "model_drafter.onnx", load_external_data=False).graph
    nbits = sum(n.op_type == "MatMulNBits" for n in graph.node)
    # fc1, fc2, 4 per adaptation layer (qkv, dense, gate, fc), the AEB's qkv and out, a ResBlock per head
    assert nbits >= 2 + 2 * 4 + 2 + 4, nbits
    report = run_check(engine, amphista.ckpt, ["a b c", "hello world again"])
    drafts = [r for r in report.rows if r.stage.endswith("drafts")]
    assert report.passed and len(drafts) >= 3, report.rows


def test_an_int8_engine_rounds_every_matrix_to_int8_and_medusa_check_passes_it(amphista):
    """--weights int8: every Linear of the base and the drafter is one MatMulIntegerToFloat over int8 rows
    (none left float: int8 needs no block), and the engine matches its int8 reference."""
    import onnx

    from medusa_trt.tools.parity import run_check

    engine = amphista.engines["int8"]
    weights = read_engine(engine)["weights"]
    assert weights["format"] == "int8" and weights["draft_int8"]
    for name, least in (("model.onnx", 5 + 1), ("model_drafter.onnx", 2 + 2 * 5 + 2 + 4 + 1)):
        ops = [n.op_type for n in onnx.load(engine / name, load_external_data=False).graph.node]
        # decoder: qkv, dense, gate, fc, proj and the lm_head; drafter: fc1, fc2, 5 per adaptation
        # layer, the AEB's qkv and out, a ResBlock per head, the logits projection
        assert ops.count("MatMulIntegerToFloat") >= least and "MatMulNBits" not in ops, (name, ops.count("MatMulIntegerToFloat"))
    report = run_check(engine, amphista.ckpt, ["a b c", "hello world again"])
    drafts = [r for r in report.rows if r.stage.endswith("drafts")]
    assert report.passed and len(drafts) >= 3, report.rows


def test_tensor_parallel_and_fp8_conversion_keep_the_drafter(amphista, tmp_path):
    from medusa_trt.converter.quantize import QuantOptions

    one = MedusaModel.from_checkpoint(amphista.ckpt)
    convert(amphista.base, amphista.root / "drafter", tmp_path / "tp2", tp_size=2, progress=False)
    two = MedusaModel.from_checkpoint(tmp_path / "tp2")  # replicated on both ranks, merged back
    for name, p in one.drafter.named_parameters():
        assert torch.equal(p, dict(two.drafter.named_parameters())[name]), name
    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(" ".join(map(str, range(i, i + 12))) for i in range(16)))
    convert(amphista.base, amphista.root / "drafter", tmp_path / "fp8", progress=False,
            quant=QuantOptions(quantize="fp8", calib_data=calib))
    fp8 = MedusaModel.from_checkpoint(tmp_path / "fp8")
    assert json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization"]["quant_algo"] == "FP8"
    assert torch.equal(fp8.drafter.w, one.drafter.w)  # the drafter stays in the model dtype
    ps = prompts(14)
    spec = decode(TorchBackend(fp8), ps, GenerationConfig(max_new_tokens=24, medusa_choices=TREE))
    assert spec.tokens == decode(TorchBackend(fp8), ps, GenerationConfig(max_new_tokens=24, use_medusa=False)).tokens
    with pytest.raises(ConvertError, match="--quantize-heads quantizes Medusa ResBlocks"):
        convert(amphista.base, amphista.root / "drafter", tmp_path / "fp8h", progress=False,
                quant=QuantOptions(quantize="fp8", calib_data=calib, quantize_heads=True))


def test_medusa_tune_tree_tunes_a_tree_for_the_amphista_engine(amphista):
    from medusa_trt.tools.tree_measure import measure_head_accuracy
    from medusa_trt.tools.tune_tree import tune

    backend = load_backend(amphista.engines["float32"])
    calib = prompts(16, lengths=(6, 9, 5))
    acc, _ = measure_head_accuracy(backend, calib, max_new_tokens=24, progress=False)
    # The drafts at each row equal the reference's there (one row per draft call): the accuracy of
    # the engine's drafter is the trained drafter's, well above chance.
    assert acc.top1[0] > 0.3 and len(acc.top1) == 4
    result = tune(backend, calib, max_nodes=8, max_new_tokens=24, reps=1, progress=False)
    assert result["medusa_choices"] and all(len(p) <= 4 for p in result["medusa_choices"])
