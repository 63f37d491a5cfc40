"""medusa-check's rules: the bound each engine output is held to, and why (tools/parity.py runs the
check; docs/design.md, "medusa-check: the rules", states them for users). One function,
`logits_rule`, turns a dtype's tolerance, the reference's logit peak and the engine's quantization
into the bounds applied, the rule as printed and the rule in words.

Tolerances (max |engine - reference| of base and Medusa logits; the reference always runs in
float32 so the figure is the engine's own error):
- float32: 1e-4. Both sides do the same float32 math in different orders; on the test models the
  difference is ~1e-6, so 1e-4 catches any real mismatch (a wrong weight moves logits by >1e-2).
- float16: 5e-2. Each layer's output is rounded to 11 mantissa bits (relative 4.9e-4, ~5e-3 at the
  logit magnitudes of 10 seen in practice) and the rounding compounds over layers and the heads.
- bfloat16: 2.5e-1. Same argument with 8 mantissa bits (relative 3.9e-3), i.e. 8x float16.
These hold for logits up to LOGIT_SCALE (10) in magnitude; rounding error is relative, so for a
model whose reference logits reach a larger peak the tolerance grows with it: tol * peak / 10
(SmolLM2-135M, 30 layers, peak ~25: float32 differences up to 1.4e-4 seen, tolerance ~2.5e-4; a
wrong weight still moves logits by >1e-2). `--atol` is used as given.
Greedy tokens must match exactly in every dtype; in float16/bfloat16 a near-tie in the logits can
legitimately flip a token, which the table shows as the first mismatching position.

FP8 engines (engine.json has a `quantization` block) are compared with the FP8 reference (the
reference model's fake quantization), which does the same arithmetic, but quantization makes the
function discontinuous: an activation within rounding noise of an e4m3 rounding boundary can round
to the neighbouring FP8 value on one side only (a 2^-3 relative step of one element), and that moves
the rows reading it (the token, its tree descendants, later tokens attending to it) by up to ~1e-1
(seen: 6.5e-2 on 5 rows of 192 in one tree step, 1e-6 everywhere else). So an FP8 output passes when
its 90th-percentile |difference| is within the dtype's tolerance and its maximum within 0.25: a
missing Q/DQ, a wrong scale or unquantized weights move every row, and fail the percentile.
In float16/bfloat16 that rounding noise is the engine dtype's: ~1% of the FP8 roundings flip, and
the engine is as far from the float32 FP8 reference (measured p90 6e-2, max 0.4) as FP8 is from no
quantization (p90 1e-1), so no tolerance tells a right graph from a wrong one: FP8 parity is
checked on float32 builds (medusa-build --dtype float32), and a float16 FP8 engine needs --atol.

int4 engines (engine.json weights.format "int4") are compared with the int4 reference (the same
dequantized weights; at accuracy level 4 the activations rounded to int8 per block). At level 0 only
float rounding differs, and the float rule of the engine's dtype holds them. Every int8
rounding of an activation is such a boundary, and the flips compound with depth: on SmolLM2-135M
(30 layers, logit peak ~38 on the default prompts) a right engine is p90 0.39 / max 2.3 from its
reference, against p90 >= 3.9 / max >= 14 for one quantized with another block size and >= 5.5 /
15 for float32 weights (docs/benchmarks/issue-13-int4.md). So an int4 output passes when its p90 is within
INT4_NOISE_PER_LAYER x layers (scaled with the peak like the tolerances: 1.7 there, 0.03 on a
2-layer test model) and its maximum within INT4_MAX_FACTOR times that. Errors below that noise (one layer's weights 2% off: p90 0.41) pass.
Greedy tokens may then part from the reference's at a near-tie: a plain decode that does is shown
as DIVERGES (not PASS), and is allowed when the reference's top-2 margin at the first differing
token is within that p90 bound (the row gives the token and the margin). Every bound is rounded to
three significant digits once and printed as applied (docs/design.md, "medusa-check: the rules").
What int4 must keep exactly is the engine's own consistency: its Medusa greedy decode must equal its
own plain greedy decode token for token (engines/onnx/attention.py, row_exact attention).
"""

from __future__ import annotations

from dataclasses import dataclass

TOLERANCES = {"float32": 1e-4, "float16": 5e-2, "bfloat16": 2.5e-1}
LOGIT_SCALE = 10.0  # the logit magnitude TOLERANCES are stated for (see the module docstring)
FP8_QUANTILE, FP8_FLIP_BOUND = 0.9, 0.25  # FP8 engines: see the module docstring
INT4_NOISE_PER_LAYER, INT4_MAX_FACTOR = 0.015, 5.0  # int4 engines: see the module docstring


@dataclass(frozen=True)
class LogitsRule:
    """The rule a batch's logits (and Medusa logits, and fused-step log-probabilities) are held to:
    max |engine - reference| <= tol, or, quantized, the FP8_QUANTILE of it <= tol and the max <=
    max_bound."""

    tol: float  # the bound max |difference| (quantized: its p90) is held to, as printed
    max_bound: float | None  # quantized engines: the bound on the max; None otherwise
    text: str  # the rule as a row prints it: "max <= 0.000251", "p90 <= 1.72 and max <= 8.6"
    words: str  # the rule in words, as the report states it

    @property
    def quantized(self) -> bool:
        return self.max_bound is not None

    def compare_func(self):
        """polygraphy's compare func applying `tol` (the max, or quantized the percentile; the max
        bound is the caller's to check)."""
        return max_abs_compare(self.tol, FP8_QUANTILE if self.quantized else None)


def logits_rule(tol: float, peak: float, scale_tol: bool = True, fp8: bool = False, int4_layers: int = 0) -> LogitsRule:
    """The rule for logits whose reference peaks at `peak` (max |logit|): `tol` (the dtype's, or
    --atol) scaled with the peak when `scale_tol`, rounded to 3 significant digits once; for an FP8
    engine the p90 within it and the max within FP8_FLIP_BOUND; for an engine rounding activations
    to int8 (`int4_layers`: its decoder depth, 0 otherwise) the int4 bounds, `tol` their floor."""
    scale = max(1.0, peak / LOGIT_SCALE) if scale_tol else 1.0  # rounding error is relative to the logits
    tol = sig3(tol * scale)  # the bound as printed is the bound applied (3 significant digits)
    max_bound = FP8_FLIP_BOUND
    if int4_layers:  # the tolerance, if given (--atol), stays the floor
        tol, max_bound = int4_bounds(int4_layers, scale, floor=tol)
    quantized = fp8 or int4_layers > 0
    text = rule_text(tol, max_bound if quantized else None)
    return LogitsRule(tol, max_bound if quantized else None, text, rule_in_words(text, fp8, int4_layers, scale))


def rule_text(tol: float, max_bound: float | None) -> str:
    """A row's rule as printed: the max within tol, or (quantized) the p90 within tol and the max
    within max_bound."""
    if max_bound is None:
        return f"max <= {tol:.3g}"
    return f"p{round(FP8_QUANTILE * 100)} <= {tol:.3g} and max <= {max_bound:.3g}"


def sig3(x: float) -> float:
    """x to 3 significant digits: a bound is applied as it is printed."""
    return float(f"{x:.3g}")


def int4_bounds(layers: int, scale: float, floor: float = 0.0) -> tuple[float, float]:
    """The int4 rule's (p90, max) bounds on |engine - reference| after `layers` int4 layers, for
    outputs `scale` times LOGIT_SCALE (at least 1; see the module docstring); `floor` bounds p90 below."""
    p90 = max(floor, sig3(INT4_NOISE_PER_LAYER * layers * scale))
    return p90, sig3(INT4_MAX_FACTOR * p90)


def rule_in_words(rule: str, fp8: bool, int4_layers: int, scale: float) -> str:
    """The logits rule of the report (docs/design.md, medusa-check)."""
    scaled = f" (scaled x{scale:.3g} with the reference's logit peak)" if scale > 1 else ""
    if int4_layers:
        return (f"{rule}: activations rounded to int8 (int4, int8), p90 bound {INT4_NOISE_PER_LAYER} per layer x {int4_layers} layers{scaled}, max bound "
                f"{INT4_MAX_FACTOR:g} x the p90 bound; plain decodes may diverge from the reference only at a "
                "near-tie (its top-2 margin within the p90 bound), Medusa decodes must equal the engine's plain one")
    if fp8:
        return f"{rule}: FP8, the dtype's tolerance on the p90{scaled}, max bound {FP8_FLIP_BOUND}"
    return f"{rule}{scaled}"


def max_abs_compare(tol: float, quantile: float | None = None):
    """Passes an output when max |engine - reference| <= tol (rtol 0: the relative test, which
    polygraphy ORs with the absolute one, never passes on its own); with `quantile`, when that
    quantile of |engine - reference| is (FP8, int4 and int8 engines)."""
    try:
        from polygraphy.comparator.compare import SimpleCompareFunc
    except ImportError:  # polygraphy < 0.50
        from polygraphy.comparator import CompareFunc

        if quantile is not None:
            return CompareFunc.simple(check_error_stat="quantile", error_quantile=quantile, atol={"": tol},
                                      rtol={"": 0.0})
        return CompareFunc.simple(check_error_stat="max", atol={"": tol}, rtol={"": 0.0})
    if quantile is not None:
        return SimpleCompareFunc(check_error_stat="quantile", error_quantile=quantile, atol={"": tol}, rtol={"": 0.0})
    return SimpleCompareFunc(check_error_stat="max", atol={"": tol}, rtol={"": 0.0})
