"""scripts/batched_greedy.py, the drafter recipe's GPU decoder: a left-padded batch decoded in one
preallocated cache gives each prompt the continuation transformers' `generate` gives it alone."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import batched_greedy  # noqa: E402

SIZES = {"vocab_size": 300, "hidden_size": 96, "intermediate_size": 128, "num_hidden_layers": 3,
         "num_attention_heads": 6, "num_key_value_heads": 2, "max_position_embeddings": 128}


def _model(kind: str):
    torch.manual_seed(0)
    if kind == "qwen2":  # biased q/k/v projections
        return Qwen2ForCausalLM(Qwen2Config(**SIZES)).eval()
    return LlamaForCausalLM(LlamaConfig(**SIZES)).eval()


def _alone(model, prompt: list[int], new_tokens: int, eos: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos,
                             pad_token_id=eos)[0, len(prompt):].tolist()
    return out[: out.index(eos) + 1] if eos in out else out


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_each_row_equals_generate_alone(kind):
    model = _model(kind)
    assert batched_greedy.supports(model) is None
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 290) for _ in range(rng.randint(1, 20))] for _ in range(7)]
    # prefill_rows=40: the prompts are prefilled in chunks of two rows
    got = batched_greedy.greedy(model, prompts, 10, eos=2, prefill_rows=40)
    assert got == [_alone(model, p, 10, 2) for p in prompts]


def test_a_row_stops_after_its_eos_and_the_others_go_on():
    model = _model("llama")
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 290) for _ in range(rng.randint(4, 12))] for _ in range(4)]
    free = batched_greedy.greedy(model, prompts, 8, eos=299)  # 299: an id none of these emits
    assert all(len(c) == 8 and 299 not in c for c in free)
    eos = free[0][2]  # the token row 0 emits third, made its end of sequence
    got = batched_greedy.greedy(model, prompts, 8, eos=eos)
    assert got[0] == free[0][: free[0].index(eos) + 1]
    assert got == [_alone(model, p, 8, eos) for p in prompts]


def test_a_sliding_window_is_refused():
    assert "sliding window" in batched_greedy.supports(
        type("M", (), {"config": MistralConfig(**SIZES, sliding_window=64)})())
