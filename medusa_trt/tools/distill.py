"""Self-distillation data: the base model's own greedy answers and its hidden state at every position.

A drafter is trained to guess what the base model will say, so its training text is the base's own
greedy continuation of real prompts (what greedy verification accepts), and its targets are the
base's distributions along that text. Both come from one pass: decoding on an engine of the base
(plain steps) while recording the final normed hidden state of every position, the prompt's
included (the prefill asks the engine for every row). The base's distribution at position t is
softmax(lm_head(hidden[t])), so soft labels need no second forward and no stored logits.

Work is cut into chunks of prompts, each saved as it finishes (`chunk_00000.pt`, ...): a run that is
stopped resumes at the first missing chunk, and more data is a larger prompt list away.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from medusa_trt.runtime.backend import Backend


@dataclass
class Sample:
    """One distilled sequence: tokens = prompt + the base's continuation; hidden[t] [n, d] float16 is
    the final normed hidden state at position t (it scores token t + 1), for t < n <= len(tokens) - 1."""

    tokens: list[int]
    prompt_len: int
    hidden: torch.Tensor
    kind: str = ""


class HiddenRecorder(Backend):
    """A backend that records, per sequence, the final normed hidden state of every row it runs: the
    whole prompt at prefill (the forward is asked for every row; the loop still gets the last row's
    logits), then each fed token. Plain decoding only (no trees, no fused step)."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.info = backend.info
        self.host_threads = backend.host_threads

    @property
    def lengths(self) -> torch.Tensor:
        return self.backend.lengths

    def start(self, batch: int, capacity: int) -> None:
        self.rows = list(range(batch))
        self.hidden: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        self.backend.start(batch, capacity)

    def forward(self, input_ids, position_ids, new_mask, logit_positions=None, with_heads=True):
        b, s = input_ids.shape
        if s > 1:  # the prefill (left-padded, steps._pad_prompts): every row's state is wanted
            logits, _ = self.backend.forward(input_ids, position_ids, new_mask, torch.arange(s).expand(b, s), False)
            h = self.backend._hidden  # [B, S, d]
            valid = new_mask[:, -1]  # [B, S] the last row attends exactly the prompt's tokens
            for row, idx in enumerate(self.rows):
                self.hidden[idx].append(h[row][valid[row]].to(torch.float16))
            keep = logit_positions if logit_positions is not None else torch.arange(s).expand(b, s)
            return logits.gather(1, keep[..., None].expand(-1, -1, logits.shape[-1])), None
        logits, _ = self.backend.forward(input_ids, position_ids, new_mask, logit_positions, False)
        h = self.backend._hidden  # [B, 1, d]
        for row, idx in enumerate(self.rows):
            self.hidden[idx].append(h[row, -1:].to(torch.float16))
        return logits, None

    def draft(self, rows, counts, next_tokens):
        return self.backend.draft(rows, counts, next_tokens)

    def commit(self, slots, counts) -> None:
        self.backend.commit(slots, counts)

    def keep(self, rows) -> None:
        self.rows = [self.rows[r] for r in rows.tolist()]
        self.backend.keep(rows)


def distill_batch(rec: HiddenRecorder, prompts: list[list[int]], new_tokens: int, stop_ids: tuple[int, ...],
                  kinds: list[str]) -> list[Sample]:
    """Greedy continuations of `prompts` decoded together, with every position's hidden state."""
    from medusa_trt.runtime.decoding import GenerationConfig, decode

    cfg = GenerationConfig(max_new_tokens=new_tokens, use_medusa=False, stop_token_ids=stop_ids)
    res = decode(rec, prompts, cfg)
    out = []
    for row, p in enumerate(prompts):
        tokens = list(p) + list(res.tokens[row])
        h = torch.cat(rec.hidden[row])[: len(tokens) - 1]  # the last token is never fed
        out.append(Sample(tokens, len(p), h, kinds[row]))
    return out


def distill(engine: str | Path, prompts: list[list[int]], out_dir: str | Path, *, kinds: list[str] | None = None,
            new_tokens: int = 128, stop_ids: tuple[int, ...] = (), batch: int = 16, chunk: int = 256,
            threads: int | None = None, desc: str = "distilling", starts: list[int] | None = None) -> list[Path]:
    """Decodes every prompt on the engine (plain greedy) in chunks of `chunk` prompts, each saved to
    out_dir/chunk_NNNNN.pt (a list of Sample fields) as it completes; existing chunks are kept and
    skipped. Returns the chunk files in order.

    `starts` (per prompt): where its drafting rows begin, when that is not the prompt's end. With
    new_tokens=1 a prompt holding a whole answer is teacher-forced text: one prefill gives every
    row's state (several times cheaper per row than decoding), its answer's rows start at `starts`."""
    from medusa_trt.runtime.loading import load_backend
    from medusa_trt.runtime.ort.session import OrtSessionOptions

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kinds = kinds or [""] * len(prompts)
    files = [out / f"chunk_{i // chunk:05d}.pt" for i in range(0, len(prompts), chunk)]
    todo = [i for i, f in enumerate(files) if not f.is_file()]
    if not todo:
        return files
    rec = HiddenRecorder(load_backend(engine, ort_options=OrtSessionOptions(threads=threads)))
    bar = tqdm(total=sum(min(chunk, len(prompts) - i * chunk) for i in todo), desc=desc, unit="prompt")
    produced, t0 = 0, time.perf_counter()
    for c in todo:
        ids, ks = prompts[c * chunk : (c + 1) * chunk], kinds[c * chunk : (c + 1) * chunk]
        firsts = starts[c * chunk : (c + 1) * chunk] if starts is not None else None
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # similar lengths pad little
        samples: list[Sample | None] = [None] * len(ids)
        for j in range(0, len(order), batch):
            idx = order[j : j + batch]
            for i, s in zip(idx, distill_batch(rec, [ids[i] for i in idx], new_tokens, stop_ids, [ks[i] for i in idx]),
                            strict=True):
                if firsts is not None:
                    s.prompt_len = firsts[i]
                samples[i] = s
                produced += len(s.tokens) - s.prompt_len
            bar.update(len(idx))
            bar.set_postfix(new_tok_s=f"{produced / (time.perf_counter() - t0):.0f}")
        tmp = files[c].with_suffix(".tmp")
        torch.save([vars(s) for s in samples], tmp)
        tmp.replace(files[c])  # a chunk appears whole or not at all
    bar.close()
    return files


def load_samples(files: list[Path]) -> list[Sample]:
    return [Sample(**d) for f in files for d in torch.load(f, weights_only=False)]
