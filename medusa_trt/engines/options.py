"""What medusa-build's backends share with its dispatcher: the options, their error, the engine
limits they resolve to and the progress bar.

engines/build.py dispatches to the backends (engines/ort, engines/trt, engines/trtllm, each a
`build.py` with its options dataclass beside its builder); the backends import this module, never
engines/build.py, so imports run one way.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, TypeVar

from medusa_trt.checkpoint import DEFAULT_MAX_DRAFT_LEN
from medusa_trt.errors import MedusaTrtError


class BuildError(MedusaTrtError):
    """Bad input to medusa-build (a checkpoint, an option, a missing tool); the CLI exits 2."""


@dataclass(frozen=True)
class BackendOptions:
    """One backend's own options, a typed dataclass next to its builder: OrtOptions
    (engines/ort/build.py), TrtOptions (engines/trt/build.py), TrtllmOptions (engines/trtllm/build.py).
    Each checks its own values where its builder starts."""

    backend: ClassVar[str] = ""  # the --backend these options belong to


@dataclass
class BuildOptions:
    checkpoint: Path
    out: Path
    backend: str = "onnxruntime"
    dtype: str | None = None  # None: float32 on the CPU (see resolve_dtype), the checkpoint's on CUDA
    max_batch_size: int = 8
    max_seq_len: int | None = None  # None: the checkpoint's max_position_embeddings
    max_draft_len: int | None = None  # None: the checkpoint's max_draft_len
    opset: int | None = None  # None: the backend's default
    device: str = "cpu"
    attention: str | None = None  # None: the backend's default attention form
    force: bool = False
    progress: bool = True
    # The backend's own options (BackendOptions of opts.backend); None: that backend's defaults.
    backend_options: BackendOptions | None = None
    # The tree the engine records (engine.json medusa.tree): what medusa-run, the Python API, Triton
    # and medusa-bench decode with by default. Anything tree.parse_medusa_choices takes, e.g. the
    # tree.json medusa-tune-tree writes; None: the engine records none.
    tree: object = None
    # The base model's own text to draft from (medusa_trt/datastore.py: read_source), indexed into the
    # engine's datastore.npz; None: no datastore.
    datastore: Path | None = None


Options = TypeVar("Options", bound=BackendOptions)


def backend_options(opts: BuildOptions, kind: type[Options]) -> Options:
    """opts.backend_options as the `kind` a builder takes: kind's defaults when None."""
    given = opts.backend_options
    if given is None:
        return kind()
    if not isinstance(given, kind):
        raise BuildError(f"--backend {opts.backend}: backend options {type(given).__name__}, expected {kind.__name__}")
    return given


@dataclass(frozen=True)
class Limits:
    """The engine's limits (engine.json "limits"): the options, or the checkpoint's values."""

    max_batch_size: int
    max_seq_len: int
    max_draft_len: int

    @property
    def tree(self) -> int:
        """Tokens of one verify step: the tree nodes plus the root."""
        return self.max_draft_len + 1

    @property
    def max_past(self) -> int:
        return self.max_seq_len + self.tree


def limits_for(opts: BuildOptions, config: dict) -> Limits:
    max_seq_len = opts.max_seq_len or int(config["max_position_embeddings"])
    max_draft_len = opts.max_draft_len or int(config.get("max_draft_len") or DEFAULT_MAX_DRAFT_LEN)
    return Limits(opts.max_batch_size, max_seq_len, max_draft_len)


def progress_bar(total: int, enabled: bool, desc: str):
    """A build's step bar (tqdm on stderr, gone when done)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, file=sys.stderr, leave=False)
