"""A real tritonserver (from the nvidia-pytriton wheel) serving a repository written by
medusa-triton for a tiny merged checkpoint, called over HTTP and gRPC with tritonclient.

Every answer is compared with the offline runtime (`decode` on the same checkpoint), token ids as
well as text: the tiny tokenizer decodes ids above 72 to nothing, so equal text alone proves little.
The heads are trivial (copies of the base lm_head), so some drafts are accepted and the acceptance
statistics are not all zero.
"""

from __future__ import annotations

import json
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from medusa_trt.runtime.decoding import GenerationConfig, decode
from medusa_trt.runtime.loading import load_backend, load_tokenizer, stop_tokens
from medusa_trt.serving.server import ServerError, running_server
from medusa_trt.serving.triton_repo import write_triton_repo, write_trtllm_triton_repo

MODEL, STREAM_MODEL, AMPHISTA_MODEL = "medusa", "medusa_stream", "amphista"
OUTPUTS = ("text_output", "output_ids", "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens",
           "tokens_per_step")

# Requests as a client sends them; `expected` below turns each into the offline decode.
CASES = [
    dict(text="Hello world", max_tokens=16),
    dict(text="The quick brown fox", max_tokens=12, medusa_choices="[[0], [0, 0], [1], [0, 0, 0]]"),
    dict(text="a", max_tokens=16, medusa_choices="{0}, {0, 0}, {0, 1}, {1}"),
    dict(text="Medusa heads draft tokens", max_tokens=16, acceptance="typical", temperature=0.7),
    dict(text="42 is the answer!", max_tokens=9, acceptance="typical", temperature=0.5,
         posterior_threshold=0.2, posterior_alpha=0.5),
    dict(text="a", max_tokens=16, acceptance="typical"),  # stops at EOS
    dict(text="zzz", max_tokens=16, end_id=79),
    dict(text="a", max_tokens=16, stop_words=["UU", "never"]),
]


@pytest.fixture(scope="session")
def served(tiny_merged, tmp_path_factory):
    """One server for the session: the plain model, a decoupled (streaming) one, the same base with an
    Amphista drafter, and the TensorRT-LLM layout's pre/postprocessing models (its ensemble and
    tensorrt_llm need the TensorRT-LLM backend, which is not here, so only those two load)."""
    ckpt = tiny_merged(heads_kwargs={"trivial": True})
    amphista = tiny_merged(fmt="amphista")
    root = tmp_path_factory.mktemp("triton")
    (root / "no-engine").mkdir()  # TensorRT-LLM cannot build an engine here; its path is only written
    repos = [
        write_triton_repo(ckpt, root / "repo", max_batch_size=16, intra_op_threads=1),
        write_triton_repo(ckpt, root / "repo_stream", model_name=STREAM_MODEL, max_batch_size=16, decoupled=True,
                          intra_op_threads=1),
        write_trtllm_triton_repo(root / "no-engine", root / "repo_trtllm", ckpt),
        write_triton_repo(amphista, root / "repo_amphista", model_name=AMPHISTA_MODEL, max_batch_size=16,
                          intra_op_threads=1),
    ]
    tok = load_tokenizer(ckpt)
    offline = dict(backend=load_backend(ckpt), tok=tok, stops=stop_tokens(ckpt, tok))
    with running_server(repos, models=[MODEL, STREAM_MODEL, "preprocessing", "postprocessing", AMPHISTA_MODEL],
                        workdir=root / "server") as server:
        yield dict(server=server, ckpt=ckpt, repo=repos[0], amphista_backend=load_backend(amphista), **offline)


def expected(served, case: dict, backend: str = "backend") -> dict:
    """The offline runtime's answer to `case`: decode with the same config, cut at a stop word."""
    tok, backend = served["tok"], served[backend]
    cfg = GenerationConfig(
        max_new_tokens=case["max_tokens"], medusa_choices=case.get("medusa_choices", "mc_sim_7b_63"),
        acceptance=case.get("acceptance", "greedy"), temperature=case.get("temperature", 0.7),
        posterior_threshold=case.get("posterior_threshold", 0.09), posterior_alpha=case.get("posterior_alpha", 0.3),
        stop_token_ids=(case["end_id"],) if "end_id" in case else served["stops"])
    prompt = tok.encode(case["text"])
    tokens = decode(backend, [prompt], cfg).tokens[0]
    for k in range(1, len(tokens) + 1):  # a stop word ends the output after the token completing it
        if any(w and w in tok.decode(tokens[:k], skip_special_tokens=True) for w in case.get("stop_words", [])):
            tokens = tokens[:k]
            break
    result = decode(backend, [prompt], replace(cfg, max_new_tokens=len(tokens)))
    assert result.tokens[0] == tokens
    st = result.stats[0]
    return dict(text=tok.decode(tokens, skip_special_tokens=True), ids=tokens, steps=st.steps,
                acceptance_rate=np.float32(st.acceptance_rate), accepted=st.accepted_draft_tokens,
                drafted=st.draft_tokens, tokens_per_step=np.float32(st.tokens_per_step))


def inputs(client, case: dict, *, stream: bool | None = None, overrides: dict | None = None) -> list:
    """tritonclient InferInputs for `case`, each [1, n] as a max_batch_size > 0 model takes them."""
    values = {"text_input": np.array([[case["text"].encode()]], dtype=np.object_),
              "max_tokens": np.array([[case["max_tokens"]]], dtype=np.int64)}
    for name in ("medusa_choices", "acceptance"):
        if name in case:
            values[name] = np.array([[case[name].encode()]], dtype=np.object_)
    for name in ("temperature", "posterior_threshold", "posterior_alpha"):
        if name in case:
            values[name] = np.array([[case[name]]], dtype=np.float32)
    if "end_id" in case:
        values["end_id"] = np.array([[case["end_id"]]], dtype=np.int64)
    if "stop_words" in case:
        values["stop_words"] = np.array([[w.encode() for w in case["stop_words"]]], dtype=np.object_)
    if stream is not None:
        values["stream"] = np.array([[stream]], dtype=np.bool_)
    values.update(overrides or {})
    dtypes = {np.object_: "BYTES", np.int32: "INT32", np.int64: "INT64", np.float32: "FP32", np.bool_: "BOOL"}
    result = []
    for name, array in values.items():
        tensor = client.InferInput(name, list(array.shape), dtypes[array.dtype.type])
        tensor.set_data_from_numpy(array)
        result.append(tensor)
    return result


def answer(result) -> dict:
    out = {name: result.as_numpy(name) for name in OUTPUTS}
    assert out["text_output"].shape == (1, 1) and out["output_ids"].shape[0] == 1
    ids = out["output_ids"][0]
    return dict(text=out["text_output"][0, 0].decode(), ids=ids[ids >= 0].tolist(),  # -1 pads
                acceptance_rate=out["acceptance_rate"][0, 0], accepted=int(out["total_accepted_draft_tokens"][0, 0]),
                drafted=int(out["total_draft_tokens"][0, 0]), tokens_per_step=out["tokens_per_step"][0, 0])


def same(got: dict, want: dict) -> None:
    assert got["ids"] == want["ids"]
    assert got["text"] == want["text"]
    assert (got["accepted"], got["drafted"]) == (want["accepted"], want["drafted"])
    assert got["acceptance_rate"] == pytest.approx(want["acceptance_rate"], rel=1e-6)
    assert got["tokens_per_step"] == pytest.approx(want["tokens_per_step"], rel=1e-6)


def http_infer(served, case: dict, model: str = MODEL, **kw) -> dict:
    with httpclient.InferenceServerClient(served["server"].http_url) as client:
        return answer(client.infer(model, inputs(httpclient, case, **kw)))


def grpc_infer(served, case: dict, model: str = MODEL, **kw) -> dict:
    with grpcclient.InferenceServerClient(served["server"].grpc_url) as client:
        return answer(client.infer(model, inputs(grpcclient, case, **kw)))


def grpc_stream(served, case: dict, stream: bool = True) -> list[tuple[dict, bool]]:
    """Every response of one request on a gRPC stream, with its final flag."""
    responses: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(served["server"].grpc_url) as client:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer(STREAM_MODEL, inputs(grpcclient, case, stream=stream),
                                  enable_empty_final_response=True)
        got = []
        while True:
            result, error = responses.get(timeout=60)
            if error is not None:
                raise error
            final = result.get_response().parameters["triton_final_response"].bool_param
            if result.get_response().outputs:
                got.append((answer(result), final))
            if final:
                break
        client.stop_stream()
    return got


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items() if k != "text"))
def test_http_matches_offline_decode(served, case):
    same(http_infer(served, case), expected(served, case))


AMPHISTA_CASES = [CASES[0], CASES[1], dict(text="Medusa heads draft tokens", max_tokens=16, medusa_choices="dynamic:6"),
                  CASES[3], CASES[6]]


def test_an_amphista_drafter_is_served_as_decoded_offline(served):
    """The repository serves an Amphista checkpoint unchanged: static and per-step trees, typical
    acceptance and an end id, sent at once so that the model may batch them (the drafter's cache then
    holds several sequences and follows the batch as each finishes)."""
    with ThreadPoolExecutor(len(AMPHISTA_CASES)) as pool:
        got = list(pool.map(lambda case: http_infer(served, case, model=AMPHISTA_MODEL), AMPHISTA_CASES))
    for answer_, case in zip(got, AMPHISTA_CASES, strict=True):
        same(answer_, expected(served, case, backend="amphista_backend"))
    assert sum(a["accepted"] for a in got) > 0  # the drafter's drafts take part


def test_grpc_matches_offline_decode(served):
    for case in CASES:
        same(grpc_infer(served, case), expected(served, case))


def test_acceptance_statistics_are_exercised(served):
    # Guards the comparisons above against a setup where nothing is ever accepted or stopped early.
    wants = [expected(served, c) for c in CASES]
    assert any(w["accepted"] > 0 for w in wants)
    assert any(len(w["ids"]) < c["max_tokens"] for w, c in zip(wants, CASES, strict=True))


@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[7]], ids=["greedy", "typical", "stop-word"])
def test_streaming_gives_one_response_per_step_and_the_same_final_output(served, case):
    want = expected(served, case)
    parts = grpc_stream(served, case)
    assert len(parts) == want["steps"]  # one response per decoding step
    assert [final for _, final in parts] == [False] * (len(parts) - 1) + [True]
    assert all(p["ids"] for p, _ in parts)  # every step adds at least its bonus token
    joined = dict(parts[-1][0], text="".join(p["text"] for p, _ in parts), ids=sum((p["ids"] for p, _ in parts), []))
    same(joined, want)
    # The decoupled model without `stream`: one final response with everything.
    whole = grpc_stream(served, case, stream=False)
    assert len(whole) == 1 and whole[0][1]
    same(whole[0][0], want)


def test_a_cancelled_stream_stops_decoding(served):
    """A gRPC client that cancels its stream after the first response: the model asks Triton after
    every step (a send to a cancelled request raises nothing) and stops the request's rows, as its
    log says; a request after it is answered as usual."""
    case = dict(text="Hello", max_tokens=450)
    assert len(expected(served, case)["ids"]) == 450  # the premise: far more steps than one
    log = served["server"].log_path
    before = log.read_text(errors="replace").count("cancelled by its client")
    responses: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(served["server"].grpc_url) as client:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer(STREAM_MODEL, inputs(grpcclient, case, stream=True), enable_empty_final_response=True)
        result, error = responses.get(timeout=60)
        assert error is None and not result.get_response().parameters["triton_final_response"].bool_param
        client.stop_stream(cancel_requests=True)
    deadline = time.monotonic() + 60
    while log.read_text(errors="replace").count("cancelled by its client") == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert log.read_text(errors="replace").count("cancelled by its client") == before + 1
    same(grpc_stream(served, CASES[0], stream=False)[0][0], expected(served, CASES[0]))


def test_generate_stream_output_ids_have_one_shape(served):
    """Triton's generate endpoint writes a one-element tensor as a JSON scalar: output_ids is a list
    in every streamed response (-1 padded), and the ids of all responses are the offline decode's."""
    case = CASES[0]
    body = json.dumps({"text_input": case["text"], "max_tokens": case["max_tokens"], "stream": True}).encode()
    req = urllib.request.Request(f"http://{served['server'].http_url}/v2/models/{STREAM_MODEL}/generate_stream",
                                 data=body, headers={"Content-Type": "application/json"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=60) as r:
        events = [json.loads(line[5:]) for line in r.read().decode().splitlines() if line.startswith("data:")]
    want = expected(served, case)
    assert len(events) == want["steps"] and all(isinstance(e["output_ids"], list) for e in events)
    assert [t for e in events for t in e["output_ids"] if t >= 0] == want["ids"]


def test_request_with_several_rows(served):
    # A [2, 1] request: both rows decode (as one batch), output_ids right-padded with -1.
    a, b = dict(text="Hello world", max_tokens=16), dict(text="a", max_tokens=5)
    with httpclient.InferenceServerClient(served["server"].http_url) as client:
        text = httpclient.InferInput("text_input", [2, 1], "BYTES")
        text.set_data_from_numpy(np.array([[b"Hello world"], [b"a"]], dtype=np.object_))
        n = httpclient.InferInput("max_tokens", [2, 1], "INT64")
        n.set_data_from_numpy(np.array([[16], [5]], dtype=np.int64))
        result = client.infer(MODEL, [text, n])
    ids, texts = result.as_numpy("output_ids"), result.as_numpy("text_output")
    for row, case in enumerate((a, b)):
        want = expected(served, case)
        assert ids[row][ids[row] >= 0].tolist() == want["ids"] and texts[row, 0].decode() == want["text"]
        assert result.as_numpy("total_draft_tokens")[row, 0] == want["drafted"]
    assert ids.shape == (2, 16) and (ids[1, 5:] == -1).all()


def test_stream_needs_the_decoupled_model(served):
    with pytest.raises(InferenceServerException, match="not decoupled; .* --decoupled"):
        http_infer(served, CASES[0], stream=True)


def metrics(served) -> dict[str, float]:
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with direct.open(served["server"].metrics_url, timeout=10) as r:
        text = r.read().decode()
    found = {}
    for name in ("nv_inference_request_success", "nv_inference_exec_count", "nv_inference_count"):
        m = re.search(rf'^{name}{{model="{MODEL}",version="1"}} (\S+)$', text, re.M)
        found[name] = float(m.group(1)) if m else 0.0
    return found


def test_load_16_clients_x_8_requests(served):
    """16 concurrent clients (half HTTP, half gRPC) x 8 requests: no errors, and each answer equals
    the same request's single-request answer although the server batched them together."""
    # Triton batches only requests that carry the same optional inputs, as one client's requests do:
    # every request sends them all (model defaults where a case has none).
    defaults = dict(medusa_choices="mc_sim_7b_63", acceptance="greedy", temperature=0.7, posterior_threshold=0.09,
                    posterior_alpha=0.3, end_id=served["stops"][0], stop_words=[""])
    cases = [{**defaults, **c, "max_tokens": m} for c in CASES for m in (16, 7)]
    singles = [http_infer(served, c) for c in cases]  # one at a time: nothing to batch with
    for single, case in zip(singles, cases, strict=True):
        same(single, expected(served, case))
    before = settled(lambda: metrics(served))
    start = threading.Barrier(16)

    def client(k: int) -> list[tuple[int, dict]]:
        module, url = ((httpclient, served["server"].http_url) if k % 2 else
                       (grpcclient, served["server"].grpc_url))
        with module.InferenceServerClient(url) as c:
            start.wait()
            out = []
            for r in range(8):
                i = (k * 5 + r * 3) % len(cases)
                out.append((i, answer(c.infer(MODEL, inputs(module, cases[i])))))
            return out

    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        results = [pair for done in pool.map(client, range(16)) for pair in done]
    seconds = time.perf_counter() - t0
    assert len(results) == 128
    for i, got in results:
        same(got, singles[i])
    # Triton's request counters may trail responses the clients already hold (a CI run read 124 of
    # 128 right after the last answer): poll them for up to 10 s.
    deadline = time.monotonic() + 10
    while True:
        after = metrics(served)
        requests = after["nv_inference_request_success"] - before["nv_inference_request_success"]
        if requests >= 128 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    executions = after["nv_inference_exec_count"] - before["nv_inference_exec_count"]
    assert requests == 128
    assert executions < requests / 2, f"{executions} executions for {requests} requests: no dynamic batching"
    print(f"\n128 requests in {seconds:.2f} s, {requests / executions:.1f} requests per batch")


BAD = [
    (dict(CASES[0], medusa_choices="[[0], [0, 0, 0, 0, 0, 0]]"), "medusa_choices.*depth 6 exceeds num_heads=4"),
    (dict(CASES[0], medusa_choices="not a tree"), "medusa_choices.*expected a preset name"),
    (dict(CASES[0], text="x" * 600), "prompt is 602 tokens; .* at most 511"),
    (dict(CASES[0], text="y" * 300, max_tokens=300), r"exceeds the engine's max_seq_len 512"),
    (dict(CASES[0], max_tokens=-3), "max_tokens: -3; expected 1..511"),
    (dict(CASES[0], max_tokens=0), "max_tokens: 0; expected 1..511"),
    (dict(CASES[0], acceptance="sampling"), "acceptance: 'sampling'; expected one of greedy, typical, sample"),
    (dict(CASES[0], temperature=-1.0), "temperature: -1.0; expected a finite value >= 0"),
    (dict(CASES[0], end_id=9999), r"end_id: 9999; expected a token id in 0..255"),
]


@pytest.mark.parametrize("case,message", BAD, ids=lambda x: x if isinstance(x, str) else None)
def test_bad_request_gets_an_error_and_the_server_keeps_serving(served, case, message):
    want = expected(served, CASES[0])
    for infer in (http_infer, grpc_infer):
        with pytest.raises(InferenceServerException, match=message):
            infer(served, case)
        same(infer(served, CASES[0]), want)


def _post_json(served, body: dict) -> tuple[int, str]:
    """A raw HTTP/JSON request (what curl sends), bypassing tritonclient's own typing."""
    import json
    import urllib.error

    request = urllib.request.Request(f"http://{served['server'].http_url}/v2/models/{MODEL}/infer",
                                     data=json.dumps(body).encode(), method="POST")
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with direct.open(request, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _request_counts(served) -> tuple[int, int]:
    """(nv_inference_request_success, nv_inference_request_failure summed over reasons) of MODEL."""
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    text = direct.open(served["server"].metrics_url, timeout=10).read().decode()
    counts = [0, 0]
    for line in text.splitlines():
        for i, name in enumerate(("nv_inference_request_success{", "nv_inference_request_failure{")):
            if line.startswith(name) and f'model="{MODEL}"' in line:
                counts[i] += int(float(line.rsplit(" ", 1)[1]))
    return counts[0], counts[1]


def _request_counts_once_changed(served, before: tuple[int, int]) -> tuple[int, int]:
    """_request_counts once they differ from `before` (or after 10 s), for one request's outcome: the
    Python backend reports a request's statistics only after sending its response, so a client can
    hold the answer before either counter moves (a loaded CI run read both unchanged)."""
    deadline = time.monotonic() + 10
    while (counts := _request_counts(served)) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    return counts


def settled(read):
    """read() once it has not changed for a second (or after 10 s): Triton can count a request after
    its client holds the answer, and a CI run read an earlier request into a test's delta."""
    deadline = time.monotonic() + 10
    value = read()
    while time.monotonic() < deadline:
        time.sleep(1.0)
        if (now := read()) == value:
            break
        value = now
    return value


def test_max_tokens_beyond_int32_is_refused_and_rejections_count_as_failures(served):
    """JSON max_tokens 4294967297 (2**32 + 1) would arrive as 1 through an INT32 input and answer one
    token; declared INT64 it arrives whole and is refused. A refused request is a failure in
    Triton's metrics, not a success."""
    success, failure = settled(lambda: _request_counts(served))
    body = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": ["Hi"]},
                       {"name": "max_tokens", "datatype": "INT64", "shape": [1, 1], "data": [2**32 + 1]}]}
    status, text = _post_json(served, body)
    assert status >= 400 and "max_tokens" in text and "4294967297" in text, (status, text)
    assert _request_counts_once_changed(served, (success, failure)) == (success, failure + 1)
    body["inputs"][1]["data"] = [4]
    status, text = _post_json(served, body)
    assert status == 200, text
    assert _request_counts_once_changed(served, (success, failure + 1)) == (success + 1, failure + 1)


def test_generate_endpoint_integers_beyond_int32_arrive_whole(served):
    """Triton's generate endpoint types JSON values by the model's config: end_id 2**32 + 79 would
    arrive as 79 through an INT32 input and decode (top_k likewise); as INT64 it is refused by value."""
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    for extra, message in (({"end_id": 2**32 + 79}, "end_id: 4294967375"),):
        body = json.dumps({"text_input": "zzz", "max_tokens": 4, **extra}).encode()
        req = urllib.request.Request(f"http://{served['server'].http_url}/v2/models/{MODEL}/generate", data=body,
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            direct.open(req, timeout=60)
        assert message in err.value.read().decode()


def test_wrong_dtype_is_refused_by_name(served):
    wrong = {"max_tokens": np.array([[16.0]], dtype=np.float32)}
    for infer in (http_infer, grpc_infer):
        with pytest.raises(InferenceServerException, match="max_tokens.*(FP32|INT64)"):
            infer(served, CASES[0], overrides=wrong)
    with pytest.raises(InferenceServerException, match="text_input"):
        http_infer(served, CASES[0], overrides={"text_input": np.array([[1]], dtype=np.int32)})
    same(http_infer(served, CASES[0]), expected(served, CASES[0]))


def test_bad_requests_batched_with_good_ones_fail_alone(served):
    good = [dict(c, max_tokens=12) for c in CASES[:6]]
    jobs = [(c, None) for c in good] + BAD[:4]  # (case, the error a bad one gets)
    start = threading.Barrier(len(jobs))

    def run(job):
        case, _ = job
        with httpclient.InferenceServerClient(served["server"].http_url) as client:
            tensors = inputs(httpclient, case)
            start.wait()
            try:
                return answer(client.infer(MODEL, tensors))
            except InferenceServerException as err:
                return err

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    for (case, message), got in zip(jobs, results, strict=True):
        if message is None:
            assert not isinstance(got, Exception), got
            same(got, expected(served, case))
        else:  # its own error, not one of the batch it was scheduled with
            assert isinstance(got, InferenceServerException) and re.search(message, str(got)), got


def test_trtllm_preprocessing_and_postprocessing_models(served):
    tok = served["tok"]
    with httpclient.InferenceServerClient(served["server"].http_url) as client:
        query = httpclient.InferInput("QUERY", [1, 1], "BYTES")
        query.set_data_from_numpy(np.array([[b"Hello world"]], dtype=np.object_))
        n = httpclient.InferInput("REQUEST_OUTPUT_LEN", [1, 1], "INT32")
        n.set_data_from_numpy(np.array([[16]], dtype=np.int32))
        pre = client.infer("preprocessing", [query, n])
        ids = pre.as_numpy("INPUT_ID")
        assert ids[0].tolist() == tok.encode("Hello world")
        assert pre.as_numpy("REQUEST_INPUT_LEN").tolist() == [[ids.shape[1]]]
        assert pre.as_numpy("OUT_END_ID").tolist() == [[tok.eos_token_id]]
        assert pre.as_numpy("STOP_WORDS_IDS").shape == (1, 2, 1)
        tokens = httpclient.InferInput("TOKENS_BATCH", [1, 1, ids.shape[1]], "INT32")
        tokens.set_data_from_numpy(ids[:, None, :].astype(np.int32))
        lengths = httpclient.InferInput("SEQUENCE_LENGTH", [1, 1], "INT32")
        lengths.set_data_from_numpy(np.array([[ids.shape[1]]], dtype=np.int32))
        post = client.infer("postprocessing", [tokens, lengths])
        assert post.as_numpy("OUTPUT").tolist() == [[b"Hello world"]]


def test_server_that_cannot_load_its_model_fails_with_its_log(served, tmp_path):
    # The model's engine dir vanished after the repository was written: the stub raises in
    # initialize, tritonserver exits, and the error carries the log naming the problem.
    engine = tmp_path / "engine"
    engine.mkdir()
    for f in served["ckpt"].iterdir():
        (engine / f.name).symlink_to(f)
    repo = write_triton_repo(engine, tmp_path / "repo", intra_op_threads=1)
    for f in engine.iterdir():
        f.unlink()
    t0 = time.perf_counter()
    with pytest.raises(ServerError, match=r"(?s)exited with status .*neither engine.json nor config.json") as e:
        with running_server(repo, timeout=120):
            pass
    assert time.perf_counter() - t0 < 100
    log = Path(re.search(r"\(full log: (.*?)\)", str(e.value)).group(1))
    assert log.is_file() and "neither engine.json nor config.json" in log.read_text()  # the log it cites is kept
    shutil.rmtree(log.parent)
    with pytest.raises(ServerError, match="not a model repository"):
        with running_server(tmp_path):
            pass


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")  # a zombie has exited already


def test_medusa_serve_killed_leaves_no_tritonserver(served):
    """SIGKILL runs none of medusa-serve's cleanup: the parent-death signal stops tritonserver anyway."""
    proc = subprocess.Popen([sys.executable, "-m", "medusa_trt.cli.serve", "--repo", str(served["repo"]),
                             "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("medusa-serve: ready"), line + (proc.stdout.read() if proc.poll() is not None else "")
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert len(children) == 1
        server = int(children[0])
        assert "tritonserver" in Path(f"/proc/{server}/cmdline").read_text()
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 60
        while _alive(server) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _alive(server)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_medusa_serve_cli_prints_endpoints_and_stops_on_ctrl_c(served, tmp_path):
    repo = tmp_path / "repo"  # a copy without the bytecode the session's server left beside model.py
    shutil.copytree(served["repo"], repo, ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.Popen([sys.executable, "-m", "medusa_trt.cli.serve", "--repo", str(repo),
                             "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        m = re.match(r"medusa-serve: ready: HTTP (127\.0\.0\.1:\d+), gRPC (127\.0\.0\.1:\d+), metrics", line)
        assert m, line + proc.stdout.read() if proc.poll() is not None else line
        with httpclient.InferenceServerClient(m.group(1)) as client:
            assert client.is_model_ready(MODEL)
        proc.send_signal(signal.SIGINT)
        # communicate reads the pipe while waiting: a wait() with the server's shutdown log unread can
        # block it on a full pipe (a CI run timed out so)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        assert "medusa-serve: stopped" in out
        assert not list(repo.rglob("__pycache__")), "serving left the stub's bytecode in the repository"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

