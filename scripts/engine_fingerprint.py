"""Fingerprint of what engines compute, to prove a restructuring changed no output bit.

Builds a tiny llama checkpoint (tests/synthetic.py) and, with the CLIs, a float32 engine, one
without the fused step, an int4 engine and an exact-int4 one (offsets, 8-bit lm_head); then decodes
the same prompts on each and on the PyTorch reference (plain and Medusa greedy at batch 4 and 1, a
chain tree, lossless sampling with a seed, typical acceptance) and hashes one forward's logits and
head logits. Run it on the old and the new code (each from its own checkout: `PYTHONPATH=.`), then
compare:

    python scripts/engine_fingerprint.py build/fp_old old.json
    python scripts/engine_fingerprint.py build/fp_new new.json --compare old.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.synthetic

ENGINES = {"f32": [], "f32_nofused": ["--no-fused-step"], "int4": ["--weights", "int4"],
           "int4_exact": ["--weights", "int4", "--int4-offsets", "--int4-lm-head-bits", "8"]}


def _cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", *args], check=True, stdout=subprocess.DEVNULL)


def _hash(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()[:16]


def fingerprint(work: Path) -> dict:
    from medusa_trt.runtime.decoding import GenerationConfig, decode
    from medusa_trt.runtime.loading import load_backend
    from tests.synthetic import make_base, make_heads

    base, heads, ckpt = work / "base", work / "heads", work / "ckpt"
    if not base.exists():
        make_base(base, "llama", hidden_size=64, layers=2)
        make_heads(heads, "medusa_v1", base)
    if not ckpt.exists():
        _cli("medusa_trt.cli.convert", "--base", str(base), "--heads", str(heads), "--out", str(ckpt))
    for name, flags in ENGINES.items():
        if not (work / name).exists():
            _cli("medusa_trt.cli.build", "--checkpoint", str(ckpt), "--out", str(work / name), *flags)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 72, (n,), generator=g).tolist() for n in (5, 11, 1, 17)]
    runs = {
        "plain_b4": (GenerationConfig(max_new_tokens=40, use_medusa=False), prompts),
        "medusa_b4": (GenerationConfig(max_new_tokens=40), prompts),
        "medusa_b1": (GenerationConfig(max_new_tokens=40), prompts[1:2]),
        "plain_b1": (GenerationConfig(max_new_tokens=40, use_medusa=False), prompts[2:3]),
        "medusa_b1_len1": (GenerationConfig(max_new_tokens=40), prompts[2:3]),
        "chain": (GenerationConfig(max_new_tokens=40, medusa_choices="[[0],[0,0],[0,0,0]]"), prompts[:2]),
        "sample": (GenerationConfig(max_new_tokens=30, acceptance="sample", temperature=0.8, seed=3), prompts),
        "typical": (GenerationConfig(max_new_tokens=30, acceptance="typical", temperature=0.7), prompts[:2]),
    }
    out = {}
    for name in ["ckpt", *ENGINES]:
        backend = load_backend(work / name)
        record = {}
        for label, (cfg, batch) in runs.items():
            result = decode(backend, batch, cfg)
            record[label] = [result.tokens, [s.steps for s in result.stats]]
        backend.start(1, 64)
        ids = torch.tensor([prompts[3]])
        n = ids.shape[1]
        logits, medusa = backend.forward(ids, torch.arange(n)[None], torch.ones(n, n, dtype=torch.bool).tril()[None])
        record["forward_logits"], record["forward_medusa"] = _hash(logits), _hash(medusa)
        out[name] = record
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("workdir", type=Path, help="where the checkpoint and engines are built (reused)")
    p.add_argument("out", type=Path, help="the fingerprint, JSON")
    p.add_argument("--compare", type=Path, help="a fingerprint of other code to compare with")
    args = p.parse_args()
    torch.set_num_threads(1)
    result = fingerprint(args.workdir)
    args.out.write_text(json.dumps(result, indent=1))
    if args.compare is None:
        return 0
    other = json.loads(args.compare.read_text())
    differ = {name: [k for k in result[name] if result[name][k] != other.get(name, {}).get(k)] for name in result}
    for name, keys in differ.items():
        print(f"{name:12} {'identical' if not keys else 'DIFFERS: ' + ', '.join(keys)}")
    return 1 if any(differ.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
