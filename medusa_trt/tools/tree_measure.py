"""What medusa-tune-tree measures on an engine before it chooses a tree (tools/tune_tree.py): the
drafter's accuracy on calibration text, the step time of every tree size on this machine, and the
rest of a real decoding step beyond the backend's compute (host work)."""

from __future__ import annotations

import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from medusa_trt.tools.train_heads import rank_hits
from medusa_trt.tree import CANDIDATE_TOPK, StepTree

BLOCK = 4  # steps timed back to back per tree size and repetition


# -- head accuracy -------------------------------------------------------------------------------


@dataclass
class HeadAccuracy:
    accuracy: list[list[float]]  # [H][topk]: P(rank r of head k is the greedy token), not cumulative
    positions: list[int]  # [H] positions measured per head
    base_agreement: float  # one forward's argmax at each continuation row == the decoded token (a sanity check, ~1.0)
    # Per calibration sequence, per continuation position t: the rank of the true token in each
    # head's top-k (-1: not there). Enough to replay decoding with any tree exactly.
    rank_paths: list[list[tuple[int, ...]]] = field(default_factory=list)

    @property
    def top1(self) -> list[float]:
        return [row[0] for row in self.accuracy]


def measure_head_accuracy(backend, prompts: list[list[int]], max_new_tokens: int = 128,
                          stop_token_ids: tuple[int, ...] = (), topk: int = CANDIDATE_TOPK,
                          progress: bool = True) -> tuple[HeadAccuracy, list[list[int]]]:
    """Head accuracies on the base's greedy continuations of `prompts` (tools/tune_tree.py's module
    docstring says what is counted).
    Also returns each prompt + continuation."""
    from tqdm import tqdm

    from medusa_trt.runtime.decoding import GenerationConfig, decode
    from medusa_trt.runtime.steps import drafts_at_every_row

    heads = backend.info.num_medusa_heads
    if heads == 0:
        raise ValueError("this engine has no Medusa heads: there is no tree to tune")
    hits = torch.zeros(heads, topk, dtype=torch.long)
    counts = torch.zeros(heads, dtype=torch.long)
    agree, total = 0, 0
    seqs, rank_paths = [], []
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, use_medusa=False, stop_token_ids=stop_token_ids)
    for p in tqdm(prompts, desc="head accuracy", disable=not progress, leave=False, file=sys.stderr):
        seq = list(p) + decode(backend, [p], cfg).tokens[0]
        seqs.append(seq)
        # Row t of the continuation: the hidden state at position first + t, whose base argmax is
        # the t-th generated token (the root of a step starting there) and whose head k predicts
        # the token at first + t + 2 + k.
        s, first = len(seq), len(p) - 1
        if s - first < 2:
            continue
        backend.start(1, s)
        ids = torch.tensor([seq])
        positions = torch.arange(s)[None]
        if backend.info.drafter_cache:
            logits, medusa = drafts_at_every_row(backend, ids, first)
        else:
            logits, medusa = backend.forward(ids, positions, torch.ones(s, s, dtype=torch.bool).tril()[None],
                                             torch.arange(first, s - 1)[None])  # [1, K, V], [H, 1, K, V]
        t = torch.arange(first, s - 1)  # [K]
        agree += int((logits[0].argmax(-1) == ids[0, t + 1]).sum())
        total += len(t)
        target_pos = t[None, :] + 2 + torch.arange(heads)[:, None]  # [H, K]
        valid = target_pos < s
        targets = torch.where(valid, ids[0, target_pos.clamp(max=s - 1)], -1)
        hits += rank_hits(medusa[:, 0], targets, topk)
        counts += valid.sum(1)
        top = medusa[:, 0].topk(min(topk, medusa.shape[-1]), dim=-1).indices  # [H, K, k]
        found = top == targets[..., None]
        rank = torch.where(found.any(-1), found.float().argmax(-1), -1)  # [H, K], -1: not in the top-k
        rank_paths.append([tuple(r) for r in rank.T.tolist()])
    if int(counts.max()) == 0:
        raise ValueError("calibration produced no positions: prompts need continuations of at least 3 tokens "
                         "(raise --max-new-tokens or check the stop tokens)")
    acc = (hits.double() / counts.clamp(min=1)[:, None]).tolist()
    return HeadAccuracy(acc, counts.tolist(), agree / max(total, 1), rank_paths), seqs



# -- step time -----------------------------------------------------------------------------------


@dataclass
class StepTimes:
    """Time of one decoding step on this machine: a tree step as a function of its tokens T (root
    included) and a plain step."""

    forward_ms: list[float]  # [T-1] backend compute of a tree step, T = 1..max, made non-decreasing
    raw_forward_ms: list[float]  # the medians as measured
    plain_forward_ms: float  # backend compute of a plain step
    # The rest of a step beyond those compute times (host work, mostly), from real decodes:
    host_plain_ms: float  # of a plain step
    host_tree_ms: tuple[float, float]  # of a tree step: a + b * T

    @property
    def max_tokens(self) -> int:
        return len(self.forward_ms)

    def plain_ms(self) -> float:
        return self.plain_forward_ms + self.host_plain_ms

    def tree_ms(self, tokens: int) -> float:
        if not 1 <= tokens <= self.max_tokens:
            raise ValueError(f"tree of {tokens} tokens is outside the measured range 1..{self.max_tokens}")
        a, b = self.host_tree_ms
        return self.forward_ms[tokens - 1] + max(0.0, a + b * tokens)


def non_decreasing(values: Sequence[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators). More tree
    tokens never cost less; a dip in the measured medians is noise from the rest of the machine."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    out: list[float] = []
    for s, c in blocks:
        out.extend([s / c] * int(c))
    return out


def measure_forward_ms(backend, context: list[int], max_tokens: int, reps: int = 7, seed: int = 0,
                       progress: bool = True) -> tuple[list[float], float]:
    """Median ms of the backend compute of one decoding step after a committed `context` (a
    realistic cache length), the calls the decoding loop's own step makes (steps.step_plan): a
    greedy tree step of T = 1..max_tokens tokens, and a plain step. Each repetition runs every size
    once, as a short block of steps, in a shuffled order so drift on a shared machine spreads
    evenly. Returns (tree step ms per T, plain step ms)."""
    from tqdm import tqdm

    from medusa_trt.runtime.decoding import GenerationConfig
    from medusa_trt.runtime.steps import step_plan

    # A two-call step of a drafter with its own cache appends a row to it at every timed call.
    extra = reps * (max_tokens + 1) * (BLOCK + 1) if backend.info.drafter_cache else 0
    backend.start(1, len(context) + max_tokens + 1 + extra)
    n = len(context)
    pos = torch.arange(n)[None]
    backend.forward(torch.tensor([context]), pos, torch.ones(n, n, dtype=torch.bool).tril()[None],
                    torch.tensor([[n - 1]]))
    backend.commit(pos, torch.tensor([n]))
    first_row, one = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    trees = {t: _timing_tree(t, backend.info.num_medusa_heads, backend.fused_step_topk or CANDIDATE_TOPK)
             for t in range(1, max_tokens + 1)}
    plans = {t: step_plan(backend, GenerationConfig(), tree) for t, tree in trees.items()}
    plans[0] = step_plan(backend, GenerationConfig(use_medusa=False), None)

    def step(t: int, tree: bool) -> float:
        ids = torch.tensor([(context * (t // n + 1))[:t]])
        plan = plans[t if tree else 0]
        t0 = time.perf_counter()
        plan.compute(ids, n + torch.arange(t)[None], trees[t] if tree else None)
        if plan.kind == "two_call":  # the drafter after acceptance, at the committed row
            backend.draft(first_row, one, ids[:, :1])
        return time.perf_counter() - t0

    rng = random.Random(seed)
    sizes: list[int] = [0, *range(1, max_tokens + 1)]  # 0: the plain step
    times: dict[int, list[float]] = {t: [] for t in sizes}
    for _ in tqdm(range(reps), desc="step time", disable=not progress, leave=False, file=sys.stderr):
        rng.shuffle(sizes)
        for t in sizes:
            # A block of identical steps, the first one dropped: a real decode repeats one pattern,
            # so its caches hold what that pattern touches (a plain step never loads the heads).
            block = [step(max(t, 1), tree=t > 0) for _ in range(BLOCK + 1)]
            times[t].extend(block[1:])
    med = {t: 1e3 * statistics.median(v) for t, v in times.items()}
    return [med[t] for t in range(1, max_tokens + 1)], med[0]


def _timing_tree(t: int, heads: int, topk: int) -> StepTree:
    """A tree of t slots to time steps with, causal like a chain: one path as deep as the heads
    allow; the candidates' values do not change the cost. One slot is a tree cut to its root, as
    the decoding loop runs it (StepTree.within_block): the full-depth path -1 padded."""
    depth = max(min(t - 1, heads), 1)
    retrieve = torch.full((1, depth + 1), -1, dtype=torch.long)
    retrieve[0, : min(depth, t - 1) + 1] = torch.arange(min(depth, t - 1) + 1)
    index = torch.arange(max(t - 1, 1)) % (depth * topk)
    return StepTree(t, t - 1, topk, index, torch.arange(t), torch.ones(t, t, dtype=torch.bool).tril(), retrieve)



# -- real decoding steps ----------------------------------------------------------------------------


def decode_steps_ms(timer, prompt: list[int], cfg) -> list[tuple[float, float]]:
    """(wall ms, backend compute ms) of each decoding step (between the loop's yields), the first
    step (which holds the prefill) left out."""
    from medusa_trt.runtime.decoding import generate

    timer.reset()
    out = []
    last_t, last_calls = None, 0
    for _ in generate(timer, [prompt], cfg):
        now, calls = time.perf_counter(), len(timer.calls)
        if last_t is not None:
            out.append((1e3 * (now - last_t), 1e3 * sum(dt for _, dt, _ in timer.calls[last_calls:calls])))
        last_t, last_calls = now, calls
    return out


def measure_decode_steps(backend, prompts: list[list[int]], trees: list, max_new_tokens: int,
                         stop_token_ids: tuple[int, ...]) -> dict[int, dict[str, float]]:
    """Median wall ms and host ms (outside the backend's compute) per step of real decodes: plain
    (key 0) and each tree (key: its tokens). Medians over single steps: a busy machine preempts some
    steps, not all."""
    from medusa_trt.runtime.decoding import GenerationConfig
    from medusa_trt.tools.bench import ForwardTimer
    from medusa_trt.tree import build_tree

    timer = ForwardTimer(backend)
    configs = {0: GenerationConfig(max_new_tokens=max_new_tokens, use_medusa=False, stop_token_ids=stop_token_ids)}
    for tree in trees:
        tokens = build_tree(tree, backend.info.num_medusa_heads).num_slots
        configs[tokens] = GenerationConfig(max_new_tokens=max_new_tokens, medusa_choices=tree,
                                           stop_token_ids=stop_token_ids)
    samples: dict[int, list[tuple[float, float]]] = {k: [] for k in configs}
    for cfg in configs.values():  # warm-up
        decode_steps_ms(timer, prompts[0], GenerationConfig(**{**asdict(cfg), "max_new_tokens": 4}))
    for p in prompts:  # interleaved, so drift on a shared machine hits every configuration
        for k, cfg in configs.items():
            samples[k].extend(decode_steps_ms(timer, p, cfg))
    return {k: {"wall": statistics.median(w for w, _ in v), "host": statistics.median(w - c for w, c in v)}
            for k, v in samples.items() if v}


def fit_line(points: dict[int, float]) -> tuple[float, float]:
    xs, ys = list(points), list(points.values())
    if len(xs) == 1:
        return ys[0], 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b
