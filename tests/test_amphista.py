"""The Amphista drafter's reference (medusa_trt/drafters/amphista.py): its math, its cache rule and
decoding with it on the reference backend."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from medusa_trt.checkpoint import ModelConfig
from medusa_trt.drafters.amphista import AmphistaConfig, stage_of
from medusa_trt.modeling import MedusaModel
from medusa_trt.runtime.decoding import GenerationConfig, decode
from medusa_trt.runtime.torch_backend import TorchBackend

CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, num_medusa_heads=4, drafter="amphista",
                  drafter_options={"num_heads": 4, "sal_intermediate_size": 48})


def _model(seed: int = 0, cfg: ModelConfig = CFG) -> MedusaModel:
    torch.manual_seed(seed)
    model = MedusaModel(cfg)
    with torch.no_grad():  # a drafter away from its identity start: every part matters
        for p in model.drafter.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model.eval()


def test_staged_split_and_the_config_block():
    assert [stage_of(k, 4) for k in range(4)] == [0, 0, 1, 1]
    assert [stage_of(k, 3) for k in range(3)] == [0, 0, 1]
    assert AmphistaConfig.from_dict(None) == AmphistaConfig()
    with pytest.raises(ValueError, match="unknown key"):
        AmphistaConfig.from_dict({"heads": 4})
    with pytest.raises(ValueError, match="lm_head 'mine'"):
        AmphistaConfig.from_dict({"lm_head": "mine"})
    with pytest.raises(ValueError, match="num_heads 0"):
        AmphistaConfig.from_dict({"num_heads": 0})


def test_the_identity_start_drafts_the_next_token_at_every_head():
    model = _model()
    model.drafter.reset_identity()
    h = torch.randn(2, 7, 32)
    tokens = torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        got = model.draft(h, tokens)
        want = model.lm_head(h).float()
    assert got.shape == (4, 2, 7, 96)
    for k in range(4):
        torch.testing.assert_close(got[k], want, rtol=1e-5, atol=1e-5)


def test_own_lm_heads_project_each_head_slot_with_its_own_matrix():
    cfg = dataclasses.replace(CFG, drafter_options={**CFG.drafter_options, "lm_head": "own"})
    model = _model(3, cfg)
    d = model.drafter
    h, tokens = torch.randn(2, 5, 32), torch.randint(0, 96, (2, 5))
    with torch.no_grad():
        got = model.draft(h, tokens)
        positions = torch.arange(5).expand(2, 5)
        h1, h2, _, _ = d.adapt(h, tokens, model.vocab_embedding, positions, torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 5, 5))
        z = d.features(h1, h2)  # [K, B, S, d]
        want = torch.einsum("kbsi,kvi->kbsv", z, d.lm_heads)
        shared = z @ d.lm_heads[0].T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[1], shared[1])  # head 1 reads its own matrix, not head 0's


def test_the_token_after_each_row_and_the_other_heads_change_the_drafts():
    model = _model()
    h = torch.randn(1, 6, 32)
    a, b = torch.randint(0, 96, (1, 6)), torch.randint(0, 96, (1, 6))
    b[0, :5] = a[0, :5]
    with torch.no_grad():
        da, db = model.draft(h, a), model.draft(h, b)
    assert torch.equal(da[:, :, :5], db[:, :, :5])  # causal: rows before the change are untouched
    assert not torch.allclose(da[:, :, 5], db[:, :, 5])
    # The slots see each other (the auto-embedding block): the second stage's change reaches head 0.
    with torch.no_grad():
        before = model.draft(h, a)
        model.drafter.sal2.proj.weight.add_(1.0)
        after = model.draft(h, a)
    assert not torch.allclose(before[0], after[0])


def test_the_cached_steps_equal_the_whole_sequence_forward():
    model = _model(1)
    h = torch.randn(1, 11, 32)
    tokens = torch.randint(0, 96, (1, 11))
    with torch.no_grad():
        want = model.draft(h, tokens)[:, 0]  # [K, S, V]
        past, start = None, 0
        for c in (4, 1, 3, 2, 1):  # a prefill then steps committing 1-3 rows
            got, past = model.drafter.append(h[:, start : start + c], tokens[:, start : start + c], model.lm_head,
                                             model.vocab_embedding, past)
            start += c
            torch.testing.assert_close(got, want[:, start - 1], rtol=1e-5, atol=1e-5)
    assert past[0].shape == (2, 1, 2, 11, 8)  # [layers, B, Hkv, rows, D]: every committed row, no more


class _Recorder(TorchBackend):
    """The reference backend, recording each draft call's output and the committed lengths then."""

    def __init__(self, model):
        super().__init__(model)
        self.calls: list[tuple[torch.Tensor, list[int]]] = []

    def draft(self, rows, counts, next_tokens):
        out = super().draft(rows, counts, next_tokens)
        # The drafter's cache holds exactly the committed rows of every sequence.
        assert [p[0].shape[3] for p in self.drafter_past] == self.lengths.tolist()
        self.calls.append((out, self.lengths.tolist()))
        return out


@pytest.mark.parametrize("acceptance", ["greedy", "sample"])
def test_decoding_with_amphista_keeps_the_output_and_drafts_from_committed_rows(acceptance, small_amphista):
    """A trained drafter (tests/conftest.py: small_amphista), so that steps accept drafts and its cache
    is appended with several rows at once: greedy equals transformers' greedy; every step's drafts
    equal the whole-sequence forward's at the last committed row, under sampling too (where the token
    after each accepted row is the one drawn there)."""
    from tests.runtime.test_decoding import oracle

    model = MedusaModel.from_checkpoint(small_amphista.ckpt)
    prompts = [[5, 9, 17, 33, 2, 40], [7, 1, 3]]
    cfg = GenerationConfig(max_new_tokens=20, acceptance=acceptance, temperature=0.8, seed=3,
                           medusa_choices="[[0], [0, 0], [1], [0, 1], [0, 0, 0]]")
    spec = decode(_Recorder(model), prompts, cfg)  # a ragged batch
    assert sum(st.accepted_draft_tokens for st in spec.stats) > 0
    if acceptance == "greedy":  # (sampling's distribution: tests/runtime statistical tests)
        assert spec.tokens == [oracle(small_amphista.hf, p, 20) for p in prompts]

    backend = _Recorder(model)
    tokens = decode(backend, prompts[:1], cfg).tokens[0]
    grown = [b[0] - a[0] for (_, a), (_, b) in zip(backend.calls, backend.calls[1:], strict=False)]
    assert max(grown) > 1  # a step appended accepted rows, not only the root
    seq = prompts[0] + tokens
    ids = torch.tensor([seq])
    mask = torch.ones(1, len(seq), len(seq), dtype=torch.bool).tril()
    keys, values = model.empty_cache(1)
    with torch.no_grad():
        _, hidden, _, _ = model.forward_hidden(ids, torch.arange(len(seq))[None], mask, keys, values)
        whole = model.draft(hidden[:, :-1], ids[:, 1:])[:, 0]  # [K, S-1, V]: drafts at every row
    checked = [(out, n) for out, (n,) in backend.calls if n < len(seq)]  # the last root is past the output
    assert len(checked) >= 3
    for out, n in checked:  # each step's drafts: the whole-sequence forward's at row n - 1
        torch.testing.assert_close(out[:, 0], whole[:, n - 1], rtol=1e-4, atol=1e-4)
