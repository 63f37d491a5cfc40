"""The Medusa decoding loop, shared by every backend.

Each step: candidates from the base argmax (root) and each head's top-k at the last accepted
position, one forward over all tree slots with the tree mask, acceptance (greedy, typical or
sample), commit of the accepted slots' KV, and the next root is the base model's pick (argmax, or
a draw under `sample`) at the last accepted slot. Greedy acceptance emits exactly the tokens plain
greedy decoding would; sample acceptance emits tokens distributed exactly as plain sampling would.
This module holds the loop, its config and its statistics; the steps themselves, and the choice of
which one a decode runs, are runtime/steps.py's.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from medusa_trt.runtime.backend import Backend, ModelInfo
from medusa_trt.runtime.config import GenerationConfig, is_int
from medusa_trt.runtime.dynamic import Context, DynamicTree, dynamic_tree
from medusa_trt.runtime.steps import Sampler, step_plan
from medusa_trt.tree import DEFAULT_TREE, StepTree, TreeError, build_tree, candidate_topk, tree_for_engine


@dataclass
class SequenceStats:
    steps: int = 0
    new_tokens: int = 0
    accepted_draft_tokens: int = 0
    draft_tokens: int = 0  # tree nodes verified (root excluded), as TensorRT-LLM counts them
    accepted_per_depth: list[int] = field(default_factory=list)  # steps whose path reached depth d+1
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def as_dict(self) -> dict:
        return {
            "steps": self.steps, "new_tokens": self.new_tokens, "tokens_per_step": round(self.tokens_per_step, 4),
            "accepted_draft_tokens": self.accepted_draft_tokens, "draft_tokens": self.draft_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4), "accepted_per_depth": self.accepted_per_depth,
            "prefill_s": round(self.prefill_s, 6), "decode_s": round(self.decode_s, 6),
        }


@dataclass
class StepOutput:
    """Tokens each sequence gained in one step (empty for finished ones), for streaming."""

    new_tokens: list[list[int]]
    finished: list[bool]


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # new tokens per sequence (stop token included when hit)
    stats: list[SequenceStats]


def resolve_tree(info: ModelInfo, medusa_choices: object = None) -> tuple[object, str]:
    """The tree a decode runs and a one-line description of it, for the commands to print: the one
    given; else the one the engine records (medusa-build --tree); else DEFAULT_TREE cut to the engine."""
    if medusa_choices is not None:
        # A name, spec or file (str or Path) describes itself; a list of paths is counted.
        if not isinstance(medusa_choices, (str, os.PathLike, list, tuple, np.ndarray)):
            raise TreeError(f"medusa_choices: got {type(medusa_choices).__name__} {medusa_choices!r:.60}; expected a "
                            "preset name, a list of paths, a string or a file path")
        given = medusa_choices if isinstance(medusa_choices, (str, os.PathLike)) else \
            f"{len(medusa_choices)} paths given"
        return medusa_choices, str(given)
    if isinstance(info.tree, str):
        return info.tree, f"{info.tree} ({info.tree_source or 'trees chosen per step'}, recorded in the engine by " \
                          "medusa-build --tree)"
    if info.tree:
        return [list(p) for p in info.tree], f"{info.tree_source or 'the tree'} ({len(info.tree)} nodes, recorded " \
                                             "in the engine by medusa-build --tree)"
    nodes = [list(p) for p in tree_for_engine(info.num_medusa_heads, info.max_draft_len).nodes]
    return nodes, (f"{DEFAULT_TREE} cut to the engine ({len(nodes)} nodes; the engine records no tree: tune one with "
                   "medusa-tune-tree and rebuild with medusa-build --tree)")


def step_tree(info: ModelInfo, medusa_choices: object = None, context: bool = True,
              slot_cost: float | None = None) -> StepTree | DynamicTree:
    """The tree a decode of `medusa_choices` (resolve_tree) runs on this engine, checked against it
    (heads, max_draft_len, vocabulary); a bad tree raises here, before any decoding. "dynamic:N"
    gives the DynamicTree of per-step trees (with context candidates unless `context` is False)."""
    spec = resolve_tree(info, medusa_choices)[0]
    dynamic = dynamic_tree(spec, info.num_medusa_heads, candidate_topk(info.vocab_size), info.max_draft_len,
                           info.chains_only, context, slot_cost)
    if dynamic is not None:
        return dynamic
    return StepTree.of(build_tree(spec, info.num_medusa_heads, info.max_draft_len, info.chains_only), info.vocab_size)


def check_prompts(prompts: object, vocab_size: int) -> None:
    """Refuses (ValueError) prompts that are not a non-empty list of non-empty token id lists within
    the vocabulary: an id past it fails deep inside a kernel, and a negative one an engine's
    embedding lookup reads from the end of the table, a silently wrong prompt."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts {prompts!r:.60}: expected a non-empty list of token id lists")
    for i, p in enumerate(prompts):
        if not isinstance(p, (list, tuple)) or not p:
            raise ValueError(f"prompt {i}: {p!r:.60}; expected a non-empty list of token ids "
                             "(every prompt needs at least one token)")
        j = next((j for j, t in enumerate(p) if not (is_int(t) and 0 <= t < vocab_size)), None)
        if j is not None:
            raise ValueError(f"prompt {i}: token {p[j]!r:.40} at position {j}; expected integer ids in "
                             f"0..{vocab_size - 1}")


def check_room(info: ModelInfo, prompts: list[list[int]], max_new_tokens: int) -> int:
    """Refuses a decode whose longest prompt and new tokens pass the engine's max_seq_len
    (ValueError), before any work (medusa-run prints its tree line only after it): plain decoding's
    rule, which Medusa keeps by cutting its last steps' trees (StepTree.within_room). Returns the
    longest prompt's length."""
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > info.max_seq_len:
        raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                         f"maximum sequence length {info.max_seq_len}")
    return longest


def _seeds(cfg: GenerationConfig, n: int, seeds: list[int] | None) -> list[int]:
    if seeds is not None:
        if not isinstance(seeds, (list, tuple)) or len(seeds) != n or \
                not all(is_int(s) and 0 <= s < 2**63 for s in seeds):
            raise ValueError(f"seeds {seeds!r:.80}: expected {n} integers in [0, 2**63), one per prompt")
        return [int(s) for s in seeds]
    base = cfg.seed if cfg.seed is not None else secrets.randbelow(2**62)  # torch's global RNG is fixed-seeded
    return [base + i for i in range(n)]


def generate(backend: Backend, prompts: list[list[int]], cfg: GenerationConfig,
             stats: list[SequenceStats] | None = None, seeds: list[int] | None = None) -> Iterator[StepOutput]:
    """Decodes all prompts together, yielding each step's new tokens. `stats` (one per prompt) is
    filled in place when given. `seeds` (one per prompt, `sample` only) replaces cfg.seed + i."""
    # An engine computes on its own threads; the loop's torch ops are tiny, and more torch threads
    # only contend with the engine for the same cores, which slows its steps several times.
    threads = backend.host_threads
    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield from _generate(backend, prompts, cfg, stats, seeds)
    finally:
        torch.set_num_threads(saved)


def _generate(backend: Backend, prompts: list[list[int]], cfg: GenerationConfig,
              stats: list[SequenceStats] | None, seeds: list[int] | None) -> Iterator[StepOutput]:
    info = backend.info
    check_prompts(prompts, info.vocab_size)
    if cfg.stop_token_ids and max(cfg.stop_token_ids) >= info.vocab_size:
        raise ValueError(f"stop_token_ids {list(cfg.stop_token_ids)}: token id {max(cfg.stop_token_ids)} is beyond the "
                         f"vocabulary; expected ids in 0..{info.vocab_size - 1}")
    if cfg.use_medusa and info.num_medusa_heads == 0:
        raise ValueError("this model has no Medusa heads; decode with use_medusa=False")
    tree = step_tree(info, cfg.medusa_choices, cfg.context_candidates, cfg.slot_cost) if cfg.use_medusa else None
    plan = step_plan(backend, cfg, tree)
    depth = tree.max_depth if tree else 0
    longest, n = check_room(info, prompts, cfg.max_new_tokens), len(prompts)
    sampler = Sampler(cfg, _seeds(cfg, n, seeds)) if cfg.acceptance == "sample" else None
    stats = stats if stats is not None else [SequenceStats() for _ in prompts]
    width = tree.num_slots if tree else 1
    if isinstance(tree, DynamicTree) and plan.kind == "fused":  # it pads every path to the heads' depth, and a
        width = max(width, tree.heads + 1)  # drafter with a cache of its own appends that many rows (dynamic:1: 5 > 2)
    # A step writes its slots after the committed rows, and a drafter with a cache of its own its
    # padded path (width rows at most): within_room keeps every slot below max_seq_len, so no cache
    # needs more than max_seq_len + width (a TensorRT engine's profile allows max_draft_len + 1 more).
    backend.start(n, min(longest + cfg.max_new_tokens + 1, info.max_seq_len) + width)

    t0 = time.perf_counter()
    carry = plan.prefill(prompts, sampler)
    if isinstance(tree, DynamicTree) and tree.context:
        carry.context = Context.of(prompts, backend.datastore if cfg.datastore else None)
    for s in stats:
        s.prefill_s = time.perf_counter() - t0
        s.accepted_per_depth = [0] * depth

    active = torch.arange(n)  # prompt index of each row still in the backend
    produced = [0] * n
    stop = set(cfg.stop_token_ids if cfg.stop_token_ids is not None else info.stop_token_ids)
    while len(active):
        t_step = time.perf_counter()
        step = tree.within_block(backend.lengths, info.key_block).within_room(backend.lengths, info.max_seq_len) \
            if tree is not None else None
        emitted, accepted, carry = plan.step(step, carry, sampler)
        kept = accepted.tolist() if tree is not None else None
        elapsed = time.perf_counter() - t_step
        out = [[] for _ in range(n)]
        finished = [False] * n
        still = []
        for row, idx in enumerate(active.tolist()):
            toks = emitted[row][: cfg.max_new_tokens - produced[idx]]
            hit = next((i for i, t in enumerate(toks) if t in stop), None)
            if hit is not None:
                toks = toks[: hit + 1]
            produced[idx] += len(toks)
            out[idx] = toks
            if tree is not None:  # the drafts it kept: none past a stop token or max_new_tokens
                _count_accepted(stats[idx], carry.slots_of(row) or step.num_slots, min(kept[row], len(toks) - 1))
            st = stats[idx]
            st.steps += 1
            st.new_tokens += len(toks)
            st.decode_s += elapsed
            finished[idx] = hit is not None or produced[idx] >= cfg.max_new_tokens
            if not finished[idx]:
                still.append(row)
        yield StepOutput(out, finished)
        if len(still) < len(active):
            rows = torch.tensor(still, dtype=torch.long)
            backend.keep(rows)
            active = active[rows]
            carry = carry.keep(rows)
            if sampler:
                sampler.keep(rows)


def decode(backend: Backend, prompts: list[list[int]], cfg: GenerationConfig) -> GenerationResult:
    """Non-streaming `generate`: the new tokens and statistics of every prompt."""
    stats = [SequenceStats() for _ in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    for step in generate(backend, prompts, cfg, stats):
        for i, t in enumerate(step.new_tokens):
            tokens[i].extend(t)
    return GenerationResult(tokens, stats)


def _count_accepted(st: SequenceStats, slots: int, accepted: int) -> None:
    st.accepted_draft_tokens += accepted
    st.draft_tokens += slots - 1
    for d in range(accepted):
        st.accepted_per_depth[d] += 1

