"""The one interface every engine implements for the decoding loop, and the PyTorch backend.

A backend owns the KV cache and the committed length of each sequence; the decoding loop only says
what to run and which of the new tokens to keep. Cache layout (shared by all backends): per
sequence, committed entries occupy [0, length[b]); a forward writes its S new tokens at [P, P+S)
with P = max(length) (shorter sequences leave a masked gap); `commit` then moves the kept ones to
follow each committed prefix. That keeps one dense [L, B, Hkv, P, D] past tensor for any batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from medusa_trt.checkpoint import DEFAULT_MAX_DRAFT_LEN
from medusa_trt.modeling import MedusaModel


@dataclass(frozen=True)
class ModelInfo:
    vocab_size: int
    num_medusa_heads: int
    max_seq_len: int  # positions the model supports (prompt + generated + tree depth)
    max_draft_len: int  # largest tree (nodes, root excluded) the engine was built for
    # A tree step's slots must stay inside one key_block-aligned block of the cache (the
    # row_exact_f32 attention, engines/onnx_export.py); None: any tree is exact.
    key_block: int | None = None
    # Only chain trees are exact (chain_f32 attention): the decoding loop verifies a tree's main chain.
    chains_only: bool = False


class Backend(Protocol):
    info: ModelInfo
    lengths: torch.Tensor  # [B] int64 committed length of each sequence

    def start(self, batch: int, capacity: int) -> None:
        """Empties the cache for `batch` sequences of at most `capacity` cached positions."""

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, new_mask: torch.Tensor,
        logit_positions: torch.Tensor | None = None, with_heads: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Runs S new tokens per sequence ([B, S] ids and positions, [B, S, S] bool mask among the
        new tokens; each also sees its sequence's committed prefix). Returns float32 logits
        [B, K, V] and medusa logits [H, B, K, V] (K = S, or the given [B, K] positions), or None
        for the latter with `with_heads=False`. The new tokens' KV stays pending until `commit`."""

    def heads(self, rows: torch.Tensor) -> torch.Tensor:
        """Medusa logits [H, B, V] at row rows[b] (of K) of the last forward, for each sequence: the
        decoding loop needs them only at the last accepted node, known after verification."""

    def commit(self, slots: torch.Tensor, counts: torch.Tensor) -> None:
        """Keeps, for sequence b, pending tokens slots[b, :counts[b]] (in order) after its prefix."""

    def keep(self, rows: torch.Tensor) -> None:
        """Drops every sequence not in `rows` (finished sequences stop costing work)."""

    # Optional, for greedy decoding in one call per step (OrtBackend): `fused_step_topk` (int, the
    # per-head top-k its candidates come from; None or absent: no fused step) and
    # fused_step(input_ids, position_ids, new_mask, retrieve, candidate_index) -> (best path [B],
    # accepted [B], next tree tokens [B, 1 + C]), the math of medusa_trt/acceptance.py.
    # Optional, for plain greedy decoding in one call per step (OrtBackend, in-place engines):
    # `plain_greedy_step` (None or absent: none), tokens [B] -> next tokens [B], the same as
    # forward(tokens[:, None], lengths[:, None], ones, zeros) + commit(zeros, ones) + argmax.
    # Optional, for greedy Medusa decoding in one call per step (OrtBackend, in-place engines):
    # `greedy_tree_step` (None or absent: none), (tokens [B, >= T], tree: decoding.StepTree) ->
    # (best path [B], accepted [B], next tree tokens [B, 1 + C]), the same as fused_step at each
    # sequence's length + the tree's offsets followed by the commit of each accepted path.
    # Optional, for backends that open their graphs on first use (OrtBackend): open_sessions() opens
    # them all now, as a server does at load so that no request pays for it.


def full_attention_mask(lengths: torch.Tensor, past: int, new_mask: torch.Tensor) -> torch.Tensor:
    """[B, S, past + S] bool: the committed prefix of each sequence, then the mask among new tokens."""
    b, s, _ = new_mask.shape
    prefix = torch.arange(past)[None, None, :] < lengths[:, None, None]  # [B, 1, P]
    return torch.cat([prefix.expand(b, s, past), new_mask], dim=-1)


def check_forward(keys: torch.Tensor, lengths: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                  logit_positions: torch.Tensor | None, max_seq_len: int, where: object) -> torch.Tensor:
    """Checks one forward of an engine backend against its cache [L, B, Hkv, capacity, D] and limits
    (`where` names the engine in messages); returns logit_positions, all rows by default."""
    b, s = input_ids.shape
    past = int(lengths.max()) if b else 0
    if b != keys.shape[1]:
        raise ValueError(f"forward got batch {b}, but the cache holds {keys.shape[1]} sequences")
    if past + s > keys.shape[3]:
        raise ValueError(f"KV cache overflow: {past} + {s} positions > capacity {keys.shape[3]}")
    if b and int(position_ids.max()) >= max_seq_len:
        raise ValueError(f"position {int(position_ids.max())} is beyond the engine's max_seq_len {max_seq_len} ({where})")
    return torch.arange(s).expand(b, s) if logit_positions is None else logit_positions


def zero_cache(layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype, device) -> tuple:
    """K and V buffers [L, B, Hkv, capacity, D] of the engine backends. Zeros, not empty: masked slots
    get probability 0, and 0 * NaN from stale memory is NaN."""
    shape = (layers, batch, kv_heads, max(capacity, 1), head_dim)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


def scatter_pending(keys: torch.Tensor, values: torch.Tensor, pending: tuple | None, lengths: torch.Tensor,
                    slots: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The engine backends' commit: the kept pending tokens (new K/V [L, B, Hkv, S, D] of the last
    forward) go after each committed prefix. Returns the new lengths."""
    if pending is None:
        raise RuntimeError("commit() without a forward() since the last commit")
    new_k, new_v = pending
    if len(counts) == 1:  # batch 1, the latency case: two slice copies, a third of the indexed path's time
        c, start = int(counts[0]), int(lengths[0])
        if keys.is_cpu and keys.dtype != torch.bfloat16:
            # Through numpy views, with as few calls as possible: a commit follows every step, when the
            # engine's run has evicted the host code's caches and each small call costs 10-30 us
            # (BENCHMARKS.md, issue 13 host overhead).
            src = slots[0, :c].tolist()
            run = slice(src[0], src[0] + c) if src == list(range(src[0], src[0] + c)) else src  # a chain: no gather
            keys.numpy()[:, 0, :, start : start + c] = new_k.numpy()[:, 0][:, :, run]
            values.numpy()[:, 0, :, start : start + c] = new_v.numpy()[:, 0][:, :, run]
            return lengths + counts
        src = slots[0, :c].to(keys.device)
        keys[:, 0, :, start : start + c] = new_k[:, 0].index_select(2, src)
        values[:, 0, :, start : start + c] = new_v[:, 0].index_select(2, src)
        return lengths + counts
    b, src, dst = (t.to(keys.device) for t in commit_indices(lengths, 0, slots, counts))  # src: new tokens
    keys[:, b, :, dst] = new_k[:, b, :, src]
    values[:, b, :, dst] = new_v[:, b, :, src]
    return lengths + counts


def compact_in_place(keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
                     counts: torch.Tensor) -> torch.Tensor:
    """Commit for a cache the step wrote into (new token j of sequence b at lengths[b] + j): moves
    each sequence's kept slots [B, >= counts] to lengths[b] + 0..counts[b]-1 and returns the new
    lengths. An accepted chain and a prefill without padding move nothing."""
    for b, (row, c, n) in enumerate(zip(slots.tolist(), counts.tolist(), lengths.tolist(), strict=True)):
        moved = [(n + s, n + i) for i, s in enumerate(row[:c]) if s != i]
        if moved:
            src, dst = (torch.tensor(x, device=keys.device) for x in zip(*moved, strict=True))
            for cache in (keys, values):
                cache[:, b, :, dst] = cache[:, b, :, src]  # the gather copies first: sources may be overwritten
    return lengths + counts


def commit_indices(lengths: torch.Tensor, past: int, slots: torch.Tensor, counts: torch.Tensor):
    """Flat (batch, source, destination) cache indices of a commit, shared by the array backends."""
    batch = torch.repeat_interleave(torch.arange(len(counts)), counts)
    keep = torch.arange(slots.shape[1])[None, :] < counts[:, None]  # [B, A]
    src = past + slots[keep]
    dst = (lengths[:, None] + torch.arange(slots.shape[1])[None, :])[keep]
    return batch, src, dst


class TorchBackend:
    """The PyTorch reference model behind the backend interface, cache preallocated once per batch."""

    def __init__(self, model: MedusaModel, max_draft_len: int = DEFAULT_MAX_DRAFT_LEN):
        self.model = model
        # The model's device (cpu or cuda) holds the cache and runs the math; the decoding loop's
        # small int tensors stay on the host and logits come back there, as from every backend.
        self.device = model.inv_freq.device
        cfg = model.cfg
        self.info = ModelInfo(cfg.vocab_size, cfg.num_medusa_heads, cfg.max_position_embeddings, max_draft_len)
        self.start(1, 0)

    def start(self, batch: int, capacity: int) -> None:
        self.keys, self.values = self.model.empty_cache(batch, capacity, self.device)  # [L, B, Hkv, cap, D]
        self.lengths = torch.zeros(batch, dtype=torch.long)
        self._past = 0  # P: where the pending tokens of the last forward were written

    @torch.inference_mode()
    def forward(self, input_ids, position_ids, new_mask, logit_positions=None, with_heads=True):
        past = int(self.lengths.max()) if len(self.lengths) else 0
        s = input_ids.shape[1]
        if past + s > self.keys.shape[3]:
            raise ValueError(f"KV cache overflow: {past} + {s} positions > capacity {self.keys.shape[3]}")
        mask = full_attention_mask(self.lengths, past, new_mask)
        dev = self.device  # .to() of a tensor already there is free: nothing moves on the CPU
        logits, self._hidden, new_k, new_v = self.model.forward_hidden(
            input_ids.to(dev), position_ids.to(dev), mask.to(dev), self.keys[..., :past, :],
            self.values[..., :past, :], None if logit_positions is None else logit_positions.to(dev)
        )
        self.keys[..., past : past + s, :] = new_k
        self.values[..., past : past + s, :] = new_v
        self._past = past
        return logits.cpu(), self.model.draft(self._hidden).cpu() if with_heads else None

    @torch.inference_mode()
    def heads(self, rows: torch.Tensor) -> torch.Tensor:
        h = self._hidden[torch.arange(len(rows), device=self.device), rows.to(self.device)]  # [B, d]
        return self.model.draft(h[:, None])[:, :, 0].cpu()

    def commit(self, slots: torch.Tensor, counts: torch.Tensor) -> None:
        b, src, dst = (i.to(self.device) for i in commit_indices(self.lengths, self._past, slots, counts))
        # Gather before scatter: destinations may overlap sources of the same commit.
        self.keys[:, b, :, dst] = self.keys[:, b, :, src].clone()
        self.values[:, b, :, dst] = self.values[:, b, :, src].clone()
        self.lengths = self.lengths + counts

    def keep(self, rows: torch.Tensor) -> None:
        self.keys, self.values = self.keys[:, rows.to(self.device)], self.values[:, rows.to(self.device)]
        self.lengths = self.lengths[rows]
