"""medusa-serve: run a real Triton Inference Server on a model repository, on 127.0.0.1
(medusa_trt.serving.server)."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from medusa_trt.cli.common import new_parser, nonnegative_int, port, positive_float, run_cli
from medusa_trt.errors import MedusaTrtError
from medusa_trt.serving.server import running_server

PROG = "medusa-serve"


def parser() -> argparse.ArgumentParser:
    p = new_parser(PROG, "Serve a Triton model repository (from medusa-triton or medusa-build --triton-repo) "
                   "with tritonserver on 127.0.0.1.")
    p.add_argument("--repo", required=True, type=Path, action="append",
                   help="model repository (repeat to serve several)")
    p.add_argument("--http-port", type=port, default=8000)
    p.add_argument("--grpc-port", type=port, default=8001)
    p.add_argument("--metrics-port", type=port, default=8002)
    p.add_argument("--model", action="append", help="load only this model (repeat); default: all")
    p.add_argument("--timeout", type=positive_float, default=300.0, help="seconds to wait for readiness (default 300)")
    p.add_argument("--log-verbose", type=nonnegative_int, default=0, help="tritonserver --log-verbose level")
    p.add_argument("--workdir", type=Path, help="keep the server log and backend copy here (default: temp dir)")
    return p


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.workdir is not None and args.workdir.exists() and not args.workdir.is_dir():
        raise MedusaTrtError(f"{args.workdir}: --workdir exists and is not a directory; expected a directory for "
                             "the server log and backend copy")
    try:
        with running_server(args.repo, http_port=args.http_port, grpc_port=args.grpc_port,
                            metrics_port=args.metrics_port, models=args.model, log_verbose=args.log_verbose,
                            timeout=args.timeout, workdir=args.workdir) as server:
            # Before "ready" is printed: a caller may signal as soon as it reads it, and a SIGINT that
            # came before the handler was lost where it was ignored (a test under load hung so).
            signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the server as cleanly as Ctrl-C
            # Ctrl-C is how it stops, also when started with SIGINT ignored (inherited from a parent:
            # a non-interactive shell starts background jobs that way), which Python would keep.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            print(f"{PROG}: ready: HTTP {server.http_url}, gRPC {server.grpc_url}, metrics {server.metrics_url}")
            print(f"{PROG}: log {server.log_path}; Ctrl-C stops the server", flush=True)
            while server.process.poll() is None:
                time.sleep(0.5)
            print(f"{PROG}: error: tritonserver exited with status {server.process.returncode}; "
                  f"{server.log_summary()}", file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        print(f"{PROG}: stopped")
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(PROG, lambda: _main(argv))


if __name__ == "__main__":
    sys.exit(main())
