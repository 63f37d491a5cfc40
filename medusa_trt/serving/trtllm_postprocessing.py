"""Postprocessing model of the TensorRT-LLM Triton repository: token ids -> text.

medusa-triton copies this file as `postprocessing/1/model.py`; like preprocessing it must stay
self-contained (numpy, transformers and Triton's stub only).

Inputs per row: TOKENS_BATCH [beam, n] (the engine's output_ids; the repository sets
exclude_input_in_output, so these are the new tokens only) and SEQUENCE_LENGTH [beam]. Output:
OUTPUT [beam], the decoded text of each beam's first SEQUENCE_LENGTH tokens.
"""

from __future__ import annotations

import json

import numpy as np


def postprocess(tokenizer, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[B, beam, n] ids and [B, beam] lengths -> [B, beam] UTF-8 strings (object array)."""
    tokens = np.asarray(tokens)
    if tokens.ndim == 2:  # a caller without the beam axis
        tokens = tokens[:, None, :]
    lengths = np.asarray(lengths).reshape(tokens.shape[0], tokens.shape[1])
    out = np.empty(lengths.shape, dtype=np.object_)
    for b in range(tokens.shape[0]):
        for k in range(tokens.shape[1]):
            n = int(lengths[b, k])
            if not 0 <= n <= tokens.shape[2]:
                raise ValueError(f"SEQUENCE_LENGTH: {n} for row {b}; expected 0..{tokens.shape[2]}")
            ids = tokens[b, k, :n].tolist()
            out[b, k] = tokenizer.decode(ids, skip_special_tokens=True).encode("utf-8")
    return out


class TritonPythonModel:
    def initialize(self, args):
        import triton_python_backend_utils as pb_utils
        from transformers import AutoTokenizer

        self.pb = pb_utils
        config = json.loads(args["model_config"])
        self.tokenizer = AutoTokenizer.from_pretrained(config["parameters"]["tokenizer_dir"]["string_value"])

    def execute(self, requests):
        pb = self.pb
        responses = []
        for request in requests:
            tokens = pb.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()
            lengths = pb.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()
            try:
                text = postprocess(self.tokenizer, tokens, lengths)
            except ValueError as err:
                responses.append(pb.InferenceResponse(error=pb.TritonError(f"postprocessing: {err}")))
                continue
            responses.append(pb.InferenceResponse(output_tensors=[pb.Tensor("OUTPUT", text)]))
        return responses
