"""The engine directory contract (engine_dir.py): engine.json's format version and required
features, its field validation, and its agreement with the graphs."""

from __future__ import annotations

import json
import shutil

import pytest

from medusa_trt.engine_dir import ENGINE_FORMAT_VERSION, ENGINE_JSON, KNOWN_FEATURES, EngineError, read_engine
from medusa_trt.runtime.ort.backend import OrtBackend
from tests.engines.ort.test_ort_build import exact_engine, int4_engine


@pytest.mark.parametrize("field, value", [("onnx.cache_in_place", "false"), ("onnx.chains_only", "false"),
                                          ("onnx.step_dynamic", "yes"), ("onnx.hidden_all_rows", 1),
                                          ("onnx.drafter_file", "../model_drafter.onnx"),
                                          ("weights.offsets", "true"), ("weights.lm_head_bits", 6)])
def test_engine_json_flags_are_validated(ort_engine, tmp_path, field, value):
    import shutil

    engine = tmp_path / "engine"
    shutil.copytree(int4_engine(ort_engine, 4), engine)
    data = json.loads((engine / "engine.json").read_text())
    section, key = field.split(".")
    data[section][key] = value
    (engine / "engine.json").write_text(json.dumps(data))
    with pytest.raises(EngineError, match=field):
        OrtBackend(engine)


def test_unknown_weight_format_is_refused(ort_engine, tmp_path):
    import shutil

    engine = tmp_path / "engine"
    shutil.copytree(ort_engine("llama"), engine)
    data = json.loads((engine / "engine.json").read_text())
    data["weights"]["format"] = "int3"
    (engine / "engine.json").write_text(json.dumps(data))
    with pytest.raises(EngineError, match="weights.format: 'int3'; expected one of 'float', 'int4'"):
        OrtBackend(engine)


@pytest.mark.parametrize("int4, edit, field", [
    (True, {"weights": {"format": "float"}}, "weights.format 'float'"),
    (False, {"weights": {"format": "int4", "block_size": 32, "accuracy_level": 4}}, "weights.format 'int4'"),
    (True, {"medusa": {"num_heads": 2}}, "medusa.num_heads 2"),
    (True, {"model": {"vocab_size": 99}}, "model.vocab_size 99"),
    (True, {"model": {"num_layers": 3}}, "3 layers"),
    (True, {"onnx": {"cache_in_place": False}}, "onnx.cache_in_place False"),
    (False, {"model": {"hidden_size": 48}}, "model.hidden_size 48"),
    (False, {"onnx": {"step_topk": 7}}, "onnx.step_topk 7"),
])
def test_engine_json_disagreeing_with_graphs_exits_2(ort_engine, tmp_path, capsys, int4, edit, field):
    """engine.json and the graphs disagree (issue 13's bad input): one line naming the field, exit 2."""
    import shutil

    from medusa_trt.cli.run import main as run_main

    engine = tmp_path / "engine"
    shutil.copytree(int4_engine(ort_engine, 4) if int4 else ort_engine("llama"), engine)
    data = json.loads((engine / "engine.json").read_text())
    for section, values in edit.items():
        data[section].update(values)
    (engine / "engine.json").write_text(json.dumps(data))
    capsys.readouterr()
    assert run_main(["--engine", str(engine), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0] and "rebuild" in err[0], err


def _edited_copy(engine_dir, tmp_path, **changes):
    engine = tmp_path / "engine"
    shutil.copytree(engine_dir, engine)
    data = json.loads((engine / ENGINE_JSON).read_text())
    (engine / ENGINE_JSON).write_text(json.dumps(data | changes))
    return engine


def test_engines_list_the_features_they_require(ort_engine):
    """An engine lists the optional features it uses, no more: a reader that knows them all reads it."""
    float_engine = read_engine(ort_engine("llama"))
    assert float_engine["format_version"] == ENGINE_FORMAT_VERSION == 8 and float_engine["requires"] == ["step_dynamic"]
    assert read_engine(int4_engine(ort_engine, 4))["requires"] == ["cache_in_place", "chains_only", "step_dynamic"]
    assert read_engine(int4_engine(ort_engine, 4, "row_exact_f32"))["requires"] == [
        "key_block", "cache_in_place", "step_dynamic"]
    assert read_engine(exact_engine(ort_engine))["requires"] == [
        "cache_in_place", "chains_only", "int4_offsets", "lm_head_bits", "step_dynamic"]
    assert set(read_engine(exact_engine(ort_engine))["requires"]) <= set(KNOWN_FEATURES)


def test_unknown_required_feature_is_refused(ort_engine, tmp_path):
    """A feature this reader does not know: one line naming engine.json, the feature and the remedy."""
    engine = _edited_copy(ort_engine("llama"), tmp_path, requires=["cache_in_place", "sliding_window"])
    with pytest.raises(EngineError) as e:
        read_engine(engine)
    message = str(e.value)
    assert "\n" not in message and str(engine / ENGINE_JSON) in message
    assert "requires 'sliding_window'" in message and "upgrade medusa-trt or rebuild the engine" in message
    with pytest.raises(EngineError, match="requires 'sliding_window'"):
        OrtBackend(engine)


def test_other_format_version_names_both_versions(ort_engine, tmp_path):
    engine = _edited_copy(ort_engine("llama"), tmp_path, format_version=7)
    with pytest.raises(EngineError) as e:
        read_engine(engine)
    message = str(e.value)
    assert "\n" not in message and str(engine / ENGINE_JSON) in message
    assert f"engine format 7, this runtime reads format {ENGINE_FORMAT_VERSION}" in message
    assert "rebuild it with medusa-build" in message


@pytest.mark.parametrize(("fmt", "ops", "error"), [
    ("float", {"MatMul"}, None),
    ("int4", {"MatMulNBits", "MatMul"}, None),
    ("int8", {"MatMulIntegerToFloat", "QuantizeLinear"}, None),
    ("int8", {"MatMulInteger", "Round"}, None),  # an int8 engine built before 2026-11-28
    ("float", {"MatMulIntegerToFloat"}, "has MatMulIntegerToFloat nodes, engine.json records weights.format 'float'"),
    ("float", {"MatMulInteger"}, "has MatMulInteger nodes, engine.json records weights.format 'float'"),
    ("int8", {"MatMulNBits"}, "has MatMulNBits nodes, engine.json records weights.format 'int8'"),
    ("int8", {"MatMul"}, "has no MatMulIntegerToFloat nodes, engine.json records weights.format 'int8'"),
    ("int4", {"MatMul"}, "has no MatMulNBits nodes"),
])
def test_weight_format_must_match_the_graph(fmt, ops, error):
    """A mislabelled engine would be checked against the wrong reference: the load refuses it."""
    from medusa_trt.engine_dir import check_weight_format

    engine = {"weights": {"format": fmt}}
    if error is None:
        check_weight_format(engine, "model.onnx", ops)
    else:
        with pytest.raises(EngineError, match=error):
            check_weight_format(engine, "model.onnx", ops)
