"""medusa-bench: plain vs Medusa decoding on the same engine, measured side by side.

For every prompt, plain greedy decoding and Medusa decoding run back to back on the same backend
(the order alternates between prompts so slow drift on a shared machine hits both equally), and
the figures are ratios from that one run: speedup, per-step overhead (Medusa step time / plain
step time), tokens per step, per-head acceptance, and the share of each step spent on the host
outside the backend's forward. Transformers' own `generate` on the same weights is the baseline a
user would otherwise run; its tokens are also checked against plain decoding.

    medusa-bench --engine DIR --prompts FILE [--medusa-choices TREE] [--max-new-tokens N] [--json OUT]
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from medusa_trt.errors import MedusaTrtError
from medusa_trt.runtime.backend import Backend
from medusa_trt.runtime.decoding import GenerationConfig, SequenceStats, decode
from medusa_trt.tree import TREE_FILE_SUFFIXES

PROG = "medusa-bench"


class BenchError(MedusaTrtError):
    """Bad input to medusa-bench / medusa-tune-tree (a file, a directory, an option); exit 2."""


class ForwardTimer(Backend):
    """A backend whose compute calls (forward, draft, fused_step: the calls the steps of
    steps.step_plan make) are timed; everything else in a step is host overhead (candidate
    selection, acceptance, KV compaction, Python). Calls before the first commit, and the draft
    right after it, belong to the prefill. Every other member of the interface goes to the wrapped backend as it is, so the
    decoding loop plans the same steps on both."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.reset()

    def reset(self) -> None:
        self.calls: list[tuple[int, float, str]] = []  # (commits before the call, seconds, the call's name)
        self._commits = 0

    def _timed(self, fn, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.calls.append((self._commits, time.perf_counter() - t0, fn.__name__))

    @property
    def seconds(self) -> float:
        return sum(dt for _, dt, _ in self.calls)

    @property
    def prefill_seconds(self) -> float:
        """The prefill's calls: those before the first commit, and the draft right after it (a
        two-call prefill drafts the first tree after committing the prompt, inside the loop's
        prefill time; see draft_seconds)."""
        return sum(dt for commits, dt, name in self.calls if commits == 0 or (commits == 1 and name == "draft"))

    @property
    def draft_seconds(self) -> list[float]:
        """The drafter's own calls of the decode steps, one per step after its commit (the two-call
        path's `draft`: heads, or an Amphista drafter's cache advance and drafting). The draft after
        the prefill's commit (commits == 1) belongs to the prefill: an Amphista drafter reads every
        prompt row there. A fused step's drafter is inside fused_step, so that path has none."""
        return [dt for commits, dt, name in self.calls if commits > 1 and name == "draft"]

    # -- the Backend interface: compute timed, commits counted, the rest passed on -----------

    @property
    def info(self):
        return self.backend.info

    @property
    def lengths(self) -> torch.Tensor:
        return self.backend.lengths

    @property
    def fused_step_topk(self) -> int | None:
        return self.backend.fused_step_topk

    @property
    def fused_step_dynamic(self) -> bool:
        return self.backend.fused_step_dynamic

    @property
    def host_threads(self) -> int | None:
        return self.backend.host_threads

    @property
    def datastore(self):
        return self.backend.datastore

    def start(self, batch: int, capacity: int) -> None:
        self.backend.start(batch, capacity)

    def forward(self, *args, **kwargs):
        return self._timed(self.backend.forward, *args, **kwargs)

    def draft(self, rows: torch.Tensor, counts: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        return self._timed(self.backend.draft, rows, counts, next_tokens)

    def fused_step(self, *args, **kwargs):
        return self._timed(self.backend.fused_step, *args, **kwargs)

    def commit(self, slots: torch.Tensor, counts: torch.Tensor) -> None:
        self._commits += 1
        self.backend.commit(slots, counts)

    def keep(self, rows: torch.Tensor) -> None:
        self.backend.keep(rows)

    def open_sessions(self) -> None:
        self.backend.open_sessions()


@dataclass
class Run:
    """One decode of one prompt in one mode."""

    tokens: list[int]
    stats: SequenceStats
    wall_s: float  # prefill + decode, as a user waits for it
    forward_s: float  # inside the backend's compute calls (prefill included)
    step_forward_s: float  # inside the backend's compute calls during the decode steps
    draft_s: tuple[float, int] = (0.0, 0)  # the drafter's own calls (two-call path): seconds, calls

    @property
    def step_s(self) -> float:
        return self.stats.decode_s / max(self.stats.steps, 1)

    @property
    def host_step_s(self) -> float:
        """Time per step outside the backend's forward."""
        return max(0.0, self.stats.decode_s - self.step_forward_s) / max(self.stats.steps, 1)


def tokens_per_s(run: Run) -> float:
    """New tokens per second of wall time: what speedups compare (a wall-time ratio would not be one
    when the modes emit different numbers of tokens, as sampling and stop tokens make them)."""
    return len(run.tokens) / max(run.wall_s, 1e-12)


def timed_decode(timer: ForwardTimer, prompt: list[int], cfg: GenerationConfig) -> Run:
    timer.reset()
    t0 = time.perf_counter()
    result = decode(timer, [prompt], cfg)
    wall = time.perf_counter() - t0
    return Run(result.tokens[0], result.stats[0], wall, timer.seconds, timer.seconds - timer.prefill_seconds,
               (sum(timer.draft_seconds), len(timer.draft_seconds)))


@dataclass
class ModeSummary:
    tokens: int = 0
    steps: int = 0
    wall_s: float = 0.0
    decode_s: float = 0.0
    prefill_s: float = 0.0
    forward_s: float = 0.0
    draft_s: float = 0.0
    drafts: int = 0

    def add(self, run: Run) -> None:
        self.tokens += run.stats.new_tokens
        self.steps += run.stats.steps
        self.wall_s += run.wall_s
        self.decode_s += run.stats.decode_s
        self.prefill_s += run.stats.prefill_s
        self.forward_s += run.forward_s
        self.draft_s += run.draft_s[0]
        self.drafts += run.draft_s[1]

    def figures(self) -> dict:
        return {
            "tokens": self.tokens, "steps": self.steps,
            "tokens_per_s": round(self.tokens / max(self.wall_s, 1e-12), 2),
            "decode_tokens_per_s": round(self.tokens / max(self.decode_s, 1e-12), 2),
            "step_ms": round(1e3 * self.decode_s / max(self.steps, 1), 4),
            "wall_s": round(self.wall_s, 4), "prefill_s": round(self.prefill_s, 4),
            # Host work between forwards (prefill included in both parts): what an engine can't speed up.
            "host_overhead_share": round(max(0.0, 1 - self.forward_s / max(self.wall_s, 1e-12)), 4),
        }


def medusa_ratios(plain: ModeSummary, medusa: ModeSummary) -> dict:
    """Medusa against plain decoding on the same engine: tokens/s ratios (wall and decode only),
    tokens per step, and the cost of one tree step in plain steps; on the two-call path also the
    drafter's own cost per step in plain steps."""
    p, m = plain, medusa
    plain_step = p.decode_s / max(p.steps, 1)
    return {
        "speedup": round(p.wall_s / m.wall_s * m.tokens / max(p.tokens, 1), 4),  # tokens/s ratio
        "decode_speedup": round(p.decode_s / m.decode_s * m.tokens / max(p.tokens, 1), 4),
        "tokens_per_step": round(m.tokens / max(m.steps, 1), 4),
        "step_overhead": round((m.decode_s / max(m.steps, 1)) / plain_step, 4),
        **({"drafter_cost": round(m.draft_s / m.drafts / plain_step, 4)} if m.drafts else {}),
    }


def also_mode(spec: str) -> dict:
    """medusa-bench --also: GenerationConfig fields of TREE, with suffixes /no-context (no context
    candidates), /no-datastore (no chains from the engine's datastore), /fill (a per-step tree fills its budget every step: slot_cost 0) and /cost=X (a
    per-step tree's slot cost X, in plain steps per slot)."""
    # Only known suffixes are split off the end: TREE may be a file path, slashes and all.
    tree, flags = spec, []
    while (cut := tree.rpartition("/"))[1] and (cut[2] in ("no-context", "no-datastore", "fill")
                                                or cut[2].startswith("cost=")):
        tree, flags = cut[0], [cut[2], *flags]
    cost = [f for f in flags if f.startswith("cost=")]
    expected = "expected TREE[/no-context][/no-datastore][/fill][/cost=X]"
    if "/" in tree and not tree.lower().endswith(TREE_FILE_SUFFIXES) and not Path(tree).exists():
        raise BenchError(f"--also {spec!r}: unknown suffix /{tree.rpartition('/')[2]}; {expected}")
    fields = {"medusa_choices": tree, "context_candidates": "no-context" not in flags,
              "datastore": "no-datastore" not in flags}
    if "fill" in flags:
        fields["slot_cost"] = 0.0
    for f in cost:
        try:
            fields["slot_cost"] = float(f[5:])
        except ValueError:
            raise BenchError(f"--also {spec!r}: /{f} is not a number; {expected}") from None
        if not (fields["slot_cost"] >= 0 and math.isfinite(fields["slot_cost"])):
            raise BenchError(f"--also {spec!r}: /{f}: expected a finite number >= 0")
    return fields


def compare(backend: Backend, prompts: list[list[int]], medusa_choices=None, max_new_tokens: int = 128,
            stop_token_ids: tuple[int, ...] = (), repeat: int = 1, warmup: bool = True,
            progress: bool = True, extra_modes: dict | None = None, sampling: dict | None = None,
            context_candidates: bool = True, datastore: bool = True) -> dict:
    """Plain vs Medusa (and any `extra_modes` {name: medusa_choices, or a dict of GenerationConfig
    fields}) per prompt, interleaved; medusa_choices None: the engine's own tree (decoding.resolve_tree).
    `sampling`: GenerationConfig fields (acceptance, temperature, top_k, top_p, seed) for the Medusa
    modes; with typical or sample acceptance the plain baseline is plain sampling on the same backend.

    Returns {"modes": {name: figures}, "per_prompt": [...], "medusa": {...ratios...}}."""
    from tqdm import tqdm

    timer = ForwardTimer(backend)
    sampling = sampling or {}
    plain = ({k: v for k, v in sampling.items() if k in ("temperature", "top_k", "top_p", "seed")} | {"acceptance": "sample"}
             if sampling.get("acceptance", "greedy") != "greedy" else {})
    modes = {"plain": GenerationConfig(max_new_tokens=max_new_tokens, use_medusa=False, stop_token_ids=stop_token_ids,
                                       **plain),
             "medusa": GenerationConfig(max_new_tokens=max_new_tokens, medusa_choices=medusa_choices,
                                        stop_token_ids=stop_token_ids, context_candidates=context_candidates,
                                        datastore=datastore, **sampling)}
    for name, mode in (extra_modes or {}).items():
        fields = mode if isinstance(mode, dict) else {"medusa_choices": mode, "context_candidates": context_candidates,
                                                      "datastore": datastore}
        modes[name] = GenerationConfig(max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, **fields,
                                       **sampling)
    if warmup:  # first calls pay for allocation and ONNX Runtime's lazy initialization
        for cfg in modes.values():
            timed_decode(timer, prompts[0], GenerationConfig(**{**asdict(cfg), "max_new_tokens": min(8, max_new_tokens)}))
    summaries = {name: ModeSummary() for name in modes}
    depth_hits: dict[str, list[int]] = {}
    per_prompt = []
    names = list(modes)
    jobs = [(i, r) for r in range(repeat) for i in range(len(prompts))]
    for n, (i, _) in enumerate(tqdm(jobs, desc=PROG, disable=not progress, leave=False, file=sys.stderr)):
        order = names if n % 2 == 0 else names[::-1]  # alternate: drift on a shared machine hits all modes
        runs = {name: timed_decode(timer, prompts[i], modes[name]) for name in order}
        row = {"prompt": i, "tokens": len(runs["plain"].tokens)}
        for name, run in runs.items():
            summaries[name].add(run)
            if name != "plain":
                hits = depth_hits.setdefault(name, [])
                apd = run.stats.accepted_per_depth
                hits.extend([0] * (len(apd) - len(hits)))
                for d, v in enumerate(apd):
                    hits[d] += v
                row[name] = {"tokens_per_step": round(run.stats.tokens_per_step, 4),
                             "speedup": round(tokens_per_s(run) / tokens_per_s(runs["plain"]), 4),
                             "equal_to_plain": run.tokens == runs["plain"].tokens}
        row["plain_tokens_per_s"] = round(tokens_per_s(runs["plain"]), 2)
        per_prompt.append(row)
    out = {"modes": {name: s.figures() for name, s in summaries.items()}, "per_prompt": per_prompt}
    plain = summaries["plain"]
    for name in names[1:]:
        s = summaries[name]
        out[name] = {
            **medusa_ratios(plain, s),
            "acceptance_per_head": [round(h / max(s.steps, 1), 4) for h in depth_hits.get(name, [])],
            "equal_to_plain": all(r[name]["equal_to_plain"] for r in per_prompt),
        }
    return out


# -- the transformers baseline ---------------------------------------------------------------


def hf_model_dir(directory: Path) -> Path:
    """The HF base a checkpoint or engine was made from: engine.json -> checkpoint -> config's
    medusa_trt.base (both written by our tools)."""
    from medusa_trt.engine_dir import ENGINE_JSON, read_engine
    from medusa_trt.errors import read_json_object

    ckpt = directory
    if (directory / ENGINE_JSON).exists():
        ckpt = Path(read_engine(directory).get("checkpoint", {}).get("path") or "")
    config = ckpt / "config.json"
    if not config.is_file():
        raise BenchError(f"{config}: not found, so the HF base model is unknown; pass --hf-model DIR")
    base = (read_json_object(config, BenchError, "merged checkpoint config.json").get("medusa_trt") or {}).get("base")
    if not base or not (Path(base) / "config.json").is_file():
        raise BenchError(f"{config}: records base {base!r}, which is not an HF model dir here; pass --hf-model DIR")
    return Path(base)


def hf_greedy(model, prompt: list[int], max_new_tokens: int, stop_token_ids: tuple[int, ...]) -> list[int]:
    """One prompt through transformers generate(do_sample=False), batch 1; the new tokens, cut after
    the first stop token as ours are. Call under torch.inference_mode()."""
    eos = list(stop_token_ids) or None
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=eos, pad_token_id=eos[0] if eos else 0)
    new = out[0, len(prompt):].tolist()
    cut = next((j for j, t in enumerate(new) if t in stop_token_ids), None)
    return new[: cut + 1] if cut is not None else new


def hf_generate(model_dir: Path, prompts: list[list[int]], max_new_tokens: int, stop_token_ids: tuple[int, ...],
                plain_tokens: list[list[int]] | None = None, progress: bool = True, threads: int | None = None) -> dict:
    """transformers generate(do_sample=False), batch 1, float32, with `threads` torch threads: the
    engine's (--threads), so the ratios compare equal threads; None, as many as cores (what a user's
    transformers run gets). Tokens are cut after the first stop token, as ours are."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    except Exception as e:  # transformers raises many unrelated types for a bad model dir
        raise BenchError(f"{model_dir}: transformers cannot load it ({type(e).__name__}: {e})") from None
    tokens, seconds, same = 0, 0.0, 0
    before, threads = torch.get_num_threads(), threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            hf_greedy(model, prompts[0], 4, stop_token_ids)  # warm-up
            for i, p in enumerate(tqdm(prompts, desc="transformers generate", disable=not progress, leave=False,
                                       file=sys.stderr)):
                t0 = time.perf_counter()
                new = hf_greedy(model, p, max_new_tokens, stop_token_ids)
                seconds += time.perf_counter() - t0
                tokens += len(new)
                same += plain_tokens is not None and new == plain_tokens[i]
    finally:
        torch.set_num_threads(before)
    return {"model": str(model_dir), "tokens": tokens, "tokens_per_s": round(tokens / max(seconds, 1e-12), 2),
            "wall_s": round(seconds, 4), "threads": threads,
            "equal_to_plain": None if plain_tokens is None else f"{same}/{len(prompts)}"}


# -- prompts and the report -------------------------------------------------------------------


def load_prompts(path: Path, tokenizer, limit: int | None = None,
                 room: tuple[int, int] | None = None) -> tuple[list[str], list[list[int]]]:
    """The prompts of a --prompts file, encoded. `room`: (max_new_tokens, the engine's max_seq_len);
    a prompt with no room for its new tokens (the decoder's own rule, decoding.check_room) is refused
    here, by its place in the file, rather than as an anonymous prompt mid-run."""
    from medusa_trt.data import DataError, read_prompts

    try:
        texts = read_prompts(path)
    except DataError as e:
        raise BenchError(str(e)) from None
    texts = texts[:limit] if limit else texts
    ids = [tokenizer.encode(t) for t in texts]
    if any(not p for p in ids):
        raise BenchError(f"{path}: a prompt encodes to no tokens")
    if room is not None:
        new, most = room
        for i, p in enumerate(ids):
            if len(p) + new > most:
                raise BenchError(f"{path}: prompt {i + 1} has {len(p)} tokens; with --max-new-tokens {new} it needs "
                                 f"{len(p) + new} positions, more than the engine's max_seq_len {most} (shorter "
                                 "prompts, or fewer new tokens)")
    return texts, ids


def format_report(r: dict) -> str:
    p, m, hf = r["plain"], r["medusa"], r["hf_generate"]
    speedups = [row["medusa"]["speedup"] for row in r["per_prompt"]]
    lines = [
        f"{PROG}: {r['num_prompts']} prompts x {r['repeat']}, up to {r['max_new_tokens']} new tokens, "
        f"{r['backend']} ({r['engine']}), tree {r['medusa_choices']}, {r.get('acceptance', 'greedy')} acceptance"
        + (f" at temperature {r['temperature']}" if r.get("temperature") is not None else ""),
        f"{'':<22}{'tokens/s':>10}{'step ms':>10}{'tok/step':>10}{'host share':>12}",
        f"{'plain':<22}{p['tokens_per_s']:>10.1f}{p['step_ms']:>10.3f}{1.0:>10.2f}{p['host_overhead_share']:>12.1%}",
        f"{'medusa':<22}{m['tokens_per_s']:>10.1f}{m['step_ms']:>10.3f}{m['tokens_per_step']:>10.2f}"
        f"{m['host_overhead_share']:>12.1%}",
    ]
    for spec, a in (r.get("also") or {}).items():
        lines.append(f"{spec[:21]:<22}{a['tokens_per_s']:>10.1f}{a['step_ms']:>10.3f}{a['tokens_per_step']:>10.2f}"
                     f"{a['host_overhead_share']:>12.1%}  {a['speedup']:.2f}x, equal to plain: {a['equal_to_plain']}")
    hf = hf if hf and "tokens_per_s" in hf else None
    if hf:
        lines.append(f"{'transformers generate':<22}{hf['tokens_per_s']:>10.1f}")
    lines += [
        f"speedup (Medusa / plain, same run): {m['speedup']:.2f}x (per prompt: median "
        f"{statistics.median(speedups):.2f}x, min {min(speedups):.2f}x, max {max(speedups):.2f}x); decoding "
        f"alone {m['decode_speedup']:.2f}x (the prompts' prefill, which both modes run, is "
        f"{m['prefill_s'] / max(m['wall_s'], 1e-9):.0%} of the Medusa run)",
        f"per-step overhead (Medusa step / plain step): {m['step_overhead']:.2f}x"
        + (f"; the drafter's own calls: {m['drafter_cost']:.1%} of a plain step" if "drafter_cost" in m else ""),
        "acceptance per head (steps whose accepted path reached depth k): "
        + ", ".join(f"{a:.2f}" for a in m["acceptance_per_head"]),
        f"Medusa output equals plain greedy: {m['equal_to_plain']}" if r.get("acceptance", "greedy") == "greedy"
        else "plain = plain sampling on the same backend (outputs differ draw by draw; `sample` is exact in distribution)",
    ]
    if hf:
        lines.append(f"vs transformers generate: plain {p['speedup_vs_hf_generate']:.2f}x, Medusa "
                     f"{m['speedup_vs_hf_generate']:.2f}x (transformers tokens equal plain: "
                     f"{hf['equal_to_plain'] or 'not checked with --repeat > 1'})")
    return "\n".join(lines)
