"""How the project calls torch.onnx's exporter (export.py and step.py): quietly, with one registry
of aten -> ONNX functions per process, and without the per-node stack traces it records."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

STACK_TRACE = "pkg.torch.onnx.stack_trace"  # node metadata the exporter writes; engines leave it out


@contextlib.contextmanager
def quiet_exporter() -> Iterator[None]:
    """The exporter warns (Python warnings and its logger) about internals we do not control, such
    as torchvision not being installed; errors still raise."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def drop_stack_traces(program) -> None:
    """Removes the Python stack trace the exporter records on every node (a torch.onnx ONNXProgram,
    in place): it names files of the build machine by absolute path, and a counter of the process's
    traced functions, so the same checkpoint gave other graph bytes in another build or folder."""
    import onnx_ir as ir

    for node in ir.traversal.RecursiveGraphIterator(program.model.graph):
        node.metadata_props.pop(STACK_TRACE, None)


_TORCHLIB_REGISTRIES: dict[tuple, object] = {}  # (registry class, opset) -> torch.onnx's registry, built once


@contextlib.contextmanager
def one_torchlib_registry() -> Iterator[None]:
    """Every torch.onnx.export builds its registry of aten -> ONNX functions anew, reading the source
    of ~500 onnxscript functions: ~0.55 s of each export, and a build exports four graphs (a tiny
    model's build 11.3 s -> 9.8 s, docs/benchmarks/issue-35-amphista.md (ai)). While open, each export gets a copy of one registry built once per
    process (a copy: the export adds the build's custom ops to it). torch.onnx's private API: where it
    differs (another torch), exports build their own registry as before."""
    try:
        from torch.onnx._internal.exporter._registration import ONNXRegistry

        original = ONNXRegistry.__dict__["from_torchlib"].__func__
        ONNXRegistry().functions  # noqa: B018  (the attribute the copy fills)
    except (ImportError, KeyError, AttributeError):
        yield
        return

    def from_torchlib(cls, *args, **kwargs):
        key = (cls, *args, *sorted(kwargs.items()))
        if key not in _TORCHLIB_REGISTRIES:
            _TORCHLIB_REGISTRIES[key] = original(cls, *args, **kwargs)
        built = _TORCHLIB_REGISTRIES[key]
        registry = cls()
        registry._opset_version = built._opset_version
        registry.functions = {target: list(decomps) for target, decomps in built.functions.items()}
        return registry

    ONNXRegistry.from_torchlib = classmethod(from_torchlib)
    try:
        yield
    finally:
        ONNXRegistry.from_torchlib = classmethod(original)
