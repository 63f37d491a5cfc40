"""benchmarks/bench_peers.py's figures: agreement with the reference, ratios to the fastest peer of the
same weight precision, Medusa's ratios against plain decoding on the same engine, the table. (Running
the peers themselves is the benchmark's job, not the test suite's.)"""

import importlib.util
import sys
from pathlib import Path

import pytest

from medusa_trt.tools.bench import ModeSummary

_BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(_BENCHMARKS))  # bench_peers imports the scripts' shared helpers as `common`
_spec = importlib.util.spec_from_file_location("bench_peers", _BENCHMARKS / "bench_peers.py")
bench_peers = importlib.util.module_from_spec(_spec)
sys.modules["bench_peers"] = bench_peers  # dataclasses look their module up there
_spec.loader.exec_module(bench_peers)


@pytest.mark.parametrize("out, ref, expected", [
    ([1, 2, 3, 4], [1, 2, 3, 4], (True, 1.0, 1.0)),
    ([1, 2, 9, 4], [1, 2, 3, 4], (False, 0.5, 0.75)),  # positions after a divergence still count
    ([1, 2], [1, 2, 3, 4], (False, 0.5, 0.5)),  # stopped early: the missing tokens disagree
    ([1, 2, 3, 4, 5], [1, 2, 3, 4], (False, 1.0, 1.0)),  # went on past the reference's stop token
    ([7], [1, 2, 3, 4], (False, 0.0, 0.0)),
])
def test_agreement(out, ref, expected):
    assert bench_peers.agreement(out, ref) == expected


def _tally(group, tokens, wall_s, equal=()):
    t = bench_peers.Tally(group, tokens, wall_s)
    for e in equal:
        t.equal.append(e)
        t.prefix_share.append(1.0 if e else 0.5)
        t.agreement.append(1.0 if e else 0.75)
    return t


def test_summarize_ratios_per_precision_and_medusa():
    F, Q = bench_peers.FLOAT32, bench_peers.FOUR_BIT
    tallies = {
        "transformers": _tally(F, 100, 10.0, [True, True]),  # 10 tok/s
        "ort-genai fp32": _tally(F, 100, 4.0, [True, True]),  # 25 tok/s: the fastest float32 peer
        "ours plain": _tally(F, 100, 2.0, [True, True]),  # 50 tok/s; ours is never "the fastest peer"
        "ours medusa": _tally(F, 100, 1.0, [True, True]),
        "ort-genai int4": _tally(Q, 90, 1.0, [False, True]),  # 90 tok/s
        "llama.cpp Q4_1": _tally(Q, 120, 1.0, [False, False]),  # 120 tok/s: the fastest 4-bit peer
    }
    tallies["ours medusa"].equal_to_plain = [True, False]  # set by run() from the two outputs
    plain = ModeSummary(tokens=100, steps=100, wall_s=2.0, decode_s=1.8)
    medusa = ModeSummary(tokens=100, steps=40, wall_s=1.0, decode_s=0.9)  # 2.5 tokens/step, step 1.25x plain
    rows = bench_peers.summarize(tallies, {"ours plain": plain, "ours medusa": medusa})
    assert rows["transformers"]["vs_fastest_peer"] == 0.4
    assert rows["ort-genai fp32"]["vs_fastest_peer"] == 1.0
    assert rows["ours plain"]["vs_fastest_peer"] == 2.0
    assert rows["ours medusa"]["vs_fastest_peer"] == 4.0
    assert rows["ort-genai int4"]["vs_fastest_peer"] == 0.75
    assert rows["llama.cpp Q4_1"]["vs_fastest_peer"] == 1.0
    m = rows["ours medusa"]
    assert (m["tokens_per_step"], m["step_overhead"], m["speedup"]) == (2.5, 1.25, 2.0)
    assert "tokens_per_step" not in rows["ours plain"]
    assert rows["ours medusa"]["equal_to_plain"] == "1/2" and "equal_to_plain" not in rows["ours plain"]
    assert rows["ort-genai int4"]["equal_to_reference"] == "1/2"
    assert rows["ort-genai int4"]["prefix_share"] == 0.75
    assert rows["llama.cpp Q4_1"]["position_agreement"] == 0.75

    table = bench_peers.markdown({"1": rows})
    lines = table.splitlines()
    assert len(lines) == 2 + len(rows)
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    assert "| 1 | ours medusa | float32 | 100.0 | 4.00 |  |  | 2.50 | 1.25 | 2.00 | 1/2 | 2/2 | 1.000 | 1.000 |" in lines


def test_prefill_and_decode_apart():
    """Each prompt's one-token run is its prefill (+ first token); the full run's remaining wall time
    over its tokens after the first is a decode token's cost."""
    t = bench_peers.Tally(bench_peers.FOUR_BIT)
    t.add_split(0.1, 0.7, 61)  # 0.6 s for 60 decode tokens
    t.add_split(0.3, 0.3, 1)  # a prompt that stopped at its first token: no decode tokens
    row = bench_peers.summarize({"ort-genai int4": t})["ort-genai int4"]
    assert (row["prefill_ms"], row["decode_ms_per_token"]) == (200.0, 10.0)
    line = bench_peers.markdown({"2": {"ort-genai int4": row}}).splitlines()[-1]
    assert line.startswith("| 2 | ort-genai int4 | 4-bit | 0.0 | ") and "| 200.0 | 10.00 |" in line


def test_medusa_equal_to_plain_per_engine():
    outputs = {"ours plain": [[1, 2], [3]], "ours medusa": [[1, 2], [4]], "ours int4 plain": [[5]],
               "ours int4 medusa": [[5]], "ours int4 exact plain": [[6]], "ours int4 exact medusa": [[7]],
               "transformers": [[1, 2], [3]]}
    assert bench_peers.equal_to_plain(outputs) == {"ours medusa": [True, False], "ours int4 medusa": [True],
                                                   "ours int4 exact medusa": [False]}


def test_no_peer_in_a_group_leaves_the_ratio_empty():
    rows = bench_peers.summarize({"ours int4 plain": _tally(bench_peers.FOUR_BIT, 10, 1.0)})
    assert rows["ours int4 plain"]["vs_fastest_peer"] is None
    assert "equal_to_reference" not in rows["ours int4 plain"]


class _Echo:
    """A fake peer: answers with the prompt's ids; segfaults (a real SIGSEGV) on a prompt of kind 'crash'."""

    group = "float32"

    def generate(self, prompt, max_new_tokens):
        if prompt.kind == "crash":
            _quiet_segfault()
        return bench_peers.Output(list(prompt.ids)[:max_new_tokens], 0.001)

    def tokenize(self, prompt):  # llama.cpp's own tokenizer, asked through the process (check_llama_tokenizer)
        return [len(prompt.text)]


def _quiet_segfault():
    """A real SIGSEGV in this (forked peer) process, without the "Fatal Python error" traceback that
    pytest's faulthandler, inherited through the fork, would print into the test run's output, where
    it reads like a crash of the suite."""
    import faulthandler
    import os
    import signal

    faulthandler.disable()
    os.kill(os.getpid(), signal.SIGSEGV)



def test_a_crashing_peer_is_reported_with_its_signal_and_the_others_run_on():
    from common import Prompt

    with pytest.raises(bench_peers.PeerCrashed, match="killed by SIGSEGV"):
        bench_peers.PeerProcess("llama.cpp Q4_1", _quiet_segfault)  # at load
    good, bad = bench_peers.PeerProcess("good", _Echo), bench_peers.PeerProcess("bad", _Echo)
    try:
        assert good.group == "float32" and good.generate(Prompt("x", "chat", [1, 2, 3]), 2).tokens == [1, 2]
        with pytest.raises(bench_peers.PeerCrashed, match="bad: its process killed by SIGSEGV"):
            bad.generate(Prompt("x", "crash", [1]), 2)
        assert good.generate(Prompt("y", "chat", [4, 5]), 8).tokens == [4, 5]  # the other peer is untouched
        tokens = bench_peers.check_llama_tokenizer(good, [Prompt("ab", "chat", [2]), Prompt("abc", "chat", [9])])
        assert tokens["prompts_with_equal_ids"] == "1/2" and tokens["differences"][0]["llama_cpp"] == [3]
    finally:
        good.close()
        bad.close()


def test_a_peer_that_fails_to_open_raises_its_error():
    def missing():
        raise ImportError("no module named llama_cpp")

    with pytest.raises(ImportError, match="llama_cpp"):
        bench_peers.PeerProcess("llama.cpp Q4_1", missing)
