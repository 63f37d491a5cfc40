"""Where a fused step's time goes: an ONNX Runtime profile of the step graph while decoding held-out
prompts, its node time split into the base, the lm_head, acceptance and the drafter (by each node's
place in the exported graph: the base's layers, the lm_head, then acceptance, then the drafter), and
the drafter's and acceptance's largest nodes. Node times include the profiler's own per-node cost, so
compare shares within one profile, not milliseconds across runs. Engines whose prefill runs through
the step graph (Medusa heads; not a drafter with its own cache) count their prefills in it too.

    python benchmarks/investigations/profile_step.py --engine build/dyn/engine5_int4_amphista --tree dynamic:16

With several --tree, each decodes the same prompts in turn, and the node time per step run of every
(part, op type) is printed side by side: what a tree's extra rows cost, op by op.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import medusa_trt.runtime.ort.session as ort_session  # noqa: E402
from medusa_trt.runtime.config import GenerationConfig  # noqa: E402
from medusa_trt.runtime.decoding import generate  # noqa: E402
from medusa_trt.runtime.loading import load_backend, load_tokenizer  # noqa: E402
from medusa_trt.runtime.ort.session import OrtSessionOptions  # noqa: E402


def categories(step_graph: Path):
    """name -> "base" | "lm_head" | "accept" | "drafter" for the step graph's nodes; fused nodes keep
    their first node's name with a suffix (skip, rotary); nodes ONNX Runtime made (QuickGelu) count
    as the base."""
    import onnx

    nodes = list(onnx.load(str(step_graph), load_external_data=False).graph.node)
    # The lm_head: the MatMul whose logits the first ArgMax (greedy acceptance) reads.
    argmax = next(i for i, n in enumerate(nodes) if n.op_type == "ArgMax")
    producer = {o: i for i, n in enumerate(nodes) for o in n.output}
    lm = producer[nodes[argmax].input[0]]
    while not nodes[lm].op_type.startswith(("MatMul", "Gemm", "FusedMatMul")):
        lm = producer[nodes[lm].input[0]]
    # The drafter starts at the first node after acceptance that reads its weights (or the lm_head again).
    drafter = next((i for i in range(argmax + 1, len(nodes)) if any("draft" in x or "head" in x for x in nodes[i].input)),
                   len(nodes))
    index = {n.name: i for i, n in enumerate(nodes)}

    def of(name: str) -> str:
        base = name
        for suffix in ("_skip", "_rotary", "_in_place", "_fused"):
            base = base.replace(suffix, "")
        i = index.get(name, index.get(base))
        if i is None:
            return "base"
        return "base" if i < lm else "lm_head" if i <= argmax else "accept" if i < drafter else "drafter"

    return of


def profile(engine: Path, tree: str, prompts: list[list[int]], new_tokens: int, threads: int) -> tuple[list, int]:
    """The step session's profile events while decoding `prompts` with `tree`, and its step runs."""
    folder = Path(tempfile.mkdtemp(prefix="profile_step_"))
    plain_options = ort_session.session_options

    def profiled(*a, **k):
        so = plain_options(*a, **k)
        so.enable_profiling, so.profile_file_prefix = True, str(folder / "p")
        return so

    ort_session.session_options = profiled  # sessions open on first use: kept until the decodes end
    try:
        backend = load_backend(engine, ort_options=OrtSessionOptions(threads=threads))
        cfg = GenerationConfig(max_new_tokens=new_tokens, medusa_choices=tree)
        for prompt in prompts:
            for _ in generate(backend, [prompt], cfg):
                pass
    finally:
        ort_session.session_options = plain_options
    events = json.loads(Path(backend.step_session.end_profiling()).read_text())
    return events, sum(1 for e in events if e.get("cat") == "Session" and e["name"] == "model_run")


def op_table(engine: Path, trees: list[str], runs: list[tuple[list, int]], top: int = 24) -> None:
    """Node time per step run of each (part, op type), one column per tree."""
    of = categories(engine / json.loads((engine / "engine.json").read_text())["onnx"]["step_file"])
    columns = []
    for events, n in runs:
        t = collections.Counter()
        for e in events:
            if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
                t[(of(e["name"][: -len("_kernel_time")]), e["args"]["op_name"])] += e["dur"] / n / 1e3
        columns.append(t)
    keys = sorted({k for c in columns for k in c}, key=lambda k: -max(c[k] for c in columns))
    print(f"{engine}: node time per step run (ms), by part and op type")
    print("".ljust(40) + "".join(tree[:18].rjust(20) for tree in trees))
    print("all nodes".ljust(40) + "".join(f"{sum(c.values()):20.3f}" for c in columns))
    for k in keys[:top]:
        print(f"{k[0]}/{k[1]}".ljust(40) + "".join(f"{c[k]:20.3f}" for c in columns))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", type=Path, required=True, help="an ONNX Runtime engine dir with a fused step graph")
    p.add_argument("--tree", action="append", help="medusa_choices (dynamic:16,cost=1000: the root only); "
                   "repeat it for an op-type table of the trees side by side (default dynamic:16)")
    p.add_argument("--prompts", type=Path, default=Path("medusa_trt/assets/smollm2/prompts_heldout.jsonl"))
    p.add_argument("--limit", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    trees = args.tree or ["dynamic:16"]
    tok = load_tokenizer(args.engine)
    prompts = [tok.encode(json.loads(line)["text"]) for line in args.prompts.open()][: args.limit]
    if len(trees) > 1:
        op_table(args.engine, trees, [profile(args.engine, t, prompts, args.new_tokens, args.threads) for t in trees])
        return 0
    events, runs = profile(args.engine, trees[0], prompts, args.new_tokens, args.threads)
    of = categories(args.engine / json.loads((args.engine / "engine.json").read_text())["onnx"]["step_file"])
    total, count, largest = collections.Counter(), collections.Counter(), collections.Counter()
    by_op, op_count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            name = e["name"][: -len("_kernel_time")]
            c = of(name)
            total[c] += e["dur"]
            count[c] += 1
            if c in ("accept", "drafter"):
                largest[(c, e["args"]["op_name"], name)] += e["dur"]
            if c == "drafter":
                by_op[e["args"]["op_name"]] += e["dur"]
                op_count[e["args"]["op_name"]] += 1
    print(f"{args.engine} {trees[0]}: {runs} step runs, node time per run:")
    for c in ("base", "lm_head", "accept", "drafter"):
        print(f"  {c:8s} {total[c] / runs / 1e3:7.2f} ms  {count[c] / runs:5.0f} nodes  "
              f"{100 * total[c] / max(1, total['base']):5.1f}% of the base")
    print("the drafter by op type (ms per run, nodes):")
    for op, d in by_op.most_common():
        print(f"  {d / runs / 1e3:6.3f}  {op_count[op] / runs:4.0f}  {op}")
    print("largest acceptance and drafter nodes (ms per run):")
    for (c, op, name), d in largest.most_common(12):
        print(f"  {d / runs / 1e3:6.3f}  {c:8s} {op:18s} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
