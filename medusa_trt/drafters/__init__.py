"""Drafters: what proposes the next tree's tokens, behind one seam.

A drafter reads what the base model has committed and returns, per head, logits for the tokens
after the next tree's root (head k: the token k + 1 after the root). The seam is one interface in
the three places a drafter lives:

- the reference model (`Drafter`, drafters/base.py): `MedusaModel.drafter` is an instance of the
  checkpoint's drafter kind (config `medusa_trt.drafter`, default "medusa"), and the model calls it
  and nothing else;
- the exported graphs: the heads graph and the fused step graph (engines/onnx/export.py) draft
  through the form the drafter exports (engines/onnx/drafters.py: graph_form, with 2-D MatMuls and
  the If-per-head ONNX Runtime runs fast); a drafter with a cache of its own exports a drafter graph
  instead (export.py: _DrafterModule) and drafts inside the step graph (step.py: _cached_draft);
- the runtime (`Backend.draft`, runtime/backend.py): the decoding loop hands every backend the rows
  it committed this step and the tokens chosen after them, once per step.

Per step a drafter gets the base model's final normed hidden state of each committed row, oldest
first, and the token chosen after each (the last one: the next root). A drafter with a cache of its
own (`Drafter.has_cache`: Amphista's staged adaptation layers, an EAGLE-style layer) appends exactly
those rows to it and never rolls back: every row it sees is committed. Medusa heads need only the
last row's hidden state.

A new drafter is a new module here: a `Drafter` subclass with its `kind` in DRAFTERS, its tensors
named in docs/formats.md, and its graph form.
"""

from __future__ import annotations

from medusa_trt.config import ModelConfig
from medusa_trt.drafters.amphista import Amphista
from medusa_trt.drafters.base import Drafter
from medusa_trt.drafters.medusa import MedusaHeads

DRAFTERS: dict[str, type[Drafter]] = {MedusaHeads.kind: MedusaHeads, Amphista.kind: Amphista}


def drafter_tensors(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor a non-Medusa drafter stores in a merged checkpoint: its module's
    parameters, prefixed with its kind (`amphista.fc1.weight`, ...). Medusa heads keep TensorRT-LLM's
    names (checkpoint.expected_tensors)."""
    import torch

    cfg = ModelConfig.from_checkpoint_config(config)
    with torch.device("meta"):
        drafter = make_drafter(cfg)
    return [(f"{cfg.drafter}.{name}", tuple(p.shape)) for name, p in drafter.named_parameters()]


def make_drafter(cfg: ModelConfig) -> Drafter:
    """An empty drafter of the checkpoint's kind (cfg.drafter) for the model `cfg` describes; the
    checkpoint's weights are loaded into it with the model's."""
    if cfg.drafter not in DRAFTERS:
        raise ValueError(f"drafter {cfg.drafter!r}: expected one of {', '.join(DRAFTERS)}")
    return DRAFTERS[cfg.drafter](cfg)
