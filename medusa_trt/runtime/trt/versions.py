"""The TensorRT releases this project builds and runs engines with, checked in one place by the
builder (engines/trt/build.py) and the runtime (runtime/trt/backend.py)."""

from __future__ import annotations

EXTRA_HINT = "pip install 'medusa-trt[tensorrt]'"

# The TensorRT releases this project builds and runs with (pyproject's extra states the same range).
# The floor: the exported graphs are opset 23, with RMSNormalization (parsed by TensorRT's ONNX parser
# from 10.15) in both modes and Attention (from 10.14) with --trt-attention native. The ceiling: 11.x
# is the newest major whose Python API every call here was checked against (strongly typed networks
# only, the Quickly Deployable Plugin API with ahead-of-time kernels, the ONNX parser to opset 25).
MIN_TENSORRT = (10, 15)
MAX_TENSORRT = (12, 0)  # exclusive
SUPPORTED_TENSORRT = "10.15 to 11.x"


def tensorrt_version_problem(version: str) -> str | None:
    """Why TensorRT `version` cannot be used here (one line), or None when it is supported."""
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if MIN_TENSORRT <= parts < MAX_TENSORRT:
        return None
    why = ("the exported opset-23 graphs (RMSNormalization, Attention) need 10.15" if parts < MIN_TENSORRT
           else "its API is not checked against this release")
    return (f"TensorRT {version} is not supported: medusa-trt works with TensorRT {SUPPORTED_TENSORRT} ({why}); "
            f"{EXTRA_HINT} installs one")
