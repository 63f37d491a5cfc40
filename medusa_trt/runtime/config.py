"""GenerationConfig: how one decode runs (tree, acceptance, sampling, stops). Apart from the loop
(runtime/decoding.py) and its steps (runtime/steps.py), which both read it."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np


@dataclass
class GenerationConfig:
    max_new_tokens: int = 64
    # Anything tree.parse_medusa_choices accepts, or "dynamic:N" (N nodes chosen per step,
    # runtime/dynamic.py); None: the engine's own tree (resolve_tree).
    medusa_choices: object = None
    use_medusa: bool = True
    # Per-step trees: continuations found in the prompt and generated text compete for the budget.
    context_candidates: bool = True
    # Per-step trees with context candidates: chains from the engine's datastore compete too (when it has one).
    datastore: bool = True
    # Per-step trees: a slot's share of a plain step's time (None: the spec's ",cost=C", else
    # dynamic.SLOT_COST); a step keeps the nodes worth their slots, up to the budget. 0: every step
    # verifies the whole budget.
    slot_cost: float | None = None
    acceptance: str = "greedy"  # "greedy" | "typical" | "sample" (lossless sampling, docs/sampling.md)
    temperature: float = 0.7  # typical and sample; typical with 0 means greedy, sample needs > 0
    posterior_threshold: float = 0.09  # epsilon
    posterior_alpha: float = 0.3  # delta
    # Tokens that end a sequence (emitted, then the sequence stops). None: the engine's own (EOS and
    # the chat template's end-of-turn tokens, ModelInfo.stop_token_ids); () never stops early.
    stop_token_ids: tuple[int, ...] | None = None
    top_k: int | None = None  # sample: keep the k most likely tokens (None: all)
    top_p: float = 1.0  # sample: nucleus mass in (0, 1]
    seed: int | None = None  # sample: sequence i draws from a torch.Generator seeded seed + i (None: random)

    def __post_init__(self) -> None:
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        for name in ("temperature", "posterior_threshold", "posterior_alpha", "top_p", "slot_cost"):
            value = getattr(self, name)
            if not (is_number(value) or (name == "slot_cost" and value is None)):
                raise ValueError(f"{name} {value!r}: expected a number")
        for name in ("use_medusa", "context_candidates", "datastore"):  # "no" would read as True
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"{name} {getattr(self, name)!r}: expected True or False")
            setattr(self, name, bool(getattr(self, name)))
        if self.stop_token_ids is not None and not (isinstance(self.stop_token_ids, (list, tuple))
                                                    and all(is_int(t) and t >= 0 for t in self.stop_token_ids)):
            raise ValueError(f"stop_token_ids {self.stop_token_ids!r}: expected a list of token ids (integers >= 0) "
                             "or None")
        if self.acceptance not in ACCEPTANCE:
            raise ValueError(f"acceptance must be one of {', '.join(ACCEPTANCE)}, got {self.acceptance!r}")
        if bad := acceptance_setting_problem(self.temperature, self.posterior_threshold, self.posterior_alpha):
            raise ValueError(f"{bad[0]} must be a finite number {bad[2]}, got {bad[1]}")
        if self.acceptance == "sample" and not self.temperature > 0:
            raise ValueError(f"temperature {self.temperature} with acceptance 'sample': expected > 0 "
                             "(for temperature 0 use acceptance 'greedy')")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p {self.top_p}: expected a value in (0, 1]")
        if self.top_k is not None and (not is_int(self.top_k) or self.top_k < 1):
            raise ValueError(f"top_k {self.top_k!r}: expected an integer >= 1")
        if self.slot_cost is not None and not (self.slot_cost >= 0 and math.isfinite(self.slot_cost)):
            raise ValueError(f"slot_cost {self.slot_cost!r}: expected a finite number >= 0")
        if self.seed is not None and not (is_int(self.seed) and 0 <= self.seed < 2**63):
            raise ValueError(f"seed {self.seed!r}: expected an integer in [0, 2**63)")
        # numpy integers pass the checks above; torch and the JSON reports want Python ints
        self.max_new_tokens = int(self.max_new_tokens)
        self.top_k = None if self.top_k is None else int(self.top_k)
        self.seed = None if self.seed is None else int(self.seed)
        if self.stop_token_ids is not None:
            self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)


ACCEPTANCE = ("greedy", "typical", "sample")


def acceptance_setting_problem(temperature: float, threshold: float, alpha: float) -> tuple[str, float, str] | None:
    """The first of temperature, posterior_threshold and posterior_alpha out of its range, as (name,
    value, expected range), or None. One check for GenerationConfig, the Triton repository's
    defaults and each served request, so no default refuses every request. Why the ranges: an
    infinite temperature divides the logits to NaN; typical acceptance takes a draft whose
    probability exceeds min(epsilon, alpha e^-H), which is 0, so every draft accepted unchecked,
    when either is 0; epsilon is a probability (above 1 it never binds: a typo, such as 9 for 0.09)."""
    for name, value, ok, expected in (("temperature", temperature, temperature >= 0, ">= 0"),
                                      ("posterior_threshold", threshold, 0 < threshold <= 1, "in (0, 1]"),
                                      ("posterior_alpha", alpha, alpha > 0, "> 0")):
        if not (math.isfinite(value) and ok):
            return name, value, expected
    return None


def is_int(value: object) -> bool:
    """An integer that is not a bool: a Python int or a numpy one (JSON and numpy give both)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def is_number(value: object) -> bool:
    """A real number that is not a bool (a string "0.5" is not one)."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
