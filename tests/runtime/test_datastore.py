"""The datastore (medusa_trt/datastore.py): its lookup against a brute-force search, its calibration and
file, the sources medusa-build reads, and decoding with it (greedy unchanged, more tokens a step)."""

from __future__ import annotations

import json
import random
from collections import Counter

import numpy as np
import pytest

from medusa_trt import datastore, drafter_corpus
from medusa_trt.cli import build as build_cli
from medusa_trt.cli import run as run_cli
from medusa_trt.errors import MedusaTrtError
from medusa_trt.runtime.decoding import GenerationConfig, decode
from medusa_trt.runtime.loading import load_backend, load_tokenizer
from tests.runtime.test_decoding import EOS, oracle, prompts

VOCAB = 256  # tests/synthetic.py: make_base's vocabulary


def _brute(sequences: list[list[int]], history: list[int], depth: int) -> tuple[int, list[int]]:
    """The longest suffix match (<= WINDOW) and, for at most MAX_OCCURRENCES occurrences, the chain
    of majority next tokens (ties to the smallest token, a sequence's end losing them all)."""
    match, occ = 0, []
    for n in range(1, min(datastore.WINDOW, len(history)) + 1):
        found = [(s, i + n) for s, seq in enumerate(sequences) for i in range(len(seq) - n + 1)
                 if seq[i:i + n] == history[-n:]]
        if not found:
            break
        match, occ = n, found
    if match < datastore.MIN_MATCH or len(occ) > datastore.MAX_OCCURRENCES:
        return match, None
    chain = []
    for d in range(depth):
        nxt = [sequences[s][p + d] if p + d < len(sequences[s]) else -1 for s, p in occ]
        if not nxt:
            break
        counts = Counter(nxt)
        best = min(counts, key=lambda t: (-counts[t], t))
        if best == -1:
            break
        chain.append(best)
        occ = [o for o, t in zip(occ, nxt, strict=True) if t == best]
    return match, chain


@pytest.mark.parametrize("seed", range(3))
def test_a_lookup_finds_the_longest_match_and_the_majority_chain(seed):
    rng = random.Random(seed)
    sequences = [[rng.randint(0, 5) for _ in range(rng.randint(1, 40))] for _ in range(60)]
    store = datastore.build(sequences)  # fewer than 2 x CALIBRATION_EVERY: every sequence is indexed
    assert store.calibration is None and len(store) == sum(map(len, sequences))
    for _ in range(200):
        history = [rng.randint(0, 5) for _ in range(rng.randint(1, 20))]
        found = store.chain(history, 5)
        match, chain = _brute(sequences, history, 5)
        assert found.match == match
        if chain is not None:
            assert found.tokens == chain
            assert all(0 < a <= 1 for a in found.agreement)
        if match < datastore.MIN_MATCH:
            assert found.tokens == []


def test_a_match_with_more_occurrences_than_it_reads_follows_a_spread_of_them():
    """Past MAX_OCCURRENCES occurrences a lookup reads that many, spread evenly over the match's
    range (the branch the brute-force test above leaves out): the chain is still the majority's, its
    agreement that of the whole (75% of 200 occurrences continue one way, in random contexts)."""
    rng = random.Random(5)
    phrase, usual, rare = [7, 8, 9], [40, 41, 42], [50, 51, 52]
    sequences = [[rng.randrange(100, 200) for _ in range(6)] + phrase + (usual if i % 4 else rare) for i in range(200)]
    store = datastore.build(sequences)
    assert 200 > datastore.MAX_OCCURRENCES
    found = store.chain([3, *phrase], 3)
    assert found.match == len(phrase) and found.tokens == usual
    assert found.agreement[0] == pytest.approx(0.75, abs=0.1) and found.agreement[1:] == [1.0, 1.0]


def test_calibration_scores_long_agreeing_matches_higher(tmp_path):
    rng = random.Random(1)
    phrases = [[rng.randrange(100, 200) for _ in range(24)] for _ in range(5)]
    # Sequences of noise with set phrases in them: a long match inside a phrase continues it.
    sequences = [[rng.randrange(200, 5000) for _ in range(8)] + rng.choice(phrases) + [rng.randrange(200, 5000) for _ in range(8)]
                 for _ in range(300)]
    store = datastore.build(sequences)
    assert store.calibration is not None
    assert store.calibration.shape == (len(datastore.MATCH_BUCKETS), datastore.AGREEMENT_BINS, datastore.DEPTHS)
    assert store.sequences == 300 - 300 // datastore.CALIBRATION_EVERY  # the held-aside ones are not indexed
    inside = store.chain(phrases[0][:14], 8)
    assert inside.match == 14 and inside.tokens == phrases[0][14:22]
    scores = store.scores(inside)
    assert scores == sorted(scores, reverse=True) and scores[0] > np.log(0.8)
    ending = store.chain(phrases[1][-14:], 4)  # noise follows a phrase: its occurrences disagree
    assert ending.match == 14 and ending.agreement[0] < 0.2 and store.scores(ending)[0] < np.log(0.2)

    path = tmp_path / datastore.FILE
    datastore.save(store, path, source="test")
    back = datastore.load(path)
    # Mapped, not read: processes serving one engine share its pages.
    assert all(isinstance(a.base, np.memmap) for a in (back.tokens, back.order, back.starts))
    assert np.array_equal(back.tokens, store.tokens) and np.array_equal(back.order, store.order)
    assert np.array_equal(back.starts, store.starts)
    assert np.array_equal(back.calibration, store.calibration) and back.sequences == store.sequences
    assert back.chain(phrases[0][:14], 8) == inside
    # A compressed file, or one without the starts table (written before it), is read as before.
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files if k != "starts"}
    np.savez_compressed(path, **arrays)
    again = datastore.load(path)
    assert not isinstance(again.tokens.base, np.memmap) and np.array_equal(again.starts, store.starts)
    assert again.chain(phrases[0][:14], 8) == inside


def test_a_file_that_is_not_a_datastore_is_one_line(tmp_path):
    bad = tmp_path / datastore.FILE
    bad.write_bytes(b"not a zip")
    with pytest.raises(datastore.DatastoreError, match=r"datastore.npz: not a datastore .*expected datastore.npz"):
        datastore.load(bad)
    np.savez(bad, tokens=np.zeros(3, np.int32), order=np.zeros(2, np.int32), meta=np.array(json.dumps({"window": 16, "sequences": 1})))
    with pytest.raises(datastore.DatastoreError, match="3 tokens and 2 order entries"):
        datastore.load(bad)
    np.savez(bad, tokens=np.zeros(3, np.int32), order=np.zeros(3, np.int32), meta=np.array(json.dumps([16])))
    with pytest.raises(datastore.DatastoreError, match=r"not a datastore \(meta is a list, not an object\)"):
        datastore.load(bad)


@pytest.mark.parametrize("length", range(1, 10))
def test_a_stream_shorter_than_the_window_is_indexed(length):
    # The prefix doubling once failed on streams of 3, 5, 6 or 7 tokens (a separator included).
    sequences = [list(range(1, length))]  # and its separator: `length` tokens in the stream
    store = datastore.build(sequences)
    assert len(store) == length - 1
    for n in range(1, length):
        assert store.chain(sequences[0][:n], 4).match == min(n, datastore.WINDOW)


def test_sources_leave_held_out_text_out_and_refuse_bad_input(tmp_path, tiny_base):
    corpus = tmp_path / "corpus"
    writer = drafter_corpus.Writer(corpus, {"decoder": "test"})
    writer.add([1, 2], "eval", [50, 51, 52])
    writer.add([3, 4], "first", [60, 61, 62])
    writer.add([5, 6], "later", [70, 71])
    writer.close()
    assert sorted(datastore.read_source(corpus, tiny_base("llama"), VOCAB)) == [[60, 61, 62], [70, 71]]

    lines = tmp_path / "text.jsonl"
    lines.write_text(json.dumps({"text": "hello world"}) + "\n\n" + json.dumps({"text": "again"}) + "\n")
    tok = load_tokenizer(tiny_base("llama"))  # tokenizer.json alone tokenizes as the runtime's tokenizer does
    assert datastore.read_source(lines, tiny_base("llama"), VOCAB) == [tok.encode(t, add_special_tokens=False)
                                                                for t in ("hello world", "again")]
    for body, message in [('{"text": "ok"}\n[1, 2]\n', "text.jsonl:2: expected an object with a string 'text' field"),
                          ('{"text": 7}\n', "text.jsonl:1: expected an object with a string 'text' field"),
                          ("\n", r"text.jsonl: no texts \(expected at least one non-empty line\)")]:
        lines.write_text(body)
        with pytest.raises(MedusaTrtError, match=message):
            datastore.read_source(lines, tiny_base("llama"), VOCAB)
    lines.write_text('{"text": "ok"}\n')
    with pytest.raises(datastore.DatastoreError, match="cannot read the tokenizer .*expected the checkpoint's tokenizer.json"):
        datastore.read_source(lines, tmp_path, VOCAB)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(datastore.DatastoreError, match="empty: 0 tokens in its 0 parts; expected at least 3"):
        datastore.read_source(empty, tiny_base("llama"), VOCAB)
    with pytest.raises(datastore.DatastoreError, match="nothing: no such file or directory; expected a directory"):
        datastore.read_source(tmp_path / "nothing", tiny_base("llama"), VOCAB)
    (tmp_path / "text.txt").write_text("one text\nanother\n")
    assert len(datastore.read_source(tmp_path / "text.txt", tiny_base("llama"), VOCAB)) == 2
    (tmp_path / "text.csv").write_text("x")
    with pytest.raises(datastore.DatastoreError, match="text.csv: suffix '.csv'; expected a directory"):
        datastore.read_source(tmp_path / "text.csv", tiny_base("llama"), VOCAB)
    # Text too short to match, and another model's corpus (ids past this model's vocabulary: each
    # would be drafted into an embedding lookup the engine cannot do).
    (tmp_path / "short.txt").write_text("a\n")
    with pytest.raises(datastore.DatastoreError, match=r"short.txt: 2 tokens in its texts; expected at least 3"):
        datastore.read_source(tmp_path / "short.txt", tiny_base("llama"), VOCAB)
    foreign = tmp_path / "foreign"
    writer = drafter_corpus.Writer(foreign, {"decoder": "test"})
    writer.add([3, 4], "first", [60, 61, VOCAB + 44])
    writer.close()
    with pytest.raises(datastore.DatastoreError, match=f"foreign: token id {VOCAB + 44}; expected ids below the "
                                                       f"model's vocab_size {VOCAB}"):
        datastore.read_source(foreign, tiny_base("llama"), VOCAB)


def test_decoding_with_a_datastore_keeps_greedy_and_accepts_more(distilled):
    """A datastore of the base's own continuations: chains from it are right, so a step accepts more
    tokens, and greedy output stays the base's own token for token."""
    m = distilled("llama")
    ps = prompts(8)
    truth = [oracle(m.hf, p) for p in ps]
    cfg = GenerationConfig(max_new_tokens=48, medusa_choices="dynamic:8", stop_token_ids=(EOS,))
    without = decode(m.backend, ps, cfg)
    m.backend.datastore = datastore.build([p + t for p, t in zip(ps, truth, strict=True)])
    try:
        with_store = decode(m.backend, ps, cfg)
        off = decode(m.backend, ps, GenerationConfig(**{**cfg.__dict__, "datastore": False}))
    finally:
        m.backend.datastore = None
    assert with_store.tokens == truth and without.tokens == truth and off.tokens == truth

    def per_step(r):
        return sum(s.new_tokens for s in r.stats) / sum(s.steps for s in r.stats)
    assert per_step(off) == per_step(without)
    assert per_step(with_store) > 1.3 * per_step(without)


def test_medusa_build_indexes_a_datastore_or_refuses_its_source(tmp_path, tiny_base, tiny_merged, capsys):
    from transformers import AutoModelForCausalLM

    ckpt = tiny_merged("llama")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    out = tmp_path / "engine"
    assert build_cli.main(["--checkpoint", str(ckpt), "--out", str(out), "--datastore", str(bad), "--quiet"]) == 2
    assert "bad.jsonl:1: not valid JSON" in capsys.readouterr().err
    assert not out.exists() and not any(tmp_path.glob(".engine.tmp-*"))

    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": f"the model says {i} things"}) + "\n" for i in range(5)))
    assert build_cli.main(["--checkpoint", str(ckpt), "--out", str(out), "--datastore", str(text)]) == 0
    captured = capsys.readouterr()
    assert "datastore" in captured.out
    assert "datastores under 1000000 tokens measured no gain" in captured.err  # built anyway, with the advice
    engine = json.loads((out / "engine.json").read_text())
    assert datastore.FILE in engine["artifacts"] and engine["build"]["options"]["datastore"] == str(text)
    backend = load_backend(out)
    assert backend.datastore is not None and backend.datastore.sequences == 5
    outputs = []
    for flags in ([], ["--no-datastore"]):
        assert run_cli.main(["--engine", str(out), "--prompt", "the model says", "--raw", "--max-new-tokens", "12",
                             "--medusa-choices", "dynamic:8", *flags]) == 0
        outputs.append(capsys.readouterr().out.split("\n-- ")[0])  # the text, not the timing line after it
    assert outputs[0] == outputs[1] and outputs[0].strip()  # greedy: the same text either way

    # On the engine, chains that do get accepted: this checkpoint's heads are random, so a datastore of
    # the base's own greedy continuations is where every accepted draft comes from.
    ps = prompts(8)
    truth = [oracle(AutoModelForCausalLM.from_pretrained(tiny_base("llama")).eval(), p) for p in ps]
    cfg = GenerationConfig(max_new_tokens=48, medusa_choices="dynamic:8", stop_token_ids=(EOS,))
    plain = decode(backend, ps, GenerationConfig(**{**cfg.__dict__, "datastore": False}))
    backend.datastore = datastore.build([p + t for p, t in zip(ps, truth, strict=True)])
    with_store = decode(backend, ps, cfg)
    assert with_store.tokens == plain.tokens == truth
    assert sum(s.accepted_draft_tokens for s in with_store.stats) > 2 * sum(s.accepted_draft_tokens for s in plain.stats) + 20
