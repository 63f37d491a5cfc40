"""Triton serving throughput: requests/s and tokens/s for 1, 4 and 16 concurrent clients.

Starts a real tritonserver (medusa_trt.serving.server) on a repository written by medusa-triton and
drives it with tritonclient (gRPC, one client and thread per simulated user, each sending its
requests back to back). Reported as ratios measured in the same run (docs/design.md): each concurrency
against 1 client (what dynamic batching buys), and 1 client against the offline runtime decoding
the same requests one by one in this process (what serving costs). Every served output is checked
against the offline decode of the same request.

Without --engine it makes a small synthetic Llama (hidden 256, 4 layers) with trivial Medusa heads
(copies of the base lm_head, so some drafts are accepted) in --workdir; the PyTorch backend runs it.

    .venv/bin/python benchmarks/bench_triton.py [--engine DIR] [--clients 1,4,16] [--requests 8]
        [--max-new-tokens 32] [--threads 1] [--workdir build/bench_triton] [--json FILE]
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

PROMPTS = [
    "Hello world", "The quick brown fox", "Medusa heads draft tokens", "42 is the answer!", "zzz",
    "Serving with Triton", "a", "Once upon a time", "Tree attention verifies candidates", "What is 2+2?",
    "CPU only, two cores", "Batching helps throughput", "The end.", "Speculative decoding", "x", "Hi!",
]


def synthetic_checkpoint(work: Path) -> Path:
    """A small random Llama with trivial heads, merged by medusa-convert (reused when present)."""
    from medusa_trt.converter.merge import convert
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test fixtures' model factories
    from synthetic import make_base, make_heads

    ckpt = work / "ckpt"
    spec = {"hidden": 256, "layers": 4, "heads": 8, "kv_heads": 4, "vocab": 512, "intermediate": 512}
    stamp = work / "model.json"
    if ckpt.is_dir() and stamp.is_file() and json.loads(stamp.read_text()) == spec:
        return ckpt
    shutil.rmtree(work, ignore_errors=True)
    base = make_base(work / "base", "llama", hidden_size=spec["hidden"], layers=spec["layers"], heads=spec["heads"],
                     kv_heads=spec["kv_heads"], vocab=spec["vocab"], intermediate=spec["intermediate"],
                     max_position_embeddings=1024)
    heads = make_heads(work / "heads", "medusa_v1", base, num_heads=4, trivial=True)
    convert(base, heads, ckpt, progress=False)
    stamp.write_text(json.dumps(spec))
    return ckpt


def make_inputs(grpcclient, text: str, max_tokens: int) -> list:
    a = grpcclient.InferInput("text_input", [1, 1], "BYTES")
    a.set_data_from_numpy(np.array([[text.encode()]], dtype=np.object_))
    b = grpcclient.InferInput("max_tokens", [1, 1], "INT64")
    b.set_data_from_numpy(np.array([[max_tokens]], dtype=np.int64))
    return [a, b]


def run_clients(url: str, clients: int, requests: int, max_tokens: int) -> dict:
    """`clients` users sending `requests` each, back to back; wall time from a common start."""
    import tritonclient.grpc as grpcclient

    start = threading.Barrier(clients + 1)

    def user(k: int) -> list[tuple[str, list[int], float]]:
        with grpcclient.InferenceServerClient(url) as c:
            start.wait()
            out = []
            for r in range(requests):
                text = PROMPTS[(k * requests + r) % len(PROMPTS)]
                t0 = time.perf_counter()
                result = c.infer("medusa", make_inputs(grpcclient, text, max_tokens))
                out.append((text, result.as_numpy("output_ids")[0].tolist(), time.perf_counter() - t0))
            return out

    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(user, k) for k in range(clients)]
        start.wait()
        t0 = time.perf_counter()
        results = [x for f in futures for x in f.result()]
        wall = time.perf_counter() - t0
    tokens = sum(len(ids) for _, ids, _ in results)
    latencies = [lat for _, _, lat in results]
    return {"clients": clients, "requests": len(results), "tokens": tokens, "seconds": round(wall, 4),
            "requests_per_s": round(len(results) / wall, 3), "tokens_per_s": round(tokens / wall, 2),
            "mean_latency_ms": round(1000 * statistics.mean(latencies), 2),
            "p90_latency_ms": round(1000 * sorted(latencies)[int(0.9 * (len(latencies) - 1))], 2),
            "outputs": [(t, ids) for t, ids, _ in results]}


def main() -> int:
    from medusa_trt.cli.common import add_max_new_tokens_arg, add_threads_arg, new_parser

    ap = new_parser("bench_triton.py", __doc__, raw=True)
    ap.add_argument("--engine", type=Path, help="engine dir or merged checkpoint (default: a synthetic model)")
    ap.add_argument("--workdir", type=Path, default=Path("build/bench_triton"))
    ap.add_argument("--clients", default="1,4,16", help="comma-separated concurrency levels (default 1,4,16)")
    ap.add_argument("--requests", type=int, default=8, help="requests per client (default 8)")
    add_max_new_tokens_arg(ap, default=32, help="max_tokens of every request (default 32)", old=["--max-tokens"])
    ap.add_argument("--medusa-choices", default="mc_sim_7b_63", help="tree every request uses (default mc_sim_7b_63)")
    add_threads_arg(ap, default=1, old=["--intra-op-threads"],
                    help="torch threads in the server (default 1: leaves the clients a core on small machines)")
    ap.add_argument("--json", type=Path, help="results file (default: <workdir>/bench_triton.json)")
    args = ap.parse_args()
    levels = [int(x) for x in args.clients.split(",")]

    import torch

    from medusa_trt.runtime.decoding import GenerationConfig, decode
    from medusa_trt.runtime.loading import load_backend, load_tokenizer, stop_tokens
    from medusa_trt.serving.server import running_server
    from medusa_trt.serving.triton_repo import write_triton_repo

    args.workdir.mkdir(parents=True, exist_ok=True)
    engine = args.engine or synthetic_checkpoint(args.workdir / "model")
    repo = write_triton_repo(engine, args.workdir / "repo", max_batch_size=max(levels),
                             medusa_choices=args.medusa_choices, intra_op_threads=args.threads, force=True)

    # Offline: the same requests one by one in this process, same thread count.
    torch.set_num_threads(max(args.threads, 1))
    backend, tok = load_backend(engine), load_tokenizer(engine)
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, medusa_choices=args.medusa_choices,
                           stop_token_ids=stop_tokens(engine, tok))
    expected, steps = {}, 0
    decode(backend, [tok.encode(PROMPTS[0])], cfg)  # warm-up
    t0 = time.perf_counter()
    for text in PROMPTS:
        result = decode(backend, [tok.encode(text)], cfg)
        expected[text], steps = result.tokens[0], steps + result.stats[0].steps
    offline_s = time.perf_counter() - t0
    offline_tokens = sum(len(v) for v in expected.values())
    offline = {"requests": len(PROMPTS), "tokens": offline_tokens, "seconds": round(offline_s, 4),
               "requests_per_s": round(len(PROMPTS) / offline_s, 3), "tokens_per_s": round(offline_tokens / offline_s, 2),
               "tokens_per_step": round(offline_tokens / steps, 3)}
    del backend

    runs = []
    with running_server(repo, timeout=300) as server:
        run_clients(server.grpc_url, 2, 2, args.max_new_tokens)  # warm-up: connections, first-batch costs
        for n in levels:
            result = run_clients(server.grpc_url, n, args.requests, args.max_new_tokens)
            outputs = result.pop("outputs")
            result["mismatches"] = sum(ids != expected[text] for text, ids in outputs)
            runs.append(result)
            print(f"  {n:>3} clients: {result['requests_per_s']:.2f} req/s", file=sys.stderr, flush=True)

    base = next((r for r in runs if r["clients"] == 1), runs[0])
    for r in runs:
        r["speedup_vs_1_client"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
    summary = {
        "engine": str(engine), "medusa_choices": args.medusa_choices, "max_tokens": args.max_new_tokens,
        "requests_per_client": args.requests,
        "intra_op_threads": args.threads, "cpu_count": os.cpu_count(), "offline_sequential": offline,
        "served": runs,
        "served_1_client_vs_offline": round(base["tokens_per_s"] / offline["tokens_per_s"], 3),
    }
    print(f"\n{'clients':>7} {'req/s':>8} {'tokens/s':>9} {'mean ms':>8} {'p90 ms':>8} {'x 1 client':>10} {'errors':>6}")
    print(f"{'offline':>7} {offline['requests_per_s']:>8.2f} {offline['tokens_per_s']:>9.1f} {'':>8} {'':>8} {'':>10} {'':>6}")
    for r in runs:
        print(f"{r['clients']:>7} {r['requests_per_s']:>8.2f} {r['tokens_per_s']:>9.1f} {r['mean_latency_ms']:>8.1f} "
              f"{r['p90_latency_ms']:>8.1f} {r['speedup_vs_1_client']:>10.2f} {r['mismatches']:>6}")
    print(f"served with 1 client / offline sequential: {summary['served_1_client_vs_offline']:.2f}; "
          f"tree {args.medusa_choices}, {offline['tokens_per_step']:.2f} tokens per step")
    out = args.json or args.workdir / "bench_triton.json"
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    return 1 if any(r["mismatches"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
