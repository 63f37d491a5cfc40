"""Does bias correction help an int4 engine's grids? (issue 35, docs/benchmarks/issue-35-amphista.md (ae))

Rounding a matrix W to W' shifts each output by (W - W') x; over text its mean shift is
(W - W') E[x], which a bias can take back. This measures it in the reference's arithmetic
(tools.parity.reference_model: the engine's own int4 grids, MatMulNBits' int8 activations) without
building anything: E[x] per base Linear from the same text the calibrated build samples (32 x 128
tokens after bos), then teacher-forced top-1 agreement and KL against the float32 model on held-out
prompts, each engine as built and with the bias added. Offsets and 8-bit blocks are left as they are.

    python benchmarks/investigations/bench_int4_bias_correction.py --checkpoint build/ckpt_amphista \
        --engine build/eng4e --engine build/eng4h [--limit 32]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common import DEFAULT_PROMPTS, read_prompts  # noqa: E402

from medusa_trt.calibration.activations import record_linear_inputs, sample_own_text  # noqa: E402
from medusa_trt.engine_dir import read_engine  # noqa: E402
from medusa_trt.modeling import MedusaModel  # noqa: E402
from medusa_trt.quant import Int4Linear, base_linear_names, dequantize_int4  # noqa: E402
from medusa_trt.tools.parity import reference_model  # noqa: E402


def logits(model, ids: list[int]) -> torch.Tensor:
    s, cfg = len(ids), model.cfg
    empty = torch.zeros(cfg.num_layers, 1, cfg.num_kv_heads, 0, cfg.head_dim)
    mask = torch.ones(1, s, s, dtype=torch.bool).tril()
    return model.forward_hidden(torch.tensor([ids]), torch.arange(s)[None], mask, empty, empty)[0][0].float()


def score(model, prompts: list[list[int]], refs: list[torch.Tensor]) -> tuple[float, float]:
    """(top-1 agreement, mean KL(reference || model)) over every prompt position."""
    agree = kl = n = 0.0
    for ids, ref in zip(prompts, refs, strict=True):
        out = logits(model, ids)
        agree += float((out.argmax(-1) == ref.argmax(-1)).sum())
        lr, lo = ref.log_softmax(-1), out.log_softmax(-1)
        kl += float((lr.exp() * (lr - lo)).sum())
        n += len(ids)
    return agree / n, kl / n


@torch.no_grad()
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, required=True, help="the merged checkpoint the engines were built from")
    p.add_argument("--engine", type=Path, action="append", required=True, help="an int4 engine dir (repeat)")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    p.add_argument("--limit", type=int, default=32)
    args = p.parse_args()
    from transformers import AutoTokenizer

    float_model = MedusaModel.from_checkpoint(args.checkpoint, dtype="float32")
    names = base_linear_names(float_model)
    sums: dict[str, torch.Tensor] = {}

    def record(name: str, x: torch.Tensor) -> None:
        sums[name] = sums[name] + x.sum(0) if name in sums else x.sum(0)

    start = json.loads((args.checkpoint / "config.json").read_text()).get("bos_token_id")
    if not isinstance(start, int):
        print(f"{args.checkpoint / 'config.json'}: bos_token_id {start!r}: expected a token id to sample text from",
              file=sys.stderr)
        return 2
    rows = record_linear_inputs(float_model, sample_own_text(float_model, start, 32, 128), names, record)
    mean = {n: s / rows for n, s in sums.items()}
    tokenizer = AutoTokenizer.from_pretrained(args.engine[0])
    prompts = [pr.ids for pr in read_prompts(args.prompts, tokenizer, args.limit)]
    refs = [logits(float_model, ids) for ids in prompts]
    print("| engine | top-1 as built | bias-corrected | KL as built | bias-corrected |")
    print("| --- | --- | --- | --- | --- |")
    for engine in args.engine:
        model = reference_model(args.checkpoint, read_engine(engine), engine)
        built = score(model, prompts, refs)
        for n in names:
            linear = model.get_submodule(n)
            if not isinstance(linear, Int4Linear) or linear.bits != 4 or linear.offsets is not None:
                continue
            shift = (float_model.get_submodule(n).weight.float()
                     - dequantize_int4(linear.packed, linear.scales, linear.zero_points)) @ mean[n]
            linear.bias = shift if linear.bias is None else linear.bias + shift
        corrected = score(model, prompts, refs)
        print(f"| {engine} | {built[0]:.3f} | {corrected[0]:.3f} | {built[1]:.3f} | {corrected[1]:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
