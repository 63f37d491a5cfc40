"""Issue 38, a user's first hour: chat prompts, decoding that stops where the model says, defaults
that fit the engine (its recorded tree), flags that cannot apply refused, --version, help that
answers, and one output format for medusa-run."""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
import shutil
from pathlib import Path

import pytest

from medusa_trt.cli import build as build_cli
from medusa_trt.cli import run as run_cli
from medusa_trt.engine_dir import EngineError, artifact_checksums
from medusa_trt.runtime.chat import encode_chat, messages_for
from medusa_trt.runtime.decoding import GenerationConfig, decode, resolve_tree, step_tree
from medusa_trt.runtime.dynamic import SLOT_COST
from medusa_trt.runtime.loading import load_backend, load_tokenizer, stop_tokens

ROOT = Path(__file__).resolve().parents[2]
# A ChatML-like template over the synthetic tokenizer's alphabet; "</s>" (its EOS) ends a turn.
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }} {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant {% endif %}")


def scripts() -> dict[str, str]:
    section = (ROOT / "pyproject.toml").read_text().split("[project.scripts]")[1].split("\n\n")[0]
    return dict((a.strip(), b.strip().strip('"')) for a, b in (line.split("=", 1) for line in section.strip().splitlines()))


def script_main(name: str):
    module, func = scripts()[name].split(":")
    return getattr(importlib.import_module(module), func)


def edited_engine(engine: Path, out: Path, edit) -> Path:
    """A copy of `engine` changed by edit(dir), its digests re-recorded (a deliberate edit)."""
    shutil.copytree(engine, out)
    edit(out)
    meta = json.loads((out / "engine.json").read_text())
    meta["artifacts"] = artifact_checksums(out)
    (out / "engine.json").write_text(json.dumps(meta))
    return out


@pytest.fixture(scope="module")
def chat_engine(ort_engine, tmp_path_factory) -> Path:
    """The tiny engine with a chat template in its tokenizer_config.json."""
    def edit(d: Path) -> None:
        config = json.loads((d / "tokenizer_config.json").read_text())
        (d / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))

    return edited_engine(ort_engine("llama"), tmp_path_factory.mktemp("chat") / "engine", edit)


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    code = run_cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


# ---- --version and help ------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(scripts()))
def test_every_command_has_version(name, capsys):
    with pytest.raises(SystemExit) as info:
        script_main(name)(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"{name} (medusa-trt) 0.1.0"


def help_of(name: str, capsys) -> str:
    with pytest.raises(SystemExit):
        script_main(name)(["--help"])
    return " ".join(capsys.readouterr().out.split())


def test_help_answers(capsys):
    train = help_of("medusa-train-heads", capsys)
    for flag, default in (("--num-heads", "default 4"), ("--steps", "default 600"), ("--lr", "default 3e-3"),
                          ("--seed", "default 0")):
        assert re.search(rf"{flag} [A-Z_]+ [^()]*\({re.escape(default)}", train), flag
    assert "sum over the heads" in train
    tune = help_of("medusa-tune-tree", capsys)
    assert re.search(r"--topk TOPK [^()]*\(default 10\)", tune) and re.search(r"--reps REPS [^()]*\(default 5\)", tune)
    for name in ("medusa-run", "medusa-bench", "medusa-triton"):
        assert "presets: " in help_of(name, capsys) and "mc_sim_7b_63" in help_of(name, capsys)
    triton = help_of("medusa-triton", capsys)
    assert "{greedy,typical,sample}" in triton
    assert re.search(r"--threads THREADS ONNX Runtime", triton)
    build = help_of("medusa-build", capsys)
    assert "--tree TREE" in build


def test_build_of_a_hugging_face_dir_says_to_convert_first(tiny_base, tmp_path, capsys):
    base = tiny_base("llama")
    capsys.readouterr()  # the fixture's own output
    assert build_cli.main(["--checkpoint", str(base), "--out", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a Hugging Face model directory" in err[0] and "run medusa-convert first" in err[0]
    assert "missing" not in err[0]


# ---- flags that cannot apply ---------------------------------------------------------------------


@pytest.mark.parametrize("extra,message", [
    (["--temperature", "0.9"], "--temperature 0.9: applies to --acceptance typical or sample only"),
    (["--top-p", "0.5"], "--top-p 0.5: applies to --acceptance sample only"),
    (["--seed", "3"], "--seed 3: applies to --acceptance sample only"),
    (["--acceptance", "typical", "--seed", "3"], "--seed 3: applies to --acceptance sample only"),
    (["--no-medusa", "--medusa-choices", "[[0]]"], "--no-medusa decodes without a tree"),
])
def test_run_refuses_flags_that_cannot_apply(ort_engine, extra, message, capsys):
    code, _, err = run(["--engine", str(ort_engine("llama")), "--prompt", "Hi", "--max-new-tokens", "2", *extra],
                       capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0], lines


def test_a_tree_node_without_its_parent_is_said_once(ort_engine, capsys):
    argv = ["--engine", str(ort_engine("llama")), "--prompt", "Hi", "--prompt", "Ho", "--max-new-tokens", "4",
            "--medusa-choices", "[[0, 1]]", "--raw"]
    code, _, err = run(argv, capsys)
    assert code == 0
    said = [line for line in err.splitlines() if "parents were not given" in line]
    assert len(said) == 1 and said[0].startswith("medusa-run: warning:") and "[[0]]" in said[0], err


# ---- the tree the engine records -----------------------------------------------------------------


def test_engine_records_its_tree_and_every_consumer_uses_it(ort_engine, tiny_merged, tmp_path, capsys):
    tree_file = tmp_path / "tree.json"
    tree_file.write_text(json.dumps({"medusa_choices": [[0], [0, 0], [1]]}))  # as medusa-tune-tree writes it
    engine = tmp_path / "engine"
    capsys.readouterr()
    assert build_cli.main(["--checkpoint", str(tiny_merged("llama")), "--out", str(engine), "--tree", str(tree_file),
                           "--quiet"]) == 0
    medusa = json.loads((engine / "engine.json").read_text())["medusa"]
    assert medusa["tree"] == [[0], [1], [0, 0]] and medusa["tree_source"] == "tree.json"  # (depth, path) order
    backend = load_backend(engine)
    assert resolve_tree(backend.info)[0] == [[0], [1], [0, 0]]
    # The Python API decodes with it: the draft tokens verified per step are its 3 nodes.
    stats = decode(backend, [[5, 9, 17]], GenerationConfig(max_new_tokens=8, stop_token_ids=())).stats[0]
    assert stats.draft_tokens == 3 * stats.steps
    code, _, err = run(["--engine", str(engine), "--prompt", "Hi", "--max-new-tokens", "4"], capsys)
    assert code == 0 and "medusa-run: tree tree.json (3 nodes, recorded in the engine" in err
    from medusa_trt.serving.triton_repo import default_tree, read_engine_info, write_triton_repo

    assert default_tree(None, read_engine_info(engine)) == ([[0], [1], [0, 0]], "tree.json recorded in the engine")
    repo = write_triton_repo(engine, tmp_path / "repo")
    assert '"{0}, {1}, {0, 0}"' in (repo / "medusa" / "config.pbtxt").read_text()
    # An engine that records none says what it falls back to.
    code, _, err = run(["--engine", str(ort_engine("llama")), "--prompt", "Hi", "--max-new-tokens", "2"], capsys)
    assert "mc_sim_7b_63 cut to the engine" in err and "medusa-build --tree" in err


def test_engine_records_per_step_trees(ort_engine, tiny_merged, tmp_path, capsys):
    """A tree file holding "dynamic:N" (what medusa-tune-tree writes when per-step trees win) is
    recorded as such, and the runtime, medusa-run and the Triton repository use it."""
    from medusa_trt.engines.build import recorded_tree
    from medusa_trt.engines.options import BuildOptions
    from medusa_trt.serving.triton_repo import write_triton_repo

    tree_file = tmp_path / "tree.json"
    tree_file.write_text(json.dumps({"medusa_choices": "dynamic:6"}))
    ckpt = tiny_merged("llama")
    config = json.loads((ckpt / "config.json").read_text())
    assert recorded_tree(BuildOptions(checkpoint=ckpt, out=tmp_path / "e", tree=str(tree_file)), config) == \
        ("dynamic:6", "tree.json: dynamic:6")
    # With the engine's measured slot cost (medusa-tune-tree), recorded and read back with it.
    tree_file.write_text(json.dumps({"medusa_choices": "dynamic:6,cost=0.25"}))
    recorded = recorded_tree(BuildOptions(checkpoint=ckpt, out=tmp_path / "e", tree=str(tree_file)), config)
    assert recorded == ("dynamic:6,cost=0.25", "tree.json: dynamic:6,cost=0.25")
    engine = tmp_path / "engine"
    shutil.copytree(ort_engine("llama"), engine)
    data = json.loads((engine / "engine.json").read_text())
    data["medusa"].update(tree="dynamic:6", tree_source="tree.json: dynamic:6")
    (engine / "engine.json").write_text(json.dumps(data))
    backend = load_backend(engine)
    assert step_tree(backend.info).slot_cost == SLOT_COST
    assert step_tree(dataclasses.replace(backend.info, tree=recorded[0])).slot_cost == 0.25
    stats = decode(backend, [[5, 9, 17]], GenerationConfig(max_new_tokens=8, stop_token_ids=(), slot_cost=0.0)).stats[0]
    assert stats.draft_tokens == 6 * stats.steps  # the recorded budget, all of it every step with slot_cost 0
    code, _, err = run(["--engine", str(engine), "--prompt", "Hi", "--max-new-tokens", "4"], capsys)
    assert code == 0 and "medusa-run: tree dynamic:6 (tree.json: dynamic:6, recorded in the engine" in err
    # An engine built with the cost recorded loads and decodes with it (engine_dir once refused it).
    costed = tmp_path / "costed"
    shutil.copytree(engine, costed)
    (costed / "engine.json").write_text(json.dumps(data | {"medusa": {**data["medusa"], "tree": recorded[0]}}))
    assert step_tree(load_backend(costed).info).slot_cost == 0.25
    for bad in ("dynamic:6,cost=", "dynamic:6,cost=-1", "dynamic:6,size=2", "dynamic:0", "dynamic:6/fill", "tree.json"):
        (costed / "engine.json").write_text(json.dumps(data | {"medusa": {**data["medusa"], "tree": bad}}))
        with pytest.raises(EngineError, match="expected a list of paths or 'dynamic:N'"):
            load_backend(costed)
    assert 'string_value: "dynamic:6"' in (write_triton_repo(engine, tmp_path / "repo") / "medusa" / "config.pbtxt").read_text()
    with pytest.raises(Exception, match="TensorRT-LLM engines verify static trees only"):
        recorded_tree(BuildOptions(checkpoint=ckpt, out=tmp_path / "e", tree="dynamic:6", backend="tensorrt-llm"), config)


def test_build_refuses_a_tree_the_engine_cannot_run(tiny_merged, tmp_path, capsys):
    assert build_cli.main(["--checkpoint", str(tiny_merged("llama")), "--out", str(tmp_path / "e"),
                           "--tree", "[[0, 0, 0, 0, 0, 0, 0, 0, 0]]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("medusa-build: error: --tree: ") and not (tmp_path / "e").exists()


# ---- chat, stopping, one output format -----------------------------------------------------------


def test_chat_is_the_default_where_the_tokenizer_has_a_template(chat_engine, ort_engine, capsys):
    tok = load_tokenizer(chat_engine)
    backend = load_backend(chat_engine)
    base = ["--engine", str(chat_engine), "--prompt", "Hi there", "--max-new-tokens", "6", "--json"]
    code, out, err = run(base, capsys)
    assert code == 0 and err.count("chat template") == 1 and "--raw" in err
    want = decode(backend, [encode_chat(tok, messages_for("Hi there"))], GenerationConfig(max_new_tokens=6))
    assert json.loads(out)["output_ids"] == want.tokens[0]
    code, out, err = run([*base, "--raw"], capsys)
    assert code == 0 and "chat template" not in err
    assert json.loads(out)["output_ids"] == decode(backend, [tok.encode("Hi there")],
                                                   GenerationConfig(max_new_tokens=6)).tokens[0]
    code, out, _ = run([*base, "--chat", "--system", "Be brief"], capsys)
    want = decode(backend, [encode_chat(tok, messages_for("Hi there", "Be brief"))], GenerationConfig(max_new_tokens=6))
    assert code == 0 and json.loads(out)["output_ids"] == want.tokens[0]
    # A prompt already rendered with the template is sent as it is.
    code, _, err = run(["--engine", str(chat_engine), "--prompt", "<s>user Hi</s><s>assistant ", "--max-new-tokens",
                        "2"], capsys)
    assert code == 0 and "chat template" not in err
    for argv, message in ((["--raw", "--system", "x"], "--system: applies to chat prompts only"),
                          (["--engine", str(ort_engine("llama")), "--chat"], "--chat: this engine's tokenizer has no "
                                                                             "chat template")):
        code, _, err = run([*base, *argv], capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_the_python_api_stops_where_the_engine_says(ort_engine, tmp_path):
    engine = ort_engine("llama")
    assert load_backend(engine).info.stop_token_ids == stop_tokens(engine, load_tokenizer(engine)) != ()
    prompt = [[5, 9, 17, 33]]
    endless = decode(load_backend(engine), prompt, GenerationConfig(max_new_tokens=48, stop_token_ids=())).tokens[0]
    stop = endless[9]  # a token the model emits: the engine's generation config names it an EOS
    engine = edited_engine(engine, tmp_path / "engine", lambda d: (d / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [stop]})))
    backend = load_backend(engine)
    assert stop in backend.info.stop_token_ids
    result = decode(backend, prompt, GenerationConfig(max_new_tokens=48))
    assert result.tokens[0] == endless[: endless.index(stop) + 1]
    assert result.stats[0].new_tokens == len(result.tokens[0])


def test_stats_count_no_draft_past_the_stop_or_max_new_tokens(distilled):
    """Each step emits its accepted drafts + 1; a stop or max_new_tokens inside a step's accepted
    drafts cuts them, and the statistics count only what was emitted. Heads that predict (distilled),
    so that drafts are accepted and cut: random heads get none accepted, and 0 == 0 proves nothing.
    (The engine's fused step keeps the same statistics: test_decoding's fused-step test.)"""
    backend = distilled("llama").backend
    prompt = [[17, 201, 44, 9, 120, 63]]  # of the kind the heads were fitted on (tests/conftest.py)
    full = decode(backend, prompt, GenerationConfig(max_new_tokens=40, stop_token_ids=()))
    assert full.stats[0].accepted_draft_tokens > 0

    def check(cfg: GenerationConfig) -> tuple[int, int]:
        result = decode(backend, prompt, cfg)
        st = result.stats[0]
        assert result.tokens[0] == full.tokens[0][: len(result.tokens[0])]
        assert st.new_tokens == len(result.tokens[0])
        assert st.accepted_draft_tokens == st.new_tokens - st.steps
        assert sum(st.accepted_per_depth) == st.accepted_draft_tokens
        return st.steps, st.accepted_draft_tokens

    by_length = [check(GenerationConfig(max_new_tokens=n, stop_token_ids=())) for n in range(1, 41)]
    # A cut inside a step: n and n + 1 tokens take the same steps (both end in one step's drafts).
    assert any(a[0] == b[0] for a, b in zip(by_length, by_length[1:], strict=False))
    # Stopped at each token it emits: some stops fall after accepted drafts.
    assert any(check(GenerationConfig(max_new_tokens=40, stop_token_ids=(stop,)))[1]
               for stop in dict.fromkeys(full.tokens[0]))


def test_chat_end_of_turn_tokens_are_stop_tokens(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                                "chat_template": "...<|im_end|>..."}))
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": [
        {"id": 0, "content": "<|endoftext|>", "special": True}, {"id": 2, "content": "<|im_end|>", "special": True},
        {"id": 7, "content": "<|eot_id|>", "special": True}]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    assert stop_tokens(tmp_path) == (0, 2, 5, 6)  # not <|eot_id|>: this template never uses it


def untimed(argv: list[str], capsys) -> str:
    """medusa-run's stdout with its timings masked (they differ run to run)."""
    return re.sub(r"[0-9.]+ (ms|tokens/s)", r"X \1", run(argv, capsys)[1])


def test_run_prints_one_format_for_prompt_and_prompts(ort_engine, tmp_path, capsys):
    engine = ["--engine", str(ort_engine("llama")), "--max-new-tokens", "5"]
    one = tmp_path / "one.txt"
    one.write_text("Hello there\n")
    given = untimed([*engine, "--prompt", "Hello there"], capsys)
    from_file = untimed([*engine, "--prompts", str(one)], capsys)
    assert given == from_file and not given.startswith("Hello there")
    two = tmp_path / "two.txt"
    two.write_text("Hello there\nsecond\n")
    from_file = untimed([*engine, "--prompts", str(two)], capsys)
    given = untimed([*engine, "--prompt", "Hello there", "--prompt", "second"], capsys)
    assert given == from_file
    answers = [line for line in given.splitlines() if line.startswith("[")]
    assert [a[:4] for a in answers] == ["[0] ", "[1] "] and "Hello there" not in given  # the continuation alone


# ---- make serve / make demo ----------------------------------------------------------------------


def test_make_serve_serves_what_make_demo_writes():
    from medusa_trt.cli import demo as demo_cli
    from medusa_trt.tools.demo import serving_repo

    makefile = (ROOT / "Makefile").read_text()
    repo = re.search(r"^REPO \?= (\S+)$", makefile, re.M).group(1)
    workdir = re.search(r"medusa_trt\.cli\.demo --workdir (\S+)", makefile).group(1)
    assert Path(repo) == serving_repo(Path(workdir))
    args = demo_cli.parser().parse_args([])
    assert serving_repo(args.workdir) == Path(repo)


# ---- progress that moves with the work -----------------------------------------------------------


def test_build_and_check_progress_move_with_the_work(tiny_merged, ort_engine, tmp_path, capsys):
    from medusa_trt.cli import check as check_cli

    tiny_merged("llama")
    capsys.readouterr()
    assert build_cli.main(["--checkpoint", str(tiny_merged("llama")), "--out", str(tmp_path / "e")]) == 0
    err = capsys.readouterr().err
    stages = ["load checkpoint", "export decoder graph", "export heads graph", "export fused step graph",
              "save graphs", "fuse ops", "share weights"]
    seen = [s for s in stages if s in err]
    assert seen == stages and "/7 [" in err  # a step per piece of work, in order
    assert check_cli.main(["--engine", str(ort_engine("llama")), "--max-new-tokens", "4", "--tree-steps", "1"]) == 0
    err = capsys.readouterr().err
    for stage in ("loading the engine", "loading the reference", "prefill + 1 tree steps", "engine plain decode",
                  "engine Medusa decode"):
        assert stage in err, stage
