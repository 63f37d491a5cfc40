"""The Python-backend model that medusa-triton writes: Triton requests in, Medusa decoding, responses out.

Triton's dynamic batcher hands `execute` every request that queued while the previous batch ran.
Rows that share a generation config (same tree, acceptance mode and, for typical acceptance, the
same temperature and thresholds, for sample acceptance the same temperature, top_k and top_p, same
stop ids) decode together in one batched `generate` call; under `sample` each row draws from its own
generator (the request's `seed` + row, random without one), so batching never changes its tokens;
each row still stops at its own max_tokens, end id or stop word, and its statistics are the ones a
single-request decode would report (snapshotted when the row finishes). A bad request gets an
error response of its own; the rest of the batch is unaffected.

Decoupled models stream: with `stream` true, a request gets one response per decoding step with
the text and ids that step added (and the statistics so far), the last one flagged final; without
it, one final response with everything. Non-decoupled models always answer once. `output_ids` is
right-padded with -1 (to the longest row, and to at least MIN_OUTPUT_IDS values): one shape, a
list, in every response, whichever endpoint renders it.

The prompt is `text_input` (raw text) or `messages` (JSON chat turns, rendered with the model's
chat template: runtime/chat.py); decoding stops at the engine's stop tokens (EOS and the chat
template's end of turn) unless the request sends `end_id`.

Everything but `TritonPythonModel` is plain Python over numpy arrays, so tests drive it directly;
`triton_python_backend_utils` exists only inside Triton's stub and is imported there.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from medusa_trt.dynamic_spec import dynamic_spec, parse_dynamic
from medusa_trt.errors import MedusaTrtError
from medusa_trt.runtime.chat import ChatError, encode_chat, parse_messages
from medusa_trt.runtime.config import ACCEPTANCE, acceptance_setting_problem
from medusa_trt.runtime.decoding import GenerationConfig, SequenceStats, generate, step_tree
from medusa_trt.runtime.loading import load_backend, load_tokenizer, stop_tokens
from medusa_trt.serving.triton_repo import MODEL_INPUTS
from medusa_trt.tree import TreeError, preset_names, read_tree

log = logging.getLogger(__name__)

# numpy dtypes Triton hands the stub for each declared data type.
_NUMPY_KINDS = {"TYPE_STRING": (np.object_, np.bytes_, np.str_), "TYPE_INT32": (np.int32,), "TYPE_INT64": (np.int64,),
                "TYPE_FP32": (np.float32,), "TYPE_BOOL": (np.bool_,), "TYPE_UINT64": (np.uint64,)}
_INPUTS = {s.name: s for s in MODEL_INPUTS}


class RequestError(MedusaTrtError):
    """A request this model refuses; the message names the input, the value and what was expected."""


class RequestCancelled(MedusaTrtError):
    """A request its client cancelled (gRPC cancellation, a timeout): answered with Triton's CANCELLED."""


@dataclass(frozen=True)
class ModelSettings:
    """The `parameters` of config.pbtxt (written by triton_repo.write_triton_repo)."""

    engine_dir: Path
    medusa_choices: str
    acceptance: str = "greedy"
    temperature: float = 0.7
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3
    max_input_len: int = 1 << 30
    max_output_len: int = 1 << 30
    device: str | None = None
    dtype: str | None = None
    intra_op_threads: int = 0
    model_name: str = "medusa"

    @classmethod
    def from_model_config(cls, config: Mapping) -> ModelSettings:
        params = {k: v.get("string_value", "") for k, v in (config.get("parameters") or {}).items()}
        where = f"model {config.get('name', '?')!r} config.pbtxt"
        if not params.get("engine_dir"):
            raise ValueError(f"{where}: parameter engine_dir is missing (write the repository with medusa-triton)")
        try:
            return cls(
                engine_dir=Path(params["engine_dir"]),
                medusa_choices=params.get("medusa_choices") or "mc_sim_7b_63",
                acceptance=params.get("acceptance") or "greedy",
                temperature=float(params.get("temperature") or 0.7),
                posterior_threshold=float(params.get("posterior_threshold") or 0.09),
                posterior_alpha=float(params.get("posterior_alpha") or 0.3),
                max_input_len=int(params.get("max_input_len") or 1 << 30),
                max_output_len=int(params.get("max_output_len") or 1 << 30),
                device=params.get("device") or None,
                dtype=params.get("dtype") or None,
                intra_op_threads=int(params.get("intra_op_threads") or 0),
                model_name=str(config.get("name", "medusa")),
            )
        except ValueError as err:
            raise ValueError(f"{where}: bad parameter value ({err})") from None


@dataclass
class Service:
    """One loaded engine with its tokenizer: what every request is decoded with."""

    backend: object
    tokenizer: object
    settings: ModelSettings
    stop_ids: tuple[int, ...]
    decoupled: bool = False


def load_service(settings: ModelSettings, decoupled: bool = False) -> Service:
    from medusa_trt.runtime.ort.session import OrtSessionOptions

    if settings.intra_op_threads:  # the PyTorch reference's threads (a merged checkpoint)
        import torch

        torch.set_num_threads(settings.intra_op_threads)
    # An ONNX Runtime engine's own threads: torch's setting does not reach its sessions.
    options = OrtSessionOptions(threads=settings.intra_op_threads or None)
    backend = load_backend(settings.engine_dir, dtype=settings.dtype, device=settings.device, ort_options=options)
    backend.open_sessions()  # a no-op for backends that open nothing on first use (runtime/backend.py)
    tokenizer = load_tokenizer(settings.engine_dir)
    return Service(backend, tokenizer, settings, stop_tokens(settings.engine_dir, tokenizer), decoupled)


@dataclass
class Job:
    """One row of one request, decoded as one sequence."""

    request: int  # index of the request in the execute() batch
    row: int
    prompt: list[int]
    max_tokens: int
    cfg: GenerationConfig
    key: tuple  # rows with equal keys decode in one batched generate call
    stop_words: tuple[str, ...] = ()
    seed: int | None = None  # sample acceptance: this row's generator seed
    tokens: list[int] = field(default_factory=list)
    live: SequenceStats | None = None  # filled by generate while the group decodes
    final: SequenceStats | None = None  # snapshot when this row finished
    done: bool = False
    sent_text: str = ""  # streaming: text already sent
    sent_ids: int = 0  # streaming: ids already sent

    @property
    def stats(self) -> SequenceStats:
        return self.final or self.live or SequenceStats()


@dataclass
class Parsed:
    jobs: list[Job]
    stream: bool


def parse_request(service: Service, inputs: Mapping[str, np.ndarray], index: int = 0) -> Parsed:
    """Checks one request's tensors and turns each row into a Job; raises RequestError."""
    s, info = service.settings, service.backend.info
    for name, array in inputs.items():
        spec = _INPUTS.get(name)
        if spec is None:
            raise RequestError(f"{name}: unknown input; expected one of {sorted(_INPUTS)}")
        if not isinstance(array, np.ndarray) or array.dtype.type not in _NUMPY_KINDS[spec.dtype]:
            got = array.dtype if isinstance(array, np.ndarray) else type(array).__name__
            raise RequestError(f"{name}: data type {got}; expected {spec.dtype[5:]}")
    given = [name for name in ("text_input", "messages") if name in inputs]
    if len(given) != 1:
        raise RequestError("text_input and messages: " + ("both given" if given else "missing") + "; expected one: "
                           "text_input (the prompt as raw text) or messages (JSON chat turns, [{\"role\": \"user\", "
                           "\"content\": ...}], rendered with the model's chat template)")
    source = given[0]
    if "max_tokens" not in inputs:
        raise RequestError("max_tokens: missing; expected an INT64 tensor with the number of tokens to generate")
    rows = inputs[source].shape[0] if inputs[source].ndim else 1
    if rows == 0:
        raise RequestError(f"{source}: 0 rows; expected at least one")
    values = {name: _rows(name, array, rows) for name, array in inputs.items()}
    stream = any(bool(v[0]) for v in values.get("stream", []))
    if stream and not service.decoupled:
        raise RequestError(f"stream: true, but model {s.model_name!r} is not decoupled; write the repository with "
                           "medusa-triton --decoupled to stream")
    jobs = []
    for r in range(rows):
        def one(name: str, default=None, _r=r):
            return values[name][_r][0] if name in values else default

        where = f" (row {r})" if rows > 1 else ""
        text = _text(source, one(source), where)
        if source == "messages":
            try:
                prompt = encode_chat(service.tokenizer, parse_messages(text, f"messages{where}"))
            except ChatError as err:
                raise RequestError(str(err) if str(err).startswith("messages") else f"messages{where}: {err}") from None
        else:
            prompt = list(service.tokenizer.encode(text))
        if not prompt:
            raise RequestError(f"{source}{where}: the prompt encodes to no tokens")
        if len(prompt) > s.max_input_len:
            raise RequestError(f"{source}{where}: prompt is {len(prompt)} tokens; model {s.model_name!r} accepts "
                               f"at most {s.max_input_len} (max_input_len in config.pbtxt)")
        max_tokens = int(one("max_tokens"))
        if not 1 <= max_tokens <= s.max_output_len:
            raise RequestError(f"max_tokens{where}: {max_tokens}; expected 1..{s.max_output_len} "
                               "(max_output_len in config.pbtxt)")
        spec = one("medusa_choices")
        spec = _inline_tree(_text("medusa_choices", spec, where), where) if spec is not None else s.medusa_choices
        try:
            if parse_dynamic(spec) is not None:  # a tree chosen per step: "dynamic:N[,cost=C]"
                tree = step_tree(info, spec)  # its slot cost: the spec's, else the default
                nodes = dynamic_spec(tree.budget, tree.slot_cost)
            else:
                nodes = read_tree(spec, info.num_medusa_heads, info.max_draft_len)
        except TreeError as err:
            raise RequestError(f"medusa_choices{where}: {err}") from None
        rank = 0 if isinstance(nodes, str) else max(max(p) for p in nodes)
        if rank >= info.vocab_size:
            raise RequestError(f"medusa_choices{where}: rank {rank} is beyond the vocabulary ({info.vocab_size} "
                               f"tokens); expected ranks < {info.vocab_size}")
        if len(prompt) + max_tokens > info.max_seq_len:
            raise RequestError(f"text_input{where}: prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) "
                               f"exceeds the engine's max_seq_len {info.max_seq_len}")
        acceptance = one("acceptance")
        acceptance = _text("acceptance", acceptance, where) if acceptance is not None else s.acceptance
        if acceptance not in ACCEPTANCE:
            raise RequestError(f"acceptance{where}: {acceptance!r}; expected one of {', '.join(ACCEPTANCE)}")
        temperature = float(one("temperature", s.temperature))
        threshold = float(one("posterior_threshold", s.posterior_threshold))
        alpha = float(one("posterior_alpha", s.posterior_alpha))
        if bad := acceptance_setting_problem(temperature, threshold, alpha):
            raise RequestError(f"{bad[0]}{where}: {bad[1]}; expected a finite value {bad[2]}")
        stop_ids = service.stop_ids
        if "end_id" in values:
            end_id = int(one("end_id"))
            if not 0 <= end_id < info.vocab_size:
                raise RequestError(f"end_id{where}: {end_id}; expected a token id in 0..{info.vocab_size - 1}")
            stop_ids = (end_id,)  # as in tensorrtllm_backend: end_id replaces the model's EOS
        stop_words = tuple(w for w in (_text("stop_words", v, where) for v in values.get("stop_words", [[]] * rows)[r])
                           if w)
        top_k = one("top_k")
        top_k = int(top_k) if top_k is not None else None
        top_p = float(one("top_p", 1.0))
        seed = one("seed")
        if seed is not None and not 0 <= int(seed) <= 2**63 - rows:  # row r draws from seed + r
            raise RequestError(f"seed{where}: {int(seed)}; expected an integer in [0, 2**63 - {rows}] "
                               f"(row r of this request draws from seed + r)")
        seed = int(seed) + r if seed is not None else secrets.randbelow(2**62)
        try:
            cfg = GenerationConfig(max_new_tokens=max_tokens, medusa_choices=nodes, acceptance=acceptance,
                                   temperature=temperature, posterior_threshold=threshold, posterior_alpha=alpha,
                                   stop_token_ids=stop_ids, top_k=top_k, top_p=top_p, seed=seed)
        except ValueError as err:
            raise RequestError(f"{err}{where}") from None
        if acceptance == "sample":  # the seed is per row (Job.seed), not part of the key
            knobs = (temperature, top_k, top_p)
        else:
            acceptance = "greedy" if acceptance == "greedy" or temperature == 0 else "typical"
            knobs = None if acceptance == "greedy" else (temperature, threshold, alpha)  # typical knobs only
        key = (nodes if isinstance(nodes, str) else tuple(map(tuple, nodes)), acceptance, knobs, stop_ids)
        jobs.append(Job(index, r, prompt, max_tokens, cfg, key, stop_words, seed if acceptance == "sample" else None))
    return Parsed(jobs, stream)


def group_jobs(jobs: list[Job], max_batch: int | None = None, max_seq_len: int | None = None) -> list[list[Job]]:
    """Jobs with the same key, in order of first appearance, each group cut into batches that one
    generate call runs, or it fails every row in it: at most `max_batch` rows (the engine's
    max_batch_size), and, with `max_seq_len`, the longest prompt + the largest max_tokens (a batch
    runs to it) within it. Each row fits alone (parse_request); two may not."""
    groups: dict[tuple, list[Job]] = {}
    for job in jobs:
        groups.setdefault(job.key, []).append(job)
    size = max_batch or len(jobs) or 1

    def fits(batch: list[Job], job: Job) -> bool:
        if len(batch) >= size:
            return False
        rows = [*batch, job]
        return max_seq_len is None or max(len(j.prompt) for j in rows) + max(j.max_tokens for j in rows) <= max_seq_len

    batches: list[list[Job]] = []
    for group in groups.values():
        batches.append([])
        for job in group:
            if batches[-1] and not fits(batches[-1], job):
                batches.append([])
            batches[-1].append(job)
    return batches


def decode_group(service: Service, jobs: list[Job], on_step: Callable[[list[Job]], None]) -> None:
    """Decodes jobs sharing a key in one batched generate; on_step(jobs that changed) after each step.

    The batch runs to the largest max_tokens; shorter rows are cut and their statistics snapshotted
    as a decode with their own max_tokens would count them (same steps and drafts, their own token
    count). Stops as soon as every row is done."""
    cfg = replace(jobs[0].cfg, max_new_tokens=max(j.max_tokens for j in jobs))
    stats = [SequenceStats() for _ in jobs]
    for job, st in zip(jobs, stats, strict=True):
        job.live = st
    seeds = [j.seed for j in jobs] if cfg.acceptance == "sample" else None
    steps = generate(service.backend, [j.prompt for j in jobs], cfg, stats, seeds)
    try:
        for step in steps:
            changed = []
            for job, new, finished in zip(jobs, step.new_tokens, step.finished, strict=True):
                if job.done:
                    continue
                start = len(job.tokens)
                job.tokens.extend(new[: job.max_tokens - start])
                stopped = _cut_at_stop_word(service.tokenizer, job, start)
                if finished or stopped or len(job.tokens) >= job.max_tokens:
                    job.done = True
                    job.final = _own_stats(job.live, len(job.tokens), len(new), len(job.tokens) - start)
                if len(job.tokens) > start or job.done:
                    changed.append(job)
            if changed:
                on_step(changed)
            if all(j.done for j in jobs):
                break
    finally:
        steps.close()  # releases the generator when rows stopped before the batch's max_tokens


def _own_stats(live: SequenceStats, tokens: int, emitted: int, kept: int) -> SequenceStats:
    """A row's statistics as a decode with its own max_tokens (or stop word) counts them: its token
    count, and none of the drafts of its last step past the tokens it kept (that step emitted
    `emitted` tokens, the row kept `kept`: accepted drafts are the emitted tokens after the first)."""
    if not live.draft_tokens:  # plain decoding: no drafts to uncount
        return replace(live, new_tokens=tokens, accepted_per_depth=list(live.accepted_per_depth))
    dropped = max(0, emitted - max(kept, 1))
    depths = list(live.accepted_per_depth)
    for d in range(max(kept, 1) - 1, emitted - 1):
        depths[d] -= 1
    return replace(live, new_tokens=tokens, accepted_draft_tokens=live.accepted_draft_tokens - dropped,
                   accepted_per_depth=depths)


def serve_batch(service: Service, batch: list[Mapping[str, np.ndarray]],
                send: Callable[[int, dict | Exception, bool], bool],
                cancelled: Callable[[int], bool] = lambda i: False) -> None:
    """Answers every request in `batch`. send(request index, outputs or error, final) delivers one
    response and returns False when the client is gone; cancelled(request index) says whether its
    client cancelled it, asked before its group starts and after every step. Either way its rows stop
    costing work: Triton answers a send to a cancelled request without an error, so only asking
    finds it.

    Every request gets exactly one final response: an error if it was refused, cancelled or its group
    failed."""
    parsed: list[Parsed | None] = []
    closed: set[int] = set()  # requests whose final response is out (or whose client is gone)

    def deliver(i: int, payload: dict | Exception, final: bool) -> None:
        if i in closed:
            return
        if not send(i, payload, final) or final:
            closed.add(i)
            for job in parsed[i].jobs if i < len(parsed) and parsed[i] else []:
                job.done = True

    for i, inputs in enumerate(batch):
        try:
            parsed.append(parse_request(service, inputs, i))
        except (RequestError, ValueError) as err:  # ValueError: tokenizer or config checks
            parsed.append(None)
            deliver(i, err if isinstance(err, RequestError) else RequestError(str(err)), True)
        except Exception as err:  # noqa: BLE001 - one request's surprise must not cost the batch its answers
            parsed.append(None)
            deliver(i, RequestError(f"request refused: {type(err).__name__}: {err}"), True)

    def cancel(requests: set[int]) -> None:
        for i in sorted(requests - closed):
            if cancelled(i):
                log.warning("request %d: cancelled by its client; its rows stop", i)
                deliver(i, RequestCancelled(f"request {i}: cancelled by its client"), True)

    def on_step(changed: list[Job]) -> None:
        cancel({j.request for j in changed})
        for i in sorted({j.request for j in changed}):
            if i in closed:
                continue
            req = parsed[i]
            final = all(j.done for j in req.jobs)
            if req.stream:
                deliver(i, stream_outputs(service, req.jobs, final), final)
            elif final:
                deliver(i, full_outputs(service, req.jobs), True)

    jobs = [j for p in parsed if p for j in p.jobs]
    for group in group_jobs(jobs, service.backend.info.max_batch_size, service.backend.info.max_seq_len):
        cancel({j.request for j in group})  # cancelled while the groups before it decoded
        if all(j.done for j in group):
            continue  # every request in it was closed already
        try:
            decode_group(service, group, on_step)
        except Exception as err:  # one failed group must not take the batch or the server down
            log.exception("decoding failed for requests %s", sorted({j.request for j in group}))
            for i in sorted({j.request for j in group}):
                deliver(i, RuntimeError(f"decoding failed: {type(err).__name__}: {err}"), True)
    for i in range(len(batch)):  # a safety net: no request may be left without its final response
        deliver(i, RuntimeError("internal error: the request finished without a response"), True)


def full_outputs(service: Service, jobs: list[Job]) -> dict[str, np.ndarray]:
    texts = [service.tokenizer.decode(j.tokens, skip_special_tokens=True) for j in jobs]
    return _outputs(jobs, texts, [j.tokens for j in jobs])


def stream_outputs(service: Service, jobs: list[Job], final: bool) -> dict[str, np.ndarray]:
    """The text and ids each row gained since its last response, with its statistics so far."""
    texts, ids = [], []
    for j in jobs:
        text = service.tokenizer.decode(j.tokens, skip_special_tokens=True)
        # A trailing U+FFFD is usually half of a multi-byte character: hold it back until the
        # next token completes it, so the concatenated stream equals the non-streamed text.
        if text.startswith(j.sent_text) and (not text.endswith("\ufffd") or j.done):
            texts.append(text[len(j.sent_text):])
            j.sent_text = text
        else:
            texts.append("")
        ids.append(j.tokens[j.sent_ids:])
        j.sent_ids = len(j.tokens)
    return _outputs(jobs, texts, ids)


# output_ids holds at least this many values, -1 padded: Triton's generate endpoint writes a tensor of
# one element as a JSON scalar and a longer one as a list, so a stream whose steps add one token or
# several would switch between the two; two or more is a list in every response.
MIN_OUTPUT_IDS = 2


def _outputs(jobs: list[Job], texts: list[str], ids: list[list[int]]) -> dict[str, np.ndarray]:
    width = max([MIN_OUTPUT_IDS, *(len(x) for x in ids)])
    out_ids = np.full((len(jobs), width), -1, dtype=np.int32)  # -1 pads (short rows, multi-row requests)
    for r, x in enumerate(ids):
        out_ids[r, : len(x)] = x
    stats = [j.stats for j in jobs]
    return {
        "text_output": np.array([[t.encode("utf-8")] for t in texts], dtype=np.object_),
        "output_ids": out_ids,
        "acceptance_rate": np.array([[s.acceptance_rate] for s in stats], dtype=np.float32),
        "total_accepted_draft_tokens": np.array([[s.accepted_draft_tokens] for s in stats], dtype=np.int32),
        "total_draft_tokens": np.array([[s.draft_tokens] for s in stats], dtype=np.int32),
        "tokens_per_step": np.array([[s.tokens_per_step] for s in stats], dtype=np.float32),
    }


def _rows(name: str, array: np.ndarray, rows: int) -> list[np.ndarray]:
    """The per-row values of an input ([rows, n] as Triton sends them with max_batch_size > 0)."""
    a = array.reshape(1, -1) if array.ndim < 2 else array.reshape(array.shape[0], -1)
    if a.shape[0] != rows:
        raise RequestError(f"{name}: {a.shape[0]} rows; expected {rows}, one per text_input row")
    if _INPUTS[name].dims == (1,) and a.shape[1] != 1:
        raise RequestError(f"{name}: {a.shape[1]} values per row; expected one")
    return list(a)


def _inline_tree(spec: str, where: str) -> str:
    """A request's tree, written out: a preset name, a list, the brace form or "dynamic:N[,cost=C]".
    The offline commands also take a tree file; a request naming a path would have the server read
    its own files (the model's config.pbtxt default still may)."""
    text = spec.strip()
    if text.startswith(("[", "{")) or text in preset_names() or (
            text.startswith("dynamic:") and not text.lower().endswith(".json")):
        return spec
    raise RequestError(f"medusa_choices{where}: {text[:60]!r}; expected a preset name ({', '.join(preset_names())}), "
                       "a list such as '[[0], [0, 1]]', the brace form '{0}, {0, 1}' or 'dynamic:N' (a request "
                       "cannot name a file on the server)")


def _text(name: str, value, where: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as err:
            raise RequestError(f"{name}{where}: not valid UTF-8 ({err})") from None
    if isinstance(value, str):
        return value
    raise RequestError(f"{name}{where}: got {type(value).__name__}; expected a string")


def _cut_at_stop_word(tokenizer, job: Job, start: int) -> bool:
    """Cuts job.tokens right after the first token whose text completes a stop word; True if cut.
    Matching text rather than token ids finds a word however the tokenizer split it."""
    if not job.stop_words:
        return False
    for k in range(start + 1, len(job.tokens) + 1):
        text = tokenizer.decode(job.tokens[:k], skip_special_tokens=True)
        if any(w in text for w in job.stop_words):
            del job.tokens[k:]
            return True
    return False


class TritonPythonModel:
    """Triton's entry point (model.py re-exports it): one engine per model instance."""

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils  # exists only inside Triton's Python stub

        self.pb = pb_utils
        config = json.loads(args["model_config"])
        decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.service = load_service(ModelSettings.from_model_config(config), decoupled)
        log.info("model %s: %s loaded (decoupled=%s)", config.get("name"), self.service.settings.engine_dir,
                 decoupled)

    def execute(self, requests: list) -> list | None:
        pb = self.pb
        batch = []
        for request in requests:
            inputs = {}
            for name in _INPUTS:
                tensor = pb.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    inputs[name] = tensor.as_numpy()
            batch.append(inputs)
        decoupled = self.service.decoupled
        senders = [r.get_response_sender() for r in requests] if decoupled else None
        responses: list = [None] * len(requests)

        def send(i: int, payload: dict | Exception, final: bool) -> bool:
            if isinstance(payload, RequestCancelled):
                response = pb.InferenceResponse(error=pb.TritonError(str(payload), pb.TritonError.CANCELLED))
            elif isinstance(payload, Exception):
                response = pb.InferenceResponse(error=pb.TritonError(str(payload)))
            else:
                response = pb.InferenceResponse(output_tensors=[pb.Tensor(k, v) for k, v in payload.items()])
            if not decoupled:
                responses[i] = response
                return True
            try:
                senders[i].send(response, flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
            except Exception as err:  # a cancelled request or a client that went away
                log.warning("request %d: cannot send a response (%s); dropping it", i, err)
                return False
            return True

        def cancelled(i: int) -> bool:  # Triton >= 23.10; a decoupled request's sender knows it too
            return bool(getattr(requests[i], "is_cancelled", lambda: False)())

        serve_batch(self.service, batch, send, cancelled)
        if not decoupled and all(r.has_error() for r in responses):
            # Triton counts a returned error response as a successful request (nv_inference_request_success);
            # only an exception from execute() is counted as a failure. A batch of rejected requests
            # alone (the usual case: a bad request rarely shares a batch) fails that way, each request
            # getting the messages. In a batch with good requests the bad ones can only get error responses
            # (a Python-backend limitation, open upstream: triton-inference-server/server#7713).
            raise pb.TritonModelException("; ".join(r.error().message() for r in responses))
        return None if decoupled else responses

    def finalize(self) -> None:
        self.service = None
