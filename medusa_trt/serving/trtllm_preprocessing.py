"""Preprocessing model of the TensorRT-LLM Triton repository: text -> token ids.

medusa-triton copies this file as `preprocessing/1/model.py`. It must stay self-contained (numpy,
transformers and Triton's stub only): the TensorRT-LLM serving image does not have medusa_trt.

Inputs per row: QUERY, REQUEST_OUTPUT_LEN, optional END_ID, PAD_ID (default: the tokenizer's),
STOP_WORDS_DICT, BAD_WORDS_DICT (lists of strings). Outputs: INPUT_ID (right-padded with the pad
id), REQUEST_INPUT_LEN, REQUEST_OUTPUT_LEN, STOP_WORDS_IDS / BAD_WORDS_IDS in TensorRT-LLM's word
list layout [2, n] (row 0 the words' ids back to back, row 1 each word's end offset, -1 padded),
OUT_END_ID, OUT_PAD_ID and RETURN_PERF_METRICS (always true, so the engine returns its
acceptance statistics).
"""

from __future__ import annotations

import json

import numpy as np


def _strings(array, name: str) -> list[list[str]]:
    rows = array.reshape(array.shape[0], -1) if array.ndim >= 2 else array.reshape(1, -1)
    try:
        return [[v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in row] for row in rows]
    except UnicodeDecodeError as err:
        raise ValueError(f"{name}: not valid UTF-8 ({err})") from None


def word_lists(tokenizer, rows: list[list[str]]) -> np.ndarray:
    """[B, 2, n] int32: per row, the ids of its words back to back, and each word's end offset."""
    flat, ends = [], []
    for words in rows:
        ids, offsets = [], []
        for word in words:
            if word:
                ids += tokenizer.encode(word, add_special_tokens=False)
                offsets.append(len(ids))
        flat.append(ids)
        ends.append(offsets)
    width = max([1] + [len(x) for x in flat] + [len(x) for x in ends])
    out = np.zeros((len(rows), 2, width), dtype=np.int32)
    out[:, 1, :] = -1
    for b, (ids, offsets) in enumerate(zip(flat, ends, strict=True)):
        out[b, 0, : len(ids)] = ids
        out[b, 1, : len(offsets)] = offsets
    return out


def preprocess(tokenizer, inputs: dict) -> dict:
    """The model's outputs for one request, from its input arrays (Triton's [B, ...] layout)."""
    queries = _strings(inputs["QUERY"], "QUERY")
    rows = len(queries)
    if any(len(q) != 1 for q in queries):
        raise ValueError("QUERY: expected one string per row")
    output_len = np.asarray(inputs["REQUEST_OUTPUT_LEN"]).reshape(rows, -1)[:, :1].astype(np.int32)
    if (output_len < 1).any():
        raise ValueError(f"REQUEST_OUTPUT_LEN: {output_len.ravel().tolist()}; expected positive token counts")
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    end_id = np.asarray(inputs["END_ID"]).reshape(rows, 1) if "END_ID" in inputs else np.full((rows, 1), eos)
    pad_id = np.asarray(inputs["PAD_ID"]).reshape(rows, 1) if "PAD_ID" in inputs else np.full((rows, 1), pad)
    ids = [tokenizer.encode(q[0]) for q in queries]
    if any(len(x) == 0 for x in ids):
        raise ValueError("QUERY: a prompt encodes to no tokens")
    width = max(len(x) for x in ids)
    input_id = np.empty((rows, width), dtype=np.int32)
    for b, x in enumerate(ids):
        input_id[b] = int(pad_id[b, 0])
        input_id[b, : len(x)] = x
    no_words = [[] for _ in range(rows)]
    return {
        "INPUT_ID": input_id,
        "REQUEST_INPUT_LEN": np.array([[len(x)] for x in ids], dtype=np.int32),
        "REQUEST_OUTPUT_LEN": output_len,
        "STOP_WORDS_IDS": word_lists(tokenizer, _strings(inputs["STOP_WORDS_DICT"], "STOP_WORDS_DICT")
                                     if "STOP_WORDS_DICT" in inputs else no_words),
        "BAD_WORDS_IDS": word_lists(tokenizer, _strings(inputs["BAD_WORDS_DICT"], "BAD_WORDS_DICT")
                                    if "BAD_WORDS_DICT" in inputs else no_words),
        "OUT_END_ID": end_id.astype(np.int32),
        "OUT_PAD_ID": pad_id.astype(np.int32),
        "RETURN_PERF_METRICS": np.ones((rows, 1), dtype=np.bool_),
    }


_INPUT_NAMES = ("QUERY", "REQUEST_OUTPUT_LEN", "END_ID", "PAD_ID", "STOP_WORDS_DICT", "BAD_WORDS_DICT")


class TritonPythonModel:
    def initialize(self, args):
        import triton_python_backend_utils as pb_utils
        from transformers import AutoTokenizer

        self.pb = pb_utils
        config = json.loads(args["model_config"])
        directory = config["parameters"]["tokenizer_dir"]["string_value"]
        self.tokenizer = AutoTokenizer.from_pretrained(directory)

    def execute(self, requests):
        pb = self.pb
        responses = []
        for request in requests:
            inputs = {}
            for name in _INPUT_NAMES:
                tensor = pb.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    inputs[name] = tensor.as_numpy()
            try:
                outputs = preprocess(self.tokenizer, inputs)
            except (ValueError, KeyError) as err:  # a bad request answers alone; the batch goes on
                responses.append(pb.InferenceResponse(error=pb.TritonError(f"preprocessing: {err}")))
                continue
            responses.append(pb.InferenceResponse(output_tensors=[pb.Tensor(k, v) for k, v in outputs.items()]))
        return responses
