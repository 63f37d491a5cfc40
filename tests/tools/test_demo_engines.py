"""make demo reuses the engines it built only while the drafter and base they were built from are
unchanged, and checks what it reads before it builds anything."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from medusa_trt.tools import demo


def test_a_changed_drafter_or_tree_rebuilds_the_demo_engine(tmp_path, monkeypatch, capsys):
    import medusa_trt.converter.merge as merge
    import medusa_trt.engines.build as build

    built: list[Path] = []

    def fake_build(options):
        options.out.mkdir(parents=True, exist_ok=True)
        built.append(options.out)
        return SimpleNamespace(seconds=0.0)

    monkeypatch.setattr(merge, "convert", lambda *a, **k: "merged")
    monkeypatch.setattr(build, "build_engine", fake_build)
    monkeypatch.setattr(demo, "_reusable", lambda engine_dir: engine_dir.is_dir())  # a built engine reads back
    drafter = tmp_path / "assets" / "heads"
    drafter.mkdir(parents=True)
    (drafter / "medusa_lm_head.safetensors").write_bytes(b"weights v1")
    (tmp_path / "assets" / "tree.json").write_text(json.dumps({"medusa_choices": "dynamic:16"}))
    work = tmp_path / "work"
    base = tmp_path / "base.gguf"
    base.write_bytes(b"base v1")

    def engine() -> Path:
        return demo._engine(base, drafter, work, "heads")

    engine()
    engine()
    assert len(built) == 1 and "reusing" in capsys.readouterr().out
    (drafter / "medusa_lm_head.safetensors").write_bytes(b"weights v2")
    engine()
    assert len(built) == 2 and "changed since it was built" in capsys.readouterr().out
    (tmp_path / "assets" / "tree.json").write_text(json.dumps({"medusa_choices": "dynamic:8"}))  # beside the dir
    engine()
    engine()
    assert len(built) == 3
    base.write_bytes(b"another base")  # --gguf of another model into the same --workdir
    engine()
    assert len(built) == 4 and "or the base base.gguf changed" in capsys.readouterr().out


def _args(tmp_path, **given):
    prompts = tmp_path / "p.jsonl"
    if not prompts.exists():
        prompts.write_text("".join(json.dumps(r) + "\n" for r in (
            {"text": "c1", "kind": "chat"}, {"text": "c2", "kind": "chat"}, {"text": "k1", "kind": "code"})))
    return SimpleNamespace(**({"gguf": None, "amphista": None, "heads": demo.ASSETS / "heads", "prompts": prompts,
                               "medusa_choices": None, "num_prompts": 4} | given))


def test_the_demo_checks_its_inputs_before_building(tmp_path, capsys):
    from medusa_trt.cli import demo as demo_cli

    rows = demo.check_inputs(_args(tmp_path))
    assert [r["text"] for r in demo.pick_prompts(rows, 4)] == ["c1", "k1", "c2"]  # in turn, then the rest
    assert [r["text"] for r in demo.pick_prompts(rows[:2], 4)] == ["c1", "c2"]  # chat alone still answers
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"kind": "chat"}\n')
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "a_file").write_text("x")
    for given, message in [
        ({"prompts": tmp_path / "bad.jsonl"}, "bad.jsonl:2: expected a JSON object with a non-empty string 'text'"),
        ({"prompts": tmp_path / "empty.jsonl"}, "empty.jsonl: no prompts"),
        ({"prompts": tmp_path / "none.jsonl"}, "none.jsonl: prompts file not found"),
        ({"heads": tmp_path / "missing"}, "--heads"),
        ({"amphista": tmp_path / "a_file"}, "--amphista"),
        ({"gguf": tmp_path}, "not a file; expected a GGUF model file"),
        ({"medusa_choices": "[[0], [x]]"}, "medusa_choices"),
    ]:
        flags = {"prompts": "--prompts", "heads": "--heads", "amphista": "--amphista", "gguf": "--gguf",
                 "medusa_choices": "--medusa-choices"}
        argv = ["--workdir", str(tmp_path / "work")]
        for key, value in given.items():
            argv += [flags[key], str(value)]
        capsys.readouterr()
        assert demo_cli.main(argv) == 2, given
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("demo: error: ") and message in err[0], (given, err)
    assert not (tmp_path / "work").exists()  # refused before the download and the builds
