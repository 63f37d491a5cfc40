"""medusa-train-heads: FasterDecoding v1 output that medusa-convert takes, heads that get accepted,
clear errors; and the committed demo model (loads, converts, Medusa greedy == plain greedy)."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from medusa_trt.cli import train_heads as train_cli
from medusa_trt.converter.merge import convert
from medusa_trt.data import read_samples
from medusa_trt.modeling import MedusaModel
from medusa_trt.runtime.decoding import GenerationConfig, decode
from medusa_trt.runtime.torch_backend import TorchBackend
from medusa_trt.tools.train_heads import greedy_continuations

WORDS = "def return class import self value items print range list dict open with for in if else".split()
DEMO = Path(__file__).resolve().parents[2] / "assets" / "demo_model"


def write_data(path: Path, n: int = 40, seed: int = 0) -> Path:
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(6, 14))) for _ in range(n)]
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    else:
        path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def self_distilled(tiny_base, tmp_path_factory):
    """medusa-train-heads --self-distill on a tiny base (a few seconds), converted by medusa-convert."""
    root = tmp_path_factory.mktemp("train-heads")
    data = write_data(root / "data.jsonl")
    rc = train_cli.main(["--base", str(tiny_base("llama")), "--data", str(data), "--out", str(root / "heads"),
                         "--self-distill", "--num-prompts", "96", "--prompt-tokens", "8", "--new-tokens", "48",
                         "--steps", "200", "--batch-tokens", "2048", "--quiet"])
    assert rc == 0
    convert(tiny_base("llama"), root / "heads", root / "ckpt", progress=False)
    return root


def test_cli_writes_the_faster_decoding_v1_format(self_distilled, tiny_base):
    heads = self_distilled / "heads"
    config = json.loads((heads / "config.json").read_text())
    assert config["medusa_num_heads"] == 4 and config["medusa_num_layers"] == 1
    state = torch.load(heads / "medusa_lm_head.pt", weights_only=True)
    base_cfg = json.loads((tiny_base("llama") / "config.json").read_text())
    d, v = base_cfg["hidden_size"], base_cfg["vocab_size"]
    assert set(state) == {f"{h}.{k}" for h in range(4) for k in ("0.linear.weight", "0.linear.bias", "1.weight")}
    assert state["0.0.linear.weight"].shape == (d, d) and state["3.1.weight"].shape == (v, d)
    assert state["0.0.linear.weight"].dtype == torch.float32  # the base's dtype
    summary = json.loads((heads / "training_summary.json").read_text())
    assert summary["targets"] == "self-distillation" and len(summary["heldout_top1"]) == 4
    ckpt = json.loads((self_distilled / "ckpt" / "config.json").read_text())
    assert ckpt["num_medusa_heads"] == 4 and ckpt["medusa_trt"]["head_format"] == "medusa_v1"


def test_self_distilled_heads_get_accepted(self_distilled, tiny_base):
    backend = TorchBackend(MedusaModel.from_checkpoint(self_distilled / "ckpt"))
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 72) for _ in range(n)] for n in (5, 9, 7)]
    medusa = decode(backend, prompts, GenerationConfig(max_new_tokens=40))
    plain = decode(backend, prompts, GenerationConfig(max_new_tokens=40, use_medusa=False))
    assert medusa.tokens == plain.tokens
    assert all(s.accepted_draft_tokens > 0 for s in medusa.stats), [s.as_dict() for s in medusa.stats]
    assert sum(s.new_tokens for s in medusa.stats) / sum(s.steps for s in medusa.stats) > 1.3


def test_shared_lm_head_writes_v2_heads_that_the_engine_runs_as_one_matmul(tiny_base, tmp_path):
    """--shared-lm-head: ResBlocks only in medusa_lm_head.safetensors with version "2"; medusa-convert
    reads it as v2, the ONNX Runtime engine computes all heads' logits with the base lm_head in one
    MatMul, and its heads equal the reference's; distilled heads still get accepted."""
    import onnx
    from safetensors.torch import load_file

    from medusa_trt.engines.build import build_engine
    from medusa_trt.engines.options import BuildOptions
    from medusa_trt.runtime.ort.backend import OrtBackend

    base = tiny_base("llama")
    data = write_data(tmp_path / "data.jsonl")
    rc = train_cli.main(["--base", str(base), "--data", str(data), "--out", str(tmp_path / "heads"), "--self-distill",
                         "--shared-lm-head", "--num-prompts", "96", "--prompt-tokens", "8", "--new-tokens", "48",
                         "--steps", "200", "--batch-tokens", "2048", "--quiet"])
    assert rc == 0
    assert json.loads((tmp_path / "heads" / "config.json").read_text())["version"] == "2"
    assert not (tmp_path / "heads" / "medusa_lm_head.pt").exists()
    state = load_file(tmp_path / "heads" / "medusa_lm_head.safetensors")
    assert set(state) == {f"{h}.0.linear.{k}" for h in range(4) for k in ("weight", "bias")}
    convert(base, tmp_path / "heads", tmp_path / "ckpt", progress=False)
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["medusa_trt"]["head_format"] == "medusa_v2"
    build_engine(BuildOptions(checkpoint=tmp_path / "ckpt", out=tmp_path / "engine", progress=False))
    engine = json.loads((tmp_path / "engine" / "engine.json").read_text())
    assert engine["onnx"]["shared_lm_head"] is True
    heads_graph = onnx.load(tmp_path / "engine" / engine["onnx"]["heads_file"])
    cfg = json.loads((base / "config.json").read_text())
    vocab, d = cfg["vocab_size"], cfg["hidden_size"]
    params = sum(int(np.prod(i.dims)) for i in heads_graph.graph.initializer if len(i.dims) == 2)
    assert params == 4 * d * d + vocab * d  # one output matrix, not one per head

    reference = TorchBackend(MedusaModel.from_checkpoint(tmp_path / "ckpt"))
    backend = OrtBackend(tmp_path / "engine")
    hidden = torch.randn(3, reference.model.cfg.hidden_size)
    expected = reference.model.draft(hidden[None])[:, 0]
    torch.testing.assert_close(backend._run_heads(hidden), expected, atol=1e-4, rtol=1e-4)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 72) for _ in range(n)] for n in (5, 9, 7)]
    medusa = decode(backend, prompts, GenerationConfig(max_new_tokens=40))
    assert medusa.tokens == decode(reference, prompts, GenerationConfig(max_new_tokens=40, use_medusa=False)).tokens
    assert sum(s.new_tokens for s in medusa.stats) / sum(s.steps for s in medusa.stats) > 1.3


def test_plain_targets_and_txt_data(tiny_base, tmp_path, capsys, monkeypatch):
    data = write_data(tmp_path / "data.txt", n=30)
    out = tmp_path / "heads"
    rc = train_cli.main(["--base", str(tiny_base("llama")), "--data", str(data), "--out", str(out),
                         "--num-heads", "3", "--num-layers", "2", "--steps", "20", "--dtype", "float16", "--quiet"])
    assert rc == 0
    state = torch.load(out / "medusa_lm_head.pt", weights_only=True)
    assert "2.1.linear.weight" in state and "2.2.weight" in state and state["2.2.weight"].dtype == torch.float16
    assert json.loads((out / "training_summary.json").read_text())["targets"] == "data"
    assert "medusa-train-heads: wrote" in capsys.readouterr().out
    convert(tiny_base("llama"), out, tmp_path / "ckpt", progress=False)
    # The existing file is kept unless --force.
    assert train_cli.main(["--base", str(tiny_base("llama")), "--data", str(data), "--out", str(out), "--quiet"]) == 2
    assert "pass --force" in capsys.readouterr().err
    # --force with a run that fails after training: --out keeps what it had, and nothing else is left.
    (out / "notes.txt").write_text("the user's own file")
    before = {f.name: f.read_bytes() for f in out.iterdir()}

    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_cli, "_summary", interrupted)
    assert train_cli.main(["--base", str(tiny_base("llama")), "--data", str(data), "--out", str(out), "--force",
                           "--shared-lm-head", "--steps", "2", "--quiet"]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "data.txt", "heads"]
    # The same run completed: the v2 file supersedes the v1 file, the user's file stays.
    monkeypatch.undo()
    assert train_cli.main(["--base", str(tiny_base("llama")), "--data", str(data), "--out", str(out), "--force",
                           "--shared-lm-head", "--steps", "2", "--quiet"]) == 0
    assert sorted(f.name for f in out.iterdir()) == ["config.json", "medusa_lm_head.safetensors", "notes.txt",
                                                     "training_summary.json"]
    # every file with the umask's permissions (safetensors' own save_file made the heads 0600)
    assert {oct(f.stat().st_mode & 0o777) for f in out.iterdir() if f.name != "notes.txt"} == {
        oct(0o666 & ~_umask())}


@pytest.mark.parametrize("case", ["missing", "empty", "suffix", "bad_json", "no_text", "bad_base", "no_base",
                                  "bad_gguf", "too_short", "bad_option", "amphista_option", "cache_without_text",
                                  "continuation_too_short", "diverged"])
def test_bad_input_exits_2(case, tiny_base, tmp_path, capsys):
    # --out in folders that do not exist yet: a failed run (the diverged case fails after training)
    # leaves none of them behind
    base, data, out = tiny_base("llama"), tmp_path / "data.jsonl", tmp_path / "new" / "new" / "heads"
    write_data(data)
    expected = {
        "missing": "missing.jsonl: file not found",
        "empty": "no samples",
        "suffix": "unsupported suffix '.csv'",
        "bad_json": "data.jsonl:2: not valid JSON",
        "no_text": "data.jsonl:1: expected an object with a string 'text' field",
        "bad_base": "cannot load",
        "no_base": "no config.json; expected a Hugging Face model directory",
        "bad_gguf": "model.gguf: not a GGUF file (starts with b'PK\\x03\\x04', expected b'GGUF')",
        "too_short": "no sample is longer than 5 tokens",
        "bad_option": "--steps 0: expected a positive integer",
        "amphista_option": "--draft-vocab: --arch amphista options",  # was ignored without a word
        "cache_without_text": "Medusa heads keep only the self-distilled text there",
        "continuation_too_short": "--max-new-tokens 4: expected more than --num-heads 4",  # before any decoding
        "diverged": "training diverged (final loss nan)",  # NaN heads were written, with exit 0
    }[case]
    args = {"--base": str(base), "--data": str(data), "--out": str(out)}
    extra: list[str] = []
    if case == "missing":
        args["--data"] = str(tmp_path / "missing.jsonl")
    elif case == "empty":
        data.write_text("\n  \n")
    elif case == "suffix":
        args["--data"] = str(tmp_path / "data.csv")
    elif case == "bad_json":
        data.write_text('{"text": "ok"}\n{"text": \n')
    elif case == "no_text":
        data.write_text('{"content": "x"}\n')
    elif case == "bad_base":
        broken = tmp_path / "broken"
        broken.mkdir()
        (broken / "config.json").write_text("{}")
        args["--base"] = str(broken)
    elif case == "no_base":
        args["--base"] = str(tmp_path / "nowhere")
    elif case == "bad_gguf":  # refused as medusa-convert refuses it (converter.gguf.load_gguf checks it first)
        (tmp_path / "model.gguf").write_bytes(b"PK\x03\x04 not gguf at all")
        args["--base"] = str(tmp_path / "model.gguf")
    elif case == "too_short":
        data.write_text('{"text": "a"}\n')
    elif case == "bad_option":
        extra = ["--steps", "0"]
    elif case == "amphista_option":
        extra = ["--draft-vocab", "512"]
    elif case == "cache_without_text":
        extra = ["--cache", str(tmp_path / "cache")]
    elif case == "continuation_too_short":
        extra = ["--self-distill", "--max-new-tokens", "4"]
    elif case == "diverged":
        extra = ["--steps", "20", "--lr", "1e30"]
    try:
        rc = train_cli.main([x for kv in args.items() for x in kv] + extra + ["--quiet"])
    except SystemExit as e:  # a flag out of its range is refused while parsing
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert "medusa-train-heads: error:" in err and expected in err, err
    assert not (tmp_path / "new").exists()


def test_batched_greedy_continuations_equal_one_at_a_time(tiny_base):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_base("llama")).eval()
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 72) for _ in range(n)] for n in (4, 4, 6, 4)]
    batched = greedy_continuations(hf, prompts, 12, batch_size=8)
    for p, seq in zip(prompts, batched, strict=True):
        ref = list(p)  # oracle: argmax of a full forward (no cache, no batching) per new token
        with torch.no_grad():
            for _ in range(12):
                ref.append(int(hf(torch.tensor([ref])).logits[0, -1].argmax()))
        assert seq == ref


@pytest.mark.skipif(not any((DEMO / "heads").glob("medusa_lm_head.*")), reason="demo model not trained yet")
def test_committed_demo_model(tmp_path):
    """The committed assets convert and decode, and Medusa greedy equals plain greedy on a held-out prompt."""
    from medusa_trt.runtime.loading import load_tokenizer, stop_tokens

    summary = json.loads((DEMO / "summary.json").read_text())
    sizes = sum(p.stat().st_size for p in DEMO.rglob("*") if p.is_file())
    assert sizes < 20 * 2**20
    convert(DEMO / "base", DEMO / "heads", tmp_path / "ckpt", dtype="float32", progress=False)
    backend = TorchBackend(MedusaModel.from_checkpoint(tmp_path / "ckpt"))
    tok = load_tokenizer(tmp_path / "ckpt")
    prompt = tok.encode(read_samples(DEMO / "prompts_heldout.jsonl")[0])
    stops = stop_tokens(tmp_path / "ckpt", tok)
    tree = DEMO / "tree.json" if (DEMO / "tree.json").is_file() else "mc_sim_7b_63"
    medusa = decode(backend, [prompt], GenerationConfig(max_new_tokens=64, medusa_choices=tree, stop_token_ids=stops))
    plain = decode(backend, [prompt], GenerationConfig(max_new_tokens=64, use_medusa=False, stop_token_ids=stops))
    assert medusa.tokens == plain.tokens
    assert medusa.stats[0].tokens_per_step > 1.5
    assert summary["heads"]["num_heads"] == backend.info.num_medusa_heads


def _sharegpt(path, n: int = 40, seed: int = 0):
    """A ShareGPT-shaped file of n conversations (ids chosen so some fall in the held-out split)."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "loop", "list", "value", "code", "tree", "node"]
    records = [{"id": f"conv{i}_0", "conversations": [
        {"from": "human", "value": " ".join(rng.choice(words) for _ in range(rng.randint(4, 12)))},
        {"from": "gpt", "value": " ".join(rng.choice(words) for _ in range(20))}]} for i in range(n)]
    path.write_text(json.dumps(records))
    return path


def test_amphista_from_sharegpt_self_distilled_and_resumed_from_its_cache(tiny_base, tmp_path, capsys):
    from medusa_trt.data import is_heldout, read_sharegpt

    data = _sharegpt(tmp_path / "sharegpt.json")
    assert any(is_heldout(c.id) for c in read_sharegpt(data)[0])  # the held-out rule has something to leave out
    args = ["--base", str(tiny_base("llama")), "--data", str(data), "--arch", "amphista", "--self-distill",
            "--num-prompts", "48", "--max-new-tokens", "24", "--steps", "30", "--sal-intermediate", "32",
            "--cache", str(tmp_path / "cache"), "--quiet"]
    assert train_cli.main([*args, "--out", str(tmp_path / "a"), "--corpus", str(tmp_path / "corpus")]) == 0
    # --corpus: the base's continuations, a datastore source (medusa-build --datastore)
    from medusa_trt import datastore

    own = datastore.read_source(tmp_path / "corpus", tiny_base("llama"), 256)
    assert 0 < len(own) <= 48 and all(0 < len(c) <= 24 for c in own)
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["drafter"] == "amphista" and config["amphista"]["sal_intermediate_size"] == 32
    summary = json.loads((tmp_path / "a" / "training_summary.json").read_text())
    assert summary["arch"] == "amphista" and len(summary["heldout_top1"]) == 4
    chunks = sorted((tmp_path / "cache").glob("*.pt"))
    text = sorted((tmp_path / "cache").glob("text_*.json"))  # the continuations, kept before the hidden states
    stamps = [c.stat().st_mtime_ns for c in [*chunks, *text]]
    assert chunks and text
    assert train_cli.main([*args, "--out", str(tmp_path / "b")]) == 0  # resumes: the chunks are read, not redone
    assert [c.stat().st_mtime_ns for c in [*chunks, *text]] == stamps
    assert "held-out top-1" in capsys.readouterr().out
    # A damaged chunk is computed again, with a warning, not a traceback (run c reads it back)
    chunks[0].write_bytes(b"not a chunk")
    # --bf16 reaches the Amphista steps (it once trained the Medusa heads only): the same run under
    # bfloat16 autocast ends elsewhere, where a rerun in float32 ends on the same bits
    assert train_cli.main([*args, "--out", str(tmp_path / "c")]) == 0
    assert "not a readable cache chunk" in capsys.readouterr().err and torch.load(chunks[0], weights_only=True)
    assert train_cli.main([*args, "--out", str(tmp_path / "d"), "--bf16"]) == 0
    from safetensors.torch import load_file

    b, c, d = (load_file(tmp_path / run / "amphista.safetensors") for run in "bcd")
    assert all(torch.equal(b[k], c[k]) for k in b) and not all(torch.equal(b[k], d[k]) for k in b)
    assert json.loads((tmp_path / "d" / "training_summary.json").read_text())["bf16"] is True
    assert oct((tmp_path / "d" / "amphista.safetensors").stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    convert(tiny_base("llama"), tmp_path / "a", tmp_path / "ckpt", progress=False)  # medusa-convert takes it


@pytest.mark.parametrize("case, expect", [
    ("arch", "--arch 'eagle': expected one of amphista, medusa"),
    ("corpus", "needs --self-distill (the corpus holds the base model's own continuations"),
    ("empty", "no conversations"),
    ("shape", "data.json:1: record 2 (x1): conversations[0]: expected {\"from\": str, \"value\": str}"),
    ("id", "record 1: field 'id': expected a non-empty string"),
    ("nested", "record 1: nested too deep to read"),  # a RecursionError traceback before
    ("blank", "no conversations (expected ShareGPT records like {\"id\": ..., \"conversations\": [...]})"),
    # the line of the record and of the fault in it, and the decoder's message without its dangling "at"
    ("control", "data.json:3: record 2: not valid JSON (Invalid control character at line 4 column 50)"),
    ("roles", "expected turns from 'human' or 'user', the file's turns are from 'assistant', 'person'"),
    ("draft-vocab", "--draft-vocab 15: expected at least 16"),
    # where the run writes, refused before it reads the data or loads the base (it was refused after)
    ("out-under-a-file", "out/sub: cannot create it: "),
    ("cache-is-a-file", "cache: --cache exists and is not a directory"),
    ("cache-is-out", "out: is --out; keep the cache in a directory of its own"),
])
def test_amphista_bad_input_exits_2_and_writes_nothing(case, expect, tiny_base, tmp_path, capsys):
    data = tmp_path / "data.json"
    arch = "eagle" if case == "arch" else "amphista"
    if case == "empty":
        data.write_text("[]")
    elif case == "shape":
        data.write_text(json.dumps([{"id": "x0", "conversations": []}, {"id": "x1", "conversations": [{"from": 1}]}]))
    elif case == "id":
        data.write_text(json.dumps([{"conversations": []}]))
    elif case == "nested":
        data.write_text("[" + "[" * 100000)
    elif case == "blank":
        data.write_text("  \n")
    elif case == "control":
        data.write_text('[{"id": "x0", "conversations": []},\n\n {"id": "x1",\n  "conversations": [{"from": "human", '
                        '"value": "a\tb"}]}]')
    elif case == "roles":
        data.write_text(json.dumps([{"id": f"x{i}", "conversations": [{"from": "person", "value": "hi"},
                                                                      {"from": "assistant", "value": "hello"}]}
                                    for i in range(3)]))
    else:
        _sharegpt(data)
    out = tmp_path / "out"
    extra = {"corpus": ["--corpus", str(tmp_path / "corpus")], "draft-vocab": ["--draft-vocab", "15"],
             "cache-is-a-file": ["--cache", str(tmp_path / "cache")], "cache-is-out": ["--cache", str(out)]}.get(case, [])
    if case == "out-under-a-file":
        out.write_text("a file")
        out = out / "sub"
    if case == "cache-is-a-file":
        (tmp_path / "cache").write_text("a file")
    before = sorted(tmp_path.iterdir())
    rc = train_cli.main(["--base", str(tiny_base("llama")), "--data", str(data), "--out", str(out),
                         "--arch", arch, "--quiet", *extra])
    err = capsys.readouterr().err
    assert rc == 2 and expect in err and err.count("\n") == 1, err
    assert sorted(tmp_path.iterdir()) == before  # nothing written: no --out, --cache or --corpus


def test_a_bad_data_file_is_refused_before_the_base_loads(tiny_base, tmp_path, capsys, monkeypatch):
    # Loading a 7B base takes minutes; a malformed --data file must not wait for it.
    def no_load(*a, **k):
        raise AssertionError("the base was loaded before the data file was read")

    monkeypatch.setattr(train_cli, "load_base", no_load)
    data = tmp_path / "data.json"
    data.write_text(json.dumps([{"id": "x0", "conversations": [{"from": 1}]}]))
    rc = train_cli.main(["--base", str(tiny_base("llama")), "--data", str(data), "--out", str(tmp_path / "out"),
                         "--arch", "amphista", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "record 1 (x0): conversations[0]" in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_evaluate_skips_continuations_too_short_for_a_head():
    # The base sometimes stops one or two tokens into its answer; such a sequence has no row for the
    # later heads, and scoring must count it for the heads it has and not fail (the 2026-11-27 GPU run).
    from medusa_trt.tools.distill import Sample
    from medusa_trt.tools.train_drafter import MedusaResBlocks, evaluate

    g = torch.Generator().manual_seed(0)
    d, v = 16, 50
    lm_head, embed = torch.randn(v, d, generator=g), torch.nn.Embedding(v, d)
    heads = MedusaResBlocks(4, 1, d)

    def sample(prompt: int, answer: int) -> Sample:
        tokens = torch.randint(v, (prompt + answer,), generator=g).tolist()
        return Sample(tokens, prompt, torch.randn(len(tokens) - 1, d, generator=g))

    long, short = sample(3, 12), sample(3, 2)
    both = evaluate(heads, "medusa", [long, short], lm_head, embed, None)
    alone = evaluate(heads, "medusa", [long], lm_head, embed, None)
    # two answer tokens: one drafting row for head 1 (its target is the second), none for heads 2-4
    assert both[1:] == alone[1:]


def test_evaluate_groups_scores_each_group_and_all_in_one_pass():
    # The recipe's held-out report (overall and per kind) comes from one pass: each group's figure
    # must be what scoring that group alone gives, and the whole's what scoring all of it gives.
    from medusa_trt.tools.distill import Sample
    from medusa_trt.tools.train_drafter import MedusaResBlocks, evaluate, evaluate_groups

    g = torch.Generator().manual_seed(1)
    d, v = 16, 50
    lm_head, embed = torch.randn(v, d, generator=g), torch.nn.Embedding(v, d)
    heads = MedusaResBlocks(3, 1, d)
    with torch.no_grad():
        heads.w.normal_(generator=g)  # not the identity: heads disagree, so the groups differ

    def sample(kind: str, answer: int) -> Sample:
        tokens = torch.randint(v, (4 + answer,), generator=g).tolist()
        return Sample(tokens, 4, torch.randn(len(tokens) - 1, d, generator=g), kind)

    samples = [sample("chat", 9), sample("code", 14), sample("chat", 6), sample("code", 3)]
    got = evaluate_groups(heads, "medusa", samples, lm_head, embed, None, lambda s: s.kind, topk=3)
    assert set(got) == {"chat", "code", None}
    for kind in ("chat", "code"):
        assert got[kind] == evaluate(heads, "medusa", [s for s in samples if s.kind == kind], lm_head, embed, None, 3)
    assert got[None] == evaluate(heads, "medusa", samples, lm_head, embed, None, 3)
    assert got["chat"] != got["code"]


def test_held_out_sequences_are_whole_samples_never_trained_on(tiny_base, monkeypatch):
    """Prompts were drawn with replacement and the split made over sequences, so a chat prompt drawn
    twice was trained on and held out at once (greedy continues it the same way): 10 of 10 held-out
    sequences were training ones in an audit. Now no snippet is drawn twice, and whole samples are
    held out."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_base("llama"))
    samples = [f"sample {i} " + "word " * (i % 7) for i in range(30)]
    calls = []

    def decode(args, model, prompts):
        calls.append(prompts)
        return [p + [5, 6, 7, 8, 9, 10] for p in prompts]

    args = SimpleNamespace(seed=0, self_distill=True, num_prompts=200, prompt_tokens=4, max_new_tokens=6,
                           num_heads=2, seq_len=8, heldout=0.2, data="d", quiet=True)
    monkeypatch.setattr(train_cli, "continuations", decode)
    for chat in (True, False):
        seqs, starts, sources = train_cli.build_sequences(args, samples, tok, None, chat)
        prompts = [tuple(s[: st + 1]) for s, st in zip(seqs, starts, strict=True)]
        assert len(set(prompts)) == len(prompts), chat  # no snippet twice
        held, train = train_cli.split_heldout(args, sources)
        assert held and train and sorted(held + train) == list(range(len(seqs)))
        assert not {sources[i] for i in held} & {sources[i] for i in train}, chat
        assert not {prompts[i] for i in held} & {prompts[i] for i in train}, chat
    assert len(calls[0]) == 30  # chat: each prompt once, all 30 (fewer than --num-prompts)


def test_the_cache_is_keyed_by_the_base_weights_and_force_replaces_the_drafter(tiny_base, tmp_path):
    """A rerun on the same --base path after its weights changed reused the old hidden states (the key
    was the path); and --force from Amphista to Medusa heads left amphista.safetensors beside them."""
    base = tmp_path / "base"
    shutil.copytree(tiny_base("llama"), base)
    data = _sharegpt(tmp_path / "sharegpt.json")
    args = ["--base", str(base), "--data", str(data), "--arch", "amphista", "--self-distill", "--num-prompts", "24",
            "--max-new-tokens", "12", "--steps", "4", "--cache", str(tmp_path / "cache"), "--quiet"]
    assert train_cli.main([*args, "--out", str(tmp_path / "a")]) == 0
    first = {p.name for p in (tmp_path / "cache").iterdir()}
    other = tiny_base("llama", seed=7)  # other weights, the same config and tokenizer
    shutil.copy(other / "model.safetensors", base / "model.safetensors")
    assert train_cli.main([*args, "--out", str(tmp_path / "b")]) == 0
    second = {p.name for p in (tmp_path / "cache").iterdir()} - first
    assert any(n.startswith("text_") for n in second) and any(n.endswith(".pt") for n in second)
    # The same --out, now Medusa heads with --force: the drafter before them goes.
    out = tmp_path / "a"
    assert train_cli.main(["--base", str(base), "--data", str(data), "--out", str(out), "--force", "--steps", "2",
                           "--quiet"]) == 0
    assert not (out / "amphista.safetensors").exists() and (out / "medusa_lm_head.pt").exists()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
