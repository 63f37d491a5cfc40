"""Safetensors, read and written by our own small code rather than through `safetensors`, so that
conversion can stream: the reader uses plain positioned reads into a fresh buffer (no mmap, whose
touched pages would count against resident memory for the whole run), and the writer takes the
full list of tensors up front, writes the header, then accepts one tensor at a time.

The format: 8 bytes of little-endian header length, a JSON header (dtype, shape and data offsets
of every tensor, optional `__metadata__`), then the data section.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from medusa_trt.errors import CheckpointError

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in SAFETENSORS_DTYPES.items()}

# The reference implementation refuses headers above 100 MB; a larger length means a corrupt file
# and we should not try to allocate it.
MAX_HEADER_BYTES = 100 * 1024 * 1024

if sys.byteorder != "little":  # safetensors data is little-endian; we copy bytes as they are
    raise ImportError("medusa_trt.safetensors_io supports little-endian hosts only")


def dtype_to_safetensors(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise CheckpointError(f"dtype {dtype} has no safetensors name; supported: "
                              f"{', '.join(str(d) for d in _DTYPE_NAMES)}") from None


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # byte offsets relative to the start of the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class SafetensorsFile:
    """Reads a .safetensors file one tensor at a time, without mmap.

    Each `read` allocates a buffer of exactly that tensor's size and fills it with plain reads, so
    the caller decides how long the memory lives.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self._file = open(self.path, "rb", buffering=0)  # noqa: SIM115 - closed in close()
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot open safetensors file: {e.strerror}") from None
        try:
            self.metadata, self.tensors, self._data_start = _parse_header(self.path, self._file)
        except BaseException:
            self._file.close()
            raise

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    def keys(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor named {name!r}") from None

    def read(self, name: str) -> torch.Tensor:
        info = self.info(name)
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        # torch.empty rather than bytearray: no zero-fill pass over memory we overwrite anyway.
        buf = torch.empty(info.nbytes, dtype=torch.uint8)
        view = memoryview(buf.numpy())
        done = 0
        while done < info.nbytes:
            self._file.seek(self._data_start + info.begin + done)
            n = self._file.readinto(view[done:])
            if not n:
                raise CheckpointError(f"{self.path}: file ends inside tensor {name!r} "
                                      f"(read {done} of {info.nbytes} bytes)")
            done += n
        return buf.view(info.dtype).reshape(info.shape)

    def read_all(self) -> dict[str, torch.Tensor]:
        return {name: self.read(name) for name in self.tensors}


def _parse_header(path: Path, f) -> tuple[dict[str, str], dict[str, TensorInfo], int]:
    size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    if len(head) < 8:
        raise CheckpointError(f"{path}: not a safetensors file: {size} bytes, expected at least 8")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise CheckpointError(f"{path}: corrupt safetensors header: header length {n} but the file "
                              f"has {size} bytes (truncated or not a safetensors file)")
    raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header: not valid JSON ({e})") from None
    except RecursionError:  # nested past the parser's stack; a real header is two levels deep
        raise CheckpointError(f"{path}: corrupt safetensors header: JSON nested too deep; expected an object of "
                              "{dtype, shape, data_offsets} entries") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header: expected a JSON object, "
                              f"got {type(header).__name__}")
    data_start = 8 + n
    data_size = size - data_start
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header: __metadata__ must be an object")
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        where = f"{path}: corrupt safetensors header: tensor {name!r}"
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise CheckpointError(f"{where}: expected {{dtype, shape, data_offsets}}, got {entry!r}")
        dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise CheckpointError(f"{where}: unknown dtype {entry['dtype']!r}; expected one of "
                                  f"{', '.join(SAFETENSORS_DTYPES)}")
        shape, offsets = entry["shape"], entry["data_offsets"]
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) for o in offsets)):
            raise CheckpointError(f"{where}: data_offsets {offsets!r} is not [begin, end]")
        begin, end = offsets
        expected = math.prod(shape) * dtype.itemsize
        if not 0 <= begin <= end <= data_size:
            raise CheckpointError(f"{where}: data_offsets [{begin}, {end}] outside the data section "
                                  f"of {data_size} bytes (file truncated?)")
        if end - begin != expected:
            raise CheckpointError(f"{where}: data_offsets [{begin}, {end}] span {end - begin} bytes, "
                                  f"expected {expected} for {entry['dtype']}{shape}")
        tensors[name] = TensorInfo(name, dtype, tuple(shape), begin, end)
    spans = sorted((t.begin, t.end, t.name) for t in tensors.values() if t.nbytes)
    for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:], strict=False):
        if begin_b < end_a:
            raise CheckpointError(f"{path}: corrupt safetensors header: tensors {a!r} and {b!r} overlap")
    return metadata, tensors, data_start


class SafetensorsWriter:
    """Writes a .safetensors file whose tensor list is known up front, one tensor at a time.

    `plan` fixes names, dtypes, shapes and order; `write` must then be called in that order, and
    each tensor is checked against its entry. The file loads with `safetensors.torch.load_file`.
    """

    def __init__(self, path: str | os.PathLike,
                 plan: Sequence[tuple[str, torch.dtype, Sequence[int]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.plan = [(name, dtype, tuple(int(d) for d in shape)) for name, dtype, shape in plan]
        names = [p[0] for p in self.plan]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise CheckpointError(f"{self.path}: tensor {dup!r} appears twice in the write plan")
        header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
        offset = 0
        for name, dtype, shape in self.plan:
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": dtype_to_safetensors(dtype), "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        self.nbytes_data = offset
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)  # keep the data section 8-byte aligned, as the reference does
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self._file.write(struct.pack("<Q", len(raw)))
        self._file.write(raw)
        self.nbytes_total = 8 + len(raw) + offset
        self._next = 0

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()

    def write(self, name: str, tensor: torch.Tensor) -> int:
        """Append the next planned tensor; returns the number of bytes written."""
        if self._next >= len(self.plan):
            raise CheckpointError(f"{self.path}: tensor {name!r} written after the last planned tensor")
        want_name, want_dtype, want_shape = self.plan[self._next]
        if name != want_name:
            raise CheckpointError(f"{self.path}: tensor {name!r} written out of order; "
                                  f"the plan expects {want_name!r} next")
        if tensor.dtype != want_dtype or tuple(tensor.shape) != want_shape:
            raise CheckpointError(f"{self.path}: tensor {name!r} is {tensor.dtype}{list(tensor.shape)}, "
                                  f"the plan says {want_dtype}{list(want_shape)}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        self._file.write(memoryview(data))
        self._next += 1
        return data.nbytes

    def close(self) -> None:
        if self._file.closed:
            return
        self._file.close()
        if self._next != len(self.plan):
            raise CheckpointError(f"{self.path}: closed after {self._next} of {len(self.plan)} planned "
                                  f"tensors; next missing: {self.plan[self._next][0]!r}")


def save_tensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """A dict of tensors as one .safetensors file, in its order: safetensors.torch.save_file's job,
    with the permissions of the files beside it (save_file makes its file 0600 whatever the umask)."""
    with SafetensorsWriter(path, [(name, t.dtype, t.shape) for name, t in tensors.items()]) as writer:
        for name, t in tensors.items():
            writer.write(name, t)


def check_finite(t: torch.Tensor, what: str, error: type[CheckpointError] = CheckpointError) -> None:
    """NaN or Inf in a weight is refused, naming the tensor: it would convert, build and decode
    without a word and give garbage (medusa-convert on what it writes, medusa-build and the reference
    on what they read). aminmax propagates NaN and shows an Inf as min or max, without a mask the
    size of the tensor: about a tenth of a dtype cast's cost (BENCHMARKS.md)."""
    if not t.is_floating_point() or t.numel() == 0:
        return
    x = t if t.element_size() > 1 else t.to(torch.float32)  # float8 has no aminmax kernel
    lo, hi = torch.aminmax(x)
    if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
        bad = int((~torch.isfinite(x)).sum())
        raise error(f"{what}: {bad} of {t.numel()} values are NaN or Inf; expected finite weights "
                    "(a corrupt or overflowed file)")
