"""make demo reuses the engines it built only while the drafter they were built from is unchanged."""

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

    def engine() -> Path:
        return demo._engine(tmp_path / "base.gguf", drafter, work, "heads")

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
