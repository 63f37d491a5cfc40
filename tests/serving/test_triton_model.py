"""The Python-backend model's logic in-process (tests/serving/test_triton_server.py runs it inside a real
tritonserver): multi-row requests, grouping, a client that goes away, the checks on each input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from medusa_trt.runtime.decoding import GenerationConfig, decode
from medusa_trt.serving.triton_model import (
    ModelSettings,
    RequestCancelled,
    RequestError,
    load_service,
    parse_request,
    serve_batch,
)


@pytest.fixture(scope="module")
def service(tiny_merged):
    ckpt = tiny_merged(heads_kwargs={"trivial": True})
    return load_service(ModelSettings(engine_dir=ckpt, medusa_choices="mc_sim_7b_63", max_input_len=100,
                                      max_output_len=64), decoupled=True)


def request(texts, max_tokens, **extra) -> dict:
    out = {"text_input": np.array([[t.encode()] for t in texts], dtype=np.object_),
           "max_tokens": np.array([[m] for m in max_tokens], dtype=np.int64)}
    for name, values in extra.items():
        sample = values[0]
        dtype = np.object_ if isinstance(sample, (str, list)) else np.float32 if isinstance(sample, float) else \
            np.bool_ if isinstance(sample, bool) else np.int64  # the model's integer inputs are INT64
        rows = [[v.encode()] if isinstance(v, str) else [w.encode() for w in v] if isinstance(v, list) else [v]
                for v in values]
        out[name] = np.array(rows, dtype=dtype)
    return out


def offline(service, text, max_tokens, **kw):
    cfg = GenerationConfig(max_new_tokens=max_tokens, stop_token_ids=service.stop_ids, **kw)
    return decode(service.backend, [service.tokenizer.encode(text)], cfg)


def run(service, batch, gone=()):
    """serve_batch with a recording sender; requests in `gone` refuse every response."""
    sent = []

    def send(i, payload, final):
        sent.append((i, payload, final))
        return i not in gone

    serve_batch(service, batch, send)
    return sent


def test_multi_row_request_and_mixed_trees_match_single_decodes(service):
    batch = [
        request(["Hello world", "a"], [16, 5]),  # two rows, different lengths: output_ids padded with -1
        request(["zzz"], [9], medusa_choices=["[[0], [1], [0, 0]]"]),  # another tree: its own group
        request(["The quick brown fox"], [12], acceptance=["typical"], temperature=[0.7]),
        request(["Hello Hello Hello"], [10], medusa_choices=["dynamic:6"]),  # trees chosen per step
        request(["Hello Hello Hello"], [10], medusa_choices=["dynamic:6,cost=0.5"]),  # its slot cost kept
    ]
    sent = run(service, batch)
    assert sorted(i for i, _, final in sent if final) == [0, 1, 2, 3, 4]  # one final response each
    outputs = {i: p for i, p, _ in sent}
    rows = [(0, 0, "Hello world", 16, {}), (0, 1, "a", 5, {}), (1, 0, "zzz", 9, {"medusa_choices": [[0], [1], [0, 0]]}),
            (2, 0, "The quick brown fox", 12, {"acceptance": "typical", "temperature": 0.7}),
            (3, 0, "Hello Hello Hello", 10, {"medusa_choices": "dynamic:6"}),
            (4, 0, "Hello Hello Hello", 10, {"medusa_choices": "dynamic:6,cost=0.5"})]
    for i, r, text, n, kw in rows:
        want = offline(service, text, n, **kw)
        ids = outputs[i]["output_ids"][r]
        assert ids[ids >= 0].tolist() == want.tokens[0] and (ids[len(want.tokens[0]):] == -1).all()
        assert outputs[i]["text_output"][r, 0].decode() == service.tokenizer.decode(want.tokens[0],
                                                                                   skip_special_tokens=True)
        assert outputs[i]["total_draft_tokens"][r, 0] == want.stats[0].draft_tokens
        assert outputs[i]["total_accepted_draft_tokens"][r, 0] == want.stats[0].accepted_draft_tokens
    # A costlier slot drafts fewer nodes per step: the served request did not fall back to the default cost.
    assert outputs[4]["total_draft_tokens"][0, 0] < outputs[3]["total_draft_tokens"][0, 0]


def test_a_client_that_goes_away_costs_no_more_responses(service):
    batch = [request(["Hello world"], [32], stream=[True]), request(["a"], [16], stream=[True])]
    sent = run(service, batch, gone={0})
    assert [final for i, _, final in sent if i == 0] == [False]  # its first response failed: nothing more
    others = [(p, final) for i, p, final in sent if i == 1]
    assert others[-1][1] and sum(int((p["output_ids"][0] >= 0).sum()) for p, _ in others) == 16  # -1 pads


def test_a_cancelled_request_stops_and_gets_one_final_cancelled_response(service):
    """Triton accepts a send to a cancelled request without an error, so the model asks: a stream
    cancelled after its first response gets one final CANCELLED answer and no more tokens; a request
    cancelled before its group starts is answered without decoding; its neighbours decode as alone."""
    batch = [request(["Hello world"], [32], stream=[True]), request(["a"], [16], stream=[True]),
             request(["zzz"], [9], medusa_choices=["[[0], [1], [0, 0]]"])]  # its own group, decoded last
    sent = []

    def send(i, payload, final):
        sent.append((i, payload, final))
        return True

    serve_batch(service, batch, send, cancelled=lambda i: i == 2 or (i == 0 and any(j == 0 for j, _, _ in sent)))
    first = [(p, final) for i, p, final in sent if i == 0]
    assert len(first) == 2 and not first[0][1] and first[1][1] and isinstance(first[1][0], RequestCancelled)
    assert [(type(p), final) for i, p, final in sent if i == 2] == [(RequestCancelled, True)]
    others = [p for i, p, _ in sent if i == 1]
    ids = np.concatenate([p["output_ids"][0] for p in others])
    assert ids[ids >= 0].tolist() == offline(service, "a", 16).tokens[0]


def test_stop_words_cut_after_the_completing_token(service):
    want = offline(service, "a", 16).tokens[0]
    text = service.tokenizer.decode(want, skip_special_tokens=True)
    word = text[2:4]  # a piece of the greedy continuation
    sent = run(service, [request(["a"], [16], stop_words=[["nope", word]])])
    got = [t for t in sent[-1][1]["output_ids"][0].tolist() if t >= 0]  # -1 pads
    assert service.tokenizer.decode(got, skip_special_tokens=True).endswith(word)
    assert got == want[: len(got)] and len(got) < len(want)


@pytest.mark.parametrize("inputs,message", [
    ({"max_tokens": np.array([[4]], dtype=np.int64)}, "text_input and messages: missing"),
    ({"text_input": np.array([[b"a"]], dtype=np.object_)}, "max_tokens: missing"),
    ({"text_input": np.array([[b"a"]], dtype=np.object_), "max_tokens": np.array([[4.0]], dtype=np.float32)},
     "max_tokens: data type float32; expected INT64"),
    ({"text_input": np.array([[b"a"], [b"b"]], dtype=np.object_), "max_tokens": np.array([[4]], dtype=np.int64)},
     "max_tokens: 1 rows; expected 2"),
    ({"text_input": np.array([[b"\xff"]], dtype=np.object_), "max_tokens": np.array([[4]], dtype=np.int64)},
     "text_input: not valid UTF-8"),
    ({"text_input": np.array([[b"a"]], dtype=np.object_), "max_tokens": np.array([[65]], dtype=np.int64)},
     r"max_tokens: 65; expected 1..64 \(max_output_len"),
    ({"text_input": np.array([[b"a" * 120]], dtype=np.object_), "max_tokens": np.array([[4]], dtype=np.int64)},
     r"prompt is 122 tokens; .* at most 100 \(max_input_len"),
])
def test_request_checks_name_the_input(service, inputs, message):
    with pytest.raises(RequestError, match=message):
        parse_request(service, inputs)


@pytest.mark.parametrize("spec", ["tree.json", "/etc/hostname", "dynamic:4.json", "no_such_preset"])
def test_a_request_tree_cannot_name_a_server_file(service, tmp_path, monkeypatch, spec):
    """Offline commands read tree files; a request is a client's text, so a path is refused before
    anything is read, even where the file exists and holds a good tree."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tree.json").write_text(json.dumps({"medusa_choices": [[0], [1]]}))
    inputs = {"text_input": np.array([[b"a"]], dtype=np.object_), "max_tokens": np.array([[4]], dtype=np.int64),
              "medusa_choices": np.array([[spec.encode()]], dtype=np.object_)}
    with pytest.raises(RequestError, match="a request cannot name a file on the server"):
        parse_request(service, inputs)


def test_settings_need_the_engine_dir():
    with pytest.raises(ValueError, match="parameter engine_dir is missing"):
        ModelSettings.from_model_config({"name": "m", "parameters": {}})
    with pytest.raises(ValueError, match="bad parameter value"):
        ModelSettings.from_model_config({"name": "m", "parameters": {"engine_dir": {"string_value": "/x"},
                                                                     "max_input_len": {"string_value": "ten"}}})


def test_sample_requests_batch_together_and_repeat_their_seeds(service):
    """Two seeded sample requests (one with two rows) decode in one group; each row's tokens are the
    offline decode with seed + row, whatever else is in the batch; a bad one errs alone."""
    def sample(texts, n, seed, **extra):
        out = request(texts, n, acceptance=["sample"] * len(texts), temperature=[0.8] * len(texts), **extra)
        out["seed"] = np.array([[seed]] * len(texts), dtype=np.uint64)
        return out

    batch = [sample(["Hello world", "a"], [10, 6], 7), sample(["zzz"], [8], 123),
             sample(["zzz"], [8], 1, top_p=[1.5])]
    assert len({j.key for i in (0, 1) for j in parse_request(service, batch[i]).jobs}) == 1
    sent = run(service, batch)
    outputs = {i: p for i, p, final in sent if final}
    assert isinstance(outputs[2], Exception) and "top_p 1.5: expected a value in (0, 1]" in str(outputs[2])
    for i, r, text, n, seed in [(0, 0, "Hello world", 10, 7), (0, 1, "a", 6, 8), (1, 0, "zzz", 8, 123)]:
        want = offline(service, text, n, acceptance="sample", temperature=0.8, seed=seed)
        ids = outputs[i]["output_ids"][r]
        assert ids[ids >= 0].tolist() == want.tokens[0], (i, r)


@pytest.mark.parametrize("extra,message", [
    ({"acceptance": ["sample"], "temperature": [0.0]}, "temperature 0.0 with acceptance 'sample'.*'greedy'"),
    ({"acceptance": ["sample"], "top_k": [0]}, "top_k 0: expected an integer >= 1"),
    ({"acceptance": ["nucleus"]}, "acceptance: 'nucleus'; expected one of greedy, typical, sample"),
])
def test_bad_sampling_requests(service, extra, message):
    with pytest.raises(RequestError, match=message):
        parse_request(service, request(["a"], [4], **extra))


def test_output_ids_is_a_list_in_every_streamed_response(service):
    """Triton's generate endpoint writes a one-element tensor as a JSON scalar: every response holds
    at least two values (-1 padded), so a stream never switches between a scalar and a list."""
    sent = run(service, [request(["Hello world"], [12], stream=[True])])
    assert len(sent) > 1
    for _, payload, _ in sent:
        assert payload["output_ids"].shape[0] == 1 and payload["output_ids"].shape[1] >= 2
    ids = [t for _, payload, _ in sent for t in payload["output_ids"][0].tolist() if t >= 0]
    assert ids == offline(service, "Hello world", 12, medusa_choices="mc_sim_7b_63").tokens[0]


def test_messages_input_is_rendered_with_the_chat_template(service):
    tok = service.tokenizer
    saved = tok.chat_template
    tok.chat_template = ("{% for m in messages %}<s>{{ m['role'] }} {{ m['content'] }}</s>{% endfor %}"
                         "{% if add_generation_prompt %}<s>assistant {% endif %}")
    try:
        from medusa_trt.runtime.chat import encode_chat

        turns = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"}]
        batch = {"messages": np.array([[json.dumps(turns).encode()]], dtype=np.object_),
                 "max_tokens": np.array([[8]], dtype=np.int64)}
        parsed = parse_request(service, batch)
        assert parsed.jobs[0].prompt == encode_chat(tok, turns)
        for inputs, message in (({**batch, "text_input": batch["messages"]}, "text_input and messages: both given"),
                                ({"max_tokens": batch["max_tokens"]}, "text_input and messages: missing"),
                                ({**batch, "messages": np.array([[b'[{"role": "x"}]']], dtype=np.object_)},
                                 r"messages\[0\]")):
            with pytest.raises(RequestError, match=message):
                parse_request(service, inputs)
    finally:
        tok.chat_template = saved
    with pytest.raises(RequestError, match="no chat template"):
        parse_request(service, batch)


def test_a_row_cut_short_counts_no_draft_past_its_end(service):
    """Rows of one batch decode to the longest max_tokens; a shorter row's statistics count only the
    drafts of the tokens it kept, as a decode of its own would."""
    sent = run(service, [request(["Hello world", "Hello world"], [3, 16])])
    (_, payload, _), = sent
    for row, n in enumerate((3, 16)):
        want = offline(service, "Hello world", n, medusa_choices="mc_sim_7b_63").stats[0]
        assert payload["total_accepted_draft_tokens"][row, 0] == want.accepted_draft_tokens
        assert payload["total_draft_tokens"][row, 0] == want.draft_tokens


def test_a_group_is_cut_at_the_engines_batch_limit():
    """Rows of one key beyond the engine's max_batch_size decode in further batches: one batch of
    them all would fail every row with 'batch exceeds the engine's max_batch_size'."""
    from types import SimpleNamespace

    from medusa_trt.serving.triton_model import group_jobs

    jobs = [SimpleNamespace(key=k, n=i) for i, k in enumerate("aabaaab")]
    cut = group_jobs(jobs, max_batch=2)
    assert [[j.n for j in g] for g in cut] == [[0, 1], [3, 4], [5], [2, 6]]
    assert [[j.n for j in g] for g in group_jobs(jobs)] == [[0, 1, 3, 4, 5], [2, 6]]


def test_rows_that_fit_alone_but_not_together_decode_in_separate_batches(tiny_merged):
    """A batch runs to its largest max_tokens, so a long prompt with few tokens and a short one with
    many each fit max_seq_len alone and not in one batch: they once failed together ('exceeds the
    model's maximum sequence length'), whichever request the long prompt came from."""
    ckpt = tiny_merged(heads_kwargs={"trivial": True})
    service = load_service(ModelSettings(engine_dir=ckpt, medusa_choices="mc_sim_7b_63", max_input_len=470,
                                         max_output_len=120), decoupled=False)
    room = service.backend.info.max_seq_len
    long_text = "a " * 220  # ~440 tokens: + 10 fits, + 100 does not
    assert len(service.tokenizer.encode(long_text)) + 100 > room
    for batch in ([request([long_text], [10]), request(["b"], [100])], [request([long_text, "b"], [10, 100])]):
        sent = run(service, batch)
        outs = [(i, p) for i, p, final in sent if final]
        assert len(outs) == len(batch) and not any(isinstance(p, Exception) for _, p in outs), outs
        rows = [(p, r) for _, p in outs for r in range(p["output_ids"].shape[0])]
        for (payload, r), (text, n) in zip(rows, [(long_text, 10), ("b", 100)], strict=True):
            ids = payload["output_ids"][r]
            assert ids[ids >= 0].tolist() == offline(service, text, n).tokens[0]


def test_serve_batch_reads_the_limit_from_the_backends_model_info(service, monkeypatch):
    """Every backend states its batch limit on ModelInfo (engine.json limits.max_batch_size; None for a
    checkpoint): serve_batch cuts at it whatever the backend, and the rows decode as alone."""
    import dataclasses

    backend = service.backend
    assert backend.info.max_batch_size is None  # a checkpoint runs any batch
    batches = []
    start = backend.start
    monkeypatch.setattr(backend, "start", lambda batch, capacity: (batches.append(batch), start(batch, capacity))[1])
    monkeypatch.setattr(backend, "info", dataclasses.replace(backend.info, max_batch_size=2))
    texts = ["Hello world", "a", "zzz", "The quick"]
    sent = run(service, [request(texts, [6] * 4)])
    assert batches and max(batches) == 2 and sum(batches) >= 4
    payload = [p for _, p, final in sent if final][0]
    for r, text in enumerate(texts):
        ids = payload["output_ids"][r]
        assert ids[ids >= 0].tolist() == offline(service, text, 6).tokens[0]
