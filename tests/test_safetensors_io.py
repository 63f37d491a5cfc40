"""medusa_trt.safetensors_io: the streaming reader and writer against the official library, and
corrupt or truncated files reported with the file name."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from medusa_trt.errors import CheckpointError
from medusa_trt.safetensors_io import SAFETENSORS_DTYPES, SafetensorsFile, SafetensorsWriter

ALL_DTYPES = sorted(SAFETENSORS_DTYPES.values(), key=str)


def sample_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 10
    if dtype == torch.bool:
        return x > 0
    if not dtype.is_floating_point:
        lo = 0 if str(dtype).startswith("torch.uint") else -100
        return torch.randint(lo, 100, shape, generator=g).to(dtype)
    return x.to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality for every dtype (float8 has no torch.equal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def test_writer_output_loads_with_official_loader_and_our_reader(tmp_path):
    shapes = [(3, 5), (7,), (), (0, 4), (2, 3, 4)]
    tensors = {f"t.{i}.{str(dt).removeprefix('torch.')}": sample_tensor(dt, shapes[i % len(shapes)], i)
               for i, dt in enumerate(ALL_DTYPES)}
    path = tmp_path / "a.safetensors"
    plan = [(n, t.dtype, t.shape) for n, t in tensors.items()]
    with SafetensorsWriter(path, plan, metadata={"who": "test"}) as w:
        for n, t in tensors.items():
            w.write(n, t)
    official = load_file(path)
    assert official.keys() == tensors.keys()
    for n, t in tensors.items():
        assert same_bits(official[n], t), n
    with SafetensorsFile(path) as f:
        assert f.metadata == {"format": "pt", "who": "test"}
        for n, t in tensors.items():
            assert same_bits(f.read(n), t), n


def test_reader_reads_official_writer(tmp_path):
    tensors = {"a": torch.randn(4, 3), "b": torch.arange(10, dtype=torch.int64),
               "c": torch.randn(2, 2).to(torch.bfloat16), "d": torch.randn(5).to(torch.float8_e4m3fn)}
    save_file(tensors, tmp_path / "x.safetensors", metadata={"format": "pt"})
    with SafetensorsFile(tmp_path / "x.safetensors") as f:
        assert sorted(f.keys()) == sorted(tensors)
        for n, t in tensors.items():
            assert same_bits(f.read(n), t)


def test_read_is_a_private_copy(tmp_path):
    save_file({"a": torch.zeros(3)}, tmp_path / "x.safetensors")
    with SafetensorsFile(tmp_path / "x.safetensors") as f:
        a = f.read("a")
        a += 1
        assert torch.equal(f.read("a"), torch.zeros(3))


def test_writer_checks_each_tensor_against_the_plan(tmp_path):
    plan = [("a", torch.float32, (2, 2)), ("b", torch.float16, (3,))]
    w = SafetensorsWriter(tmp_path / "x.safetensors", plan)
    with pytest.raises(CheckpointError, match="out of order.*'a'"):
        w.write("b", torch.zeros(3, dtype=torch.float16))
    with pytest.raises(CheckpointError, match=r"torch.float16\[2, 2\].*torch.float32\[2, 2\]"):
        w.write("a", torch.zeros(2, 2, dtype=torch.float16))
    with pytest.raises(CheckpointError, match="plan says"):
        w.write("a", torch.zeros(4))
    w.write("a", torch.zeros(2, 2))
    with pytest.raises(CheckpointError, match="closed after 1 of 2 planned tensors; next missing: 'b'"):
        w.close()
    with pytest.raises(CheckpointError, match="appears twice"):
        SafetensorsWriter(tmp_path / "y.safetensors", plan + plan[:1])


def _raw_file(path, header: dict | bytes, data: bytes = b"", length: int | None = None):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


@pytest.mark.parametrize("case, pattern", [
    ("short", "not a safetensors file: 3 bytes"),
    ("header_too_long", "header length 999999 but the file has"),
    ("bad_json", "not valid JSON"),
    ("not_object", "expected a JSON object"),
    ("unknown_dtype", "unknown dtype 'F128'"),
    ("out_of_range", r"outside the data section of 16 bytes"),
    ("wrong_size", "span 8 bytes, expected 16"),
    ("overlap", "'a' and 'b' overlap"),
    ("bad_shape", "not a list of non-negative integers"),
    ("missing_field", "expected {dtype, shape, data_offsets}"),
])
def test_corrupt_headers_are_reported_with_the_file_name(tmp_path, case, pattern):
    p = tmp_path / f"{case}.safetensors"
    data = bytes(16)
    ok = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
    if case == "short":
        p.write_bytes(b"abc")
    elif case == "header_too_long":
        _raw_file(p, {"a": ok}, data, length=999999)
    elif case == "bad_json":
        _raw_file(p, b"{not json", data)
    elif case == "not_object":
        _raw_file(p, b"[1, 2]", data)
    elif case == "unknown_dtype":
        _raw_file(p, {"a": {**ok, "dtype": "F128"}}, data)
    elif case == "out_of_range":
        _raw_file(p, {"a": {**ok, "shape": [8], "data_offsets": [0, 32]}}, data)
    elif case == "wrong_size":
        _raw_file(p, {"a": {**ok, "data_offsets": [0, 8]}}, data)
    elif case == "overlap":
        _raw_file(p, {"a": {**ok, "shape": [2], "data_offsets": [0, 8]},
                      "b": {**ok, "shape": [2], "data_offsets": [4, 12]}}, data)
    elif case == "bad_shape":
        _raw_file(p, {"a": {**ok, "shape": [-4]}}, data)
    elif case == "missing_field":
        _raw_file(p, {"a": {"dtype": "F32"}}, data)
    with pytest.raises(CheckpointError, match=pattern) as e:
        SafetensorsFile(p)
    assert str(p) in str(e.value)


def test_truncated_file_is_reported(tmp_path):
    p = tmp_path / "t.safetensors"
    save_file({"a": torch.randn(100), "b": torch.randn(100)}, p)
    p.write_bytes(p.read_bytes()[:-50])
    with pytest.raises(CheckpointError, match=f"{p}.*outside the data section"):
        SafetensorsFile(p)
