"""The drafter recipe's GPU stage (scripts/train_smollm2_drafters.py --stage cuda) on this CPU with a
tiny real base: a --decode-only run keeps every prompt's greedy continuation once, a later one adds
only the turns it lacks, and a training run reads the kept text and saves both drafters. A GPU
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


def _run(pack: dict, out: Path, *args: str) -> None:
    assert recipe.main(["--stage", "cuda", "--device", "cpu", "--gguf", str(pack["base"]), "--pack", str(pack["path"]),
                        "--out", str(out), "--gen-tokens", "6", "--new-tokens", "6", "--gen-batch", "4",
                        "--threads", "1", *args]) == 0


def test_decode_only_keeps_each_prompt_once_and_a_later_run_adds_what_is_missing(pack, tmp_path):
    _run(pack, tmp_path, "--decode-only", "--budget", "60")
    held, train = recipe._load_decoded(tmp_path / "decoded.npz")
    distinct_later = {tuple(p) for p in pack["later"]}
    assert len(held) == len(pack["held"]) and len(train) == len(pack["train"]) + len(distinct_later)
    report = json.loads((tmp_path / "decode_report.json").read_text())
    assert report["later_turns"] == len(distinct_later)
    assert report["decoded_now"]["sequences"] == len(held) + len(train)
    assert report["decoded_now"]["new_tokens"] == sum(len(s.tokens) - s.prompt_len for s in held + train)
    assert not (tmp_path / "amphista").exists()  # decoding only
    # Each continuation is the base's own greedy text (transformers' generate, one prompt at a time).
    hf = AutoModelForCausalLM.from_pretrained(pack["base"]).eval()
    for s in train[:3] + train[-2:]:
        prompt = s.tokens[: s.prompt_len]
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=EOS,
                               pad_token_id=EOS)[0, len(prompt):].tolist()
        if EOS in want:
            want = want[: want.index(EOS) + 1]
        assert s.tokens[s.prompt_len:] == want
    # A decoded.npz missing some later turns (an earlier run cut off by its deadline): the next run
    # decodes those only, once each.
    dropped = {tuple(pack["later"][1]), tuple(pack["later"][2])}
    kept = [s for s in train if tuple(s.tokens[: s.prompt_len]) not in dropped]
    recipe._save_decoded(tmp_path / "decoded.npz", held, kept, later_decoded=len(distinct_later) - 2)
    assert [tuple(p) for p in recipe._undecoded(kept, pack["later"])] == [tuple(pack["later"][1]), tuple(pack["later"][2])]
    _run(pack, tmp_path, "--decode-only", "--budget", "60")
    _, again = recipe._load_decoded(tmp_path / "decoded.npz")
    assert sorted(s.tokens for s in again) == sorted(s.tokens for s in train)


@pytest.mark.parametrize("keep_hidden", [["--keep-hidden"], ["--keep-hidden", "--kept-dtype", "float16"],
                                         ["--no-keep-hidden"]], ids=["float32", "float16", "base-each-step"])
def test_a_training_run_reads_the_kept_text_and_saves_both_drafters(pack, tmp_path, keep_hidden):
    _run(pack, tmp_path, "--decode-only", "--budget", "60")
    _run(pack, tmp_path, "--budget", "8", "--gen-share", "0", "--batch-samples", "2", "--timed-steps", "2",
         "--val", "2", "--sal-intermediate", "32", "--vocab-size", "64", *keep_hidden)
    report = json.loads((tmp_path / "cuda_report.json").read_text())
    assert report["data"]["reused_decoded_text"] and report["steps"] >= 4
    kept = "float16" if "float16" in keep_hidden else "float32" if "--keep-hidden" in keep_hidden else None
    assert report["data"]["kept_hidden"] == kept
    assert report["data"]["sequences"] == len(pack["train"]) + len({tuple(p) for p in pack["later"]}) - 2  # --val
    for arch in ("amphista", "medusa"):
        assert len(report[arch]["heldout_top1"]) == 4
    assert (tmp_path / "amphista" / "config.json").is_file() and (tmp_path / "heads").is_dir()
