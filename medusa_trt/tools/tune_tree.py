"""medusa-tune-tree: the Medusa tree that is fastest on this engine and this machine.

Two measurements, then a choice:

1. Head accuracy on calibration text. The base decodes each calibration prompt greedily on the
   engine; one forward over prompt + continuation then gives every head's logits at every position
   t. Rank r of head k is correct at t when its rank-r token equals the greedy token at t+2+k, the
   only token greedy verification can accept there. accuracy[k][r] = fraction of positions. The
   rank of the true token per head and position is kept too: with it, decoding with any tree can
   be replayed exactly on the calibration continuations (`simulate`).
2. Step time on this machine: the backend's compute for a tree step of T = 1..max tokens and for a
   plain step (back-to-back blocks, medians over shuffled repetitions, made non-decreasing in T),
   plus the rest of a real step (host work: top-k, acceptance, KV compaction), measured on real
   plain and Medusa decodes and linear in T.

The tree: the Medusa paper's greedy construction adds, one node at a time, the node with the
highest expected acceptance, the product of the per-rank accuracies along its path; every prefix of
that order is a tree, and with greedy acceptance its expected tokens per step is 1 + the sum of its
nodes' values. Heads are not independent and steps do not start at random positions (they start
where the last one missed), so with calibration rows at hand the candidates also include orders by
measured joint acceptance (over all rows, then over the rows where steps start), and every
candidate's tokens per step comes from the replay. The size chosen is the one with the most
expected tokens per millisecond, not the most tokens per step: a tree too large for the hardware is
why users see "Medusa slower than baseline". If no tree is predicted to beat plain decoding (or, when
the tree is then measured, if it measured no faster than plain), that is said and plain decoding is
recommended.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from medusa_trt.tools.tree_measure import (
    StepTimes,
    fit_line,
    measure_decode_steps,
    measure_forward_ms,
    measure_head_accuracy,
    non_decreasing,
)
from medusa_trt.tree import CANDIDATE_TOPK, DEFAULT_TREE

# Ranks measured per head default to CANDIDATE_TOPK, so a tuned tree keeps the runtime's shared top-k
# (and the fused step graph); DEFAULT_TREE is what the tuned tree is compared with. The measurements
# themselves are in tools/tree_measure.py.


# -- the greedy construction ----------------------------------------------------------------------


def greedy_tree(accuracy: Sequence[Sequence[float]], max_nodes: int) -> list[tuple[tuple[int, ...], float]]:
    """Nodes in the order the greedy construction adds them, with their expected acceptance.

    A node's value is the product of accuracy[depth][rank] along its path. A child never beats its
    parent (accuracies <= 1) and enters the frontier only once the parent is in, so every prefix of
    the result is a valid tree. Ties go to the lexicographically smaller path (deterministic)."""
    heads = len(accuracy)
    frontier = [(-float(accuracy[0][r]), (r,)) for r in range(len(accuracy[0]))] if heads else []
    heapq.heapify(frontier)
    nodes: list[tuple[tuple[int, ...], float]] = []
    while frontier and len(nodes) < max_nodes:
        neg, path = heapq.heappop(frontier)
        nodes.append((path, -neg))
        depth = len(path)
        if depth < heads:
            for r, a in enumerate(accuracy[depth]):
                heapq.heappush(frontier, (neg * float(a), (*path, r)))
    return nodes


def expected_tokens_per_step(accuracy: Sequence[Sequence[float]], tree: Sequence[Sequence[int]]) -> float:
    """1 (the bonus token) + sum over nodes of the product of per-rank accuracies along the path;
    ranks beyond the measured top-k count as never right."""
    total = 1.0
    for path in tree:
        value = 1.0
        for depth, rank in enumerate(path):
            row = accuracy[depth] if depth < len(accuracy) else []
            value *= float(row[rank]) if rank < len(row) else 0.0
        total += value
    return total


def accepted_length(path: tuple[int, ...], tree: set[tuple[int, ...]]) -> int:
    """Draft tokens greedy verification accepts at a position whose true tokens sit at ranks `path`:
    the longest prefix of `path` that is a node of the tree."""
    depth = 0
    while depth < len(path) and path[: depth + 1] in tree:
        depth += 1
    return depth


def simulate(rank_paths: list[list[tuple[int, ...]]], tree: Sequence[Sequence[int]]) -> tuple[float, list[list[int]]]:
    """Replays Medusa decoding of the calibration continuations with `tree`: a step at row t emits
    its root and the accepted drafts, the next step starts at the last accepted token. Exact for
    greedy acceptance (the heads' predictions at each row do not depend on the tree). Returns
    (tokens per step, the rows where steps started, per sequence)."""
    nodes = {tuple(p) for p in tree}
    tokens = steps = 0
    starts = []
    for rows in rank_paths:
        t, here = 0, []
        while t < len(rows):
            here.append(t)
            emitted = min(1 + accepted_length(rows[t], nodes), len(rows) - t)
            tokens += emitted
            steps += 1
            t += emitted
        starts.append(here)
    return tokens / max(steps, 1), starts


def joint_tree(rank_paths: list[list[tuple[int, ...]]], max_nodes: int,
               weights: list[list[float]] | None = None) -> list[tuple[tuple[int, ...], float]]:
    """The greedy construction with measured joint acceptance instead of a product of marginals:
    a node's value is the (weighted) fraction of rows whose true tokens follow its whole path.
    Heads are not independent (a right guess at depth 1 makes one at depth 2 likelier, or less), and
    `weights` can put the mass where steps actually start: after a miss more than mid-run."""
    value: dict[tuple[int, ...], float] = {}
    total = 0.0
    for i, rows in enumerate(rank_paths):
        for t, path in enumerate(rows):
            w = weights[i][t] if weights is not None else 1.0
            total += w
            if w == 0:
                continue
            for d in range(len(path)):
                if path[d] < 0:  # a miss ends the path: nothing deeper can be accepted
                    break
                value[path[: d + 1]] = value.get(path[: d + 1], 0.0) + w
    # A child's value never exceeds its parent's, and on a tie the parent sorts first: every
    # prefix of this order is a tree.
    order = sorted(((-v / max(total, 1e-12), p) for p, v in value.items() if v > 0), key=lambda x: (x[0], len(x[1]), x[1]))
    return [(p, -v) for v, p in order[:max_nodes]]


# -- the choice ----------------------------------------------------------------------------------


@dataclass
class TreeChoice:
    medusa_choices: list[list[int]]
    recommendation: str  # "medusa" or "plain"
    nodes: int
    tokens_per_step: float  # expected
    step_ms: float  # expected
    speedup_vs_plain: float  # expected
    estimator: str  # "product": the paper's product of per-rank accuracies; "replay": decoding replayed
    construction: str  # which greedy order the tree is a prefix of
    by_size: list[dict]  # every prefix size of that order


def _sizes(order, steps: StepTimes, tokens_per_step) -> list[dict]:
    plain = steps.plain_ms()
    rows = []
    for n in range(1, len(order) + 1):
        expected = tokens_per_step([list(p) for p, _ in order[:n]])
        ms = steps.tree_ms(n + 1)
        rows.append({"nodes": n, "tokens_per_step": round(expected, 4), "step_ms": round(ms, 4),
                     "speedup_vs_plain": round(expected * plain / ms, 4)})
    return rows


def _usable(candidates: dict[str, list[dict]], required: bool = True) -> dict[str, list[dict]]:
    """The candidate orders that hold a node. An order is empty when no calibration row's true token
    was among the heads' top-k where it could be drafted (a joint order; any order of a chains-only
    engine whose heads never ranked it first); with none left, no tree can be chosen."""
    usable = {name: rows for name, rows in candidates.items() if rows}
    if required and not usable:
        raise ValueError("calibration gave no usable step: at no calibration position did the heads' top-k hold "
                         "the token a tree could accept; use more or longer prompts, a larger --max-new-tokens, "
                         "or heads trained for this base")
    return usable


def choose_tree(accuracy: Sequence[Sequence[float]], steps: StepTimes, max_nodes: int,
                rank_paths: list[list[tuple[int, ...]]] | None = None, rounds: int = 3,
                chains_only: bool = False) -> TreeChoice:
    """The tree with the most expected tokens per millisecond among the prefixes of greedy orders.
    `chains_only` (an engine exact for chains alone, engine.json onnx.chains_only): the candidates
    are the chains [0], [0, 0], ... up to the heads' depth (and max_nodes).

    Without `rank_paths`: the paper's construction and its estimate (products of per-rank
    accuracies). With them, tokens per step of every candidate come from replaying decoding on the
    calibration continuations, and the candidates also include joint-accuracy orders, first over
    all rows, then (for `rounds`) over the rows where the best tree so far starts its steps."""
    max_nodes = min(max_nodes, steps.max_tokens - 1)
    if max_nodes < 1:
        raise ValueError(f"step times cover {steps.max_tokens} token(s); a tree needs at least 2")

    def allowed(order: list[tuple[tuple[int, ...], float]]) -> list[tuple[tuple[int, ...], float]]:
        # A node never accepted (value 0, as are all below it) adds step time and no token: left out.
        return [(p, v) for p, v in order if v > 0]

    if chains_only:
        # The greedy order over rank 0 alone is the chain, one node per head. Not a full order cut to
        # its chain: max_nodes nodes of a full order are mostly branches, and the deeper chain nodes
        # would be lost with them. Every joint order's chain is this chain too: one order is enough.
        estimator = "product" if rank_paths is None else "replay"
        orders = {"chain": allowed(greedy_tree([row[:1] for row in accuracy], max_nodes))}
        per_step = (lambda tree: expected_tokens_per_step(accuracy, tree)) if rank_paths is None else \
            (lambda tree: simulate(rank_paths, tree)[0])
        candidates = _usable({"chain": _sizes(orders["chain"], steps, per_step)})
    elif rank_paths is None:
        estimator = "product"
        orders = {"product": allowed(greedy_tree(accuracy, max_nodes))}
        candidates = _usable({"product": _sizes(orders["product"], steps,
                                                lambda tree: expected_tokens_per_step(accuracy, tree))})
    else:
        estimator = "replay"
        replay = lambda tree: simulate(rank_paths, tree)[0]  # noqa: E731
        orders = {"product": allowed(greedy_tree(accuracy, max_nodes)),
                  "joint": allowed(joint_tree(rank_paths, max_nodes))}
        candidates = _usable({name: _sizes(order, steps, replay) for name, order in orders.items()})
        for r in range(rounds):
            name, rows = max(candidates.items(), key=lambda kv: max(row["speedup_vs_plain"] for row in kv[1]))
            best = max(rows, key=lambda row: row["speedup_vs_plain"])
            _, starts = simulate(rank_paths, [list(p) for p, _ in orders[name][: best["nodes"]]])
            weights = [[0.0] * len(rows_) for rows_ in rank_paths]
            for i, here in enumerate(starts):
                for t in here:
                    weights[i][t] = 1.0
            orders[f"joint@starts{r + 1}"] = allowed(joint_tree(rank_paths, max_nodes, weights))
            candidates.update(_usable({f"joint@starts{r + 1}": _sizes(orders[f"joint@starts{r + 1}"], steps, replay)},
                                      required=False))
    name, rows = max(candidates.items(), key=lambda kv: max(row["speedup_vs_plain"] for row in kv[1]))
    best = max(range(len(rows)), key=lambda i: (rows[i]["speedup_vs_plain"], -i))
    row = rows[best]
    tree = [list(path) for path, _ in orders[name][: best + 1]]
    return TreeChoice(tree, "medusa" if row["speedup_vs_plain"] > 1.0 else "plain", row["nodes"],
                      row["tokens_per_step"], row["step_ms"], row["speedup_vs_plain"], estimator, name, rows)


def predict(accuracy, steps: StepTimes, tree: Sequence[Sequence[int]],
            rank_paths: list[list[tuple[int, ...]]] | None = None) -> dict:
    """Expected tokens per step, step time and speedup over plain of any tree that fits (replayed on
    the calibration continuations when `rank_paths` is given, else the product estimate)."""
    tokens = len(tree) + 1
    expected = simulate(rank_paths, tree)[0] if rank_paths is not None else expected_tokens_per_step(accuracy, tree)
    ms = steps.tree_ms(tokens)
    out = {"nodes": len(tree), "tokens_per_step": round(expected, 4), "step_ms": round(ms, 4),
           "speedup_vs_plain": round(expected * steps.plain_ms() / ms, 4)}
    if rank_paths is not None:
        out["tokens_per_step_product_estimate"] = round(expected_tokens_per_step(accuracy, tree), 4)
    return out


# -- the whole procedure ---------------------------------------------------------------------------


def tune(backend, calib: list[list[int]], *, max_nodes: int = 64, max_new_tokens: int = 128,
         stop_token_ids: tuple[int, ...] = (), topk: int = CANDIDATE_TOPK, reps: int = 5,
         progress: bool = True) -> dict:
    """Measures accuracy and step times, chooses the tree; returns the tree.json content."""
    # Engines compute on their own threads; the few torch ops here would only contend with them
    # (the decoding loop does the same for its own ops).
    threads, saved = backend.host_threads, torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _tune(backend, calib, max_nodes, max_new_tokens, stop_token_ids, topk, reps, progress)
    finally:
        torch.set_num_threads(saved)


def _tune(backend, calib, max_nodes, max_new_tokens, stop_token_ids, topk, reps, progress) -> dict:
    from medusa_trt.tree import TreeError, main_chain, read_tree

    info = backend.info
    max_nodes = min(max_nodes, info.max_draft_len)
    if info.chains_only:  # the engine runs a tree's main chain: one node per head at most
        max_nodes = min(max_nodes, info.num_medusa_heads)
    acc, seqs = measure_head_accuracy(backend, calib, max_new_tokens, stop_token_ids, topk, progress)
    reference = None
    try:
        reference = read_tree(DEFAULT_TREE, info.num_medusa_heads, info.max_draft_len)
        reference = main_chain(reference) if info.chains_only else reference  # what this engine would run
    except TreeError:
        pass  # fewer heads or a smaller max_draft_len than the reference tree needs: no comparison
    # Cache length for the timings: the middle of a typical request, then one tree of up to `largest` rows.
    context = seqs[0][: len(calib[0]) + max_new_tokens // 2]
    room = info.max_seq_len - len(context) - 1
    if reference is not None and len(reference) + 1 > room:
        reference = None  # the reference tree does not fit this engine after the context: no comparison
    largest = max(max_nodes, len(reference) if reference else 0) + 1
    if largest > room:
        raise ValueError(f"the engine's max_seq_len {info.max_seq_len} leaves {room} positions after a timing context "
                         f"of {len(context)} tokens, too few for trees of {max_nodes} nodes; lower --max-nodes or "
                         "--max-new-tokens, or rebuild the engine with a larger --max-seq-len")
    raw, plain_ms = measure_forward_ms(backend, context, largest, reps, progress=progress)
    if info.chains_only:
        host_trees = [[[0] * (d + 1) for d in range(n)] for n in sorted({min(2, max_nodes), max_nodes})]
    else:
        host_trees = [[list(p) for p, _ in greedy_tree(acc.accuracy, n)] for n in sorted({min(4, max_nodes), max_nodes})]
    real = measure_decode_steps(backend, calib[: min(4, len(calib))], host_trees, min(max_new_tokens, 64),
                                stop_token_ids)
    curve = non_decreasing(raw)
    # The rest of a real step beyond the back-to-back compute curve: the host work, and what the
    # compute costs more inside a real decode (caches shared with the host's work). Measured on real
    # decodes of plain and two trees, linear in the tree tokens in between.
    rest_plain = real[0]["wall"] - plain_ms
    rest_tree = {t: real[t]["wall"] - curve[t - 1] for t in real if t}
    steps = StepTimes(curve, raw, plain_ms, rest_plain, fit_line(rest_tree))
    choice = choose_tree(acc.accuracy, steps, max_nodes, acc.rank_paths, chains_only=info.chains_only)
    predicted = {"tuned": {**{k: v for k, v in asdict(choice).items() if k not in ("medusa_choices", "by_size",
                                                                                  "recommendation")},
                           "tokens_per_step_product_estimate": round(
                               expected_tokens_per_step(acc.accuracy, choice.medusa_choices), 4)},
                 "plain": {"tokens_per_step": 1.0, "step_ms": round(steps.plain_ms(), 4), "speedup_vs_plain": 1.0}}
    if reference is not None:
        predicted[DEFAULT_TREE] = predict(acc.accuracy, steps, reference, acc.rank_paths)
        predicted["tuned_vs_" + DEFAULT_TREE] = round(
            choice.speedup_vs_plain / predicted[DEFAULT_TREE]["speedup_vs_plain"], 4)
    return {
        "medusa_choices": choice.medusa_choices,
        "recommendation": choice.recommendation,
        "predicted": predicted,
        "head_accuracy": {"rank_accuracy": [[round(a, 5) for a in row] for row in acc.accuracy],
                          "top1": [round(a, 4) for a in acc.top1], "positions": acc.positions,
                          "base_agreement": round(acc.base_agreement, 4)},
        "step_time_ms": {"heads_separate": True,  # every backend runs its heads at the accepted rows only
                         "fused_step": backend.fused_step_topk is not None,
                         "plain_forward": round(steps.plain_forward_ms, 4),
                         "forward": [round(v, 4) for v in steps.forward_ms],
                         "forward_raw": [round(v, 4) for v in steps.raw_forward_ms],
                         "rest_plain": round(steps.host_plain_ms, 4),
                         "rest_tree": {"a": round(steps.host_tree_ms[0], 4), "b_per_token": round(steps.host_tree_ms[1], 5)},
                         "real_decode_steps": {("plain" if k == 0 else f"T={k}"): {m: round(v, 4) for m, v in d.items()}
                                               for k, d in real.items()}},
        "by_size": choice.by_size,
    }


def format_report(result: dict) -> str:
    p = result["predicted"]
    t = p["tuned"]
    acc = result["head_accuracy"]
    lines = [
        f"head top-1 accuracy: {', '.join(f'{a:.3f}' for a in acc['top1'])} "
        f"({min(acc['positions'])}-{max(acc['positions'])} positions)",
        f"step time: plain {p['plain']['step_ms']:.3f} ms; tree compute T=2 {result['step_time_ms']['forward'][1]:.3f} ms, "
        f"T={len(result['step_time_ms']['forward'])} {result['step_time_ms']['forward'][-1]:.3f} ms"
        + (f"; a slot adds {result['slot_cost']:.3f} plain steps" if "slot_cost" in result else ""),
        f"tuned tree: {t['nodes']} nodes, predicted {t['tokens_per_step']:.2f} tokens/step, {t['step_ms']:.3f} ms/step, "
        f"{t['speedup_vs_plain']:.2f}x vs plain",
    ]
    if DEFAULT_TREE in p:
        r = p[DEFAULT_TREE]
        lines.append(f"{DEFAULT_TREE}: predicted {r['tokens_per_step']:.2f} tokens/step, {r['step_ms']:.3f} ms/step, "
                     f"{r['speedup_vs_plain']:.2f}x vs plain; tuned / {DEFAULT_TREE} = {p['tuned_vs_' + DEFAULT_TREE]:.2f}x")
    m = result.get("measured")
    if m:
        line = (f"measured on {m['num_prompts']} prompts ({m['data']}): tuned {m['tuned']['tokens_per_step']:.2f} "
                f"tokens/step, {m['tuned']['speedup']:.2f}x vs plain")
        if DEFAULT_TREE in m:
            r = m[DEFAULT_TREE]
            line += (f"; {DEFAULT_TREE} {r['tokens_per_step']:.2f} tokens/step, {r['speedup']:.2f}x vs plain; "
                     f"tuned / {DEFAULT_TREE} = {m['tuned_vs_' + DEFAULT_TREE]:.2f}x")
        lines.append(line)
    for name, r in (m or {}).items():
        if name.startswith("dynamic:"):
            lines.append(f"per-step trees {name}: {r['tokens_per_step']:.2f} tokens/step, {r['speedup']:.2f}x vs plain")
    if "choice" in result:
        lines.append(f"chosen: {result['choice']['chosen']} ({result['choice']['why']})")
    if result["recommendation"] == "plain" and "speedup_vs_plain" in result.get("choice", {}):
        lines.append(f"warning: the chosen tree measured no faster than plain decoding on this engine and machine "
                     f"({result['choice']['speedup_vs_plain']:.2f}x); use plain decoding (medusa-run --no-medusa)")
    elif result["recommendation"] == "plain":
        lines.append(f"warning: no tree is predicted to beat plain decoding on this engine and machine (best "
                     f"{t['speedup_vs_plain']:.2f}x); use plain decoding (medusa-run --no-medusa)")
    return "\n".join(lines)


def dump_json(obj, level: int = 0) -> str:
    """JSON with every container of scalars on one line (a tree path, a row of accuracies, one
    tree size's prediction) and the rest indented: small diffs, readable by eye."""
    scalar = (str, int, float, bool, type(None))
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list) else None
    if items is None or all(isinstance(v, scalar) for v in items):
        return json.dumps(obj) + ("\n" if level == 0 else "")
    pad, inner = " " * level, " " * (level + 1)
    if isinstance(obj, dict):
        body = ",\n".join(f"{inner}{json.dumps(k)}: {dump_json(v, level + 1)}" for k, v in obj.items())
        text = "{\n" + body + "\n" + pad + "}"
    else:
        text = "[\n" + ",\n".join(inner + dump_json(v, level + 1) for v in obj) + "\n" + pad + "]"
    return text + ("\n" if level == 0 else "")
