"""Static tree or per-step trees: what medusa-tune-tree measures beside its tuned static tree (the
budgets, each with the engine's own slot cost) and which of them it writes (runtime/dynamic.py)."""

from __future__ import annotations

from medusa_trt.dynamic_spec import dynamic_spec
from medusa_trt.tools.tree_measure import fit_line
from medusa_trt.tree import candidate_topk


def budget_limit(info, max_nodes: int | None = None) -> int:
    """The largest per-step budget the engine (max_draft_len) and its drafter (heads x top-k) allow,
    and at most `max_nodes` when given."""
    limit = min(info.max_draft_len, info.num_medusa_heads * candidate_topk(info.vocab_size))
    return limit if max_nodes is None else min(limit, max_nodes)


def check_budgets(asked: list[int] | None, info) -> None:
    """--budgets the engine cannot run are refused (ValueError), not dropped without a word."""
    limit = budget_limit(info)
    if asked and (beyond := [n for n in asked if n > limit]):
        raise ValueError(f"--budgets {','.join(map(str, asked))}: {beyond[0]} is beyond what this engine and drafter "
                         f"verify; expected budgets in 1..{limit} (max_draft_len {info.max_draft_len}, "
                         f"{info.num_medusa_heads} heads x top-{candidate_topk(info.vocab_size)})")


def budgets_for(nodes: int, info, asked: list[int] | None = None, max_nodes: int | None = None) -> list[int]:
    """The per-step budgets medusa-tune-tree measures beside a tuned tree of `nodes` nodes: `asked`, or
    half, once and twice its size, these at most `max_nodes` (--max-nodes); all within what the engine
    and drafter allow. Budgets asked for are kept beyond --max-nodes: a per-step tree is not the
    static tree --max-nodes bounds, and one may well want it larger."""
    if asked is not None:
        return sorted({n for n in asked if 1 <= n <= budget_limit(info)})
    return sorted({n for n in (max(nodes // 2, 1), nodes, 2 * nodes) if n <= budget_limit(info, max_nodes)})


def slot_cost(result: dict, max_slots: int) -> float:
    """What one more tree slot adds to a step on this engine, in plain steps: the slope of the
    measured step compute over 1..max_slots slots, over a whole plain step. Per-step trees weigh
    their nodes against it (runtime/dynamic.py: worth); it differs by engine (an int4 step of two
    rows and more runs another kernel than a one-row step) and machine."""
    st = result["step_time_ms"]
    _, per_slot = fit_line({t + 1: ms for t, ms in enumerate(st["forward"][:max_slots])})
    return round(max(per_slot, 0.0) / (st["plain_forward"] + max(st["rest_plain"], 0.0)), 3)


def dynamic_specs(budgets: list[int], cost: float) -> list[str]:
    """The per-step trees medusa-tune-tree measures: each budget with the engine's slot cost."""
    return [dynamic_spec(n, cost) for n in budgets]


def choose_static_or_dynamic(result: dict, specs: list[str]) -> None:
    """Between the tuned static tree and the per-step trees `specs` (dynamic_specs), keeps the fastest
    measured one as result["medusa_choices"] (the static tree stays in result["static_tree"]) and
    says why. The recommendation then follows the measurement, not the prediction: plain decoding
    unless the chosen tree measured faster than plain."""
    m = result["measured"]
    static = m["tuned"]["tokens_per_s"]
    best = max(specs, key=lambda spec: m[spec]["tokens_per_s"], default=None)
    result["static_tree"] = result["medusa_choices"]
    if best is None:
        result["choice"] = {"chosen": "static", "why": "no per-step budget measured"}
    else:
        fast = m[best]
        figures = (f"{best} {fast['tokens_per_s']:.1f} tokens/s ({fast['tokens_per_step']:.2f} tokens/step), "
                   f"the {len(result['static_tree'])}-node static tree {static:.1f} tokens/s "
                   f"({m['tuned']['tokens_per_step']:.2f} tokens/step), measured on {m['num_prompts']} prompts")
        if fast["tokens_per_s"] > static and fast["equal_to_plain"]:
            result["medusa_choices"] = best
            result["choice"] = {"chosen": best, "why": f"faster: {figures}"}
        else:
            result["choice"] = {"chosen": "static", "why": f"the static tree is as fast or faster: {figures}"}
    chosen = m["tuned" if result["choice"]["chosen"] == "static" else best]["tokens_per_s"]
    result["choice"]["speedup_vs_plain"] = round(chosen / max(m["plain_tokens_per_s"], 1e-12), 4)
    result["recommendation"] = "medusa" if chosen > m["plain_tokens_per_s"] else "plain"
