"""medusa-triton: repository layout, every config.pbtxt parsed with Triton's own schema, the
ensemble wiring, brace-form trees, atomic writes and clear errors. No server here
(tests/serving/test_triton_server.py runs one)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from medusa_trt.cli.triton import main
from medusa_trt.serving import trtllm_postprocessing, trtllm_preprocessing
from medusa_trt.serving.triton_repo import (
    MODEL_INPUTS,
    MODEL_OUTPUTS,
    RepoError,
    read_engine_info,
    write_triton_repo,
    write_trtllm_triton_repo,
)
from medusa_trt.tree import DEFAULT_TREE, parse_medusa_choices, tree_to_brace, validate_and_expand

HEADS = 4  # tiny_merged's head count


def parse_config(path: Path) -> model_config_pb2.ModelConfig:
    """Triton's schema: unknown fields, wrong types or bad enums raise ParseError."""
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def params(config: model_config_pb2.ModelConfig) -> dict[str, str]:
    return {k: v.string_value for k, v in config.parameters.items()}


def imports_of(path: Path) -> set[str]:
    """Top-level packages a Python file imports (compiling it on the way)."""
    tree = ast.parse(path.read_text(), str(path))
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    return {name.split(".")[0] for name in names}


def trtllm_engine(tmp_path: Path, heads: int = HEADS, max_batch_size: int = 8) -> Path:
    """An engine dir as trtllm-build leaves it, minus rank0.engine (TensorRT-LLM cannot build here):
    its config.json is what the repository writer reads."""
    d = tmp_path / "trtllm-engine"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({
        "version": "0.20.0",
        "pretrained_config": {"architecture": "MedusaForCausalLM", "num_medusa_heads": heads, "max_draft_len": 63,
                              "max_position_embeddings": 512},
        "build_config": {"max_batch_size": max_batch_size, "max_seq_len": 512, "max_draft_len": 63,
                         "speculative_decoding_mode": "medusa"},
    }))
    return d


def test_python_repo_config_follows_triton_schema(tiny_merged, tmp_path):
    ckpt = tiny_merged()
    out = write_triton_repo(ckpt, tmp_path / "repo", max_batch_size=4, intra_op_threads=1)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "medusa/1/model.py", "medusa/config.pbtxt"]
    config = parse_config(out / "medusa" / "config.pbtxt")
    assert config.name == "medusa" and config.backend == "python" and config.max_batch_size == 4
    assert config.HasField("dynamic_batching") and not config.model_transaction_policy.decoupled
    types = model_config_pb2.DataType
    assert [(i.name, types.Name(i.data_type), list(i.dims), i.optional) for i in config.input] == [
        (s.name, s.dtype, list(s.dims), s.optional) for s in MODEL_INPUTS]
    assert [(o.name, types.Name(o.data_type), list(o.dims)) for o in config.output] == [
        (s.name, s.dtype, list(s.dims)) for s in MODEL_OUTPUTS]
    # The prompt is text_input or messages (the model requires exactly one), so neither is required here.
    assert {i.name for i in config.input if not i.optional} == {"max_tokens"}
    p = params(config)
    assert Path(p["engine_dir"]) == ckpt.resolve() and Path(p["engine_dir"]).is_absolute()
    assert p["acceptance"] == "greedy" and p["intra_op_threads"] == "1"
    # prompt + output fit 512 positions (each request is checked); a tree needs no room of its own
    assert int(p["max_input_len"]) == int(p["max_output_len"]) == 512 - 1
    assert "medusa_trt" in imports_of(out / "medusa" / "1" / "model.py")


def test_decoupled_repo_and_brace_round_trip(tiny_merged, tmp_path):
    tree = [[0], [0, 0], [1], [0, 1], [0, 0, 0], [2, 0]]  # [2] missing: the writer adds prefixes
    out = write_triton_repo(tiny_merged(), tmp_path / "repo", model_name="medusa_stream", medusa_choices=tree,
                            decoupled=True, acceptance="typical")
    config = parse_config(out / "medusa_stream" / "config.pbtxt")
    assert config.model_transaction_policy.decoupled
    brace = params(config)["medusa_choices"]
    assert brace.startswith("{0}, {1}, {2}, {0, 0}")
    assert parse_medusa_choices(brace) == validate_and_expand(tree, HEADS)
    assert params(config)["acceptance"] == "typical"


@pytest.mark.parametrize("spec", [DEFAULT_TREE, "[[0], [1], [0, 0]]", "{0}, {0, 0}, {0, 0, 0}, {1}"])
def test_brace_form_round_trips_every_spelling(spec, tiny_merged, tmp_path):
    out = write_triton_repo(tiny_merged(), tmp_path / "repo", medusa_choices=spec)
    written = params(parse_config(out / "medusa" / "config.pbtxt"))["medusa_choices"]
    expected = validate_and_expand(parse_medusa_choices(spec), HEADS, 63)
    assert parse_medusa_choices(written) == expected
    assert tree_to_brace(parse_medusa_choices(written)) == written


def test_trtllm_repo_configs_follow_triton_schema_and_wire_up(tiny_merged, tmp_path):
    engine = trtllm_engine(tmp_path)
    tree = "[[0], [0, 0], [1], [0, 0, 0]]"
    out = write_trtllm_triton_repo(engine, tmp_path / "repo", tiny_merged(), tree, decoupled=True)
    configs = {p.parent.name: parse_config(p) for p in sorted(out.glob("*/config.pbtxt"))}
    assert sorted(configs) == ["ensemble", "postprocessing", "preprocessing", "tensorrt_llm"]
    for name, config in configs.items():
        assert config.name == name and (out / name / "1").is_dir()
    for name in ("preprocessing", "postprocessing"):
        assert configs[name].backend == "python"
        assert not imports_of(out / name / "1" / "model.py") & {"medusa_trt"}  # runs where medusa_trt is absent
        assert Path(params(configs[name])["tokenizer_dir"]) == tiny_merged().resolve()

    trt = configs["tensorrt_llm"]
    assert trt.backend == "tensorrtllm" and trt.model_transaction_policy.decoupled
    p = params(trt)
    assert p["decoding_mode"] == "medusa" and p["max_beam_width"] == "1"
    assert Path(p["gpt_model_path"]) == engine.resolve()
    assert p["medusa_choices"] == "{0}, {1}, {0, 0}, {0, 0, 0}"
    assert parse_medusa_choices(p["medusa_choices"]) == validate_and_expand(parse_medusa_choices(tree), HEADS)
    # Read without a default while the tensorrtllm backend loads (model_instance_state.cc,
    # getGuidedDecodingConfigFromParams): absent, the model fails to load. Empty turns guided decoding off.
    assert Path(p["tokenizer_dir"]) == tiny_merged().resolve()
    assert p["guided_decoding_backend"] == "" and p["xgrammar_tokenizer_info_path"] == ""
    # As tensorrtllm_backend's template: variable-length inputs batch across requests of other lengths.
    assert {t.name for t in trt.input if t.allow_ragged_batch} == {"input_ids", "stop_words_list", "bad_words_list"}

    # The ensemble: every step names a model of the repository and real tensors of it; every tensor
    # a step reads is an ensemble input or an earlier step's output, with the same data type.
    ens = configs["ensemble"]
    assert ens.platform == "ensemble"
    assert {"text_input", "max_tokens", "stream", "stop_words", "end_id"} <= {i.name for i in ens.input}
    assert {o.name for o in ens.output} == {"text_output", "acceptance_rate", "total_accepted_draft_tokens",
                                            "total_draft_tokens"}
    available = {i.name: i.data_type for i in ens.input}
    for step in ens.ensemble_scheduling.step:
        model = configs[step.model_name]
        assert model.max_batch_size >= ens.max_batch_size
        inputs = {i.name: i for i in model.input}
        for model_input, tensor in step.input_map.items():
            assert model_input in inputs, (step.model_name, model_input)
            assert tensor in available, (step.model_name, tensor)
            assert available[tensor] == inputs[model_input].data_type, (step.model_name, model_input)
        required = {n for n, i in inputs.items() if not i.optional}
        assert required <= set(step.input_map), (step.model_name, required - set(step.input_map))
        outputs = {o.name: o.data_type for o in model.output}
        for model_output, tensor in step.output_map.items():
            assert model_output in outputs, (step.model_name, model_output)
            available[tensor] = outputs[model_output]
    for o in ens.output:
        assert available.get(o.name) == o.data_type, o.name


def test_trtllm_repo_defaults_and_validation(tiny_merged, tmp_path):
    engine = trtllm_engine(tmp_path, heads=2, max_batch_size=4)
    out = write_trtllm_triton_repo(engine, tmp_path / "repo", tiny_merged(), "[[0], [0, 1], [1]]")
    trt = parse_config(out / "tensorrt_llm" / "config.pbtxt")
    assert trt.max_batch_size == 4 and not trt.model_transaction_policy.decoupled
    with pytest.raises(RepoError, match="depth 3 exceeds num_heads=2"):
        write_trtllm_triton_repo(engine, tmp_path / "bad", tiny_merged(), "[[0, 0, 0]]")
    with pytest.raises(RepoError, match="max_batch_size 16: expected 1..4"):
        write_trtllm_triton_repo(engine, tmp_path / "bad", tiny_merged(), None, max_batch_size=16)
    with pytest.raises(RepoError, match="no tokenizer"):
        write_trtllm_triton_repo(engine, tmp_path / "bad", engine, None)
    with pytest.raises(RepoError, match="not TensorRT-LLM"):
        write_trtllm_triton_repo(tiny_merged(), tmp_path / "bad", tiny_merged(), None)
    assert not (tmp_path / "bad").exists()
    # write_triton_repo (what medusa-build --triton-repo calls) picks this layout for TensorRT-LLM engines.
    out2 = write_triton_repo(engine, tmp_path / "auto", tokenizer_dir=tiny_merged(), decoupled=True,
                             medusa_choices="[[0], [1]]")
    assert (out2 / "ensemble" / "config.pbtxt").is_file()
    # With no tree given, TensorRT-LLM's own default (mc_sim_7b_63) is written out explicitly.
    out3 = write_trtllm_triton_repo(trtllm_engine(tmp_path / "x", heads=4), tmp_path / "default", tiny_merged())
    p = params(parse_config(out3 / "tensorrt_llm" / "config.pbtxt"))
    assert parse_medusa_choices(p["medusa_choices"]) == validate_and_expand(parse_medusa_choices(DEFAULT_TREE), 4)


def test_pre_and_postprocessing_round_trip(tiny_merged):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_merged())
    out = trtllm_preprocessing.preprocess(tok, {
        "QUERY": np.array([[b"Hello world"], [b"a"]], dtype=object),
        "REQUEST_OUTPUT_LEN": np.array([[16], [4]], dtype=np.int32),
        "STOP_WORDS_DICT": np.array([[b"ab", b"c"], [b"", b""]], dtype=object),
    })
    hello, a = tok.encode("Hello world"), tok.encode("a")
    assert out["INPUT_ID"][0].tolist() == hello
    assert out["INPUT_ID"][1, : len(a)].tolist() == a and (out["INPUT_ID"][1, len(a):] == tok.pad_token_id).all()
    assert out["REQUEST_INPUT_LEN"].tolist() == [[len(hello)], [len(a)]]
    ab, c = tok.encode("ab", add_special_tokens=False), tok.encode("c", add_special_tokens=False)
    words = out["STOP_WORDS_IDS"]
    assert words.shape[:2] == (2, 2)
    assert words[0, 0, : len(ab + c)].tolist() == ab + c
    assert words[0, 1, :2].tolist() == [len(ab), len(ab + c)] and (words[0, 1, 2:] == -1).all()
    assert (words[1, 1] == -1).all()  # no words in row 1
    assert out["OUT_END_ID"].tolist() == [[tok.eos_token_id]] * 2 and out["RETURN_PERF_METRICS"].all()
    tokens = np.array([[hello + [0, 0]], [a + [0] * (len(hello) + 2 - len(a))]], dtype=np.int32)
    text = trtllm_postprocessing.postprocess(tok, tokens, np.array([[len(hello)], [len(a)]], dtype=np.int32))
    assert text.tolist() == [[b"Hello world"], [b"a"]]


def test_existing_repo_needs_force_and_a_failed_write_changes_nothing(tiny_merged, tmp_path):
    out = tmp_path / "repo"
    write_triton_repo(tiny_merged(), out)
    before = (out / "medusa" / "config.pbtxt").read_text()
    with pytest.raises(RepoError, match="already exists"):
        write_triton_repo(tiny_merged(), out, decoupled=True)
    with pytest.raises(RepoError, match="medusa_choices.*depth 6 exceeds num_heads=4"):  # fails validating, with force
        write_triton_repo(tiny_merged(), out, medusa_choices="[[0, 0, 0, 0, 0, 0]]", force=True)
    assert (out / "medusa" / "config.pbtxt").read_text() == before
    write_triton_repo(tiny_merged(), out, model_name="other", force=True)
    assert sorted(p.name for p in out.iterdir()) == ["other"]  # replaced, not merged
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo"]  # no temp dirs left behind


def test_interrupted_write_leaves_no_repository(tiny_merged, tmp_path, monkeypatch):
    # A write that dies half-way (disk full, Ctrl-C): the target never appears, temp files go away.
    import medusa_trt.serving.triton_repo as triton_repo

    def fail_after_some_files(src, dst, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(triton_repo.shutil, "copyfile", fail_after_some_files)
    with pytest.raises(OSError, match="No space"):
        write_trtllm_triton_repo(trtllm_engine(tmp_path), tmp_path / "out" / "repo", tiny_merged())
    assert not (tmp_path / "out").exists()  # nor the parent it created


def test_bad_engine_dirs_give_clear_errors(tiny_merged, tiny_base, tmp_path):
    with pytest.raises(RepoError, match=r"missing: engine directory not found"):
        write_triton_repo(tmp_path / "missing", tmp_path / "repo")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RepoError, match=r"empty: neither engine.json nor config.json"):
        write_triton_repo(tmp_path / "empty", tmp_path / "repo")
    with pytest.raises(RepoError, match=r"architecture .* is neither a merged checkpoint"):
        write_triton_repo(tiny_base(), tmp_path / "repo")  # an HF base, not merged
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "engine.json").write_text("{not json")
    with pytest.raises(RepoError, match=r"broken/engine.json: not valid JSON"):
        write_triton_repo(tmp_path / "broken", tmp_path / "repo")
    with pytest.raises(RepoError, match=r"depth 6 exceeds num_heads=4"):
        write_triton_repo(tiny_merged(), tmp_path / "repo", medusa_choices="[[0, 0, 0, 0, 0, 0]]")
    with pytest.raises(RepoError, match="model name"):
        write_triton_repo(tiny_merged(), tmp_path / "repo", model_name="a/b")
    with pytest.raises(RepoError, match="max_input_len 600: expected 1..511"):
        write_triton_repo(tiny_merged(), tmp_path / "repo", max_input_len=600)
    assert not (tmp_path / "repo").exists()


def test_engine_json_limits(tiny_merged, ort_engine, tmp_path):
    # An engine dir as medusa-build writes it: the repository takes its limits from engine.json.
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "tokenizer.json").write_text((tiny_merged() / "tokenizer.json").read_text())
    built = json.loads((ort_engine("llama") / "engine.json").read_text())
    built["medusa"].update(num_heads=4, max_draft_len=20)
    built["limits"] = {"max_batch_size": 4, "max_seq_len": 128, "max_draft_len": 20}
    (engine / "engine.json").write_text(json.dumps(built))
    info = read_engine_info(engine)
    assert (info.kind, info.max_batch_size, info.max_seq_len) == ("onnxruntime", 4, 128)
    with pytest.raises(RepoError, match="max_draft_len=20"):  # mc_sim_7b_63 has 63 nodes
        write_triton_repo(engine, tmp_path / "repo", medusa_choices="mc_sim_7b_63")
    # Without a tree, and none recorded in the engine: mc_sim_7b_63 cut to the engine (issue 38).
    cut = write_triton_repo(engine, tmp_path / "cut")
    assert params(parse_config(cut / "medusa" / "config.pbtxt"))["medusa_choices"].count("{") == 20
    out = write_triton_repo(engine, tmp_path / "repo", medusa_choices="[[0], [0, 0], [1]]")
    config = parse_config(out / "medusa" / "config.pbtxt")
    assert config.max_batch_size == 4 and params(config)["max_input_len"] == str(128 - 1)
    with pytest.raises(RepoError, match="max_batch_size 8: expected 1..4"):
        write_triton_repo(engine, tmp_path / "repo2", medusa_choices="[[0]]", max_batch_size=8)


def test_cli(tiny_merged, tmp_path, capsys):
    assert main(["--engine", str(tiny_merged()), "--out", str(tmp_path / "repo"), "--decoupled",
                 "--medusa-choices", "{0}, {0, 0}", "--max-batch-size", "2"]) == 0
    assert "models: medusa" in capsys.readouterr().out
    config = parse_config(tmp_path / "repo" / "medusa" / "config.pbtxt")
    assert config.max_batch_size == 2 and params(config)["medusa_choices"] == "{0}, {0, 0}"
    assert main(["--engine", str(tmp_path / "nope"), "--out", str(tmp_path / "repo2")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("medusa-triton: error: ") and "nope: engine directory not found" in err
    # a per-step default tree is named as one, not counted as the characters of "dynamic:6"
    assert main(["--engine", str(tiny_merged()), "--out", str(tmp_path / "repo3"), "--medusa-choices", "dynamic:6"]) == 0
    assert "default tree dynamic:6 (trees chosen per step;" in capsys.readouterr().out


@pytest.mark.parametrize("setting,message", [
    (dict(temperature=float("nan")), "temperature nan: expected a finite value >= 0"),
    (dict(temperature=float("inf")), "temperature inf"),
    (dict(posterior_threshold=1.5), r"posterior_threshold 1.5: expected a finite value in \(0, 1\]"),
    (dict(posterior_alpha=0.0), "posterior_alpha 0.0: expected a finite value > 0"),
])
def test_defaults_every_request_would_refuse_are_refused_at_write(setting, message, tiny_merged, tmp_path):
    """The repository's default knobs are held to the request's own ranges (triton_model.parse_request):
    a NaN temperature once made a repository whose model refused every request."""
    with pytest.raises(RepoError, match=message):
        write_triton_repo(tiny_merged(), tmp_path / "repo", **setting)
    assert not (tmp_path / "repo").exists()


def test_medusa_build_writes_the_repository_beside_the_engine(tmp_path, tiny_merged):
    from medusa_trt.cli.build import main as build_main

    engine, repo = tmp_path / "engine", tmp_path / "repo"
    assert build_main(["--checkpoint", str(tiny_merged("llama")), "--out", str(engine), "--triton-repo", str(repo),
                       "--max-batch-size", "4", "--quiet"]) == 0
    config = parse_config(repo / "medusa" / "config.pbtxt")
    assert config.max_batch_size == 4
    assert Path(params(config)["engine_dir"]) == engine.resolve()


def test_trtllm_scalars_are_reshaped_and_ranks_fit_4_bits(tiny_merged, tmp_path):
    """tensorrtllm_backend's template reshapes its scalar inputs to []: without it the backend sees
    [B, 1] input_lengths and refuses requests of several rows. Its C++ runtime holds tree ranks in 4 bits."""
    engine = trtllm_engine(tmp_path)
    out = write_trtllm_triton_repo(engine, tmp_path / "repo", tiny_merged(), medusa_choices="[[0], [15]]")
    config = parse_config(out / "tensorrt_llm" / "config.pbtxt")
    reshaped = {i.name for i in config.input if i.HasField("reshape") and list(i.reshape.shape) == []}
    assert {"input_lengths", "end_id", "pad_id", "temperature", "runtime_top_k", "runtime_top_p"} <= reshaped
    assert not {"input_ids", "request_output_len", "stop_words_list", "streaming"} & reshaped
    with pytest.raises(RepoError, match=r"rank 16; TensorRT-LLM encodes tree ranks in 4 bits"):
        write_trtllm_triton_repo(engine, tmp_path / "repo2", tiny_merged(), medusa_choices="[[0], [16]]")
    assert not (tmp_path / "repo2").exists()


def test_repository_dirs_get_the_umask_permissions(tiny_merged, tmp_path):
    """Made with mkdir (not mkdtemp's 0700): the Triton server's user can read what medusa-triton wrote."""
    import os

    umask = os.umask(0o022)
    try:
        out = write_triton_repo(tiny_merged(), tmp_path / "repo")
    finally:
        os.umask(umask)
    for d in (out, out / "medusa", out / "medusa" / "1"):
        assert d.stat().st_mode & 0o777 == 0o755, d
