"""The PyTorch reference model behind the runtime's Backend interface (runtime/backend.py)."""

from __future__ import annotations

import torch

from medusa_trt.checkpoint import DEFAULT_MAX_DRAFT_LEN
from medusa_trt.modeling import MedusaModel
from medusa_trt.runtime.backend import Backend, ModelInfo, commit_indices, full_attention_mask, last_rows


class TorchBackend(Backend):
    """The PyTorch reference model behind the backend interface, cache preallocated once per batch."""

    def __init__(self, model: MedusaModel, max_draft_len: int = DEFAULT_MAX_DRAFT_LEN,
                 hidden_all_rows: bool | None = None):
        self.model = model
        # The model's device (cpu or cuda) holds the cache and runs the math; the decoding loop's
        # small int tensors stay on the host and logits come back there, as from every backend.
        self.device = model.inv_freq.device
        cfg = model.cfg
        # A drafter with a cache of its own reads prompt rows whose logits nobody needs: every row's
        # hidden state is kept, as its ONNX Runtime engines do (ModelInfo.hidden_all_rows), unless
        # `hidden_all_rows` says otherwise (medusa-check: as the engine it is compared with does).
        all_rows = model.drafter.has_cache if hidden_all_rows is None else hidden_all_rows
        self.info = ModelInfo(cfg.vocab_size, cfg.num_medusa_heads, cfg.max_position_embeddings, max_draft_len,
                              drafter_cache=model.drafter.has_cache, hidden_all_rows=all_rows)
        self.start(1, 0)

    def start(self, batch: int, capacity: int) -> None:
        self.keys, self.values = self.model.empty_cache(batch, capacity, self.device)  # [L, B, Hkv, cap, D]
        self.lengths = torch.zeros(batch, dtype=torch.long)
        self.drafter_past: list = [None] * batch  # per sequence, a drafter with a cache (Drafter.append)
        self._past = 0  # P: where the pending tokens of the last forward were written

    @torch.inference_mode()
    def forward(self, input_ids, position_ids, new_mask, logit_positions=None, with_heads=True):
        past = int(self.lengths.max()) if len(self.lengths) else 0
        s = input_ids.shape[1]
        if past + s > self.keys.shape[3]:
            raise ValueError(f"KV cache overflow: {past} + {s} positions > capacity {self.keys.shape[3]}")
        mask = full_attention_mask(self.lengths, past, new_mask)
        dev = self.device  # .to() of a tensor already there is free: nothing moves on the CPU
        logits, self._hidden, new_k, new_v = self.model.forward_hidden(
            input_ids.to(dev), position_ids.to(dev), mask.to(dev), self.keys[..., :past, :],
            self.values[..., :past, :], None if logit_positions is None else logit_positions.to(dev),
            all_hidden=self.info.hidden_all_rows,
        )
        self.keys[..., past : past + s, :] = new_k
        self.values[..., past : past + s, :] = new_v
        self._past = past
        return logits.cpu(), self.model.draft(self._hidden).cpu() if with_heads else None

    @torch.inference_mode()
    def draft(self, rows: torch.Tensor, counts: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        model = self.model
        if model.drafter.has_cache:  # one sequence at a time: the reference, exact for ragged batches
            out = []
            for b in range(len(rows)):
                c = int(counts[b])
                h = self._hidden[b, rows[b, :c].to(self.device)][None]
                logits, self.drafter_past[b] = model.drafter.append(
                    h, next_tokens[b, :c][None].to(self.device), model.lm_head, model.vocab_embedding,
                    self.drafter_past[b])
                out.append(logits)
            return torch.stack(out, dim=1).cpu()
        # A stateless drafter drafts from the last committed row and the token chosen after it.
        last = last_rows(rows, counts)
        b = torch.arange(len(rows))
        h = self._hidden[b.to(self.device), last.to(self.device)]  # [B, d]
        tokens = next_tokens[b, counts - 1].to(self.device)  # [B]
        return self.model.draft(h[:, None], tokens[:, None])[:, :, 0].cpu()

    def commit(self, slots: torch.Tensor, counts: torch.Tensor) -> None:
        b, src, dst = (i.to(self.device) for i in commit_indices(self.lengths, self._past, slots, counts))
        # Gather before scatter: destinations may overlap sources of the same commit.
        self.keys[:, b, :, dst] = self.keys[:, b, :, src].clone()
        self.values[:, b, :, dst] = self.values[:, b, :, src].clone()
        self.lengths = self.lengths + counts

    def keep(self, rows: torch.Tensor) -> None:
        self.keys, self.values = self.keys[:, rows.to(self.device)], self.values[:, rows.to(self.device)]
        self.lengths = self.lengths[rows]
        self.drafter_past = [self.drafter_past[r] for r in rows.tolist()]
