"""What every console script shares: one error line, exit 2, and clean interruption.

`run_cli(prog, body)` runs a CLI's body with a `prog: level: message` log handler and turns
- a MedusaTrtError (bad input, already explained) and an OSError (permission denied, no space
  left, not a directory, ...) into ONE line `prog: error: <message>` on stderr and exit code 2;
- SIGINT and SIGTERM into one line and exit code 130 / 143. SIGTERM (what schedulers and `kill`
  send) is turned into a KeyboardInterrupt subclass, so the `except BaseException` blocks that
  remove temporary output run exactly as they do for Ctrl-C.
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Callable

from medusa_trt.errors import MedusaTrtError

EXIT_BAD_INPUT = 2


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so cleanup code runs."""


def _on_sigterm(signum, frame):
    raise Terminated()


class _Formatter(logging.Formatter):
    def __init__(self, prog: str):
        super().__init__()
        self.prog = prog

    def format(self, record: logging.LogRecord) -> str:  # "medusa-build: warning: ..."
        return f"{self.prog}: {record.levelname.lower()}: {record.getMessage()}"


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def describe_os_error(e: OSError) -> str:
    """`path: reason` (both paths for a rename), e.g. 'out/x: Permission denied'."""
    reason = e.strerror or str(e)
    paths = [str(p) for p in (e.filename, e.filename2) if p is not None]
    return f"{' -> '.join(paths)}: {reason}" if paths else reason


def error_line(prog: str, message: str) -> str:
    return f"{prog}: error: {one_line(message)}"


def run_cli(prog: str, body: Callable[[], int | None], *, handle_sigterm: bool = True) -> int:
    """Runs body() and returns its exit code (0 for None); see the module docstring."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(prog))
    logger = logging.getLogger("medusa_trt")
    logger.addHandler(handler)
    previous = None
    if handle_sigterm:
        try:
            previous = signal.signal(signal.SIGTERM, _on_sigterm)
        except ValueError:  # not the main thread (a CLI called from a worker thread): leave signals alone
            previous = None
    try:
        return body() or 0
    except MedusaTrtError as e:
        print(error_line(prog, str(e)), file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:
        print(error_line(prog, describe_os_error(e)), file=sys.stderr)
        return EXIT_BAD_INPUT
    except Terminated:
        print(f"{prog}: error: terminated (SIGTERM)", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print(f"{prog}: error: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        logger.removeHandler(handler)
