"""The one interface every backend implements for the decoding loop (Backend, ModelInfo), and the
cache helpers the engine backends share.

A backend owns the KV cache and the committed length of each sequence; the decoding loop only says
what to run and which of the new tokens to keep. Cache layout (shared by all backends): per
sequence, committed entries occupy [0, length[b]); a forward writes its S new tokens at [P, P+S)
with P = max(length) (shorter sequences leave a masked gap); `commit` then moves the kept ones to
follow each committed prefix. That keeps one dense [L, B, Hkv, P, D] past tensor for any batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from medusa_trt.datastore import Datastore


@dataclass(frozen=True)
class ModelInfo:
    vocab_size: int
    num_medusa_heads: int
    max_seq_len: int  # positions the model supports (prompt + generated; trees are cut to fit them)
    max_draft_len: int  # largest tree (nodes, root excluded) the engine was built for
    # A tree step's slots must stay inside one key_block-aligned block of the cache (the
    # row_exact_f32 attention, engines/onnx/attention.py); None: any tree is exact.
    key_block: int | None = None
    # Only chain trees are exact (chain_f32 attention): the decoding loop verifies a tree's main chain.
    chains_only: bool = False
    # The drafter keeps a cache over every committed row (drafters.base.Drafter.has_cache): the
    # prefill hands `draft` all of each prompt's rows, not only the last.
    drafter_cache: bool = False
    # `forward` keeps the hidden state of every new row whatever logit_positions asks (engine.json
    # onnx.hidden_all_rows), so a prefill asks for the last row's logits only and `draft` still reads
    # any row: rows then name new rows, not logit rows.
    hidden_all_rows: bool = False
    # The tree the engine records (engine.json medusa.tree, from medusa-build --tree) and where it came
    # from: what a decode uses when its config names none (decoding.resolve_tree). None: none recorded.
    tree: tuple[tuple[int, ...], ...] | str | None = None  # str: "dynamic:N" (runtime/dynamic.py)
    tree_source: str | None = None
    # Where a decode stops unless its config says otherwise: EOS of the model config, generation config
    # and tokenizer, and the chat template's end-of-turn tokens (loading.stop_tokens, set by load_backend).
    stop_token_ids: tuple[int, ...] = ()
    # The largest batch the engine runs (engine.json limits.max_batch_size): callers cut larger groups
    # (serving.triton_model.group_jobs) instead of failing every row. None: any batch (a checkpoint).
    max_batch_size: int | None = None


class Backend:
    """The interface every backend implements (a fixed runner interface, as Polygraphy's): the
    decoding loop calls only these members. The five required methods raise here; the optional
    capabilities are declared with the value that means "absent", so callers read them directly
    and never probe (steps.step_plan decides from them which step runs)."""

    info: ModelInfo
    lengths: torch.Tensor  # [B] int64 committed length of each sequence
    # The per-head top-k of the fused greedy step's candidates (tree.candidate_topk); None: no fused step.
    fused_step_topk: int | None = None
    # Whether the fused step takes a tree per sequence (retrieve [B, N, D+1]) and returns the drafter's
    # top-k ids and log-probs: per-step trees (runtime/dynamic.py) then run on it.
    fused_step_dynamic: bool = False
    # Torch threads for the decoding loop's own small ops while this backend computes (decoding.generate);
    # None: leave torch's setting alone.
    host_threads: int | None = None
    # The base model's own text as draft chains for per-step trees (medusa_trt/datastore.py), from the
    # engine's datastore.npz (medusa-build --datastore); None: none.
    datastore: Datastore | None = None

    def start(self, batch: int, capacity: int) -> None:
        """Empties the cache for `batch` sequences of at most `capacity` cached positions."""
        raise NotImplementedError

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, new_mask: torch.Tensor,
        logit_positions: torch.Tensor | None = None, with_heads: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Runs S new tokens per sequence ([B, S] ids and positions, [B, S, S] bool mask among the
        new tokens; each also sees its sequence's committed prefix). Returns float32 logits
        [B, K, V] and medusa logits [H, B, K, V] (K = S, or the given [B, K] positions), or None
        for the latter with `with_heads=False`. The new tokens' KV stays pending until `commit`."""
        raise NotImplementedError

    def draft(self, rows: torch.Tensor, counts: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """The drafter's seam (medusa_trt/drafters/): its logits [H, B, V] for the next tree, once a
        step, after `commit`. rows [B, A]: the rows (of K) of the last forward that sequence b just
        committed, the first counts[b] of them, in order; next_tokens [B, A]: the token chosen after
        each (the last one: the next tree's root). A drafter that reads hidden states alone (Medusa)
        drafts at each sequence's last committed row; one with a cache of its own appends every
        committed row to it (and never rolls back). After a prefill the rows are the ones the
        prefill's forward kept: each prompt's last token, or with `info.drafter_cache` every prompt
        row (row j of sequence b is its prompt's token j, counts = the prompt lengths; with
        `info.hidden_all_rows` the forward kept every row however few logits it computed)."""
        raise NotImplementedError

    def commit(self, slots: torch.Tensor, counts: torch.Tensor) -> None:
        """Keeps, for sequence b, pending tokens slots[b, :counts[b]] (in order) after its prefix."""
        raise NotImplementedError

    def keep(self, rows: torch.Tensor) -> None:
        """Drops every sequence not in `rows` (finished sequences stop costing work)."""
        raise NotImplementedError

    def fused_step(self, input_ids: torch.Tensor, position_ids: torch.Tensor, new_mask: torch.Tensor,
                   retrieve: torch.Tensor, candidate_index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Greedy decoding in one call per step, where fused_step_topk is set: verifies the tree,
        accepts and drafts the next tree (the math of medusa_trt/acceptance.py). retrieve is [N, D+1]
        for the batch, or [B, N, D+1] per sequence where fused_step_dynamic. Returns best path [B],
        accepted draft tokens [B] and the next tree's tokens [B, 1 + C], then (fused_step_dynamic)
        the drafter's top-k ids and log-probs [B, H, k] at the new root, H = min(D, heads); the new
        tokens' KV stays pending until `commit`."""
        raise NotImplementedError(f"{type(self).__name__} has no fused step (fused_step_topk is None)")

    def open_sessions(self) -> None:
        """Opens now whatever the backend would open on first use, as a server does at load so that
        no request pays for it. Nothing to open by default."""


def last_rows(rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """[B] each sequence's last committed row of a `draft` call: rows[b, counts[b] - 1]."""
    return rows[torch.arange(len(rows)), counts - 1]


def drafter_inputs(hidden: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor, next_tokens: torch.Tensor,
                   lengths: torch.Tensor) -> dict[str, torch.Tensor]:
    """The drafter graph's inputs but its cache (engines/onnx/export.py, _DrafterModule; both engine
    backends): each sequence's committed rows of the last forward's `hidden` [B, S, d] (rows [B, C],
    counts [B]), the token chosen after each, positions after the drafter's `lengths` [B] committed
    rows, a causal mask among them and the last row to draft at. Rows past counts[b] are padding:
    they attend only themselves and are never committed. `hidden` stays on its device; the rest is
    host tensors."""
    b, c = len(rows), int(counts.max())
    j = torch.arange(c)
    valid = j[None] < counts[:, None]  # [B, C]
    idx = torch.where(valid, rows[:, :c], 0).to(hidden.device)
    mask = (torch.ones(c, c, dtype=torch.bool).tril()[None] & valid[:, None, :]) | torch.eye(c, dtype=torch.bool)
    return {"hidden": hidden[torch.arange(b, device=hidden.device)[:, None], idx],  # [B, C, d]
            "next_tokens": torch.where(valid, next_tokens[:, :c], 0).long(),
            "position_ids": lengths[:, None] + j, "past_lengths": lengths, "new_mask": mask.expand(b, c, c),
            "last": counts - 1}


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
    if len(counts) == 1:  # batch 1, the latency case: two slice copies, cheaper than the indexed path
        c, start = int(counts[0]), int(lengths[0])
        if c == 0:  # a finished or empty row keeps nothing: a legal commit, and there is no first slot to read
            return lengths + counts
        if keys.is_cpu and keys.dtype != torch.bfloat16:
            # Through numpy views, with as few calls as possible: a commit follows every step, when the
            # engine's run has evicted the host code's caches and each small call is costly
            # (docs/benchmarks/issue-13-int4.md, host overhead).
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
