"""Per-step tree specs: "dynamic:N[,cost=C]" (N nodes chosen per step, C the step time one slot adds
on its engine, in plain steps), given as text or held by a tree file's medusa_choices (what
medusa-tune-tree writes when per-step trees win). Read here so engine.json, the runtime and the
serving layer share one grammar; runtime/dynamic.py chooses the trees themselves."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from medusa_trt.tree import MAX_TREE_TEXT, TREE_FILE_SUFFIXES, TreeError, check_bounds, tree_file

_DYNAMIC = re.compile(r"dynamic:(.*)", re.IGNORECASE)


def _from_file(spec: object) -> object:
    """A tree file's medusa_choices when it is a string ("dynamic:N", what medusa-tune-tree writes when
    per-step trees won), else `spec` itself (a list file is parse_medusa_choices' to read)."""
    path = tree_file(spec)
    if path is None or path.suffix.lower() not in TREE_FILE_SUFFIXES:
        return spec
    yaml_text = path.suffix.lower() != ".json"
    try:
        if not path.is_file() or path.stat().st_size > MAX_TREE_TEXT:
            return spec
        text = path.read_text(encoding="utf-8")
        check_bounds(text, str(path), yaml_text)  # no parser on a file nested to exhaust the stack (or aliased)
        if yaml_text:
            import yaml  # only needed for YAML trees

            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError:
                return spec
        else:
            data = json.loads(text)
    except (OSError, ValueError, TreeError):
        return spec  # parse_medusa_choices names the problem
    choices = data.get("medusa_choices") if isinstance(data, dict) else None
    return choices if isinstance(choices, str) else spec


@dataclass(frozen=True)
class DynamicSpec:
    """A parsed "dynamic:N[,cost=C]": the node budget and the slot cost it records (None: none)."""

    text: str
    budget: int
    cost: float | None

    def __str__(self) -> str:
        return dynamic_spec(self.budget, self.cost)

    def check_fits(self, heads: int, topk: int, max_draft_len: int) -> None:
        """TreeError unless an engine of `max_draft_len` and a drafter of `heads` x top-`topk`
        candidates can fill the budget."""
        if self.budget > max_draft_len:
            raise TreeError(f"medusa_choices {self.text!r}: budget {self.budget} exceeds the engine's max_draft_len "
                            f"{max_draft_len}; expected dynamic:N with N <= {max_draft_len}")
        if self.budget > heads * topk:
            raise TreeError(f"medusa_choices {self.text!r}: budget {self.budget} exceeds the drafter's {heads} heads x "
                            f"top-{topk} = {heads * topk} candidates; expected dynamic:N with N <= {heads * topk}")


def dynamic_spec(budget: int, cost: float | None = None) -> str:
    """The text of a per-step tree spec: "dynamic:N", or "dynamic:N,cost=C" when it records a cost."""
    return f"dynamic:{budget}" + ("" if cost is None else f",cost={cost:g}")


def read_dynamic(spec: object) -> DynamicSpec | None:
    """The DynamicSpec of "dynamic:N" or "dynamic:N,cost=C", or of a tree file holding one (read once);
    None when `spec` is not a dynamic spec. A malformed budget or cost raises TreeError naming it (and
    the file it is in)."""
    text = _from_file(spec)
    try:
        return dynamic_from_text(text)
    except TreeError as e:
        if text is not spec:
            raise TreeError(f"tree file {str(spec)!r}: {e}") from None
        raise


def dynamic_from_text(spec: object) -> DynamicSpec | None:
    """read_dynamic of the spec's text itself, never of a file it names: what engine.json records."""
    if not isinstance(spec, str):
        return None
    m = _DYNAMIC.fullmatch(spec.strip())
    if m is None:
        return None
    text, _, option = m.group(1).strip().partition(",")
    cost = _cost(spec, option) if option else None
    if "/" in text:  # medusa-bench's --also suffixes (/fill, /no-context, ...) are modes of the bench, not of a tree
        raise TreeError(f"medusa_choices {spec!r}: unknown option /{text.partition('/')[2]}; expected dynamic:N or "
                        "dynamic:N,cost=C (the /fill, /no-context and /no-datastore suffixes are medusa-bench --also's)")
    try:
        budget = int(text)
    except ValueError:
        raise TreeError(f"medusa_choices {spec!r}: budget {text!r} is not an integer; expected dynamic:N with "
                        "N >= 1 nodes per step, e.g. dynamic:16") from None
    if budget < 1:
        raise TreeError(f"medusa_choices {spec!r}: budget {budget}; expected dynamic:N with N >= 1 nodes per step")
    return DynamicSpec(spec, budget, cost)


def parse_dynamic(spec: object) -> int | None:
    """The budget N of a dynamic spec (read_dynamic), None when `spec` is not one."""
    parsed = read_dynamic(spec)
    return None if parsed is None else parsed.budget


def spec_cost(spec: object) -> float | None:
    """The slot cost a dynamic spec (or a tree file holding one) records, None when it records none:
    medusa-tune-tree writes the engine's own, measured."""
    parsed = read_dynamic(spec)
    return None if parsed is None else parsed.cost


def _cost(spec: str, option: str) -> float:
    """C of a spec's ",cost=C" option: the step time one slot adds on its engine, in plain steps."""
    name, _, text = option.partition("=")
    expected = "expected dynamic:N or dynamic:N,cost=C with C >= 0 plain steps per slot, e.g. dynamic:16,cost=0.08"
    if name.strip().lower() != "cost":
        raise TreeError(f"medusa_choices {spec!r}: unknown option {option.strip()!r}; {expected}")
    try:
        cost = float(text)
    except ValueError:
        raise TreeError(f"medusa_choices {spec!r}: cost {text.strip()!r} is not a number; {expected}") from None
    if not (cost >= 0 and math.isfinite(cost)):
        raise TreeError(f"medusa_choices {spec!r}: cost {cost}; {expected}")
    return cost
