"""medusa_trt/runtime/loading.py: what a directory opens as (engine or merged checkpoint), its
tokenizer and its stop tokens, on the tiny real fixtures; and its errors, one clear line each."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from synthetic import EOS
from transformers import AutoTokenizer

from medusa_trt.engine_dir import ENGINE_JSON, EngineError
from medusa_trt.errors import CheckpointError, MedusaTrtError
from medusa_trt.modeling import MedusaModel
from medusa_trt.runtime.decoding import GenerationConfig, decode
from medusa_trt.runtime.loading import load_backend, load_tokenizer, stop_tokens, tokenizer_model_type
from medusa_trt.runtime.ort.backend import OrtBackend
from medusa_trt.runtime.ort.session import OrtSessionOptions
from medusa_trt.runtime.torch_backend import TorchBackend

PROMPTS = [[5, 9, 33, 7], [40, 3]]
TEXT = "Hello, World 42! it's a-ok?"


def greedy(backend) -> list[list[int]]:
    return decode(backend, PROMPTS, GenerationConfig(max_new_tokens=8)).tokens


def config_only(tmp_path, source, **changes):
    """A directory holding only `source`'s config.json, with `changes` applied (what
    stop_tokens and tokenizer_model_type read)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text()) | changes
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_merged_checkpoint_opens_the_pytorch_reference(tiny_merged):
    ckpt = tiny_merged("llama")
    backend = load_backend(ckpt)
    assert isinstance(backend, TorchBackend)
    assert backend.info.max_draft_len == json.loads((ckpt / "config.json").read_text()).get("max_draft_len", 63)
    assert backend.info.num_medusa_heads == 4
    assert greedy(backend) == greedy(TorchBackend(MedusaModel.from_checkpoint(ckpt)))
    half = load_backend(ckpt, dtype="float16")
    assert next(half.model.parameters()).dtype == torch.float16


def test_merged_checkpoint_on_a_device(tiny_merged):
    """device "cpu" is the default; "cuda" runs the reference on the GPU where torch sees one (the
    same tokens: scripts/gpu_check.py measures that on real hardware) and is refused, naming the
    device, where it does not; any other name is refused everywhere."""
    ckpt = tiny_merged("llama")
    assert greedy(load_backend(ckpt, device="cpu")) == greedy(load_backend(ckpt))
    if torch.cuda.is_available():
        assert greedy(load_backend(ckpt, device="cuda")) == greedy(load_backend(ckpt))
    else:
        with pytest.raises(EngineError, match="device 'cuda'.*sees 0"):
            load_backend(ckpt, device="cuda")
    with pytest.raises(EngineError, match="device 'tpu'"):
        load_backend(ckpt, device="tpu")


def test_engine_dir_opens_its_engine(ort_engine, tiny_merged):
    engine = ort_engine("llama")
    backend = load_backend(engine, ort_options=OrtSessionOptions(threads=1))
    assert isinstance(backend, OrtBackend)
    assert backend.session.get_session_options().intra_op_num_threads == 1
    assert greedy(backend) == greedy(load_backend(tiny_merged("llama")))


def test_each_mode_opens_only_its_session(ort_engine):
    """Sessions open on first use: greedy Medusa runs on the fused step graph alone (its left-padded
    prefill of ragged prompts too) and plain decoding on the decoder graph alone, so a process doing
    one holds one packed copy of the weights (issue 13). Both give plain greedy's tokens."""
    engine = ort_engine("llama")
    one_thread = OrtSessionOptions(threads=1)
    medusa, plain = load_backend(engine, ort_options=one_thread), load_backend(engine, ort_options=one_thread)
    assert medusa.open_session_names == plain.open_session_names == frozenset()
    tokens = decode(medusa, PROMPTS, GenerationConfig(max_new_tokens=12, medusa_choices=[[0], [0, 0], [1]])).tokens
    assert medusa.open_session_names == {"step_session"}
    assert decode(plain, PROMPTS, GenerationConfig(max_new_tokens=12, use_medusa=False)).tokens == tokens
    assert plain.open_session_names == {"session"}
    plain.open_sessions()
    assert plain.open_session_names == {"session", "heads_session", "step_session"}


def test_spin_reaches_every_session(ort_engine):
    """`spin` (medusa-run --spin, carried in OrtSessionOptions) sets ONNX Runtime's intra-op spinning
    on all of an engine's sessions; the default stays off (a shared machine), and the tokens do not
    depend on it."""
    engine = ort_engine("llama")
    key = "session.intra_op.allow_spinning"
    quiet = load_backend(engine, ort_options=OrtSessionOptions(threads=2))
    spinning = load_backend(engine, ort_options=OrtSessionOptions(threads=2, spin=True))
    for backend, want in ((quiet, "0"), (spinning, "1")):
        sessions = [backend.session, backend.heads_session, backend.step_session]
        assert all(s is not None for s in sessions)
        assert [s.get_session_options().get_session_config_entry(key) for s in sessions] == [want] * 3
    assert greedy(spinning) == greedy(quiet)


def test_bad_directories(tmp_path, tiny_base, ort_engine):
    with pytest.raises(EngineError, match=r"threads 0: expected a positive number"):
        load_backend(tmp_path, ort_options=OrtSessionOptions(threads=0))
    with pytest.raises(EngineError, match=r"nope: not a directory; expected an engine directory or a merged"):
        load_backend(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(EngineError, match=r"file: not a directory"):
        load_backend(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(EngineError, match=r"empty: neither engine.json nor config.json found"):
        load_backend(tmp_path / "empty")
    # An HF model (not merged by medusa-convert): says so and what to run.
    with pytest.raises(EngineError, match=r"config.json: architecture None is not a merged checkpoint .*medusa-convert"):
        load_backend(tiny_base("llama"))
    # A TensorRT-LLM engine has no Python runtime: say where it is served instead.
    engine = json.loads((ort_engine("llama") / ENGINE_JSON).read_text())
    trtllm = tmp_path / "trtllm"
    trtllm.mkdir()
    rank0 = {"sha256": "0" * 64, "bytes": 0}
    (trtllm / ENGINE_JSON).write_text(json.dumps(engine | {"backend": "tensorrt-llm",
                                                           "tensorrt_llm": {"engines": ["rank0.engine"]},
                                                           "artifacts": engine["artifacts"] | {"rank0.engine": rank0}}))
    with pytest.raises(EngineError, match=r"engine.json: backend 'tensorrt-llm' has no Python runtime here .*tritonserver"):
        load_backend(trtllm)
    # engine.json is validated before anything opens.
    old = tmp_path / "old"
    old.mkdir()
    (old / ENGINE_JSON).write_text(json.dumps(engine | {"format_version": 1}))
    with pytest.raises(EngineError, match=r"old/engine.json: engine format 1, this runtime reads format"):
        load_backend(old)


def test_bad_merged_config_is_the_checkpoint_error(tmp_path, tiny_merged):
    bad = tmp_path / "ckpt"
    shutil.copytree(tiny_merged("llama"), bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config | {"vocab_size": "many"}))
    with pytest.raises(CheckpointError, match=r"config.json: vocab_size"):
        load_backend(bad)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config.json"):
        load_backend(bad)
    assert issubclass(CheckpointError, MedusaTrtError) and issubclass(EngineError, MedusaTrtError)


def test_tokenizers_of_base_checkpoint_and_engine_agree(tiny_base, tiny_merged, ort_engine):
    ref = AutoTokenizer.from_pretrained(tiny_base("llama"))
    want = ref.encode(TEXT)
    assert len(want) > len(TEXT) // 2  # the synthetic tokenizer: about one token per character
    for directory in (tiny_base("llama"), tiny_merged("llama"), ort_engine("llama")):
        tok = load_tokenizer(directory)
        assert tok.encode(TEXT) == want, directory
        assert tok.decode(want, skip_special_tokens=True) == ref.decode(want, skip_special_tokens=True)
        assert tok.eos_token_id == EOS


def test_tokenizer_model_type(tmp_path, tiny_base, tiny_merged, ort_engine):
    assert tokenizer_model_type(tiny_base("qwen2")) == "qwen2"
    assert tokenizer_model_type(tiny_merged("qwen2")) == "qwen2"  # medusa_trt.base_model_type
    assert tokenizer_model_type(ort_engine("llama")) == "llama"
    assert tokenizer_model_type(tmp_path) is None
    # A merged config names the base's type apart from its own (TensorRT-LLM's) model_type.
    odd = config_only(tmp_path / "odd", tiny_merged("llama"), medusa_trt={"base_model_type": "mistral"})
    assert tokenizer_model_type(odd) == "mistral"


def test_tokenizer_errors(tmp_path, tiny_merged):
    (tmp_path / "empty").mkdir()
    with pytest.raises(EngineError, match=r"empty: cannot load the tokenizer \("):
        load_tokenizer(tmp_path / "empty")
    # A model_type transformers does not know: its own tokenizer choice, no crash.
    unknown = tmp_path / "unknown"
    shutil.copytree(tiny_merged("llama"), unknown)
    config = json.loads((unknown / "config.json").read_text())
    config["medusa_trt"] = (config.get("medusa_trt") or {}) | {"base_model_type": "no-such-model-type"}
    (unknown / "config.json").write_text(json.dumps(config))
    assert load_tokenizer(unknown).encode(TEXT) == load_tokenizer(tiny_merged("llama")).encode(TEXT)


def test_stop_tokens(tmp_path, tiny_base, tiny_merged, ort_engine):
    tok = load_tokenizer(tiny_base("llama"))
    ckpt = tiny_merged("llama")
    assert stop_tokens(ckpt, tok) == (EOS,)
    assert stop_tokens(ort_engine("llama"), tok) == (EOS,)
    # A list in the config (Llama 3 style), merged with the tokenizer's EOS, sorted, no duplicates.
    assert stop_tokens(config_only(tmp_path / "list", ckpt, eos_token_id=[9, EOS, 5]), tok) == (EOS, 5, 9)
    assert stop_tokens(config_only(tmp_path / "int", ckpt, eos_token_id=7), tok) == (EOS, 7)
    assert stop_tokens(config_only(tmp_path / "null", ckpt, eos_token_id=None), tok) == (EOS,)
    engine = json.loads((ort_engine("llama") / ENGINE_JSON).read_text())
    listed = tmp_path / "engine"
    listed.mkdir()
    (listed / ENGINE_JSON).write_text(json.dumps(engine | {"eos_token_id": [11, 3]}))
    assert stop_tokens(listed, tok) == (EOS, 3, 11)
    # No config at all: the tokenizer's EOS alone.
    (tmp_path / "bare").mkdir()
    assert stop_tokens(tmp_path / "bare", tok) == (EOS,)
    # A config whose eos is invalid is refused, not guessed around.
    with pytest.raises(CheckpointError, match=r"eos_token_id"):
        stop_tokens(config_only(tmp_path / "bad", ckpt, eos_token_id="two"), tok)


def _edit_engine(engine, out, change):
    """A copy of `engine` whose engine.json `change(meta, dir)` edits (the digests are not re-recorded:
    the edits are to engine.json itself, or name what they add)."""
    shutil.copytree(engine, out)
    meta = json.loads((out / ENGINE_JSON).read_text())
    change(meta, out)
    (out / ENGINE_JSON).write_text(json.dumps(meta))
    return out


def _foreign_datastore(meta, d, ids=(60, 61, 62, 63)):
    from medusa_trt import datastore

    datastore.save(datastore.build([list(ids)]), d / datastore.FILE, source="elsewhere")


def _listed_datastore(ids):
    def change(meta, d):
        from medusa_trt.engine_dir import artifact_checksums

        _foreign_datastore(meta, d, ids)
        meta["artifacts"] = artifact_checksums(d)
    return change


# Hand edits of engine.json (or files dropped beside it) that once crashed every command later, or
# loaded unchecked: each is one EngineError line at load, for every reader.
ENGINE_EDITS = {
    "dtype-of-other-graphs": (lambda m, d: m.update(dtype="float16"),
                              r"model.onnx: input 'past_key_0' is FLOAT, engine.json records dtype 'float16'"),
    "tokenizer-not-an-object": (lambda m, d: m.update(tokenizer="llama"), r"engine.json: tokenizer: 'llama' is a string; expected JSON object"),
    "graph-not-in-artifacts": (lambda m, d: m["artifacts"].pop(m["onnx"]["file"]),
                               r"onnx.file 'model.onnx' is not in artifacts; expected every file the engine reads listed"),
    "tree-deeper-than-the-heads": (lambda m, d: m["medusa"].update(tree=[[0] * (m["medusa"]["num_heads"] + 1)]),
                                   r"medusa.tree: .*depth 5 exceeds num_heads=4.*rebuild the engine with a --tree"),
    "tree-over-max-draft-len": (lambda m, d: m["medusa"].update(tree=[[r] for r in range(m["limits"]["max_draft_len"] + 1)]),
                                r"medusa.tree: medusa_choices: tree has \d+ nodes after adding prefixes; expected at most"),
    "dynamic-over-the-candidates": (lambda m, d: m.update(limits=m["limits"] | {"max_draft_len": 64}) or
                                    m["medusa"].update(tree="dynamic:63"),
                                    r"medusa.tree: .*budget 63 exceeds the drafter's 4 heads x top-10 = 40"),
    "datastore-of-no-build": (_foreign_datastore, r"datastore.npz: not in engine.json's artifacts"),
    "datastore-of-another-vocab": (_listed_datastore((300, 301, 302, 303)),
                                   r"datastore.npz: token id 303; expected ids below the model's vocab_size 256"),
}


@pytest.mark.parametrize("name", sorted(ENGINE_EDITS))
def test_engine_json_edits_are_one_line_at_load(name, ort_engine, tmp_path):
    change, message = ENGINE_EDITS[name]
    engine = _edit_engine(ort_engine("llama"), tmp_path / "engine", change)
    with pytest.raises(MedusaTrtError, match=message) as e:  # EngineError, or DatastoreError for the datastore's ids
        load_backend(engine)
    assert "\n" not in str(e.value)
