"""A pytest plugin that says where the test suite's time goes: the seconds in `torch.onnx.export`,
in `build_engine` and in ONNX Runtime session creation, per test file, one JSON file per xdist
worker (docs/benchmarks/issue-35-amphista.md, (al)). Not a benchmark of the product: run it beside
the suite, from the repository root, and sum the files:

    PYTHONPATH=benchmarks/investigations .venv/bin/python -m pytest -q -n 2 --dist loadfile \
        -p suite_time_plugin            # writes build/suite_time/<worker>.json
"""

from __future__ import annotations

import collections
import functools
import json
import os
import time
from pathlib import Path

OUT = Path("build/suite_time")
_current = {"file": "?"}
_seconds: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


def _timed(fn, key: str):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            counter = _seconds[_current["file"]]
            counter[key] += time.perf_counter() - t
            counter[key + " calls"] += 1
    return wrapper


def pytest_configure(config) -> None:
    # Patched before collection: test modules import these names after this runs.
    import onnxruntime
    import torch

    import medusa_trt.engines.build as build

    torch.onnx.export = _timed(torch.onnx.export, "export")
    build.build_engine = _timed(build.build_engine, "build")
    onnxruntime.InferenceSession.__init__ = _timed(onnxruntime.InferenceSession.__init__, "session")


def pytest_runtest_setup(item) -> None:
    _current["file"] = item.nodeid.split("::")[0]


def pytest_unconfigure(config) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    (OUT / f"{worker}.json").write_text(json.dumps({k: dict(v) for k, v in _seconds.items()}, indent=1))
