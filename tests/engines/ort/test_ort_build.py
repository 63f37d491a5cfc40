"""The ONNX Runtime builder (engines/ort/build.py): int4 engines (MatMulNBits) against the int4
reference, and the builder's int4 options.

The int4 reference (quant.quantize_model_int4) runs MatMulNBits' arithmetic: the same packed
weights dequantized in float32, and with accuracy level 4 the activations rounded to int8 per block.
Level 0 parity is float32 parity (1e-4). At level 4 a value at an int8 rounding boundary may round
the other way in the kernel (seen on a few logits of a 3x64-slot tree step), so level 4 is held to
medusa-check's FP8 criterion: 90th percentile within 1e-4, max within 0.25.

int4_engine and exact_engine are the int4 engines the other int4 tests (engines/onnx, engines/ort,
runtime, engine_dir) import from here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from medusa_trt.engine_dir import read_engine
from medusa_trt.engines.ort.build import OrtOptions, gguf_blocks_hint, gguf_int4_defaults
from medusa_trt.modeling import MedusaModel
from medusa_trt.quant import quantize_model_int4
from medusa_trt.runtime.ort.backend import OrtBackend
from medusa_trt.runtime.ort.session import make_session
from medusa_trt.tools.parity import reference_model
from medusa_trt.tools.parity_rules import int4_bounds
from tests.engines.onnx.test_export import ATOL, make_inputs, run_decoder

INT4 = {"weights": "int4", "int4_block_size": 32}


def int4_engine(ort_engine, level: int, attention: str | None = None):
    """The default attention at level 4 is chain_f32; "row_exact_f32" keeps branching trees exact."""
    return ort_engine("llama", backend_options=OrtOptions(**INT4, int4_accuracy_level=level),
                      **({"attention": attention} if attention else {}))


# The GGUF-exact scheme (docs/benchmarks/issue-13-int4.md (o)): per-block float offsets, 8-bit lm_head.
EXACT = {"int4_offsets": True, "int4_lm_head_bits": 8}


def exact_engine(ort_engine, level: int = 4):
    return ort_engine("llama", backend_options=OrtOptions(**INT4, **EXACT, int4_accuracy_level=level))


def int4_reference(tiny_merged, engine) -> MedusaModel:
    """As medusa-check builds it from engine.json: the embedding as int8 rows unless the blocks stay
    the GGUF's (offsets), zero-point blocks searched with the input weights the engine dir keeps."""
    model = reference_model(tiny_merged("llama"), read_engine(engine), engine)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.layers.modules())  # every Linear int4
    return model


@pytest.mark.parametrize("level, exact", [(0, False), (4, False), (0, True), (4, True)])
@pytest.mark.parametrize("batch, past, kind", [(1, 0, "causal"), (3, 11, "tree")])
def test_int4_engine_parity(ort_engine, tiny_merged, level, exact, batch, past, kind):
    """Both schemes: zero points, and offsets with an 8-bit lm_head (EXACT)."""
    engine = exact_engine(ort_engine, level) if exact else int4_engine(ort_engine, level)
    info = json.loads((engine / "engine.json").read_text())["weights"]
    assert info["format"] == "int4" and info["block_size"] == 32 and info["accuracy_level"] == level
    assert (info["offsets"], info["lm_head_bits"], info["embedding"]) == ((True, 8, "float") if exact else (False, 4, "int8"))
    assert info["rounding"] == "offsets" if exact else (
        {k: info["rounding"][k] for k in ("method", "file")} == {"method": "calibrated", "file": "int4_importance.safetensors"})
    model = int4_reference(tiny_merged, engine)
    feeds, ref_args = make_inputs(model, batch, past, kind)
    got = run_decoder(make_session(engine / "model.onnx"), feeds)
    with torch.no_grad():
        want = model.forward_hidden(*ref_args)
    for name, a, b in zip(("logits", "hidden", "present_keys", "present_values"), got, want, strict=True):
        diff = np.abs(a - b.numpy())
        if level == 0:
            assert diff.max() <= ATOL, f"{name}: {diff.max():.2e}"
        else:
            # Level 4 rounds each MatMulNBits input to int8 per block, as the reference does; they differ
            # only where float32 noise puts an activation across a rounding boundary (a flip of one int8
            # step). So 90% of the elements agree to float32 and the flips are held to medusa-check's int4
            # max bound for this many layers (0.15 at 2 layers: 4x the largest flip seen, 0.040 on logits
            # of magnitude 4.5, batch 3 tree rows, 2026-12-07).
            _, most = int4_bounds(model.cfg.num_layers, 1.0)
            assert np.quantile(diff, 0.9) <= ATOL and diff.max() <= most, f"{name}: {diff.max():.2e} > {most}"
    # the int4 graph really is int4: no float copy of the decoder weights
    import onnx

    graph = onnx.load(engine / "model.onnx").graph
    nodes = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert nodes
    # Two Splits a layer in both schemes (qkv, the fused gate/up): the offsets' correction of the
    # gate/up pair is added before its Split (ort/fusions.py: _add_before_split), not per half.
    assert sum(n.op_type == "Split" for n in graph.node) == 2 * model.cfg.num_layers
    bits = sorted({next(a.i for a in n.attribute if a.name == "bits") for n in nodes})
    assert bits == ([4, 8] if exact else [4])
    assert {len(n.input) for n in nodes} == ({3} if exact else {4})  # offsets: no zero points


def test_engine_graphs_name_no_path_of_the_build_machine(ort_engine):
    """The exporter records each node's Python stack trace (files of the build machine by absolute
    path, a per-process counter): engines leave it out, so a graph's bytes come from the checkpoint
    and the options, not from where or in which process it was built."""
    import onnx

    import medusa_trt

    engine = ort_engine("llama")
    graphs = sorted(engine.glob("*.onnx"))
    assert {p.name for p in graphs} >= {"model.onnx", "model_heads.onnx", "model_step.onnx"}
    for path in graphs:
        data = onnx.load(str(path), load_external_data=False).SerializeToString()
        assert b"pkg.torch.onnx.stack_trace" not in data, path.name
        assert str(Path(medusa_trt.__file__).parent).encode() not in data, path.name


def test_no_cache_in_place_flag(tiny_merged, tmp_path):
    """medusa-build --no-cache-in-place: the int4 engine returns new K/V for the runtime to scatter."""
    from medusa_trt.cli.build import main as build_main

    out = tmp_path / "engine"
    assert build_main(["--checkpoint", str(tiny_merged("llama")), "--out", str(out), "--weights", "int4",
                       "--no-cache-in-place", "--quiet"]) == 0
    assert json.loads((out / "engine.json").read_text())["onnx"]["cache_in_place"] is False
    assert not OrtBackend(out).in_place


def test_bad_lm_head_bits_is_refused_before_anything_is_written(tiny_merged, tmp_path, capsys):
    from medusa_trt.cli.build import main as build_main
    from medusa_trt.engines.build import build_engine
    from medusa_trt.engines.options import BuildError, BuildOptions

    out = tmp_path / "engine"
    args = ["--checkpoint", str(tiny_merged("llama")), "--out", str(out), "--weights", "int4", "--quiet"]
    with pytest.raises(SystemExit) as e:
        build_main([*args, "--int4-lm-head-bits", "6"])
    assert e.value.code == 2 and "--int4-lm-head-bits" in capsys.readouterr().err
    with pytest.raises(BuildError, match="--int4-lm-head-bits 6: expected one of 4, 8"):
        build_engine(BuildOptions(checkpoint=tiny_merged("llama"), out=out, progress=False,
                                  backend_options=OrtOptions(**INT4, int4_lm_head_bits=6)))
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_gguf_blocks_hint_names_the_options_a_gguf_checkpoint_misses():
    """medusa-build --weights int4 on a checkpoint converted from a Q4_1 / Q8_0 GGUF says which of
    the GGUF-exact options would keep its blocks; nothing once they are given, or for other sources."""
    gguf = {"medusa_trt": {"gguf": {"tensor_types": {"F32": 61, "Q4_1": 210, "Q8_0": 1}}}}
    hint = gguf_blocks_hint(gguf, offsets=False, lm_head_bits=4)
    assert "Q4_1 (210 tensors) and Q8_0 (1 tensor)" in hint
    assert "--int4-offsets --int4-lm-head-bits 8 (the default for it) would keep" in hint
    assert "--int4-offsets (the default" in gguf_blocks_hint(gguf, offsets=False, lm_head_bits=8)
    assert "--int4-lm-head-bits 8 (the default" in gguf_blocks_hint(gguf, offsets=True, lm_head_bits=4)
    assert gguf_blocks_hint(gguf, offsets=True, lm_head_bits=8) is None
    assert gguf_blocks_hint({"medusa_trt": {"gguf": {"tensor_types": {"F16": 3}}}}, False, 4) is None
    assert gguf_blocks_hint({"medusa_trt": {"base": "hf"}}, False, 4) is None
    # What the flags leave open (None) follows the GGUF's blocks; what they say stays.
    auto = OrtOptions(**INT4)
    assert (auto.int4_offsets, auto.int4_lm_head_bits) == (None, None)
    picked = gguf_int4_defaults(auto, gguf)
    assert (picked.int4_offsets, picked.int4_lm_head_bits) == (True, 8) and not picked.calibrates
    only_q4 = {"medusa_trt": {"gguf": {"tensor_types": {"F32": 61, "Q4_1": 211}}}}
    assert gguf_int4_defaults(auto, only_q4).int4_lm_head_bits == 4
    for config in ({"medusa_trt": {"gguf": {"tensor_types": {"F16": 3}}}}, {}):
        plain = gguf_int4_defaults(auto, config)
        assert (plain.int4_offsets, plain.int4_lm_head_bits) == (False, 4) and plain.calibrates
    kept = gguf_int4_defaults(OrtOptions(**INT4, int4_offsets=False, int4_lm_head_bits=4), gguf)
    assert (kept.int4_offsets, kept.int4_lm_head_bits) == (False, 4)


def test_int4_build_keeps_a_gguf_bases_blocks_by_default(tiny_merged, tmp_path, capsys):
    """medusa-build --weights int4 on a checkpoint medusa-convert read from a GGUF of Q4_1 blocks
    (its config says so) keeps them: offsets, an 8-bit lm_head, nothing calibrated, no hint; with
    --no-int4-offsets it re-rounds them (calibrated, the 8-bit lm_head left out of the search), says
    what it gave up, and medusa-check's reference holds the same bytes."""
    import shutil

    from safetensors.torch import load_file

    from medusa_trt.cli.build import main as build_main
    from medusa_trt.cli.check import main as check_main

    ckpt = tmp_path / "gguf_ckpt"
    shutil.copytree(tiny_merged("llama"), ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config.setdefault("medusa_trt", {})["gguf"] = {"tensor_types": {"F32": 5, "Q4_1": 14, "Q8_0": 1}}
    (ckpt / "config.json").write_text(json.dumps(config))
    base = ["--checkpoint", str(ckpt), "--weights", "int4", "--int4-block-size", "32", "--quiet"]
    capsys.readouterr()
    assert build_main([*base, "--out", str(tmp_path / "exact")]) == 0
    weights = read_engine(tmp_path / "exact")["weights"]
    assert (weights["offsets"], weights["lm_head_bits"], weights["rounding"]) == (True, 8, "offsets")
    assert "would keep" not in capsys.readouterr().err
    rerounded = tmp_path / "rerounded"
    assert build_main([*base, "--out", str(rerounded), "--no-int4-offsets"]) == 0
    weights = read_engine(rerounded)["weights"]
    assert (weights["offsets"], weights["lm_head_bits"], weights["rounding"]["method"]) == (False, 8, "calibrated")
    assert "--int4-offsets (the default for it) would keep" in capsys.readouterr().err
    kept = load_file(str(rerounded / "int4_importance.safetensors"))
    assert "layers.0.qkv" in kept and "lm_head" not in kept and "lm_head:rows" not in kept
    assert check_main(["--engine", str(rerounded), "--checkpoint", str(ckpt), "--max-new-tokens", "4"]) == 0


def test_int8_weights_need_a_float32_engine_and_nothing_is_written(tiny_merged, tmp_path, capsys):
    """--weights int8 scales its integer products back to float32 on a CPU: another --dtype or
    --device cuda is one clear line, exit 2, and no engine directory."""
    from medusa_trt.cli.build import main as build_main

    out, ckpt = tmp_path / "engine", tiny_merged("llama")
    capsys.readouterr()  # the fixture's own output
    code = build_main(["--checkpoint", str(ckpt), "--out", str(out), "--weights", "int8",
                       "--dtype", "float16", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--dtype float16 with --weights int8: expected float32" in err[0], err
    assert not out.exists()
    code = build_main(["--checkpoint", str(ckpt), "--out", str(out), "--weights", "int8", "--device", "cuda", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--device cuda with --weights int8: expected cpu" in err[0], err
    assert not out.exists()
    # int4 likewise: a float16 int4 build crashed (zero-point blocks) or wrote an engine ONNX Runtime
    # refuses to load (--int4-offsets)
    for extra in ([], ["--int4-offsets"]):
        code = build_main(["--checkpoint", str(ckpt), "--out", str(out), "--weights", "int4", "--dtype", "float16",
                           "--int4-block-size", "32", "--quiet", *extra])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and "--dtype float16 with --weights int4: expected float32" in err[0], err
        assert not out.exists()


def test_int8_float_channel_options_refuse_bad_input_and_write_nothing(tiny_merged, tmp_path, capsys):
    """--int8-float-channels below 0, --calibration (or its old name --int8-calibration) where nothing
    calibrates (no int8 float channels; int4 offsets), a calibration file that is missing or holds no
    text, and a checkpoint with no bos_token_id to sample calibration text from (int8, and int4's
    calibrated rounding): one line naming the flag, file or key, exit 2, no engine directory."""
    import shutil

    from medusa_trt.cli.build import main as build_main

    out, ckpt = tmp_path / "engine", tiny_merged("llama")
    no_bos = tmp_path / "no_bos"
    shutil.copytree(ckpt, no_bos)
    config = json.loads((no_bos / "config.json").read_text())
    config["bos_token_id"] = None
    (no_bos / "config.json").write_text(json.dumps(config))
    (tmp_path / "empty.jsonl").write_text("\n")
    capsys.readouterr()  # the fixture's own output
    for args, message in (
        (["--weights", "int8", "--int8-float-channels", "-1"], "--int8-float-channels -1: expected a count >= 0"),
        (["--int8-calibration", "c.txt"], "--calibration c.txt: read only with --weights int8"),
        (["--weights", "int4", "--int4-offsets", "--calibration", "c.txt"], "--calibration c.txt: read only with"),
        (["--weights", "int4", "--int4-rounding", "nearest", "--calibration", "c.txt"], "read only with"),
        (["--weights", "int8", "--int8-calibration", str(tmp_path / "nope.txt")], "nope.txt: file not found"),
        (["--weights", "int4", "--calibration", str(tmp_path / "empty.jsonl")], "empty.jsonl: no prompts"),
        (["--weights", "int8", "--checkpoint", str(no_bos)], "bos_token_id None: expected a token id"),
        (["--weights", "int4", "--checkpoint", str(no_bos)], "or --int4-rounding nearest"),
    ):
        argv = ["--checkpoint", str(ckpt), "--out", str(out), "--quiet", *args]
        code = build_main(argv[2:] if "--checkpoint" in args else argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and message in err[0], (args, err)
        assert not out.exists()


def test_int4_rounding_nearest_keeps_the_plain_grid_and_calibrated_keeps_its_weights(ort_engine, tiny_merged, tmp_path,
                                                                                      capsys):
    """--int4-rounding nearest builds the bytes quantize_model_int4 gives without importance, and no
    weights file; the calibrated default keeps each base Linear's input weights and searched rows in
    the engine dir (and how many rows were searched in engine.json), which medusa-check reads to
    search the same grids: without the file it stops with one line (the
    artifact check names it first)."""
    import shutil

    from safetensors.torch import load_file

    from medusa_trt.calibration.activations import split_int4_calibration
    from medusa_trt.cli.check import main as check_main
    from medusa_trt.quant import base_linear_names

    nearest = ort_engine("llama", backend_options=OrtOptions(**INT4, int4_rounding="nearest"))
    assert read_engine(nearest)["weights"]["rounding"] == "nearest"
    assert not (nearest / "int4_importance.safetensors").exists()
    plain = MedusaModel.from_checkpoint(tiny_merged("llama"))
    quantize_model_int4(plain, 32, 4, draft=True, embedding=True)
    ref = reference_model(tiny_merged("llama"), read_engine(nearest), nearest)
    assert all(torch.equal(a, b) for a, b in zip(plain.buffers(), ref.buffers(), strict=True))

    calibrated = int4_engine(ort_engine, 4)
    importance, rows = split_int4_calibration(load_file(str(calibrated / "int4_importance.safetensors")))
    assert set(importance) == set(rows) == set(base_linear_names(plain))
    searched, total = read_engine(calibrated)["weights"]["rounding"]["searched_rows"].split(" of ")
    assert int(total) == sum(r.numel() for r in rows.values()) and int(searched) == sum(int(r.sum()) for r in rows.values())
    searched = reference_model(tiny_merged("llama"), read_engine(calibrated), calibrated)
    assert not torch.equal(searched.layers[0].qkv.packed, ref.layers[0].qkv.packed)
    engine = tmp_path / "engine"
    shutil.copytree(calibrated, engine)
    (engine / "int4_importance.safetensors").unlink()
    capsys.readouterr()
    assert check_main(["--engine", str(engine), "--checkpoint", str(tiny_merged("llama")), "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "int4_importance.safetensors: missing" in err[0], err


def test_calibration_text_stays_within_the_engines_positions(tiny_merged, tmp_path):
    """Calibration runs no position the engine cannot: --max-seq-len caps both the model's own
    sampled text and the tokens of a --calibration file."""
    from medusa_trt.engines.options import BuildOptions
    from medusa_trt.engines.ort.build import _calibration

    ckpt = tiny_merged("llama")
    config = json.loads((ckpt / "config.json").read_text())
    model = MedusaModel.from_checkpoint(ckpt)
    opts = BuildOptions(checkpoint=ckpt, out=tmp_path / "engine", max_seq_len=24)
    own, source = _calibration(opts, OrtOptions(), config, model, "--int4-rounding nearest")
    assert own and max(len(ids) for ids in own) == 24 and "x 23 tokens" in source
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(["hello world"] * 200) + "\n")
    from_file, _ = _calibration(opts, OrtOptions(calibration=text), config, model, "--int4-rounding nearest")
    assert max(len(ids) for ids in from_file) == 24
