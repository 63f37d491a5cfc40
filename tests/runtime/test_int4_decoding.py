"""int4 engines end to end through the runtime: Medusa greedy equals plain greedy on every greedy
path (fused step, two calls, the bound one-call steps), the one-row kernel padding, the cache
written in place, and medusa-check on int4 engines.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from medusa_trt.cli.check import main as check_main
from medusa_trt.engines.ort.build import OrtOptions
from medusa_trt.runtime import ort_backend
from medusa_trt.runtime.decoding import GenerationConfig, decode, prefill
from medusa_trt.runtime.ort_backend import OrtBackend
from tests.engines.ort.test_ort_build import INT4, exact_engine, int4_engine


@pytest.mark.parametrize("attention", [None, "row_exact_f32", "exact weights"])
def test_int4_medusa_greedy_equals_plain(ort_engine, attention):
    """Medusa greedy on an int4 engine == plain greedy on the same engine (fused step and two-call
    path), with the default tree: a chain_f32 engine runs its main chain, row_exact_f32 all of it."""
    if attention == "exact weights":
        backend = OrtBackend(exact_engine(ort_engine))
        attention = None
    else:
        backend = OrtBackend(int4_engine(ort_engine, 4, attention))
    assert backend.info.chains_only == (attention is None)
    prompts = [[5, 9, 17, 33], [3, 4], list(range(20, 40))]
    plain = decode(backend, prompts, GenerationConfig(max_new_tokens=32, use_medusa=False)).tokens
    assert decode(backend, prompts, GenerationConfig(max_new_tokens=32, use_medusa=True)).tokens == plain
    backend.step_session = None
    backend.fused_step_topk = None
    assert decode(backend, prompts, GenerationConfig(max_new_tokens=32, use_medusa=True)).tokens == plain


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
        bound_step, backend.plain_greedy_step = backend.plain_greedy_step, None  # forward + commit instead
        assert decode(backend, [prompt], GenerationConfig(max_new_tokens=24, use_medusa=False)).tokens == plain
        backend.plain_greedy_step = bound_step
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
    logits, _ = prefill(backend, [prompt])
    token = logits.argmax(-1)
    for _ in range(2):  # the second step has no room for a second row
        token = backend.plain_greedy_step(token)
    assert backend.lengths.tolist() == [len(prompt) + 2]
    with pytest.raises(ValueError, match="KV cache overflow"):
        backend.plain_greedy_step(token)


def test_lone_tree_slots_run_as_two_rows_where_the_cpu_has_a_one_row_kernel(ort_engine, monkeypatch):
    """With pad_one_row (forced here), the fused step never runs a lone row either: a one-token
    prompt's prefill and a row_exact_f32 tree cut to its root at a key-block edge go in as two rows,
    the second never accepted, and Medusa greedy stays equal to plain greedy."""
    monkeypatch.setattr(ort_backend, "one_row_kernel_differs", lambda block_size, level: True)
    for attention, prompt in ((None, [17]), ("row_exact_f32", list(range(3, 123)))):
        backend = OrtBackend(int4_engine(ort_engine, 4, attention))
        rows = []
        run = backend._run_in_place

        def spy(name, feeds, outputs, run=run, rows=rows):
            rows.append(feeds["input_ids"].shape)
            return run(name, feeds, outputs)

        backend._run_in_place = spy
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


def test_tree_cut_at_the_key_block_keeps_medusa_equal_to_plain(ort_engine):
    """A branching tree on a row_exact_f32 engine is cut where its slots would cross a key block
    (runtime/decoding.py: StepTree.within_block). With a block of 8 the cut runs every few steps: the
    cut trees verify and draft right on both greedy paths (fused step, two-call) at batch 1."""
    from dataclasses import replace

    backend = OrtBackend(int4_engine(ort_engine, 4, "row_exact_f32"))
    backend.info = replace(backend.info, key_block=8)
    tree = [[0], [1], [0, 0], [1, 0], [0, 1], [0, 0, 0]]
    for prompt in ([5, 9, 17, 33], list(range(20, 39))):
        plain = decode(backend, [prompt], GenerationConfig(max_new_tokens=40, use_medusa=False))
        medusa = decode(backend, [prompt], GenerationConfig(max_new_tokens=40, use_medusa=True, medusa_choices=tree))
        assert medusa.tokens == plain.tokens
        steps = medusa.stats[0].steps
        assert medusa.stats[0].draft_tokens < steps * len(tree)  # some steps verified a cut tree
        saved = backend.step_session, backend.fused_step_topk
        backend.step_session, backend.fused_step_topk = None, None
        try:
            two_call = decode(backend, [prompt], GenerationConfig(max_new_tokens=40, use_medusa=True, medusa_choices=tree))
        finally:
            backend.step_session, backend.fused_step_topk = saved
        assert two_call.tokens == plain.tokens


def test_plain_greedy_step_equals_forward_and_commit(ort_engine):
    """OrtBackend.plain_greedy_step (in-place engines: one bound call per plain greedy step) leaves
    the cache, the lengths and the next tokens bit for bit where forward + commit + argmax leave
    them: on a ragged batch, mixed with those calls (which replace the lengths it writes), across
    keep (a new cache) and when the capacity runs out (forward's error)."""
    from medusa_trt.runtime.decoding import argmax

    lean, plain = OrtBackend(int4_engine(ort_engine, 4)), OrtBackend(int4_engine(ort_engine, 4))
    assert lean.plain_greedy_step is not None
    assert OrtBackend(ort_engine("llama", backend_options=OrtOptions(**INT4, int4_accuracy_level=4, cache_in_place=False))
                      ).plain_greedy_step is None
    plain.plain_greedy_step = None  # an instance attribute hides the property: forward + commit

    def generic(backend, tokens):
        b = len(tokens)
        logits, _ = backend.forward(tokens[:, None], backend.lengths[:, None], torch.ones(b, 1, 1, dtype=torch.bool),
                                    torch.zeros(b, 1, dtype=torch.long), with_heads=False)
        backend.commit(torch.zeros(b, 1, dtype=torch.long), torch.ones(b, dtype=torch.long))
        return argmax(logits[:, 0])

    prompts = [[5, 9, 17, 33, 2, 8], [3, 4]]
    roots = []
    for backend in (lean, plain):
        backend.start(2, 20)
        logits, _ = prefill(backend, prompts, heads=False)
        roots.append(argmax(logits))
    steps = ["lean"] * 3 + ["generic"] * 2 + ["lean"] * 2 + ["keep"] + ["lean"] * 3
    for what in steps:
        if what == "keep":
            for i, backend in enumerate((lean, plain)):
                backend.keep(torch.tensor([1]))
                roots[i] = roots[i][[1]]
            continue
        step = lean.plain_greedy_step if what == "lean" else lambda t: generic(lean, t)
        roots = [step(roots[0]), generic(plain, roots[1])]
        assert roots[0].tolist() == roots[1].tolist()
        assert lean.lengths.tolist() == plain.lengths.tolist()
        torch.testing.assert_close(lean.keys, plain.keys, rtol=0, atol=0)
        torch.testing.assert_close(lean.values, plain.values, rtol=0, atol=0)
    assert lean.lengths.tolist() == [len(prompts[1]) + 10]
    for _ in range(20 - len(prompts[1]) - 10):
        roots[0] = lean.plain_greedy_step(roots[0])
    with pytest.raises(ValueError, match="KV cache overflow"):
        lean.plain_greedy_step(roots[0])


@pytest.mark.parametrize("attention", [None, "row_exact_f32"])
def test_greedy_tree_step_equals_fused_step_and_commit(ort_engine, attention):
    """OrtBackend.greedy_tree_step (in-place engines: one bound call per greedy Medusa step) leaves
    the cache, the lengths and the outputs bit for bit where fused_step + the commit of each
    accepted path leave them: a chain (chain_f32) and a branching tree whose accepted path is not
    the first (row_exact_f32: the commit moves slots), on a ragged batch, mixed with plain steps
    (which replace the lengths it writes), across keep and when the capacity runs out."""
    from medusa_trt.runtime.decoding import StepTree, _fused_tree_step
    from medusa_trt.tree import build_tree

    engine = int4_engine(ort_engine, 4, attention)
    lean, generic = OrtBackend(engine), OrtBackend(engine)
    assert lean.greedy_tree_step is not None
    generic.greedy_tree_step = None  # fused_step, then commit
    choices = [[0], [0, 0], [0, 0, 0]] if attention is None else [[0], [1], [0, 0], [1, 0], [1, 1]]
    tree = StepTree.of(build_tree(choices, lean.num_medusa_heads, chains_only=attention is None), lean.vocab_size)
    assert tree.is_chain == (attention is None)
    # The path the test makes greedy: the chain, or root -> second child -> its second child.
    path = max(tree.paths, key=lambda p: (len(set(p)), p))
    prompts = [[5, 9, 17, 33, 2, 8], [3, 4]]
    follow = [decode(lean, [p], GenerationConfig(max_new_tokens=40, use_medusa=False)).tokens[0] for p in prompts]
    for backend in (lean, generic):
        backend.start(2, 40)
        prefill(backend, prompts, heads=False)
    produced = [0, 0]
    rng = torch.Generator().manual_seed(0)
    steps = ["tree"] * 3 + ["plain"] + ["tree"] * 2 + ["keep"] + ["tree"] * 2
    rows = [0, 1]
    for what in steps:
        if what == "keep":
            for backend in (lean, generic):
                backend.keep(torch.tensor([1]))
            rows = [1]
            continue
        if what == "plain":
            roots = torch.tensor([follow[r][produced[r]] for r in rows])
            assert lean.plain_greedy_step(roots).tolist() == generic.plain_greedy_step(roots).tolist()
            produced = [n + (r in rows) for r, n in enumerate(produced)]
            continue
        tokens = torch.randint(100, 200, (len(rows), tree.num_slots + 2), generator=rng)
        for i, r in enumerate(rows):  # the root, and the greedy continuation along `path`
            for depth, slot in enumerate(path):
                tokens[i, slot] = follow[r][produced[r] + depth]
        got = [_fused_tree_step(backend, tree, tokens) for backend in (lean, generic)]
        (emitted, accepted, next_tokens), want = got
        assert emitted == want[0] and accepted.tolist() == want[1].tolist() == [len(path) - 1] * len(rows)
        assert torch.equal(next_tokens, want[2])
        assert lean.lengths.tolist() == generic.lengths.tolist()
        torch.testing.assert_close(lean.keys, generic.keys, rtol=0, atol=0)
        torch.testing.assert_close(lean.values, generic.values, rtol=0, atol=0)
        produced = [n + len(path) * (r in rows) for r, n in enumerate(produced)]
    tokens = torch.zeros(1, tree.num_slots, dtype=torch.long)
    while int(lean.lengths[0]) + tree.num_slots <= lean.keys.shape[3]:
        lean.greedy_tree_step(tokens, tree)
    with pytest.raises(ValueError, match="KV cache overflow"):
        lean.greedy_tree_step(tokens, tree)


def test_onnx_runtime_writes_the_bound_cache_in_place(ort_engine, capfd, monkeypatch):
    """The point of the in-place engine: ONNX Runtime's TensorScatter writes into the bound cache
    rather than copying it, which it reports (a warning) when it cannot. The same graph run through
    session.run, with fresh output buffers, shows that warning: the check can fail."""
    import medusa_trt.runtime.ort_backend as ort_backend

    options = ort_backend.session_options
    monkeypatch.setattr(ort_backend, "session_options", lambda *a, **k: _with_warnings(options(*a, **k)))
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


@pytest.mark.parametrize("exact", [False, True])
def test_medusa_check_int4(ort_engine, tmp_path, exact):
    report = tmp_path / "r.json"
    engine = exact_engine(ort_engine) if exact else int4_engine(ort_engine, 4)
    assert check_main(["--engine", str(engine), "--json", str(report),
                       "--max-new-tokens", "12", "--tree-steps", "2"]) == 0
    assert json.loads(report.read_text())["passed"]


def test_medusa_check_int4_catches_wrong_weights(ort_engine, tmp_path):
    """int4 parity is held to a noise bound, not the float32 tolerance (tools/parity.py): packed
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


def test_decode_with_large_capacity_equals_small(ort_engine):
    backend = OrtBackend(ort_engine("llama"))
    prompts = [[5, 9, 17, 33], [3, 4]]
    cfg = GenerationConfig(max_new_tokens=16)
    small = decode(backend, prompts, cfg).tokens
    start = backend.start
    backend.start = lambda batch, capacity: start(batch, capacity + 300)
    assert decode(backend, prompts, cfg).tokens == small
