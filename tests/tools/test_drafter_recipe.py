"""The drafter recipe's GPU stage (scripts/train_smollm2_drafters.py --stage cuda) on this CPU with a
tiny real base: a --decode-only run keeps every prompt's greedy continuation once in the corpus, a
later one adds only what it lacks, and a training run reads the corpus and saves both drafters. A GPU
session is short; this is what makes sure the stage runs there the first time."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from synthetic import EOS
from transformers import AutoModelForCausalLM

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import train_smollm2_drafters as recipe  # noqa: E402

from medusa_trt import drafter_corpus  # noqa: E402
from medusa_trt.tools import train_drafter  # noqa: E402


def _prompts(rng: random.Random, n: int, lo: int, hi: int) -> list[list[int]]:
    return [[rng.randrange(3, 250) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def pack(tmp_path_factory, tiny_merged, tiny_base) -> dict:
    """A pack as --stage pack writes it, of random token prompts for the tiny base: 12 first turns
    (4 code), 6 held-out, 10 later turns of which 2 repeat others (the data repeats turns)."""
    rng = random.Random(0)
    train, held, later = _prompts(rng, 12, 3, 8), _prompts(rng, 6, 3, 6), _prompts(rng, 8, 6, 12)
    later += [later[1], later[5]]
    path = tmp_path_factory.mktemp("recipe") / "pack.npz"
    flat = {name: recipe._ragged(seqs) for name, seqs in (("train", train), ("eval", held), ("later", later))}
    np.savez_compressed(path, train=flat["train"][0], train_offsets=flat["train"][1],
                        train_code=np.array([i % 3 == 0 for i in range(len(train))]), eval=flat["eval"][0],
                        eval_offsets=flat["eval"][1], later=flat["later"][0], later_offsets=flat["later"][1],
                        eos=EOS, config=(tiny_merged() / "config.json").read_text())
    return {"path": path, "base": tiny_base(), "train": train, "held": held, "later": later}


def _run(pack: dict, corpus: Path, out: Path, *args: str) -> None:
    assert recipe.main(["--stage", "cuda", "--device", "cpu", "--gguf", str(pack["base"]), "--pack", str(pack["path"]),
                        "--out", str(out), "--corpus", str(corpus), "--gen-tokens", "6", "--new-tokens", "6",
                        "--gen-batch", "4", "--threads", "1", *args]) == 0


def _keyed(prompts: list[list[int]]) -> dict[int, list[int]]:
    return {drafter_corpus.prompt_key(p): p for p in prompts}


def test_decode_only_keeps_each_prompt_once_and_a_later_run_decodes_only_what_the_corpus_lacks(pack, tmp_path):
    corpus = tmp_path / "corpus"
    _run(pack, corpus, tmp_path, "--decode-only", "--budget", "60")
    have, parts = drafter_corpus.read([corpus])
    distinct_later = {tuple(p) for p in pack["later"]}
    assert len(have) == len(pack["held"]) + len(pack["train"]) + len(distinct_later)
    assert sum(p["sequences"] for p in parts) == len(have) and parts[0]["device"] and parts[0]["decoder"] == "static"
    report = json.loads((tmp_path / "decode_report.json").read_text())
    assert report["later_turns"] == len(distinct_later) and report["heldout_sequences"] == len(pack["held"])
    assert report["decoded_now"]["sequences"] == len(have)
    assert report["decoded_now"]["static_check"] == "4/4 continuations of 16 tokens equal generate's"
    assert report["decoded_now"]["new_tokens"] == sum(map(len, have.values()))
    assert not (tmp_path / "amphista").exists()  # decoding only
    # Each continuation is the base's own greedy text (transformers' generate, one prompt at a time).
    hf = AutoModelForCausalLM.from_pretrained(pack["base"]).eval()
    prompts = _keyed(pack["train"] + pack["held"] + pack["later"])
    for key in list(have)[:3] + list(have)[-3:]:
        prompt = prompts[key]
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=EOS,
                               pad_token_id=EOS)[0, len(prompt):].tolist()
        if EOS in want:
            want = want[: want.index(EOS) + 1]
        assert have[key] == want
    # A corpus missing two first turns and two later turns (a run cut off by its deadline): the next
    # run decodes those four only, once each, into its own part.
    dropped = _keyed([pack["train"][0], pack["train"][5], pack["later"][1], pack["later"][2]])
    for part in corpus.iterdir():
        part.unlink()
    writer = drafter_corpus.Writer(corpus, {"decoder": "test"})
    for key, cont in have.items():
        if key not in dropped:
            writer.add(prompts[key], "first", cont)
    writer.close()
    fresh = tmp_path / "fresh"
    _run(pack, corpus, tmp_path, "--decode-only", "--budget", "60", "--corpus-out", str(fresh))
    assert json.loads((tmp_path / "decode_report.json").read_text())["decoded_now"]["sequences"] == 4
    assert set(drafter_corpus.read([fresh])[0]) == set(dropped)
    assert drafter_corpus.read([corpus, fresh])[0] == have


def test_corpus_parts_roll_over_and_read_back_whole(tmp_path):
    rng = random.Random(1)
    prompts, conts = _prompts(rng, 40, 1, 9), _prompts(rng, 40, 0, 30)
    writer = drafter_corpus.Writer(tmp_path, {"decoder": "test"}, part_tokens=100, every_s=0.0)
    keys = [writer.add(p, "later", c) for p, c in zip(prompts, conts, strict=True)]
    names = writer.close()
    assert len(names) >= sum(map(len, conts)) // 130 and sorted(names) == sorted(x.name for x in tmp_path.iterdir())
    have, metas = drafter_corpus.read([tmp_path])
    assert keys == [drafter_corpus.prompt_key(p) for p in prompts]
    assert have == dict(zip(keys, conts, strict=True))
    assert all(m["decoder"] == "test" for m in metas) and sum(m["sequences"] for m in metas) == 40
    # a part named by its file is read alone (what a run trained on, when the folder has grown since)
    one, metas = drafter_corpus.read([tmp_path / names[0]])
    assert [m["part"] for m in metas] == [names[0]] and 0 < len(one) < len(have)
    assert all(have[k] == c for k, c in one.items())


def test_token_ids_past_65535_are_kept_whole(tmp_path):
    # A vocabulary past 65,536 ids (Llama 3, Qwen2): a part holding such an id stores uint32, and
    # such a prompt's key never meets a uint16 one's with the same bytes ([70000] and [4464, 1]).
    writer = drafter_corpus.Writer(tmp_path, {"decoder": "test"})
    big = [writer.add([70000], "first", [151_000, 3]), writer.add([4464, 1], "first", [5, 6])]
    writer.close()
    have, _ = drafter_corpus.read([tmp_path])
    assert len(set(big)) == 2 and have == {big[0]: [151_000, 3], big[1]: [5, 6]}


def test_a_corpus_part_that_is_not_one_is_refused_naming_the_file(tmp_path):
    (tmp_path / "part-x.npz.xz").write_bytes(b"not xz")
    with pytest.raises(drafter_corpus.CorpusError, match="part-x.npz.xz: not a drafter corpus part"):
        drafter_corpus.read([tmp_path])


@pytest.mark.parametrize("keep_hidden", [["--keep-hidden"], ["--keep-hidden", "--kept-dtype", "float16"],
                                         ["--no-keep-hidden"]], ids=["float32", "float16", "base-each-step"])
def test_a_training_run_reads_the_kept_text_and_saves_both_drafters(pack, tmp_path, keep_hidden):
    _run(pack, tmp_path / "corpus", tmp_path, "--decode-only", "--budget", "60")
    _run(pack, tmp_path / "corpus", tmp_path, "--budget", "8", "--gen-share", "0", "--batch-samples", "2", "--timed-steps", "2",
         "--val", "2", "--sal-intermediate", "32", "--vocab-size", "64", *keep_hidden)
    report = json.loads((tmp_path / "cuda_report.json").read_text())
    assert report["data"]["reused_decoded_text"] and report["steps"] >= 4
    kept = "float16" if "float16" in keep_hidden else "float32" if "--keep-hidden" in keep_hidden else None
    assert report["data"]["kept_hidden"] == kept
    assert report["data"]["sequences"] == len(pack["train"]) + len({tuple(p) for p in pack["later"]}) - 2  # --val
    for arch in ("amphista", "medusa"):
        assert len(report[arch]["heldout_top1"]) == 4
    assert (tmp_path / "amphista" / "config.json").is_file() and (tmp_path / "heads").is_dir()
    assert "hidden_size" in report["compared"]["skipped"]  # the shipped drafters are SmolLM2's, not the tiny base's
    if keep_hidden == ["--no-keep-hidden"]:
        return
    # The eval stage scores saved drafters on the corpus's held-out text: this run's own, saved as
    # float16 and scored by the run in float32, score the same here (drafters left untrained: 0.07 off).
    assert recipe.main(["--stage", "eval", "--device", "cpu", "--gguf", str(pack["base"]), "--pack", str(pack["path"]),
                        "--corpus", str(tmp_path / "corpus"), "--drafters", str(tmp_path), "--out",
                        str(tmp_path / "eval"), "--threads", "1"]) == 0
    scores = json.loads((tmp_path / "eval" / "eval_report.json").read_text())
    assert scores["heldout_sequences"] == len({tuple(p) for p in pack["held"]})
    for arch in ("amphista", "medusa"):
        assert scores[arch]["heldout_top1"] == report[arch]["heldout_top1"]


def test_a_warm_start_goes_on_from_saved_drafters_with_their_vocabulary(pack, tmp_path):
    """--init: the drafters of a folder (the shipped ones on a GPU) are where training starts. With
    a learning rate of 0 the run ends where it started: the same held-out figures and vocabulary."""
    corpus, first, warm = tmp_path / "corpus", tmp_path / "first", tmp_path / "warm"
    common = ["--gen-share", "0", "--batch-samples", "2", "--timed-steps", "2", "--val", "2", "--sal-intermediate",
              "32", "--vocab-size", "48"]
    _run(pack, corpus, first, "--decode-only", "--budget", "60")
    _run(pack, corpus, first, "--budget", "8", *common)
    _run(pack, corpus, warm, "--budget", "8", "--init", str(first), "--lr", "0", *common)
    before = json.loads((first / "cuda_report.json").read_text())
    after = json.loads((warm / "cuda_report.json").read_text())
    assert after["data"]["init"] == str(first) and after["steps"] >= 4
    for arch in ("amphista", "medusa"):
        assert after[arch]["heldout_top1"] == before[arch]["heldout_top1"]
        saved = json.loads((warm / ("amphista" if arch == "amphista" else "heads") / "config.json").read_text())
        assert saved["draft_vocab"] == json.loads((first / "amphista" / "config.json").read_text())["draft_vocab"]
    with pytest.raises(SystemExit, match="--archs amphista,eagle: eagle unknown"):
        _run(pack, corpus, warm, "--budget", "8", "--archs", "amphista,eagle", *common)
    # Deeper heads from the same start: the added ResBlocks are the identity, so at a learning rate of
    # 0 they draft as the loaded heads did; fewer layers than loaded would change the drafts.
    deep = tmp_path / "deep"
    _run(pack, corpus, deep, "--budget", "8", "--init", str(first), "--lr", "0", "--archs", "medusa",
         "--head-layers", "3", *common)
    report = json.loads((deep / "cuda_report.json").read_text())
    assert report["medusa"]["heldout_top1"] == before["medusa"]["heldout_top1"]
    assert json.loads((deep / "heads" / "config.json").read_text())["medusa_num_layers"] == 3
    with pytest.raises(SystemExit, match="--head-layers 1: the --init heads have 2"):
        _run(pack, corpus, deep, "--budget", "8", "--init", str(first), "--archs", "medusa", "--head-layers", "1",
             *common)


def test_the_eval_stage_refuses_a_folder_without_drafters(pack, tmp_path):
    _run(pack, tmp_path / "corpus", tmp_path, "--decode-only", "--budget", "60")
    argv = ["--stage", "eval", "--device", "cpu", "--gguf", str(pack["base"]), "--pack", str(pack["path"]),
            "--corpus", str(tmp_path / "corpus"), "--drafters", str(tmp_path), "--out", str(tmp_path)]
    with pytest.raises(SystemExit, match="no amphista/config.json or heads/config.json"):
        recipe.main(argv)
    # A config without its weights (weight files are left out of the tree a GPU session sends)
    (tmp_path / "amphista").mkdir()
    (tmp_path / "amphista" / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match="amphista.safetensors: missing beside its config.json"):
        recipe.main(argv)


def _stdlib_args(tmp_path: Path):
    """The recipe's arguments over a small standard library of 40 files, a fifth of them held out."""
    std = tmp_path / "stdlib"
    for i in range(40):
        (std / f"pkg{i % 4}").mkdir(parents=True, exist_ok=True)
        (std / f"pkg{i % 4}" / f"mod{i}.py").write_text(
            "".join(f"def f{i}_{j}(x):\n    return x + {j}\n\n" for j in range(30)))
    return recipe.parse_args(["--stdlib", str(std), "--code-heldout-percent", "20"])


def test_extra_code_windows_come_from_training_side_files_and_skip_existing_prompts(tmp_path):
    """--stage pack's extra code prompts: windows of files on the training side of the split, none
    equal to a prompt the recipe already has, the same ones on every run."""
    from synthetic import make_tokenizer

    args = _stdlib_args(tmp_path)
    files = recipe.code_files(args)
    assert files["train"] and files["heldout"] and not {r for r, _ in files["train"]} & {r for r, _ in files["heldout"]}
    tok = make_tokenizer(256)
    first = recipe.code_windows(random.Random(0), tok, files["train"], 30)
    taken = {p["text"] for p in first[:10]}
    again = recipe.code_windows(random.Random(0), tok, files["train"], 30, taken)
    assert not taken & {p["text"] for p in again}
    assert again == recipe.code_windows(random.Random(0), tok, files["train"], 30, taken)
    held = {r for r, _ in files["heldout"]}
    assert all(p["source"] not in held and p["kind"] == "code" for p in first + again)
    assert all(len(tok.encode(p["text"])) <= recipe.MAX_CODE_TOKENS for p in again)


def test_no_batch_starts_that_would_end_past_the_deadline(pack):
    """A split that follows one cut off by the deadline starts no batch: the previous split's last
    batch time stands in for its first (a GPU run once overran its deadline by a later-turn batch)."""
    import time

    model = recipe.load_base(pack["base"], torch.device("cpu"))
    prompts = pack["later"][:4]
    soon = time.perf_counter() + 5.0
    new, _ = recipe._cuda_decode(model, prompts, ["chat"] * 4, 6, EOS, 2, soon, "t", last=10.0)
    assert new == []
    new, last = recipe._cuda_decode(model, prompts, ["chat"] * 4, 6, EOS, 2, soon + 60, "t", last=0.0)
    assert len(new) == 4 and 0 < last < 60


def test_decoding_stops_where_the_text_would_leave_the_training_too_few_passes(pack, tmp_path):
    """The time plan (--min-passes): with the first turns already in the corpus, a run allowed to decode
    for its whole budget decodes no later turn when the text it has needs more training time than is
    left, and all of them when the plan is off (the plan a GPU session had would have decoded until
    the hidden states alone took the training's time)."""
    corpus = tmp_path / "corpus"
    writer = drafter_corpus.Writer(corpus, {"decoder": "test"})
    rng = random.Random(1)
    for p in pack["train"]:
        writer.add(p, "first", [*(rng.randrange(3, 250) for _ in range(6)), EOS])
    writer.close()
    common = ["--budget", "8", "--gen-share", "1", "--batch-samples", "2", "--timed-steps", "2", "--val", "2",
              "--sal-intermediate", "32", "--vocab-size", "64"]
    reports = {}
    for passes in ("1e9", "0"):
        (out := tmp_path / passes).mkdir()
        _run(pack, corpus, out, "--min-passes", passes, *common)
        reports[passes] = json.loads((out / "cuda_report.json").read_text())
    planned, unplanned = reports["1e9"], reports["0"]
    assert planned["data"]["later_turns"] == 0
    assert planned["time_plan"]["hidden_s_per_row"] > 0 and planned["time_plan"]["step_s_per_row"] > 0
    assert unplanned["data"]["later_turns"] == len({tuple(p) for p in pack["later"]}) and unplanned["time_plan"] is None
    assert planned["passes"] > 0


def test_a_run_without_time_to_keep_the_hidden_states_runs_the_base_each_step(pack, tmp_path, monkeypatch):
    """Keeping the hidden states pays from the second pass on: where the plan's rates say they would
    take more than half of the training's time, the steps run the base instead and start at once."""
    _run(pack, tmp_path / "corpus", tmp_path, "--decode-only", "--budget", "60")
    monkeypatch.setattr(recipe, "_time_plan", lambda *a, **k: {"hidden_s_per_row": 1.0, "step_s_per_row": 1e-6})
    _run(pack, tmp_path / "corpus", tmp_path, "--budget", "8", "--gen-share", "0", "--batch-samples", "2",
         "--timed-steps", "2", "--val", "2", "--sal-intermediate", "32", "--vocab-size", "64")
    report = json.loads((tmp_path / "cuda_report.json").read_text())
    assert report["data"]["kept_hidden"] is None and report["steps"] >= 4


def test_a_pack_that_is_missing_or_incomplete_is_refused_naming_it(pack, tmp_path):
    with pytest.raises(SystemExit, match="nope.npz: not a pack"):
        recipe.load_pack(tmp_path / "nope.npz")
    np.savez(tmp_path / "half.npz", train=np.zeros(3, dtype=np.uint16))
    with pytest.raises(SystemExit, match="half.npz: no train_offsets, train_code, eval, eval_offsets, eos, config"):
        recipe.load_pack(tmp_path / "half.npz")
    assert recipe.load_pack(pack["path"])["eos"] == EOS


def test_a_static_decoder_that_fails_on_the_device_falls_back_to_generate(pack, tmp_path, monkeypatch):
    """The static decoder's first run on a GPU is a lent session's: if it fails there, the run says
    why and decodes with generate rather than losing the session."""
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")

    monkeypatch.setattr(recipe.batched_greedy, "greedy", broken)
    _run(pack, tmp_path / "corpus", tmp_path, "--decode-only", "--budget", "60")
    report = json.loads((tmp_path / "decode_report.json").read_text())
    assert report["decoded_now"]["decoder"] == "generate"
    assert report["decoded_now"]["static_check"] == ("failed (RuntimeError: CUDA error: an illegal memory access was "
                                                     "encountered); decoding with generate")
    assert report["heldout_sequences"] == len({tuple(p) for p in pack["held"]})


def test_an_interrupted_decode_keeps_the_batches_it_finished(pack, tmp_path, monkeypatch):
    """A decode stopped by hand (Ctrl-C; a session's end) keeps every continuation of the batches that
    ended before it: the writer's open part is written on the way out, not only at the run's end."""
    real = recipe._cuda_decode

    def stopped(*args, **kwargs):  # the eval split's batches end, then the run is interrupted
        real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(recipe, "_cuda_decode", stopped)
    with pytest.raises(KeyboardInterrupt):
        _run(pack, tmp_path / "corpus", tmp_path, "--decode-only", "--budget", "60")
    have, _ = drafter_corpus.read([tmp_path / "corpus"])
    assert set(have) == set(_keyed(pack["held"])) and all(have.values())


def test_a_run_that_fails_after_training_keeps_the_drafters_of_its_last_validation(pack, tmp_path, monkeypatch):
    """A lent session's training is minutes of device time: a failure in scoring drafters (a
    validation bug ended the first GPU run of 2026-11-27) must not take the trained ones along."""
    _run(pack, tmp_path / "corpus", tmp_path, "--decode-only", "--budget", "60")

    def broken(*args, **kwargs):
        raise RuntimeError("scoring failed")

    monkeypatch.setattr(train_drafter, "evaluate", broken)  # the run's validation scores with it
    with pytest.raises(RuntimeError, match="scoring failed"):
        _run(pack, tmp_path / "corpus", tmp_path, "--budget", "8", "--gen-share", "0", "--batch-samples", "2",
             "--timed-steps", "2", "--val", "2", "--sal-intermediate", "32", "--vocab-size", "64", "--no-keep-hidden")
    assert not (tmp_path / "cuda_report.json").exists()
    saved = recipe.load_drafters(json.loads(str(np.load(pack["path"])["config"])), tmp_path)
    assert sorted(saved) == ["amphista", "medusa"] and all(len(v) == 64 for _, v in saved.values())


def test_the_held_out_set_leaves_out_prompts_the_training_side_also_has():
    """The data repeats questions across conversations, so a held-out prompt can equal a training-side
    first turn (or later turn): it is not evaluated on. A later turn equal to a first turn is read once."""
    held, first, later = [[5, 6, 7], [8, 9], [13]], [[1, 2], [8, 9], [3, 4]], [[3, 4], [10, 11, 12], [13]]
    have = {drafter_corpus.prompt_key(p): [40, 41] for p in held + first + later}
    sets = {"eval": (held, ["chat", "code", "chat"]), "first": (first, ["chat"] * 3), "later": (later, ["chat"] * 3)}
    held_s, train, n_later = recipe.corpus_text(sets, have)
    assert [s.tokens[: s.prompt_len] for s in held_s] == [[5, 6, 7]]
    assert [s.tokens[: s.prompt_len] for s in train] == [[1, 2], [8, 9], [3, 4], [10, 11, 12], [13]] and n_later == 2


def test_more_heldout_prompts_are_held_out_new_and_the_same_on_every_run(tmp_path, monkeypatch):
    """--stage pack's held-out prompts beyond prompts.json's: first questions of held-out
    conversations in sha1 order of their ids and windows of held-out files, none a prompt the pack
    already has, the same ones on every run (a decoded held-out continuation is kept by its prompt)."""
    import hashlib

    from synthetic import make_tokenizer

    from medusa_trt.data import Conversation, is_heldout

    args = _stdlib_args(tmp_path)
    tok = make_tokenizer(256)
    monkeypatch.setattr(recipe, "MORE_HELDOUT", 4)
    monkeypatch.setattr(recipe, "chat_prompt", lambda tok, question: f"user: {question}\nassistant:")
    convs = [Conversation(f"conv{i}", (("human", f"question number {i % 30} about item"), ("gpt", "an answer")))
             for i in range(400)]
    held = sorted((c for c in convs if is_heldout(c.id)), key=lambda c: hashlib.sha1(c.id.encode()).hexdigest())
    # the first held-out question is a prompt the pack already has; repeated questions are read once
    taken = {drafter_corpus.prompt_key(tok.encode(recipe.chat_prompt(tok, held[0].first_human())))}
    before = set(taken)
    got = recipe.more_heldout(args, tok, convs, taken, set())
    chat, code = got[:4], got[4:]
    assert [p["kind"] for p in got] == ["chat"] * 4 + ["code"] * 4
    order = [c.id for c in held[1:] if c.first_human() not in {held[0].first_human()}]
    assert all(p["source"] in order for p in chat) and [p["source"] for p in chat] == sorted(
        (p["source"] for p in chat), key=order.index)
    keys = [drafter_corpus.prompt_key(p["ids"]) for p in got]
    assert len(set(keys)) == 8 and not set(keys) & before and set(keys) <= taken
    held_files = {r for r, _ in recipe.code_files(args)["heldout"]}
    assert all(p["source"] in held_files for p in code)
    assert [p["text"] for p in recipe.more_heldout(args, tok, convs, set(before), set())] == [p["text"] for p in got]


def test_a_fixed_warm_up_trains_while_the_schedule_is_still_a_placeholder():
    """The cuda stage sizes its steps only after its timed steps, and starts with steps=10**6: a
    warm-up of a twentieth of that ran the timed steps at a near-zero rate."""
    drafter = torch.nn.Linear(4, 4)
    rates = {}
    for warmup in (0, 175):
        opt, sched = train_drafter.optimizer(drafter, train_drafter.TrainOptions(steps=10**6, lr=1e-3, warmup=warmup))
        for _ in range(59):
            sched.step()
        rates[warmup] = opt.param_groups[0]["lr"]
    assert rates[0] < 2e-6  # the old warm-up: 60 / 50,000 of the rate
    assert rates[175] == pytest.approx(1e-3 * 60 / 175, rel=1e-3)
    opt, sched = train_drafter.optimizer(drafter, train_drafter.TrainOptions(steps=100, lr=1e-3))
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 / 5)  # warmup 0: a twentieth of the steps
