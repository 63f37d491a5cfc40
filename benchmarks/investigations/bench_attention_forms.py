"""What does each part of the row-exact attention cost, without a profiler? (issue 13)

ONNX Runtime's profiler adds ~2 us to every op it times, which inflates a graph of ~900 small ops by
more than the ops themselves cost (a chain of 900 Reshapes runs at ~0.2 us an op). So this exports
one decode step's attention alone, for every layer of SmolLM2-135M (30 layers, 9 query heads over 3
KV heads of 64), in several forms, and times whole session runs round-robin:

  row_exact      the engine's form (engines/onnx/attention.py: row_exact_attention, the prefix Slice of
                 _ExportModule included): Slice + Concat of the cache, float64 softmax and weighted sum
  no_slice       the runtime hands the committed prefix itself (not possible with a head-major
                 cache: the prefix of [B, H, T, D] is not contiguous)
  no_copy        no Slice and no Concat (scores over the past only: a lower bound, not attention)
  f32_softmax    softmax in float32, weighted sum in float64
  f32            everything in float32 (what a fused kernel such as GroupQueryAttention computes)
  token_major    a [T, B, H, D] cache whose prefix the runtime hands in place; past and new keys
                 scored separately (FusedMatMul transBatchB) and the weighted sum split likewise,
                 in float64 (exact, like row_exact)
  row_exact_f32  the int4 default from the eighth run to 2026-11-24: float32, the softmax's sum in
                 float64 over the exponentials, the weighted sum a float32 MatMul of them
                 (row-invariant within key blocks, engines/onnx/attention.py: row_exact_f32_attention)
  chain_f32      the int4 default since 2026-11-24: row_exact_f32's placed keys and grouped query
                 rows in one ONNX Attention op (row-invariant for plain steps and chain trees,
                 engines/onnx/attention.py: chain_f32_attention)

Only row_exact, token_major and row_exact_f32 are row-invariant for any tree, chain_f32 for chains
(Medusa == plain on int4 engines); the others say what each part costs.

    python benchmarks/investigations/bench_attention_forms.py [--committed 190,1000] [--slots 1,2] [--out build/attention_forms]
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from medusa_trt.engines.onnx.attention import grouped_attention_op, grouped_attention_translation
from medusa_trt.runtime.ort.session import OrtSessionOptions, make_session

LAYERS, HQ, HKV, D = 30, 9, 3, 64
G = HQ // HKV
CAPACITY = 2048


def _attend(q, keys, values, mask, *, f64_softmax=True, f64_sum=True):
    b, _, s, d = q.shape
    qg = q.reshape(b, HKV, G * s, d) * (1.0 / math.sqrt(d))
    scores = torch.matmul(qg, keys.transpose(-1, -2))
    scores = scores.double() if f64_softmax else scores
    probs = torch.softmax(scores.masked_fill(~mask, torch.finfo(scores.dtype).min), dim=-1)
    probs = probs.double() if f64_sum else probs.float()
    values = values.double() if f64_sum else values
    return torch.matmul(probs, values).reshape(b, HQ, s, d).to(q.dtype)


def head_major(slice_prefix: bool, concat: bool, **precision):
    def form(q, k, v, past_k, past_v, mask, used):
        if slice_prefix:
            past_k, past_v = past_k.narrow(2, 0, used), past_v.narrow(2, 0, used)
        keys = torch.cat([past_k, k], dim=2) if concat else past_k
        values = torch.cat([past_v, v], dim=2) if concat else past_v
        return _attend(q, keys, values, mask if concat else mask[..., :keys.shape[2]], **precision)
    return form


def _placed(k, v, past_k, past_v, used):
    """The new K/V written into the buffer's slots after the prefix (batch 1: at `used`)."""
    b, _, s, d = k.shape
    index = (used + torch.arange(s))[None, None, :, None].expand(b, HKV, s, d)
    return past_k.narrow(2, 0, used + s).scatter(2, index, k), past_v.narrow(2, 0, used + s).scatter(2, index, v)


def row_exact_f32(q, k, v, past_k, past_v, mask, used):
    """engines/onnx/attention.py: row_exact_f32_attention, the mask already tiled."""
    b, _, s, d = q.shape
    keys, values = _placed(k, v, past_k, past_v, used)
    scores = torch.matmul(q.reshape(b, HKV, G * s, d) * (1.0 / math.sqrt(d)), keys.transpose(-1, -2))
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    e = torch.exp(scores - scores.amax(-1, keepdim=True))
    return (torch.matmul(e, values) / e.double().sum(-1, keepdim=True).float()).reshape(b, HQ, s, d)


def chain_f32(q, k, v, past_k, past_v, mask, used):
    """engines/onnx/attention.py: chain_f32_attention, the mask already tiled: one Attention op."""
    b, _, s, d = q.shape
    keys, values = _placed(k, v, past_k, past_v, used)
    return grouped_attention_op()(q.reshape(b, HKV, G * s, d), keys, values, mask).reshape(b, HQ, s, d)


def token_major(q, k, v, past_k, past_v, mask, used):
    """past_k/past_v [T, B, Hkv, D]: the committed prefix, read in place."""
    b, _, s, d = q.shape
    t = past_k.shape[0]
    qg = q.reshape(b, HKV, G * s, d) * (1.0 / math.sqrt(d))
    scores = torch.cat([torch.matmul(qg, past_k.permute(1, 2, 3, 0)), torch.matmul(qg, k.transpose(-1, -2))], dim=-1)
    probs = torch.softmax(scores.double().masked_fill(~mask, torch.finfo(torch.float64).min), dim=-1)
    out = torch.matmul(probs[..., :t], past_v.double().permute(1, 2, 0, 3)) + torch.matmul(probs[..., t:], v.double())
    return out.reshape(b, HQ, s, d).to(q.dtype)


FORMS = {
    "row_exact": head_major(True, True),
    "no_slice": head_major(False, True),
    "no_copy": head_major(False, False),
    "f32_softmax": head_major(True, True, f64_softmax=False),
    "f32": head_major(True, True, f64_softmax=False, f64_sum=False),
    "token_major": token_major,
    "row_exact_f32": row_exact_f32,
    "chain_f32": chain_f32,
}
SLICED = {"row_exact", "f32_softmax", "f32", "row_exact_f32", "chain_f32"}  # these take the whole cache buffer and slice it


class _Layers(torch.nn.Module):
    def __init__(self, form):
        super().__init__()
        self.form = form

    def forward(self, q, k, v, lengths, mask, past):
        used = lengths.max().item()
        torch._check(used >= 0)
        torch._check(used + q.shape[2] <= past[0].shape[0 if self.form is token_major else 2])
        mask = mask[:, None].repeat(1, 1, G, 1)  # once per step, as the engine tiles it
        for i in range(LAYERS):  # each layer's output feeds the next query, as in the decoder
            q = q + 1e-3 * self.form(q, k, v, past[2 * i], past[2 * i + 1], mask, used)
        return q


def export(name: str, out: Path) -> Path:
    from torch.export import Dim

    path = out / f"{name}.onnx"
    s, t = 3, 5
    q, k = torch.randn(1, HQ, s, D), torch.randn(1, HKV, s, D)
    new = name != "no_copy"
    if name == "token_major":
        past, past_dims = tuple(torch.randn(t, 1, HKV, D) for _ in range(2 * LAYERS)), {0: Dim("past")}
    else:  # the whole buffer (sliced in the graph) or the prefix itself
        cache = t + s + 2 if name in SLICED else t
        past, past_dims = tuple(torch.randn(1, HKV, cache, D) for _ in range(2 * LAYERS)), {2: Dim("cache")}
    inputs = {"q": q, "k": k, "v": k.clone(), "lengths": torch.tensor([t]),
              "mask": torch.ones(1, s, t + s if new else t, dtype=torch.bool), "past": past}
    news, keys = Dim("new"), Dim("keys")
    shapes = {"q": {2: news}, "k": {2: news}, "v": {2: news}, "lengths": None, "mask": {1: news, 2: keys},
              "past": tuple(past_dims for _ in range(2 * LAYERS))}
    table = {grouped_attention_op()._opoverload: grouped_attention_translation} if name == "chain_f32" else None
    program = torch.onnx.export(_Layers(FORMS[name]), (), kwargs=inputs, dynamic_shapes=shapes, dynamo=True,
                                custom_translation_table=table, opset_version=23, optimize=True, verbose=False)
    program.save(path)
    return path


def feeds(name: str, session, committed: int, slots: int, cache: list, rng) -> dict:
    """`cache`: every layer's K and V, head-major [1, Hkv, CAPACITY, D] and token-major [CAPACITY, 1,
    Hkv, D] copies of the same values, made once: every form reads the same memory."""
    q = rng.standard_normal((1, HQ, slots, D), dtype=np.float32)
    k = rng.standard_normal((1, HKV, slots, D), dtype=np.float32)
    cache, by_token = cache
    if name == "token_major":
        past = [c[:committed] for c in by_token]  # a view, no copy
    elif name in SLICED:
        past = cache
    else:
        past = [np.ascontiguousarray(c[:, :, :committed]) for c in cache]
    keys = committed + (0 if name == "no_copy" else slots)
    mask = np.ones((1, slots, keys), dtype=bool)
    values = [q, k, k.copy(), np.array([committed]), mask, *past]
    return {i.name: v for i, v in zip(session.get_inputs(), values, strict=True)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--committed", default="190,1000", help="committed cache lengths")
    p.add_argument("--slots", default="1,2", help="new tokens per step (1: plain, 2: the int4 tree [[0]])")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("build/attention_forms"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sessions = {name: make_session(export(name, args.out), options=OrtSessionOptions(threads=args.threads))
                for name in tqdm(FORMS, desc="export", unit="form")}
    rng = np.random.default_rng(0)
    cache = [rng.standard_normal((1, HKV, CAPACITY, D), dtype=np.float32) for _ in range(2 * LAYERS)]
    cache = (cache, [np.ascontiguousarray(c.transpose(2, 0, 1, 3)) for c in cache])
    cases = [(c, s) for c in (int(x) for x in args.committed.split(",")) for s in (int(x) for x in args.slots.split(","))]
    results = {}
    for committed, slots in tqdm(cases, desc="time", unit="case"):
        case = {name: feeds(name, sessions[name], committed, slots, cache, np.random.default_rng(slots)) for name in FORMS}
        best = dict.fromkeys(FORMS, float("inf"))
        for _ in range(args.rounds):  # round-robin: the machine's drift hits every form alike
            for name, session in sessions.items():
                for _ in range(20):
                    session.run(None, case[name])
                t = time.perf_counter()
                for _ in range(100):
                    session.run(None, case[name])
                best[name] = min(best[name], (time.perf_counter() - t) / 100 * 1e3)
        results[(committed, slots)] = best
    print(f"\n{LAYERS} layers of one step's attention, {args.threads} thread(s), best of {args.rounds} rounds, ms "
          "(x row_exact)")
    print("| committed | slots | " + " | ".join(FORMS) + " |")
    print("|---|---|" + "---|" * len(FORMS))
    for (committed, slots), best in results.items():
        base = best["row_exact"]
        print(f"| {committed} | {slots} | " + " | ".join(f"{v:.3f} ({v / base:.2f})" for v in best.values()) + " |")


if __name__ == "__main__":
    main()
