"""medusa-check: passes on a good engine, exits 1 on a tampered one, 2 on bad input."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest

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
    assert {"prefill", "tree step 1", "tree step 2", "decode 0 (plain)", "decode 2 (medusa)"} <= stages
    for row in report["rows"]:
        if row["output"] != "tokens":
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
    # The weights live in the shared weights.bin (engines/onnx_weights.py): nudge one matrix in place.
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


@pytest.mark.parametrize("argv", [["--max-new-tokens", "0"], ["--max-new-tokens", "5000"], ["--device", "cuda"]])
def test_bad_options_exit_2(ort_engine, argv):
    import onnxruntime

    if "--device" in argv and "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("CUDA provider installed")
    assert main(["--engine", str(ort_engine("llama")), *argv]) == 2


def test_float16_engine(ort_engine, tmp_path):
    """A float16 engine (CPU, casts inserted by ONNX Runtime) is held to the float16 tolerance."""
    report_path = tmp_path / "report.json"
    assert main(["--engine", str(ort_engine("llama", dtype="float16")), "--json", str(report_path), *FAST]) == 0
    report = json.loads(report_path.read_text())
    assert report["dtype"] == "float16" and report["tolerance"] == 5e-2
    worst = max(r["max_abs_diff"] for r in report["rows"] if r["max_abs_diff"] is not None)
    assert 1e-5 < worst < 5e-2  # really float16 arithmetic, within the stated bound
