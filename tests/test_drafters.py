"""The drafter seam (medusa_trt/drafters/): the registry, the reference model's one call into its
drafter, and what every backend's `draft` receives from the decoding loop each step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from medusa_trt.checkpoint import ModelConfig
from medusa_trt.drafters import DRAFTERS, make_drafter
from medusa_trt.drafters.amphista import Amphista
from medusa_trt.drafters.medusa import MedusaHeads
from medusa_trt.modeling import MedusaModel
from medusa_trt.runtime.decoding import GenerationConfig, decode
from medusa_trt.runtime.torch_backend import TorchBackend

CFG = ModelConfig(vocab_size=80, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                  head_dim=8, num_medusa_heads=3)


def test_the_checkpoint_names_its_drafter_and_an_unknown_kind_is_refused():
    assert DRAFTERS == {"medusa": MedusaHeads, "amphista": Amphista}
    assert ModelConfig.from_checkpoint_config({
        "vocab_size": 80, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4}).drafter == "medusa"  # checkpoints without the key hold Medusa heads
    drafter = make_drafter(CFG)
    assert isinstance(drafter, MedusaHeads) and drafter.num_heads == 3 and not drafter.reads_tokens
    with pytest.raises(ValueError, match="drafter 'eagle': expected one of medusa, amphista"):
        make_drafter(dataclasses.replace(CFG, drafter="eagle"))


def test_the_model_drafts_through_its_drafter_alone(tiny_merged):
    model = MedusaModel.from_checkpoint(tiny_merged("llama"))
    h = torch.randn(2, 5, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    want = model.drafter(h, None, model.lm_head)
    assert want.shape == (model.cfg.num_medusa_heads, 2, 5, model.cfg.vocab_size)
    assert torch.equal(model.draft(h), want)
    ids = torch.arange(6)[None]
    mask = torch.ones(1, 6, 6, dtype=torch.bool).tril()
    keys, values = model.empty_cache(1)
    logits, medusa, _, _ = model(ids, ids, mask, keys, values)
    _, hidden, _, _ = model.forward_hidden(ids, ids, mask, keys, values)
    assert torch.equal(medusa, model.draft(hidden))


class _Recorder(TorchBackend):
    """The reference backend, recording what the loop hands `draft` and what it commits."""

    def __init__(self, model):
        super().__init__(model)
        self.calls: list[tuple] = []
        self.tokens: torch.Tensor | None = None

    def forward(self, input_ids, *args, **kwargs):
        self.tokens = input_ids  # the rows of this forward
        return super().forward(input_ids, *args, **kwargs)

    def draft(self, rows, counts, next_tokens):
        self.calls.append((self.tokens, rows.clone(), counts.clone(), next_tokens.clone()))
        return super().draft(rows, counts, next_tokens)


@pytest.mark.parametrize("acceptance", ["greedy", "sample"])
def test_each_step_hands_the_drafter_the_committed_rows_and_the_tokens_after_them(distilled, acceptance):
    """rows[b, :counts[b]] are the rows the step committed (the accepted path), next_tokens the token
    after each: the next accepted token, and after the last the next root, which the next step
    verifies first. An Amphista or EAGLE drafter appends exactly these to its own cache. Heads that
    predict (distilled), so that steps commit accepted rows beyond the root: random heads get none."""
    backend = _Recorder(MedusaModel.from_checkpoint(distilled("llama").ckpt))
    cfg = GenerationConfig(max_new_tokens=24, acceptance=acceptance, temperature=0.9, seed=1,
                           medusa_choices="[[0], [0, 0], [1], [0, 1]]")
    prompt = [17, 201, 44, 9, 120, 63]  # of the kind the heads were fitted on (tests/conftest.py)
    tokens = decode(backend, [prompt], cfg).tokens[0]
    emitted = []  # the tokens as the drafter saw them, rebuilt from the calls alone
    for i, (forward_tokens, rows, counts, after) in enumerate(backend.calls):
        n = int(counts[0])
        if i == 0:  # prefill: its forward keeps one row (K = 1), the prompt's last token
            assert (rows.tolist(), n, forward_tokens[0, -1].item()) == ([[0]], 1, prompt[-1])
        else:  # a tree step keeps every slot's row (K = T): rows are the tree's slots
            committed = forward_tokens[0, rows[0, :n]].tolist()
            assert committed[0] == emitted[-1]  # the root the last call named came first
            assert after[0, : n - 1].tolist() == committed[1:]
            emitted.extend(committed[1:])
        emitted.append(int(after[0, n - 1]))  # the next root
    assert emitted[: len(tokens)] == tokens
    assert max(int(counts[0]) for *_, counts, _ in backend.calls) > 1  # some step committed accepted rows
