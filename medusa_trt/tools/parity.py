"""medusa-check: does an engine compute what the PyTorch reference computes?

Both run through the runtime's Backend interface on identical inputs: the decoding loop's own
prefill of every prompt and greedy tree-verify steps with the default Medusa tree cut to the engine
(runtime/steps.py `prefill` and `tree_step`, driving both backends at once; candidates and
acceptance come from the reference, so both sides always see the same tokens and commit the same
cache entries), the engine's fused step where it has one (its accepted path and its drafts'
log-probabilities, against the reference's two-call step on the same tree), and whole greedy decodes. Logits are compared with polygraphy's comparator on the max absolute difference;
decoded tokens must be equal. Works for any engine the runtime can open, not only ONNX Runtime.

The rules each output is held to (the tolerance of each dtype, scaled with the reference's logit
peak; the FP8, int4 and int8 rules; when greedy tokens may part) and why: tools/parity_rules.py.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from medusa_trt.errors import MedusaTrtError
from medusa_trt.runtime.backend import Backend, last_rows
from medusa_trt.tools.parity_rules import FP8_QUANTILE, TOLERANCES, LogitsRule, logits_rule

if TYPE_CHECKING:
    from medusa_trt.modeling import MedusaModel

DEFAULT_PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Medusa heads draft a tree; the base model verifies it.",
    "Hi",
)
COMPARED_OUTPUTS = ("logits", "medusa_logits")


class CheckInputError(MedusaTrtError):
    """Bad input to medusa-check (engine, checkpoint, prompts); the CLI exits 2."""


@dataclass
class CheckRow:
    stage: str  # "prefill", "tree step 2", "decode 0 (medusa)"
    output: str  # "logits", "medusa_logits", "tokens"
    passed: bool
    max_abs_diff: float | None = None
    tolerance: float | None = None  # the bound max_abs_diff (or, quantized, p90_abs_diff) is held to
    detail: str = ""
    rule: str = ""  # the rule applied, as printed: "max <= 0.000251", "p90 <= 1.72 and max <= 8.6"
    p90_abs_diff: float | None = None  # quantized engines: the 90th percentile of |engine - reference|
    diverged: bool = False  # an int4 plain decode that leaves the reference at a near-tie (allowed)


@dataclass
class CheckReport:
    engine: str
    checkpoint: str
    backend: str
    dtype: str
    tolerance: float  # the logits tolerance the rows apply (the loosest, if prompt batches differ)
    rows: list[CheckRow] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    rule: str = ""  # the logits rule the rows apply, in words

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(r.passed for r in self.rows)

    def as_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}

    def table(self) -> str:
        header = ("stage", "output", "max abs diff", "rule", "result")
        lines = [header]
        for r in self.rows:
            diff = "" if r.max_abs_diff is None else f"{r.max_abs_diff:.3e}"
            verdict = "DIVERGES" if r.diverged else "PASS" if r.passed else "FAIL"
            lines.append((r.stage, r.output, diff, r.rule, verdict + (f"  {r.detail}" if r.detail else "")))
        widths = [max(len(line[i]) for line in lines) for i in range(4)]
        out = ["  ".join(c.ljust(w) for c, w in zip(line[:4], widths, strict=False)) + "  " + line[4] for line in lines]
        out.insert(1, "-" * len(out[0]))
        return "\n".join(out)


def reference_model(checkpoint: Path, engine: dict, engine_dir: Path | None = None) -> MedusaModel:
    """The float32 model of `checkpoint`, its weights quantized as the engine (engine.json `engine`,
    read from `engine_dir`) holds them: int4 engines' MatMulNBits bytes (calibrated rounding searches
    with the input weights the engine dir keeps), and the drafter's too where `draft_int4` says so
    (engines built before it keep a float drafter); the int8 embedding where `embedding` says so
    (absent: a float table, as engines built before 2026-11-28 hold it); an int8 engine's float
    input channels where `float_channels` names them."""
    from medusa_trt.modeling import MedusaModel

    model = MedusaModel.from_checkpoint(checkpoint, dtype="float32")
    weights = engine.get("weights") or {}
    if weights.get("format") == "int4":
        from medusa_trt.quant import quantize_model_int4

        grids, block = None, int(weights["block_size"])
        rounding = weights.get("rounding")  # absent (engines before it) or a string: no search
        if isinstance(rounding, dict):
            from safetensors.torch import load_file

            from medusa_trt.calibration.activations import int4_grids, split_int4_calibration

            if engine_dir is None:
                raise ValueError("an int4 engine with calibrated rounding: its reference needs the engine dir")
            path = Path(engine_dir) / str(rounding.get("file"))
            if not path.is_file():
                raise ValueError(f"{path}: not found; engine.json weights.rounding names it (rebuild the engine)")
            grids = int4_grids(model, *split_int4_calibration(load_file(str(path))), block)
        quantize_model_int4(model, block, int(weights["accuracy_level"]),
                            draft=bool(weights.get("draft_int4")), offsets=weights.get("offsets", False),
                            lm_head_bits=weights.get("lm_head_bits", 4), embedding=weights.get("embedding") == "int8",
                            grids=grids)
    elif weights.get("format") == "int8":
        from medusa_trt.quant import quantize_model_int8

        quantize_model_int8(model, draft=bool(weights.get("draft_int8")), embedding=weights.get("embedding") == "int8",
                            float_channels=(weights.get("float_channels") or {}).get("channels"))
    return model


def run_check(engine_dir: str | Path, checkpoint: str | Path | None = None, prompts: Sequence[str] | None = None, *,
              max_new_tokens: int = 32, tree_steps: int = 4, device: str | None = None,
              atol: float | None = None, progress: bool = False) -> CheckReport:
    """Runs every comparison; raises CheckInputError on bad input, never on a parity failure.
    `progress`: a bar on stderr that moves with each stage (loading, steps, every decode)."""
    from medusa_trt.checkpoint import validate_checkpoint
    from medusa_trt.engine_dir import sha256_file, verify_artifacts
    from medusa_trt.errors import CheckpointError
    from medusa_trt.runtime.loading import load_backend
    from medusa_trt.runtime.torch_backend import TorchBackend

    engine_dir = Path(engine_dir)
    if atol is not None and not (atol >= 0 and math.isfinite(atol)):
        raise CheckInputError(f"--atol {atol}: expected a finite number >= 0")
    engine = _read_engine(engine_dir)
    problems = verify_artifacts(engine_dir, engine)  # every digest: this is the integrity check
    if problems:
        raise CheckInputError("; ".join(problems) + "; rebuild the engine with medusa-build")
    recorded = (engine.get("checkpoint") or {}).get("path")
    if checkpoint is None and not recorded:
        raise CheckInputError(f"{engine_dir / 'engine.json'} records no checkpoint path; pass --checkpoint")
    checkpoint = Path(checkpoint or recorded)
    try:
        validate_checkpoint(checkpoint)
    except CheckpointError as e:
        raise CheckInputError(f"reference checkpoint: {e}") from None
    dtype = engine.get("dtype", "float32")
    if atol is None and dtype not in TOLERANCES:
        raise CheckInputError(f"{engine_dir / 'engine.json'}: dtype {dtype!r} has no stated tolerance; pass --atol")
    fp8 = bool(engine.get("quantization"))
    # int4 engines round activations to int8 per block (MatMulNBits accuracy level 4) as the int4
    # reference does; a value at a rounding boundary may round the other way, as with FP8: same criterion.
    # int8 engines round every Linear's input rows to int8 (Int8Linear): the same criterion. At accuracy
    # level 0 an int4 engine multiplies float activations by the reference's own dequantized weights:
    # float rounding only, so the float rule holds it, as it holds a float engine.
    weights = engine.get("weights") or {}
    rounded = weights.get("format") == "int8" or (weights.get("format") == "int4" and weights.get("accuracy_level") != 0)
    if fp8 and dtype != "float32" and atol is None:
        raise CheckInputError(f"{engine_dir / 'engine.json'}: an FP8 engine in {dtype} cannot be held to a tolerance "
                              f"that separates a right graph from a wrong one ({dtype} rounding flips e4m3 "
                              "roundings); check a float32 build of the same checkpoint (medusa-build --dtype "
                              "float32), or pass --atol")
    tol = atol if atol is not None else TOLERANCES[dtype]
    report = CheckReport(str(engine_dir), str(checkpoint), str(engine.get("backend")), dtype, tol)

    recorded_sha = (engine.get("checkpoint") or {}).get("config_sha256")
    if recorded_sha and sha256_file(checkpoint / "config.json") != recorded_sha:
        report.warnings.append(f"{checkpoint / 'config.json'} differs from the one the engine was built from")

    from tqdm import tqdm

    bar = tqdm(total=2, desc="loading the engine", unit="stage", disable=not progress, leave=False)
    try:
        subject = load_backend(engine_dir, device=device)
    except ValueError as e:
        bar.close()
        raise CheckInputError(str(e)) from None
    bar.update()
    bar.set_description("loading the reference")
    try:
        model = reference_model(checkpoint, engine, Path(engine_dir))
    except ValueError as e:
        bar.close()
        raise CheckInputError(str(e)) from None
    # The reference keeps the rows the engine keeps, so a draft call names the same rows on both.
    reference = TorchBackend(model, max_draft_len=subject.info.max_draft_len,
                             hidden_all_rows=subject.info.hidden_all_rows)
    mine, theirs = subject.info, reference.info
    if (mine.vocab_size, mine.num_medusa_heads) != (theirs.vocab_size, theirs.num_medusa_heads):
        raise CheckInputError(f"checkpoint {checkpoint} does not match the engine: vocab/heads "
                              f"{theirs.vocab_size}/{theirs.num_medusa_heads} vs {mine.vocab_size}/{mine.num_medusa_heads}")
    if mine.drafter_cache != theirs.drafter_cache:  # another kind of drafter: a wrong pairing, not a wrong engine
        kinds = {True: "a drafter with a cache of its own (Amphista)", False: "Medusa heads"}
        raise CheckInputError(f"checkpoint {checkpoint} does not match the engine: it holds {kinds[theirs.drafter_cache]}, "
                              f"the engine {kinds[mine.drafter_cache]}")

    bar.update()
    ids = _prompt_ids(engine_dir, prompts, mine.vocab_size, report)
    max_batch = int((engine.get("limits") or {}).get("max_batch_size") or len(ids))
    chunks = range(0, len(ids), max_batch)
    # Per batch of prompts: the steps, the reference's decode and the engine's plain (and Medusa) decode.
    fused = bool(mine.num_medusa_heads and tree_steps and getattr(subject, "fused_step_dynamic", False))
    bar.total += len(chunks) * (3 + bool(mine.num_medusa_heads) + fused)
    draft = torch.tensor(model.cfg.draft_vocab) if model.cfg.draft_vocab else None
    try:
        for start in chunks:
            chunk = ids[start:start + max_batch]
            label = f" [{start}:{start + len(chunk)}]" if len(ids) > max_batch else ""
            bar.set_description(f"prefill + {tree_steps} tree steps{label}")
            rule = _compare_steps(report, subject, reference, chunk, tree_steps, tol, label, fp8=fp8,
                                  scale_tol=atol is None, int4_layers=int(engine["model"]["num_layers"]) if rounded else 0,
                                  draft_vocab=draft)
            bar.update()
            if fused:
                bar.set_description(f"{tree_steps} fused steps{label}")
                _compare_fused_steps(report, subject, reference, chunk, tree_steps, label, rule)
                bar.update()
            _compare_decodes(report, subject, reference, chunk, max_new_tokens, start, tie=rule.tol if rounded else None,
                             tick=lambda what, label=label: (bar.update(), bar.set_description(what + label)))
    except ValueError as e:  # the backends' limits: batch, sequence length, tree size
        raise CheckInputError(f"the prompts do not fit the engine: {e}") from None
    finally:
        bar.close()
    return report


def _prompt_ids(engine_dir: Path, prompts: Sequence[str] | None, vocab_size: int, report: CheckReport) -> list[list[int]]:
    """Prompts through the engine's tokenizer; without one, and without --prompts, fixed token ids."""
    from medusa_trt.runtime.loading import load_tokenizer

    try:
        tokenizer = load_tokenizer(engine_dir)
    except ValueError as e:
        if prompts:
            raise CheckInputError(f"--prompts needs the engine's tokenizer: {e}") from None
        report.warnings.append(f"no tokenizer ({e}); using fixed token-id prompts")
        return [[(7 * i + 3 * j + 1) % vocab_size for j in range(n)] for i, n in enumerate((11, 5, 1))]
    ids = [tokenizer.encode(t) for t in (prompts or DEFAULT_PROMPTS)]
    if any(not p for p in ids):
        raise CheckInputError("a prompt encodes to no tokens; give non-empty prompts")
    return ids


def _read_engine(engine_dir: Path) -> dict:
    from medusa_trt.engine_dir import EngineError, read_engine

    try:
        return read_engine(engine_dir)
    except EngineError as e:
        raise CheckInputError(str(e)) from None


class _Observed(Backend):
    """The Backend the decoding loop's own steps run on in medusa-check: every call goes to the
    engine and to the reference with the same inputs, and the loop carries on with the reference's
    outputs, so both sides see the same tokens and commit the same cache entries. Each forward asks
    both for every position with the heads (then hands the loop the rows it asked for), so the
    logits and Medusa logits of every position are compared, not only the rows the loop reads. With
    a drafter that keeps a cache of its own, forwards ask for the loop's rows without heads, and the
    drafts are compared at the `draft` calls instead."""

    def __init__(self, subject, reference, draft_vocab: torch.Tensor | None = None):
        self.sides = (subject, reference)
        # Heads over a draft vocabulary (docs/formats.md, draft_vocab) fill every other column with one
        # constant on both sides: compared over the draft columns alone, so no figure counts padding.
        self.draft_vocab = draft_vocab
        self.info = reference.info
        # A drafter with a cache of its own (Amphista) drafts from the rows the loop commits, so its
        # drafts are compared where the loop asks for them (`draft`), each call a stage of its own.
        self.cached = reference.info.drafter_cache
        self.outputs: list[tuple[OrderedDict, OrderedDict]] = []  # per call: engine's, reference's
        self.kinds: list[str] = []  # per call: "forward" or "drafts"
        self._medusa: torch.Tensor | None = None  # [H, B, K, V] the reference's, at the rows asked for

    @property
    def lengths(self) -> torch.Tensor:
        return self.sides[1].lengths

    def start(self, batch: int, capacity: int) -> None:
        for b in self.sides:
            b.start(batch, capacity)

    def forward(self, input_ids, position_ids, new_mask, logit_positions=None, with_heads=True):
        outs = []
        for b in self.sides:
            if self.cached:  # the rows the loop keeps, which its draft() call then names
                logits, _ = b.forward(input_ids, position_ids, new_mask, logit_positions, with_heads=False)
                outs.append(OrderedDict(logits=logits.float().numpy().copy()))
                continue
            logits, medusa = b.forward(input_ids, position_ids, new_mask)
            outs.append(OrderedDict(logits=logits.float().numpy().copy(), medusa_logits=medusa.float().numpy().copy()))
        self.outputs.append(tuple(OrderedDict(o, medusa_logits=np.ascontiguousarray(
                                      o["medusa_logits"][..., self.draft_vocab.numpy()]))
                                  for o in outs) if self.draft_vocab is not None and not self.cached
                            else (outs[0], outs[1]))
        self.kinds.append("forward")
        logits = torch.from_numpy(outs[1]["logits"])
        if self.cached:
            return logits, None
        medusa = torch.from_numpy(outs[1]["medusa_logits"])
        if logit_positions is not None:
            rows = torch.arange(len(input_ids))[:, None]
            logits, medusa = logits[rows, logit_positions], medusa[:, rows, logit_positions]
        self._medusa = medusa
        return logits, medusa if with_heads else None

    def draft(self, rows: torch.Tensor, counts: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        if not self.cached:
            return self._medusa[:, torch.arange(len(rows)), last_rows(rows, counts)]
        outs = [b.draft(rows, counts, next_tokens) for b in self.sides]
        # Over the draft vocabulary's columns only: the others are the same constant on both sides.
        cols = self.draft_vocab.numpy() if self.draft_vocab is not None else slice(None)
        self.outputs.append(tuple(OrderedDict(medusa_logits=o.float().numpy()[..., cols].copy()) for o in outs))
        self.kinds.append("drafts")
        return outs[1]

    def commit(self, slots: torch.Tensor, counts: torch.Tensor) -> None:
        for b in self.sides:
            b.commit(slots, counts)

    def keep(self, rows: torch.Tensor) -> None:
        for b in self.sides:
            b.keep(rows)


def _compare_steps(report: CheckReport, subject, reference, prompts: list[list[int]], tree_steps: int,
                   tol: float, label: str, fp8: bool = False, scale_tol: bool = True, int4_layers: int = 0,
                   draft_vocab: torch.Tensor | None = None) -> LogitsRule:
    """The decoding loop's prefill and greedy tree steps (runtime/steps.py), run on both backends
    at once (see _Observed) with the default tree cut to the engine; one polygraphy comparison.
    `int4_layers`: the decoder depth of an int4 engine (0 otherwise). Returns the rule applied
    (tools/parity_rules.py, logits_rule: the tolerance scaled with the reference's logit peak)."""
    from polygraphy.comparator import Comparator, IterationResult, RunResults
    from polygraphy.logger import G_LOGGER

    from medusa_trt.runtime.decoding import GenerationConfig
    from medusa_trt.runtime.steps import prefill, tree_step
    from medusa_trt.tree import StepTree, tree_for_engine

    info = reference.info
    tree = tree_for_engine(info.num_medusa_heads, info.max_draft_len) if info.num_medusa_heads else None
    steps = tree_steps if tree is not None else 0
    width = tree.num_slots if tree is not None else 1
    both = _Observed(subject, reference, draft_vocab)
    both.start(len(prompts), max(len(p) for p in prompts) + steps * width + 1)
    stages = ["prefill" + label]
    logits, root, medusa = prefill(both, prompts)  # [B, V], [B], [H, B, V]
    if tree is not None:
        step_tree, greedy = StepTree.of(tree, info.vocab_size), GenerationConfig()
        for step in range(steps):
            stages.append(f"tree step {step + 1}" + label)
            _, _, root, medusa = tree_step(both, step_tree, root, medusa, greedy)
    if both.cached:  # a stage per call: each forward, then the drafts from its committed rows
        stages = [f"{stage}{' drafts' * (kind == 'drafts')}" for stage, kind in
                  zip([s for s in stages for _ in range(2)], both.kinds, strict=True)]
    ours = [IterationResult(engine, runner_name="engine") for engine, _ in both.outputs]
    refs = [IterationResult(ref, runner_name="reference") for _, ref in both.outputs]

    peak = max(float(abs(r["logits"]).max()) for r in refs if "logits" in r)
    rule = logits_rule(tol, peak, scale_tol=scale_tol, fp8=fp8, int4_layers=int4_layers)
    tol, max_bound, q = rule.tol, rule.max_bound, round(FP8_QUANTILE * 100)
    report.tolerance = tol if report.rule == "" else max(report.tolerance, tol)
    report.rule = rule.words
    results = RunResults([("engine", ours), ("reference", refs)])
    with G_LOGGER.verbosity(G_LOGGER.CRITICAL):  # our own table replaces polygraphy's log
        accuracy = Comparator.compare_accuracy(results, compare_func=rule.compare_func())
    if not hasattr(accuracy, "items"):  # polygraphy >= 0.50 returns one AccuracyResult per compare func
        accuracy = accuracy[0]
    per_iteration = next(iter(accuracy.values()))
    for stage, outputs in zip(stages, per_iteration, strict=True):
        for name in COMPARED_OUTPUTS:
            if name not in outputs:  # a drafter with a cache: logits and drafts in separate stages
                continue
            result = outputs[name]
            if rule.quantized:  # the percentile is within tol (checked by polygraphy), the max within the flip bound
                p90 = float(result.quantile_absdiff)
                passed = bool(result) and float(result.max_absdiff) <= max_bound
                report.rows.append(CheckRow(stage, name, passed, float(result.max_absdiff), tol, f"p{q} {p90:.3g}",
                                            rule.text, p90))
            else:
                report.rows.append(CheckRow(stage, name, bool(result), float(result.max_absdiff), tol, rule=rule.text))
    return rule


def _compare_fused_steps(report: CheckReport, subject, reference, prompts: list[list[int]], tree_steps: int,
                         label: str, rule: LogitsRule) -> None:
    """The fused greedy step, which a greedy decode reaches without showing what it drafts (any
    drafts leave the tokens plain greedy's): one engine call verifies a tree, accepts and drafts the
    next, against the reference's two-call step on the same tree tokens. Rows per step: the
    accepted path, the drafter's top-k log-probabilities the step returns against the reference's
    log-probabilities of those tokens, and those tokens' against the reference's own top k (a
    wrong token ranked in is off by its gap; a near-tie may swap two tokens, within the bound)."""
    from medusa_trt.acceptance import tree_candidates
    from medusa_trt.runtime.decoding import GenerationConfig
    from medusa_trt.runtime.steps import commit_path, prefill, verify
    from medusa_trt.tree import StepTree, tree_for_engine

    tol, max_bound = rule.tol, rule.max_bound
    info = reference.info
    tree = StepTree.of(tree_for_engine(info.num_medusa_heads, info.max_draft_len), info.vocab_size)
    k, b = subject.fused_step_topk, len(prompts)
    for side in (subject, reference):
        side.start(b, max(len(p) for p in prompts) + tree_steps * tree.num_slots + 1)
    prefill(subject, prompts)
    _, root, medusa = prefill(reference, prompts)
    mask = tree.mask.expand(b, -1, -1)

    def row(stage: str, output: str, diff: torch.Tensor) -> None:
        peak = float(diff.max())
        if max_bound is None:
            report.rows.append(CheckRow(stage, output, peak <= tol, peak, tol, rule=rule.text))
            return
        p90 = float(diff.flatten().quantile(FP8_QUANTILE))
        report.rows.append(CheckRow(stage, output, p90 <= tol and peak <= max_bound, peak, tol,
                                    f"p{round(FP8_QUANTILE * 100)} {p90:.3g}", rule.text, p90))

    for step in range(tree_steps):
        stage = f"fused step {step + 1}{label}"
        tokens = tree_candidates(root, medusa, tree.candidate_index, tree.topk)[:, : tree.num_slots]
        positions = reference.lengths[:, None] + tree.position_offsets[None]
        best, accepted, _, ids, logp = subject.fused_step(tokens, positions, mask, tree.retrieve, tree.candidate_index)[:5]
        ours = commit_path(subject, tree, tokens, best, accepted)[0]
        theirs, _, root, medusa = verify(reference, tree, tokens, GenerationConfig())
        if ours != theirs:  # quantized: a near-tie at a verified slot may go either way; then stop here
            report.rows.append(CheckRow(stage, "accepted path", False, rule="equal path", detail=f"engine accepted {ours}, "
                                        f"the reference {theirs}", diverged=max_bound is not None))
            report.rows[-1].passed = max_bound is not None
            return
        report.rows.append(CheckRow(stage, "accepted path", True, rule="equal path"))
        heads = ids.shape[1]
        ref = medusa.float()[:heads]
        ref = (ref - ref.logsumexp(-1, keepdim=True)).permute(1, 0, 2)  # [B, H, V] log-probabilities
        at = ref.gather(-1, ids)
        row(stage, "draft log-probs", (logp.float() - at).abs())
        row(stage, "draft ranks", (at - ref.topk(k, dim=-1).values).abs())


def _compare_decodes(report: CheckReport, subject, reference, prompts: list[list[int]], max_new_tokens: int,
                     offset: int, tie: float | None = None, tick: Callable[[str], object] = lambda what: None) -> None:
    """Whole greedy decodes: the engine (Medusa and plain) must emit the reference's plain tokens.
    With `tie` (int4 engines), the engine's plain decode may part from the reference's where the
    reference's top-2 margin is within `tie`, and its Medusa decode must equal its own plain decode."""
    from medusa_trt.runtime.decoding import GenerationConfig, decode

    info = reference.info
    # stop_token_ids=(): both sides decode max_new_tokens whatever the engine's stop tokens are.
    plain = GenerationConfig(max_new_tokens=max_new_tokens, use_medusa=False, stop_token_ids=())
    expected = decode(reference, prompts, plain).tokens
    tick("engine plain decode")
    runs = [("plain", plain)]
    if info.num_medusa_heads:
        from medusa_trt.tree import tree_for_engine

        tree = tree_for_engine(info.num_medusa_heads, info.max_draft_len)
        runs.append(("medusa", GenerationConfig(max_new_tokens=max_new_tokens, medusa_choices=[list(p) for p in tree.nodes],
                                                stop_token_ids=())))
    own_plain = None
    for mode, cfg in runs:
        got = decode(subject, prompts, cfg).tokens
        tick("engine Medusa decode" if mode == "plain" and len(runs) > 1 else "done")
        against, name = (own_plain, "engine plain") if tie is not None and mode == "medusa" else (expected, "reference")
        for i, (a, b) in enumerate(zip(got, against, strict=True)):
            mismatch = _first_mismatch(a, b)
            passed = mismatch is None
            detail = f"{len(b)} tokens equal" + (f" to the {name}'s" if name != "reference" else "") if passed else (
                f"first mismatch at token {mismatch}: engine {a[mismatch:mismatch + 1]} vs {name} {b[mismatch:mismatch + 1]}")
            diverged = False
            if not passed and tie is not None and mode == "plain" and mismatch < min(len(a), len(b)):
                margin = _top2_margin(reference, prompts[i] + b[:mismatch])
                passed = diverged = margin <= tie
                detail = (f"from the reference at token {mismatch} of {len(b)} (engine {a[mismatch]} vs reference "
                          f"{b[mismatch]}); the reference's top-2 margin there, {margin:.3g}, is "
                          + (f"within the p90 bound {tie:.3g}: a near-tie, allowed" if passed
                             else f"above the p90 bound {tie:.3g}: not a near-tie"))
            rule = "equal tokens" + (" (int8-rounded activations: a near-tie may diverge)" if tie is not None and mode == "plain" else "")
            report.rows.append(CheckRow(f"decode {offset + i} ({mode})", "tokens", passed, detail=detail, rule=rule,
                                        diverged=diverged))
        own_plain = got


def _first_mismatch(a: list[int], b: list[int]) -> int | None:
    mismatch = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    return min(len(a), len(b)) if mismatch is None and len(a) != len(b) else mismatch


def _top2_margin(reference, ids: list[int]) -> float:
    """The reference's top-2 logit margin for the token after `ids`."""
    from medusa_trt.runtime.steps import prefill

    reference.start(1, len(ids) + 1)
    top = prefill(reference, [ids], heads=False)[0][0].topk(2).values
    return float(top[0] - top[1])
