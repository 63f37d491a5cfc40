"""medusa-check: passes on a good engine, exits 1 on a tampered one, 2 on bad input."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
import torch

from medusa_trt.cli.check import main

FAST = ["--max-new-tokens", "12", "--tree-steps", "2"]


def test_good_engine_passes(ort_engine, tmp_path, capsys):
    report_path = tmp_path / "report.json"
    assert main(["--engine", str(ort_engine("llama")), "--json", str(report_path), *FAST]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "FAIL" not in out
    report = json.loads(report_path.read_text())
    assert report["passed"] and report["dtype"] == "float32" and report["tolerance"] == 1e-4
    stages = {r["stage"] for r in report["rows"]}
    assert {"prefill", "tree step 1", "tree step 2", "fused step 1", "fused step 2", "decode 0 (plain)",
            "decode 2 (medusa)"} <= stages
    assert {r["output"] for r in report["rows"] if r["stage"] == "fused step 2"} == {
        "accepted path", "draft log-probs", "draft ranks"}
    for row in report["rows"]:
        if row["output"] not in ("tokens", "accepted path"):
            assert row["max_abs_diff"] < 1e-4
    assert report["warnings"] == []


def test_prompts_file_and_explicit_checkpoint(ort_engine, tiny_merged, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\n\nsecond one\n")
    assert main(["--engine", str(ort_engine("llama")), "--checkpoint", str(tiny_merged("llama")),
                 "--prompts", str(prompts), *FAST]) == 0


def test_perturbed_weights_fail(ort_engine, tmp_path, capsys):
    """One initializer nudged after the build: the digest refuses it (exit 2); with digests re-recorded,
    parity fails (exit 1)."""
    engine = tmp_path / "engine"
    shutil.copytree(ort_engine("llama"), engine)
    # The weights live in the shared weights.bin (engines/ort/weights.py): nudge one matrix in place.
    model = onnx.load(engine / "model.onnx", load_external_data=False)
    target = max(model.graph.initializer, key=lambda t: np.prod(t.dims))  # an embedding or lm_head matrix
    info = {e.key: int(e.value) for e in target.external_data if e.key in ("offset", "length")}
    data = np.fromfile(engine / "weights.bin", dtype=np.uint8)
    region = data[info["offset"]:info["offset"] + info["length"]].view(np.float32)
    region[: region.size // 2] += 0.05
    data.tofile(engine / "weights.bin")
    capsys.readouterr()
    # engine.json's digest no longer matches: refused before any comparison, naming the file.
    assert main(["--engine", str(engine), *FAST]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "weights.bin: sha256 differs" in err[0], err
    # Digests re-recorded (a deliberate edit): parity itself must catch the change.
    from medusa_trt.engine_dir import artifact_checksums

    info = json.loads((engine / "engine.json").read_text())
    info["artifacts"] = artifact_checksums(engine)
    (engine / "engine.json").write_text(json.dumps(info))
    report_path = tmp_path / "report.json"
    assert main(["--engine", str(engine), "--json", str(report_path), *FAST]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out
    report = json.loads(report_path.read_text())
    assert not report["passed"]
    assert any(not r["passed"] and r["output"] in ("logits", "medusa_logits") for r in report["rows"])


def test_a_wrong_fused_step_drafter_fails(ort_engine, tmp_path, capsys):
    """The fused step graph keeps its own copy of the heads' biases (inline, not in weights.bin): a
    build that got them wrong decodes plain greedy's tokens still (any drafts do), so only the
    fused step's own rows, its drafts' log-probabilities, can catch it (a read-only audit found
    medusa-check passing such an engine)."""
    from medusa_trt.engine_dir import artifact_checksums

    engine = tmp_path / "engine"
    shutil.copytree(ort_engine("llama"), engine)
    step = onnx.load(engine / "model_step.onnx", load_external_data=False)
    biases = [t for t in step.graph.initializer if ".head_b." in t.name and not t.external_data]
    assert biases, [t.name for t in step.graph.initializer]
    for t in biases:
        values = onnx.numpy_helper.to_array(t) + np.float32(3.0) * np.sign(np.arange(np.prod(t.dims)) % 2 - 0.5)
        t.CopyFrom(onnx.numpy_helper.from_array(values.astype(np.float32), t.name))
    onnx.save(step, engine / "model_step.onnx")
    info = json.loads((engine / "engine.json").read_text())
    info["artifacts"] = artifact_checksums(engine)
    (engine / "engine.json").write_text(json.dumps(info))
    report_path = tmp_path / "report.json"
    assert main(["--engine", str(engine), "--json", str(report_path), *FAST]) == 1
    rows = json.loads(report_path.read_text())["rows"]
    failed = {(r["stage"], r["output"]) for r in rows if not r["passed"]}
    assert ("fused step 1", "draft log-probs") in failed, rows
    assert all(stage.startswith("fused step") for stage, _ in failed), failed  # the other graphs are right
    assert all(r["passed"] for r in rows if r["output"] == "tokens")  # decodes cannot show it


def test_a_checkpoint_with_another_kind_of_drafter_is_bad_input(ort_engine, tiny_merged, capsys):
    """Medusa heads' engine against an Amphista checkpoint (same head count): a wrong pairing, exit 2,
    not a parity failure (exit 1) of a right engine."""
    capsys.readouterr()
    assert main(["--engine", str(ort_engine("llama")), "--checkpoint", str(tiny_merged(fmt="amphista")), *FAST]) == 2
    err = capsys.readouterr().err
    assert "holds a drafter with a cache of its own (Amphista), the engine Medusa heads" in err, err


def test_bad_inputs_exit_2(ort_engine, tmp_path, capsys):
    engine = ort_engine("llama")
    assert main(["--engine", str(tmp_path / "missing")]) == 2
    assert "engine.json" in capsys.readouterr().err

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "engine.json").write_text("{not json")
    assert main(["--engine", str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err

    assert main(["--engine", str(engine), "--checkpoint", str(tmp_path)]) == 2
    assert "config.json" in capsys.readouterr().err

    assert main(["--engine", str(engine), "--prompts", str(tmp_path / "none.txt")]) == 2
    assert "none.txt" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    assert main(["--engine", str(engine), "--prompts", str(empty)]) == 2
    assert "no prompts" in capsys.readouterr().err

    moved = tmp_path / "moved"
    shutil.copytree(engine, moved)
    meta = json.loads((moved / "engine.json").read_text())
    meta["checkpoint"]["path"] = str(tmp_path / "gone")
    (moved / "engine.json").write_text(json.dumps(meta))
    assert main(["--engine", str(moved)]) == 2
    assert "gone" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--max-new-tokens", "0"], "--max-new-tokens 0: expected a positive integer"),
    (["--max-new-tokens", "5000"], "max_new_tokens (5000) exceeds the model's maximum sequence length 512"),
    (["--device", "cuda"], "device 'cuda' keeps the KV cache in torch CUDA tensors, but this torch"),
])
def test_bad_options_exit_2(ort_engine, argv, message, capsys):
    import onnxruntime

    if "--device" in argv and "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("CUDA provider installed")
    try:
        rc = main(["--engine", str(ort_engine("llama")), *argv])
    except SystemExit as e:  # a flag out of its range is refused while parsing
        rc = e.code
    errors = [line for line in capsys.readouterr().err.split("\n") if "medusa-check: error:" in line]
    assert rc == 2 and len(errors) == 1 and message in errors[0], errors  # one line, naming what was wrong


def test_float16_engine(ort_engine, tmp_path):
    """A float16 engine (CPU, casts inserted by ONNX Runtime) is held to the float16 tolerance."""
    report_path = tmp_path / "report.json"
    assert main(["--engine", str(ort_engine("llama", dtype="float16")), "--json", str(report_path), *FAST]) == 0
    report = json.loads(report_path.read_text())
    assert report["dtype"] == "float16" and report["tolerance"] == 5e-2
    worst = max(r["max_abs_diff"] for r in report["rows"] if r["max_abs_diff"] is not None)
    assert 1e-5 < worst < 5e-2  # really float16 arithmetic, within the stated bound


# ---- the step comparison drives the decoding loop's own code ------------------------------------


class _Recorder:
    """A backend that records the inputs of every forward, delegating everything to `inner`."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, input_ids, position_ids, new_mask, *args, **kwargs):
        self.calls.append((input_ids.clone(), position_ids.clone(), new_mask.clone()))
        return self.inner.forward(input_ids, position_ids, new_mask, *args, **kwargs)


# With trivial heads (each head repeats the base's prediction), drafts are accepted where greedy
# decoding repeats a token: the first two prompts end where the tiny model's continuation does.
PROMPTS = [[3, 30, 38, 51, 183, 33], [8, 8, 1, 123, 159, 107, 5, 74, 232, 66, 26, 107], [5, 9, 2]]


def _torch_backend(tiny_merged, perturb_heads: bool = False):
    from medusa_trt.modeling import MedusaModel
    from medusa_trt.runtime.torch_backend import TorchBackend

    model = MedusaModel.from_checkpoint(tiny_merged("llama", heads_kwargs={"trivial": True}), dtype="float32")
    if perturb_heads:  # a fault in the Medusa heads only: the base logits stay exact
        with torch.no_grad():
            next(p for name, p in model.named_parameters() if name.startswith("drafter.")).add_(0.05)
    return TorchBackend(model, max_draft_len=63)


def _report():
    from medusa_trt.tools.parity import CheckReport

    return CheckReport("engine", "checkpoint", "torch", "float32", 1e-4)


def test_steps_feed_the_backends_what_the_decoding_loop_feeds(tiny_merged):
    """The prefill and tree steps medusa-check compares are the ones `decode` runs with the same tree
    (greedy): the same token ids, positions and masks, forward by forward, drafts accepted on the way
    (so the next tree comes from the accepted slot's heads, not the root's)."""
    from medusa_trt.runtime.decoding import GenerationConfig, decode
    from medusa_trt.tools.parity import _compare_steps
    from medusa_trt.tree import tree_for_engine

    reference = _Recorder(_torch_backend(tiny_merged))
    steps = 3
    _compare_steps(_report(), _torch_backend(tiny_merged), reference, PROMPTS, steps, 1e-4, "")
    assert len(reference.calls) == 1 + steps

    loop = _Recorder(_torch_backend(tiny_merged))
    tree = tree_for_engine(loop.info.num_medusa_heads, loop.info.max_draft_len)
    assert tree.num_slots > 8  # a real tree, several depths
    # Enough new tokens that no sequence finishes within the compared steps (each emits <= depth + 1).
    cfg = GenerationConfig(max_new_tokens=steps * (tree.max_depth + 1) + 1, medusa_choices=[list(p) for p in tree.nodes])
    decode(loop, PROMPTS, cfg)
    assert len(loop.calls) > steps
    starts = [pos[:, 0] for _, pos, _ in loop.calls[1: 1 + steps]]  # each tree step's root position
    assert any(bool(((b - a) > 1).any()) for a, b in zip(starts, starts[1:], strict=False))  # some accepted
    for i, (ours, theirs) in enumerate(zip(reference.calls, loop.calls[: 1 + steps], strict=True)):
        for name, a, b in zip(("input_ids", "position_ids", "new_mask"), ours, theirs, strict=True):
            assert torch.equal(a, b), (i, name)


def test_step_comparison_is_exact_on_equal_backends_and_catches_a_head_fault(tiny_merged):
    from medusa_trt.tools.parity import _compare_steps

    same = _report()
    _compare_steps(same, _torch_backend(tiny_merged), _torch_backend(tiny_merged), PROMPTS, 2, 1e-4, " [x]")
    assert [(r.stage, r.output) for r in same.rows] == [
        (stage, output) for stage in ("prefill [x]", "tree step 1 [x]", "tree step 2 [x]")
        for output in ("logits", "medusa_logits")]
    assert all(r.passed and r.max_abs_diff == 0 for r in same.rows)

    faulty = _report()
    _compare_steps(faulty, _torch_backend(tiny_merged, perturb_heads=True), _torch_backend(tiny_merged), PROMPTS, 2,
                   1e-4, "")
    assert [r.passed for r in faulty.rows] == [True, False] * 3  # every stage: base logits exact, heads off
    assert all(r.max_abs_diff > 1e-3 for r in faulty.rows if r.output == "medusa_logits")


def test_the_printed_rule_is_the_rule_applied(ort_engine, tmp_path, capsys):
    """The table prints each row's bound as it is applied (no rounding that differs), and the JSON's
    top-level tolerance is the one its rows apply."""
    report_path = tmp_path / "report.json"
    assert main(["--engine", str(ort_engine("llama")), "--json", str(report_path), *FAST]) == 0
    out = capsys.readouterr().out
    report = json.loads(report_path.read_text())
    logits_rows = [r for r in report["rows"] if r["output"] not in ("tokens", "accepted path")]
    assert {r["tolerance"] for r in logits_rows} == {report["tolerance"]}
    for r in logits_rows:
        assert r["rule"] == f"max <= {r['tolerance']:.3g}" and float(r["rule"].split()[-1]) == r["tolerance"]
        assert r["rule"] in out
    assert f"medusa-check: logits rule: {report['rule']}" in out


def test_a_divergence_is_shown_as_one():
    from medusa_trt.tools.parity import CheckReport, CheckRow

    report = CheckReport("e", "c", "onnxruntime", "float32", 1.0, rows=[
        CheckRow("decode 0 (plain)", "tokens", True, detail="from the reference at token 6", diverged=True)])
    assert "DIVERGES  from the reference at token 6" in report.table() and "PASS" not in report.table()


def test_draft_vocabulary_padding_is_not_compared(tiny_merged):
    """Heads over a draft vocabulary fill every other column with one constant: the comparison
    (and its p90) covers the draft columns alone."""
    from medusa_trt.runtime.loading import load_backend
    from medusa_trt.tools.parity import _Observed

    a, b = load_backend(tiny_merged("llama")), load_backend(tiny_merged("llama"))
    draft = torch.tensor([3, 5, 8])
    both = _Observed(a, b, draft)
    both.start(1, 8)
    both.forward(torch.tensor([[4, 5, 6]]), torch.arange(3)[None], torch.ones(1, 3, 3, dtype=torch.bool).tril())
    engine, reference = both.outputs[0]
    assert engine["medusa_logits"].shape[-1] == reference["medusa_logits"].shape[-1] == 3
    assert engine["logits"].shape[-1] == a.info.vocab_size  # the base logits are all real entries
