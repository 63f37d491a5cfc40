"""The TensorRT graph rewrite (test_rewrite.py) on a model with a sliding window: the windowed
layer's plugin node carries the window, and the rewritten graph matches the ONNX Runtime engine
past the window. A file of its own so that `make test`'s workers (--dist loadfile) can run it
beside test_rewrite.py rather than after it: each builds an engine of its own.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys

import numpy as np
import pytest
import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None
if HAVE_TRITON and not torch.cuda.is_available() and "triton" not in sys.modules:
    # As in test_tree_attention_kernel: triton picks interpreted mode at its first import.
    os.environ["TRITON_INTERPRET"] = "1"
    import triton  # noqa: F401

# Imported, not importorskip'd: `make test` installs them (the dev extra), so a broken install fails
# here rather than skipping the graph rewrite's tests without a word.
import onnx  # noqa: E402
import onnx_graphsurgeon  # noqa: E402, F401
import onnxruntime_extensions  # noqa: E402, F401
from synthetic import SLIDING_WINDOW_CONFIGS, WINDOW  # noqa: E402

from medusa_trt.engines.trt.rewrite import (  # noqa: E402
    PACKED_MASK,
    PAST_LENS,
    POSITIONS,
    RewriteError,
    reference_session,
    rewrite_attention,
    rewrite_onnx_file,
)
from medusa_trt.modeling import MedusaModel  # noqa: E402
from medusa_trt.runtime.decoding import GenerationConfig, decode  # noqa: E402
from medusa_trt.runtime.ort.backend import OrtBackend  # noqa: E402
from medusa_trt.runtime.trt.tree_attention import kernel  # noqa: E402
from medusa_trt.runtime.trt.tree_attention.plugin import PLUGIN_NAME  # noqa: E402
from medusa_trt.tree import build_tree  # noqa: E402
from tests.engines.trt.test_rewrite import TREE, _attr, _feeds, _run_both  # noqa: E402

WINDOWED = {"extra_config": SLIDING_WINDOW_CONFIGS["qwen2"]}  # window 8 in layer 1 of 2


@pytest.fixture(scope="module")
def rewritten_window(ort_engine, tiny_merged, tmp_path_factory):
    """(ORT engine dir, unrewritten model.onnx, rewrite result) of the Qwen2 with a window in layer 1."""
    engine = ort_engine("qwen2", base_kwargs=WINDOWED)
    work = tmp_path_factory.mktemp("rewrite-window")
    shutil.copy(engine / "model.onnx", work / "model.onnx")
    shutil.copy(engine / "weights.bin", work / "weights.bin")
    cfg = MedusaModel.from_checkpoint(tiny_merged("qwen2", base_kwargs=WINDOWED)).cfg
    return engine, engine / "model.onnx", rewrite_onnx_file(work / "model.onnx", windows=cfg.windows), cfg


def test_sliding_window_layers_get_the_window(rewritten_window):
    """The windowed layer's plugin node carries the window, the other 0; a graph whose windowed
    masks do not match the model's layers is refused by name."""
    _, src, result, cfg = rewritten_window
    after = onnx.load(str(result.path))
    plugins = [n for n in after.graph.node if n.op_type == PLUGIN_NAME]
    assert sorted(_attr(n, "window") for n in plugins) == [0, WINDOW]
    assert all(list(n.input[3:]) == [PAST_LENS, PACKED_MASK, POSITIONS] for n in plugins)
    with pytest.raises(RewriteError, match=r"1 of the graph's 2 Attention nodes read a sliding-window mask, but the "
                                           r"model has 0 layers"):
        rewrite_attention(onnx.load(str(src)))
    with pytest.raises(RewriteError, match="one window size"):
        rewrite_attention(onnx.load(str(src)), windows=(4, 8))


@pytest.mark.parametrize("impl", ["reference", "kernel"])
def test_sliding_window_matches_unrewritten_engine(rewritten_window, impl):
    """Past the window: a ragged tree step and a prefill with a committed prefix, through the plugin
    op (the reference, or the Triton kernel under its interpreter), equal the ONNX Runtime engine."""
    if impl == "kernel" and not (HAVE_TRITON and kernel.interpreter_active()):
        pytest.skip("triton is not running interpreted in this process")
    _, src, result, cfg = rewritten_window
    dims = dict(layers=cfg.num_layers, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, vocab=cfg.vocab_size)
    rng = np.random.default_rng(11)
    tree = build_tree(TREE, num_heads=cfg.num_medusa_heads)
    mask = np.broadcast_to(tree.attention_mask, (3, tree.num_slots, tree.num_slots))
    _run_both(src, result.path, _feeds(rng, batch=3, new=tree.num_slots, past=40, lengths=[37, 4, 21], mask=mask,
                                       positions=tree.position_offsets, **dims), impl)
    causal = np.tril(np.ones((12, 12), dtype=bool))[None].repeat(2, 0)
    _run_both(src, result.path, _feeds(rng, batch=2, new=12, past=30, lengths=[30, 0], mask=causal, **dims), impl)


def test_sliding_window_medusa_decode_through_rewritten_graph(rewritten_window, tiny_base):
    """Greedy Medusa through the rewritten graph, far past the window: transformers' tokens."""
    from transformers import AutoModelForCausalLM

    engine, _, result, _ = rewritten_window
    hf = AutoModelForCausalLM.from_pretrained(tiny_base("qwen2", **WINDOWED)).eval()
    prompts = [[1, 5, 9, 14, 3, 22, 60, 61, 62, 63, 64], [1, 40]]
    backend = OrtBackend(engine)
    backend.session = reference_session(result.path)
    got = decode(backend, prompts, GenerationConfig(max_new_tokens=24, medusa_choices=TREE))
    for prompt, tokens in zip(prompts, got.tokens, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                               min_new_tokens=0, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens == want
