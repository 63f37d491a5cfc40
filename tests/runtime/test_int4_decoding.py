"""int4 engines end to end through the runtime: Medusa greedy equals plain greedy on every greedy
path (fused step, two calls), the one-row kernel padding, the cache
written in place, and medusa-check on int4 engines.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from medusa_trt.cli.check import main as check_main
from medusa_trt.runtime.decoding import GenerationConfig, decode
from medusa_trt.runtime.ort import backend as ort_backend
from medusa_trt.runtime.ort.backend import OrtBackend
from medusa_trt.runtime.ort.cache import InPlaceCache
from medusa_trt.runtime.steps import prefill
from tests.engines.ort.test_ort_build import INT4, exact_engine, int4_engine


@pytest.fixture(scope="module")
def distilled_int4(distilled, tmp_path_factory):
    """A row_exact_f32 int4 engine with heads that predict (tests/conftest.py: distilled): random heads
    get almost no draft accepted, so Medusa == plain on them barely runs the commit of accepted rows
    (the in-place cache moves, cut trees' accepted paths)."""
    from medusa_trt.engines.build import build_engine
    from medusa_trt.engines.options import BuildOptions
    from medusa_trt.engines.ort.build import OrtOptions

    out = tmp_path_factory.mktemp("distilled-int4") / "engine"
    build_engine(BuildOptions(checkpoint=distilled("llama").ckpt, out=out, progress=False, attention="row_exact_f32",
                              backend_options=OrtOptions(**INT4, int4_accuracy_level=4)))
    return out


@pytest.mark.parametrize("case", [None, "row_exact_f32", "exact weights", "distilled heads"])
def test_int4_medusa_greedy_equals_plain(ort_engine, case, request):
    """Medusa greedy on an int4 engine == plain greedy on the same engine (fused step and two-call
    path), with the default tree: a chain_f32 engine runs its main chain, row_exact_f32 all of it.
    With heads that predict, drafts are accepted and committed on both paths."""
    predicting_heads = case == "distilled heads"
    if case == "exact weights":
        backend, attention = OrtBackend(exact_engine(ort_engine)), None
    elif predicting_heads:
        backend, attention = OrtBackend(request.getfixturevalue("distilled_int4")), "row_exact_f32"
    else:
        backend, attention = OrtBackend(int4_engine(ort_engine, 4, case)), case
    assert backend.info.chains_only == (attention is None)
    prompts = [[5, 9, 17, 33], [3, 4], list(range(20, 40))]
    plain = decode(backend, prompts, GenerationConfig(max_new_tokens=32, use_medusa=False)).tokens
    fused = decode(backend, prompts, GenerationConfig(max_new_tokens=32, use_medusa=True))
    assert fused.tokens == plain
    backend.step_session = None
    backend.fused_step_topk = None
    two_call = decode(backend, prompts, GenerationConfig(max_new_tokens=32, use_medusa=True))
    assert two_call.tokens == plain
    if predicting_heads:
        assert all(sum(s.accepted_draft_tokens for s in r.stats) > 10 for r in (fused, two_call))


def test_one_token_steps_run_as_two_rows_where_the_cpu_has_a_one_row_kernel(ort_engine, monkeypatch):
    """Where MatMulNBits computes a lone row on a kernel of its own (forced here, whatever this CPU
    does), a batch-1 one-token step of an int4 engine runs as two rows: the one-call greedy step and
    forward + commit give the same next tokens, Medusa greedy equals plain greedy at batch 1, a
    forward returns the first row's logits and heads, and a step with no room left for the throwaway
    row runs as one row rather than failing."""
    monkeypatch.setattr(ort_backend, "one_row_kernel_differs", lambda block_size, level: True)
    backend = OrtBackend(int4_engine(ort_engine, 4))
    assert backend.pad_one_row
    assert not OrtBackend(ort_engine("llama")).pad_one_row  # float weights: no MatMulNBits
    for prompt in ([5, 9, 17, 33], list(range(20, 40))):
        plain = decode(backend, [prompt], GenerationConfig(max_new_tokens=24, use_medusa=False)).tokens
        assert decode(backend, [prompt], GenerationConfig(max_new_tokens=24, medusa_choices=[[0], [0, 0]])).tokens == plain
    # A one-token forward with heads: one row of logits and of each head's logits, the first row's
    # (the throwaway row's differ), as an unpadded backend computes them up to the kernels' rounding.
    unpadded = OrtBackend(int4_engine(ort_engine, 4))
    unpadded.pad_one_row = False
    got = []
    for b in (backend, unpadded):
        b.start(1, 8)
        prefill(b, [[5, 9, 17]])
        got.append(b.forward(torch.tensor([[33]]), b.lengths[:, None], torch.ones(1, 1, 1, dtype=torch.bool)))
    (logits, medusa), (want_logits, want_medusa) = got
    assert logits.shape == want_logits.shape == (1, 1, backend.vocab_size)
    assert medusa.shape == want_medusa.shape == (backend.num_medusa_heads, 1, 1, backend.vocab_size)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-4)
    torch.testing.assert_close(medusa, want_medusa, rtol=0, atol=1e-4)
    prompt = [5, 9, 17, 33]
    backend.start(1, len(prompt) + 2)
    logits, _, _ = prefill(backend, [prompt])
    token = logits.argmax(-1)
    one = torch.ones(1, 1, 1, dtype=torch.bool)
    for _ in range(2):  # the second step has no room for a second row
        logits, _ = backend.forward(token[:, None], backend.lengths[:, None], one, with_heads=False)
        backend.commit(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long))
        token = logits[:, 0].argmax(-1)
    assert backend.lengths.tolist() == [len(prompt) + 2]
    with pytest.raises(ValueError, match="KV cache overflow"):
        backend.forward(token[:, None], backend.lengths[:, None], one, with_heads=False)


def test_lone_tree_slots_run_as_two_rows_where_the_cpu_has_a_one_row_kernel(ort_engine, monkeypatch):
    """With pad_one_row (forced here), the fused step never runs a lone row either: a one-token
    prompt's prefill and a row_exact_f32 tree cut to its root at a key-block edge go in as two rows,
    the second never accepted, and Medusa greedy stays equal to plain greedy."""
    monkeypatch.setattr(ort_backend, "one_row_kernel_differs", lambda block_size, level: True)
    for attention, prompt in ((None, [17]), ("row_exact_f32", list(range(3, 123)))):
        backend = OrtBackend(int4_engine(ort_engine, 4, attention))
        rows = []
        run = InPlaceCache.run

        def spy(cache, session, feeds, outputs, run=run, rows=rows):
            rows.append(feeds["input_ids"].shape)
            return run(cache, session, feeds, outputs)

        monkeypatch.setattr(InPlaceCache, "run", spy)
        plain = decode(backend, [prompt], GenerationConfig(max_new_tokens=12, use_medusa=False)).tokens
        rows.clear()
        medusa = decode(backend, [prompt], GenerationConfig(max_new_tokens=12, medusa_choices=[[0], [1], [0, 0]]))
        assert medusa.tokens == plain
        assert rows and all(r[1] >= 2 for r in rows)
        if attention:  # lengths 123.. cross key 128: some step is cut to its root (and padded)
            assert backend.info.key_block == 128 and rows.count((1, 2)) >= 1


def test_chain_engine_runs_a_branching_tree_as_its_main_chain(ort_engine, caplog):
    """A chain_f32 engine (engine.json onnx.chains_only) verifies only a tree's main chain, says so
    once, and its Medusa greedy equals its plain greedy on both greedy paths."""
    backend = OrtBackend(int4_engine(ort_engine, 4))
    tree = [[0], [1], [0, 0], [1, 0], [0, 1], [0, 0, 0]]
    prompt = list(range(20, 39))
    plain = decode(backend, [prompt], GenerationConfig(max_new_tokens=40, use_medusa=False))
    with caplog.at_level("WARNING", logger="medusa_trt.tree"):
        medusa = decode(backend, [prompt], GenerationConfig(max_new_tokens=40, use_medusa=True, medusa_choices=tree))
    assert medusa.tokens == plain.tokens
    assert medusa.stats[0].draft_tokens == 3 * medusa.stats[0].steps  # [0], [0, 0], [0, 0, 0]
    assert "runs as its main chain [[0], [0, 0], [0, 0, 0]]" in caplog.text
    backend.step_session, backend.fused_step_topk = None, None
    two_call = decode(backend, [prompt], GenerationConfig(max_new_tokens=40, use_medusa=True, medusa_choices=tree))
    assert two_call.tokens == plain.tokens


def test_tree_cut_at_the_key_block_keeps_medusa_equal_to_plain(distilled_int4):
    """A branching tree on a row_exact_f32 engine is cut where its slots would cross a key block
    (runtime/decoding.py: StepTree.within_block). With a block of 8 the cut runs every few steps: the
    cut trees verify, accept and draft right on both greedy paths (fused step, two-call) at batch 1."""
    from dataclasses import replace

    backend = OrtBackend(distilled_int4)
    backend.info = replace(backend.info, key_block=8)
    tree = [[0], [1], [0, 0], [1, 0], [0, 1], [0, 0, 0]]
    for prompt in ([5, 9, 17, 33], list(range(20, 39))):
        plain = decode(backend, [prompt], GenerationConfig(max_new_tokens=40, use_medusa=False))
        medusa = decode(backend, [prompt], GenerationConfig(max_new_tokens=40, use_medusa=True, medusa_choices=tree))
        assert medusa.tokens == plain.tokens
        steps = medusa.stats[0].steps
        assert medusa.stats[0].draft_tokens < steps * len(tree)  # some steps verified a cut tree
        assert medusa.stats[0].accepted_draft_tokens > 0
        saved = backend.step_session, backend.fused_step_topk
        backend.step_session, backend.fused_step_topk = None, None
        try:
            two_call = decode(backend, [prompt], GenerationConfig(max_new_tokens=40, use_medusa=True, medusa_choices=tree))
        finally:
            backend.step_session, backend.fused_step_topk = saved
        assert two_call.tokens == plain.tokens


@pytest.mark.parametrize("attention", [None, "row_exact_f32"])
def test_int4_per_step_trees_equal_plain(ort_engine, attention):
    """dynamic:N on int4 engines: a chain_f32 engine verifies one chain per step (the drafter's or the
    context's, as long as it pays), a row_exact_f32 engine whole trees cut at its key blocks (8 here,
    so cuts run often); ragged batch, a prompt that repeats itself, fused step and two-call path."""
    from dataclasses import replace

    backend = OrtBackend(int4_engine(ort_engine, 4, attention))
    if attention:
        backend.info = replace(backend.info, key_block=8)
    prompts = [[5, 9, 17, 33], [7, 8, 9, 10] * 5, list(range(20, 39))]
    plain = decode(backend, prompts, GenerationConfig(max_new_tokens=32, use_medusa=False)).tokens
    cfg = GenerationConfig(max_new_tokens=32, medusa_choices="dynamic:6")
    fused = decode(backend, prompts, cfg)
    assert fused.tokens == plain
    assert sum(s.accepted_draft_tokens for s in fused.stats) > 0
    backend.step_session, backend.fused_step_topk = None, None
    assert decode(backend, prompts, cfg).tokens == plain


def test_onnx_runtime_writes_the_bound_cache_in_place(ort_engine, capfd, monkeypatch):
    """The point of the in-place engine: ONNX Runtime's TensorScatter writes into the bound cache
    rather than copying it, which it reports (a warning) when it cannot. The same graph run through
    session.run, with fresh output buffers, shows that warning: the check can fail."""
    import medusa_trt.runtime.ort.session as ort_session

    options = ort_session.session_options
    monkeypatch.setattr(ort_session, "session_options", lambda *a, **k: _with_warnings(options(*a, **k)))
    backend = OrtBackend(int4_engine(ort_engine, 4))
    capfd.readouterr()
    decode(backend, [[5, 9, 17, 33]], GenerationConfig(max_new_tokens=6, use_medusa=False))
    decode(backend, [[5, 9, 17, 33]], GenerationConfig(max_new_tokens=6, use_medusa=True))
    assert backend.open_session_names == {"session", "step_session"}
    assert "in-place optimization not activated" not in capfd.readouterr().err
    feeds = {i.name: np.zeros([d if isinstance(d, int) else 1 for d in i.shape], dtype=np.int64 if "int64" in i.type
                              else np.bool_ if "bool" in i.type else np.float32) for i in backend.session.get_inputs()}
    backend.session.run(None, feeds)
    assert "in-place optimization not activated" in capfd.readouterr().err


def _with_warnings(options):
    options.log_severity_level = 1  # ONNX Runtime reports a TensorScatter that copies at warning level
    return options


def test_compact_in_place_moves_accepted_slots():
    """The commit of an in-place cache: each sequence's accepted slots move to its length + 0..count-1
    (sources read before any is overwritten); slots already in place stay untouched."""
    from medusa_trt.runtime.backend import compact_in_place

    keys = torch.arange(2 * 1 * 8, dtype=torch.float32).reshape(1, 2, 1, 8, 1).repeat(1, 1, 1, 1, 2)
    values = -keys.clone()
    before = keys.clone()
    lengths = torch.tensor([2, 1])
    slots = torch.tensor([[0, 2, 3], [0, 1, 3]])  # sequence 0 keeps slots 0, 2, 3; sequence 1 slots 0, 1
    new = compact_in_place(keys, values, lengths, slots, torch.tensor([3, 2]))
    assert new.tolist() == [5, 3]
    assert keys[0, 0, 0, :, 0].tolist() == [0, 1, 2, 4, 5, 5, 6, 7]  # positions 3, 4 <- 4, 5
    assert torch.equal(keys[0, 1], before[0, 1])  # slots 0, 1 were in place
    assert torch.equal(values, -keys)


@pytest.mark.parametrize("kind", ["level 4", "exact", "level 0"])
def test_medusa_check_int4(ort_engine, tmp_path, kind):
    """Level 4 rounds activations to int8 and is held to the int4 noise bound; level 0 multiplies
    float activations by the reference's own dequantized weights and is held to the float32 rule."""
    report = tmp_path / "r.json"
    engine = {"level 4": lambda: int4_engine(ort_engine, 4), "exact": lambda: exact_engine(ort_engine),
              "level 0": lambda: int4_engine(ort_engine, 0)}[kind]()
    assert check_main(["--engine", str(engine), "--json", str(report),
                       "--max-new-tokens", "12", "--tree-steps", "2"]) == 0
    result = json.loads(report.read_text())
    assert result["passed"]
    assert ("int8" in result["rule"]) == (kind != "level 0"), result["rule"]


def test_medusa_check_int4_catches_wrong_weights(ort_engine, tmp_path):
    """int4 parity is held to a noise bound, not the float32 tolerance (tools/parity_rules.py): packed
    weights of one matrix off by a few quantization steps must still fail it."""
    import shutil

    import onnx

    from medusa_trt.engine_dir import artifact_checksums

    engine = tmp_path / "engine"
    shutil.copytree(int4_engine(ort_engine, 4), engine)
    model = onnx.load(engine / "model.onnx", load_external_data=False)
    packed = [t for t in model.graph.initializer if t.data_type == onnx.TensorProto.UINT8]
    target = max(packed, key=lambda t: np.prod(t.dims))  # the lm_head's packed int4 weights
    info = {e.key: int(e.value) for e in target.external_data if e.key in ("offset", "length")}
    data = np.fromfile(engine / "weights.bin", dtype=np.uint8)
    region = data[info["offset"]:info["offset"] + info["length"]]
    region[: region.size // 2] ^= 0x33  # flips two bits of every nibble in half the matrix
    data.tofile(engine / "weights.bin")
    meta = json.loads((engine / "engine.json").read_text())
    meta["artifacts"] = artifact_checksums(engine)  # a deliberate edit: parity itself must catch it
    (engine / "engine.json").write_text(json.dumps(meta))
    report = tmp_path / "r.json"
    assert check_main(["--engine", str(engine), "--json", str(report), "--max-new-tokens", "12",
                       "--tree-steps", "2"]) == 1
    rows = json.loads(report.read_text())["rows"]
    assert any(not r["passed"] and r["output"] == "logits" for r in rows)


def test_medusa_check_int4_catches_one_broken_decoder_matrix(ort_engine, tmp_path, capsys):
    """The int4 rule is strict enough for a subtler fault than a broken lm_head: one decoder layer's
    MLP weights shifted by one quantization step each fails it, and the printed rule is the rule applied."""
    import shutil

    import onnx

    from medusa_trt.engine_dir import artifact_checksums

    engine = tmp_path / "engine"
    shutil.copytree(int4_engine(ort_engine, 4), engine)
    model = onnx.load(engine / "model.onnx", load_external_data=False)
    # layer 0's MLP down projection (TensorRT-LLM names: mlp.proj), its packed 4-bit weights
    target = next(t for t in model.graph.initializer if t.name == "model.layers.0.proj.packed")
    info = {e.key: int(e.value) for e in target.external_data if e.key in ("offset", "length")}
    data = np.fromfile(engine / "weights.bin", dtype=np.uint8)
    region = data[info["offset"]:info["offset"] + info["length"]]
    region[:] = (region & 0xF0) | ((region & 0x0F) ^ 0x01)  # the low nibble of every byte one step off
    data.tofile(engine / "weights.bin")
    meta = json.loads((engine / "engine.json").read_text())
    meta["artifacts"] = artifact_checksums(engine)
    (engine / "engine.json").write_text(json.dumps(meta))
    report = tmp_path / "r.json"
    capsys.readouterr()
    assert check_main(["--engine", str(engine), "--json", str(report), "--max-new-tokens", "12",
                       "--tree-steps", "2", "--quiet"]) == 1
    out = capsys.readouterr().out
    result = json.loads(report.read_text())
    assert any(not r["passed"] and r["output"] == "logits" for r in result["rows"])
    for r in result["rows"]:
        if r["output"] not in ("tokens", "accepted path"):
            p90, bound = r["rule"].split(" and ")
            assert float(p90.split()[-1]) == r["tolerance"] and r["rule"] in out
            assert r["passed"] == (r["p90_abs_diff"] <= r["tolerance"] and r["max_abs_diff"] <= float(bound.split()[-1]))


def test_decode_with_large_capacity_equals_small(ort_engine):
    backend = OrtBackend(ort_engine("llama"))
    prompts = [[5, 9, 17, 33], [3, 4]]
    cfg = GenerationConfig(max_new_tokens=16)
    small = decode(backend, prompts, cfg).tokens
    start = backend.start
    backend.start = lambda batch, capacity: start(batch, capacity + 300)
    assert decode(backend, prompts, cfg).tokens == small
