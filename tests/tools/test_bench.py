"""medusa-bench on a tiny checkpoint and a tiny ONNX Runtime engine: the report's fields and their
consistency, the forward timer, and bad input."""

from __future__ import annotations

import json

import pytest
import torch

from medusa_trt.cli import bench as bench_cli
from medusa_trt.runtime.decoding import GenerationConfig, decode
from medusa_trt.runtime.loading import load_backend
from medusa_trt.tools import bench

TEXTS = ("def add(a, b):", "import os", "Hello there")


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return path


def check_report(report: dict, num_prompts: int, depth: int) -> None:
    assert report["num_prompts"] == num_prompts
    for mode in ("plain", "medusa"):
        r = report[mode]
        for key in ("tokens", "steps", "tokens_per_s", "decode_tokens_per_s", "step_ms", "host_overhead_share",
                    "speedup_vs_hf_generate"):
            assert key in r, (mode, key)
        assert r["tokens_per_s"] > 0 and 0 <= r["host_overhead_share"] < 1
    p, m = report["plain"], report["medusa"]
    assert p["steps"] == p["tokens"]  # plain decoding: one token per step
    assert m["tokens_per_step"] == pytest.approx(m["tokens"] / m["steps"], abs=1e-3)
    assert m["speedup"] == pytest.approx(m["tokens_per_s"] / p["tokens_per_s"], rel=1e-2)
    assert m["step_overhead"] == pytest.approx(m["step_ms"] / p["step_ms"], rel=1e-2)
    assert len(m["acceptance_per_head"]) == depth and all(0 <= a <= 1 for a in m["acceptance_per_head"])
    assert m["equal_to_plain"] is True
    hf = report["hf_generate"]
    assert hf["tokens_per_s"] > 0 and hf["equal_to_plain"] == f"{num_prompts}/{num_prompts}"
    assert len(report["per_prompt"]) == num_prompts


def test_bench_on_a_checkpoint(tiny_merged, prompts_file, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = bench_cli.main(["--engine", str(tiny_merged("llama")), "--prompts", str(prompts_file), "--max-new-tokens", "24",
                     "--medusa-choices", "[[0], [0, 0], [1]]", "--json", str(out), "--quiet"])
    assert rc == 0
    report = json.loads(out.read_text())
    check_report(report, len(TEXTS), depth=2)
    assert report["backend"] == "TorchBackend"
    printed = capsys.readouterr().out
    assert "speedup (Medusa / plain, same run)" in printed and "transformers generate" in printed
    m = report["medusa"]
    assert f"decoding alone {m['decode_speedup']:.2f}x" in printed
    assert f"is {m['prefill_s'] / m['wall_s']:.0%} of the Medusa run" in printed


def test_bench_on_an_onnxruntime_engine(ort_engine, prompts_file, tmp_path):
    out = tmp_path / "bench.json"
    rc = bench_cli.main(["--engine", str(ort_engine("llama")), "--prompts", str(prompts_file), "--max-new-tokens", "24",
                     "--limit", "2", "--json", str(out), "--quiet", "--threads", "1"])
    assert rc == 0
    report = json.loads(out.read_text())
    check_report(report, 2, depth=4)
    assert report["threads"] == report["hf_generate"]["threads"] == 1  # the baseline gets the engine's threads
    # The engine records no tree: the report says which one ran (issue 38).
    assert report["backend"] == "OrtBackend" and report["medusa_choices"].startswith("mc_sim_7b_63 cut to the engine")


def test_forward_timer_splits_forward_and_host_time(tiny_merged):
    timer = bench.ForwardTimer(load_backend(tiny_merged("llama")))
    run = bench.timed_decode(timer, [1, 5, 9, 13], GenerationConfig(max_new_tokens=10, use_medusa=False))
    prefill = [dt for commits, dt, _ in timer.calls if commits == 0]
    assert 1 <= len(prefill) <= 2  # forward (+ heads where the backend computes them separately)
    assert len(timer.calls) - len(prefill) >= run.stats.steps  # at least one compute call per step
    assert 0 < run.step_forward_s < run.forward_s <= run.wall_s
    assert run.host_step_s >= 0
    # The wrapper is transparent: same tokens as the bare backend.
    assert run.tokens == decode(timer.backend, [[1, 5, 9, 13]], GenerationConfig(max_new_tokens=10,
                                                                                 use_medusa=False)).tokens[0]


def test_forward_timer_times_the_drafter_calls_apart(ort_engine):
    # The two-call path (sampling takes it) drafts in calls of its own: one per step, inside the
    # step's compute time.
    timer = bench.ForwardTimer(load_backend(ort_engine("llama")))
    cfg = GenerationConfig(max_new_tokens=10, medusa_choices=[[0], [0, 0]], acceptance="sample", seed=0)
    run = bench.timed_decode(timer, [1, 5, 9, 13], cfg)
    drafts = [(commits, dt) for commits, dt, name in timer.calls if name == "draft"]
    assert [c for c, _ in drafts] == list(range(1, run.stats.steps + 2))  # the first drafts after the prefill
    steps = [dt for _, dt in drafts[1:]]
    assert run.draft_s == (sum(steps), run.stats.steps) and 0 < sum(steps) < run.step_forward_s


def test_also_mode_suffixes():
    assert bench.also_mode("dynamic:8") == {"medusa_choices": "dynamic:8", "context_candidates": True, "datastore": True}
    assert bench.also_mode("dynamic:8/no-context/fill") == {"medusa_choices": "dynamic:8", "context_candidates": False,
                                                           "datastore": True, "slot_cost": 0.0}
    assert bench.also_mode("dynamic:8/no-datastore")["datastore"] is False
    assert bench.also_mode("dynamic:8/cost=0.3")["slot_cost"] == 0.3
    for bad, said in (("dynamic:8/wide", "unknown suffix /wide"), ("dynamic:8/cost=x", "/cost=x is not a number"),
                      ("dynamic:8/cost=-1", "expected a finite number >= 0"), ("dynamic:8/cost=inf", ">= 0")):
        with pytest.raises(bench.BenchError, match=said):
            bench.also_mode(bad)


def test_also_takes_tree_file_paths():
    """Only the known suffixes are split off: a tree file's path keeps its slashes."""
    assert bench.also_mode("trees/tuned.json") == {"medusa_choices": "trees/tuned.json", "context_candidates": True,
                                                   "datastore": True}
    assert bench.also_mode("/abs/t.yml/no-context/cost=0.1") == {"medusa_choices": "/abs/t.yml",
                                                                 "context_candidates": False, "datastore": True,
                                                                 "slot_cost": 0.1}
    with pytest.raises(bench.BenchError, match="unknown suffix /wide"):
        bench.also_mode("mc_sim_7b_63/wide/fill")


def test_per_prompt_speedup_is_a_tokens_per_s_ratio(monkeypatch):
    """Plain emits 128 tokens in 1 s, Medusa 12 (it sampled a stop token) in 0.5 s: Medusa is 0.1875x
    as fast per token, not 2x (the ratio of the wall times)."""
    from medusa_trt.runtime.decoding import SequenceStats

    def fake(timer, prompt, cfg):
        n, wall = (12, 0.5) if cfg.use_medusa else (128, 1.0)
        return bench.Run([7] * n, SequenceStats(steps=n, new_tokens=n, decode_s=wall), wall, wall / 2, wall / 3)

    monkeypatch.setattr(bench, "timed_decode", fake)
    out = bench.compare(None, [[1, 2, 3]], [[0]], 128, warmup=False, progress=False)
    row = out["per_prompt"][0]
    assert row["medusa"]["speedup"] == pytest.approx((12 / 0.5) / (128 / 1.0)) == out["medusa"]["speedup"]
    assert row["plain_tokens_per_s"] == 128.0


def test_prompts_need_room_for_their_new_tokens(tiny_merged, tmp_path, capsys, monkeypatch):
    """The decoder's rule (prompt + new tokens <= max_seq_len, whatever the trees: it cuts the last
    steps' trees), checked before any decoding and naming the file and the prompt."""
    from medusa_trt.runtime.loading import load_tokenizer

    ckpt = tiny_merged("llama")
    most = load_backend(ckpt).info.max_seq_len
    text = "hello " * 50
    n = len(load_tokenizer(ckpt).encode(text))
    prompts = tmp_path / "p.txt"
    prompts.write_text(f"a b c\n{text}\n")
    args = ["--engine", str(ckpt), "--prompts", str(prompts), "--no-hf", "--quiet", "--medusa-choices",
            "[[0], [0, 0], [0, 0, 0]]", "--also", "dynamic:32"]
    assert bench_cli.main([*args, "--max-new-tokens", str(most - n + 1)]) == 2
    assert f"{prompts}: prompt 2 has {n} tokens; with --max-new-tokens {most - n + 1} it needs {most + 1} positions, " \
        f"more than the engine's max_seq_len {most}" in capsys.readouterr().err

    def reached(*a, **k):  # the room check passed: the decodes would start here
        raise SystemExit(7)

    monkeypatch.setattr(bench_cli, "compare", reached)
    with pytest.raises(SystemExit, match="7"):
        bench_cli.main([*args, "--max-new-tokens", str(most - n)])


def test_hf_model_dir_follows_engine_and_checkpoint(tiny_merged, ort_engine, tiny_base):
    base = tiny_base("llama").resolve()
    assert bench.hf_model_dir(tiny_merged("llama")) == base
    assert bench.hf_model_dir(ort_engine("llama")) == base


def test_bad_input_exits_2(tiny_merged, prompts_file, tmp_path, capsys):
    ckpt = str(tiny_merged("llama"))
    assert bench_cli.main(["--engine", ckpt, "--prompts", str(tmp_path / "none.txt")]) == 2
    assert "none.txt: file not found" in capsys.readouterr().err
    assert bench_cli.main(["--engine", str(tmp_path / "nope"), "--prompts", str(prompts_file)]) == 2
    assert "--engine directory not found" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "no"}\n')
    assert bench_cli.main(["--engine", ckpt, "--prompts", str(bad)]) == 2
    assert "bad.jsonl:2: expected an object with a string 'text' field" in capsys.readouterr().err
    assert bench_cli.main(["--engine", ckpt, "--prompts", str(prompts_file), "--medusa-choices", "[[0, 0, 0, 0, 0]]",
                       "--no-hf", "--quiet"]) == 2
    assert "depth 5 exceeds" in capsys.readouterr().err
    assert bench_cli.main(["--engine", ckpt, "--prompts", str(prompts_file), "--hf-model", str(tmp_path)]) == 2
    assert "--hf-model has no config.json" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        bench_cli.main(["--engine", ckpt, "--prompts", str(prompts_file), "--hf-model", ckpt, "--no-hf"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_threads_are_restored_after_the_transformers_baseline(tiny_base):
    before = torch.get_num_threads()
    bench.hf_generate(tiny_base("llama"), [[1, 5, 9]], 4, ())
    assert torch.get_num_threads() == before
