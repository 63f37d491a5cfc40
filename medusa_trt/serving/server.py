"""medusa-serve: run a real Triton Inference Server on a model repository, on 127.0.0.1.

The server comes from the `nvidia-pytriton` wheel, which bundles `tritonserver`, the Python
backend and one Python-backend stub per Python version. The stub embeds Python and takes its
sys.path from the environment that starts tritonserver, so we start it with this interpreter's
virtualenv first on PATH (model.py can then import medusa_trt and torch), copy the backend plus the
stub for the running Python into a private backend directory, and put the wheel's bundled
libraries on LD_LIBRARY_PATH (the stub needs them once moved out of the wheel).

`running_server(repo)` is the reusable form (tests, benchmarks): free loopback ports, waits for
/v2/health/ready, and stops the server on exit. A server that dies while starting raises with the
tail of its log.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from medusa_trt.errors import MedusaTrtError

_LOG_ERROR = re.compile(r"E\d{4} ")  # glog severity E + month and day
_LOG_NOISE = ("CudaDriverHelper has not been initialized",)  # every start on a machine without a GPU


class ServerError(MedusaTrtError, RuntimeError):
    """tritonserver is missing, would not start, or died; the message says which and shows its log."""


@dataclass(frozen=True)
class TritonInstall:
    """The pieces of the nvidia-pytriton wheel we run."""

    binary: Path  # tritonserver
    python_backend: Path  # backends/python (libtriton_python.so + triton_python_backend_utils.py)
    stub: Path  # triton_python_backend_stub for the running Python
    libs: Path  # the wheel's bundled shared libraries (nvidia_pytriton.libs)


def find_triton() -> TritonInstall:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ServerError("nvidia-pytriton is not installed; it provides tritonserver "
                          "(pip install 'medusa-trt[triton]')")
    package = Path(next(iter(spec.submodule_search_locations)))
    root = package / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stubs = root / "python_backend_stubs"
    install = TritonInstall(root / "bin" / "tritonserver", root / "backends" / "python",
                            stubs / version / "triton_python_backend_stub", package.parent / "nvidia_pytriton.libs")
    for what, path in (("tritonserver", install.binary), ("Python backend", install.python_backend),
                       ("bundled libraries", install.libs)):
        if not path.exists():
            raise ServerError(f"{path}: {what} not found in the nvidia-pytriton wheel (reinstall it)")
    if not install.stub.is_file():
        have = sorted(p.name for p in stubs.iterdir()) if stubs.is_dir() else []
        raise ServerError(f"{install.stub}: no Python-backend stub for Python {version} in nvidia-pytriton "
                          f"(it has {', '.join(have) or 'none'}); use one of those Python versions")
    return install


def prepare_backends(install: TritonInstall, directory: Path) -> Path:
    """A --backend-directory holding the Python backend with this Python's stub beside it."""
    python = directory / "python"
    if python.exists():  # a reused --workdir: refresh the copy (the wheel may have been upgraded)
        shutil.rmtree(python)
    shutil.copytree(install.python_backend, python, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(install.stub, python / "triton_python_backend_stub")
    return directory


def server_env(install: TritonInstall) -> dict[str, str]:
    env = dict(os.environ)
    venv_bin = str(Path(sys.executable).parent)  # not resolved: the venv's bin, not the base Python's
    env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
    if sys.prefix != sys.base_prefix:
        env["VIRTUAL_ENV"] = sys.prefix
    # The package's parent, for a medusa_trt used from a source tree without being installed.
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    # The stub links libpython3.X.so: prefer this interpreter's own over a system copy of another
    # patch release, then the wheel's libraries.
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    libs = [str(install.libs)]
    if libdir and any(Path(libdir).glob("libpython3*.so*")):
        libs.insert(0, libdir)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [p for p in [env.get("LD_LIBRARY_PATH")] if p])
    return env


def check_ports_free(**ports: int) -> None:
    """Each given port (0: none asked for) can be bound on 127.0.0.1, or one ServerError naming it. Another
    server there would answer our readiness probe and we would report it ready."""
    for name, port in ports.items():
        if not port:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError as e:
                flag = "--" + name.replace("_", "-")
                raise ServerError(f"{flag} {port}: 127.0.0.1:{port} is in use ({e.strerror}); stop what listens "
                                  f"there or pick another port (0: a free one)") from None


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:
    """In the child before exec: the kernel sends tritonserver SIGTERM when the process that started
    it dies, even by SIGKILL, which runs no cleanup of ours (the server is in its own session, so no
    terminal signal reaches it). Linux only; elsewhere stop_server is the only stop."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() == 1:  # the parent died before prctl took effect: the signal will never come
            os._exit(1)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    process: subprocess.Popen
    http_port: int
    grpc_port: int
    metrics_port: int
    log_path: Path

    @property
    def http_url(self) -> str:  # tritonclient takes host:port
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def log_summary(self, tail: int = 5) -> str:
        """The log's error lines (a failed model load says why there), then its last lines: the
        plain tail is mostly tritonserver's option table."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return f"(no log at {self.log_path})"
        errors = [line[:400] for line in lines if _LOG_ERROR.match(line) and not any(n in line for n in _LOG_NOISE)]
        parts = (["errors:", *errors] if errors else []) + ["last lines:", *lines[-tail:]]
        return "\n".join(parts) + f"\n(full log: {self.log_path})"


def start_server(repos: Path | Sequence[Path], workdir: Path, *, http_port: int = 0, grpc_port: int = 0,
                 metrics_port: int = 0, models: Sequence[str] | None = None, log_verbose: int = 0,
                 timeout: float = 180.0) -> RunningServer:
    """Starts tritonserver and waits until it is ready; workdir holds the backend copy and the log.
    Ports 0 pick free ones. `models` loads only those (explicit model control) instead of all."""
    repos = _repo_list(repos)
    for name, port in (("--http-port", http_port), ("--grpc-port", grpc_port), ("--metrics-port", metrics_port)):
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ServerError(f"{name} {port!r}: expected a TCP port 1..65535 (0: pick a free one)")
    if not (timeout > 0 and math.isfinite(timeout)):
        raise ServerError(f"--timeout {timeout}: expected a positive number of seconds")
    for repo in repos:
        if not repo.is_dir() or not any(repo.glob("*/config.pbtxt")):
            raise ServerError(f"{repo}: not a model repository (expected <model>/config.pbtxt; write one with "
                              "medusa-triton)")
    check_ports_free(http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port)
    install = find_triton()
    backends = prepare_backends(install, workdir / "backends")
    http_port, grpc_port, metrics_port = (p or free_port() for p in (http_port, grpc_port, metrics_port))
    cmd = [str(install.binary), *(f"--model-repository={r.resolve()}" for r in repos),
           f"--backend-directory={backends}",
           "--http-address=127.0.0.1", f"--http-port={http_port}",
           "--grpc-address=127.0.0.1", f"--grpc-port={grpc_port}",
           "--allow-metrics=true", "--allow-gpu-metrics=false", "--metrics-address=127.0.0.1",
           f"--metrics-port={metrics_port}",
           # Python-backend shared-memory regions are named by this prefix: unique per server, so
           # several servers (parallel tests, a benchmark) can share a machine.
           f"--backend-config=python,shm-region-prefix-name=medusa_{os.getpid()}_{http_port}_",
           "--exit-on-error=true", "--strict-readiness=true", f"--log-verbose={log_verbose}",
           "--exit-timeout-secs=15"]  # unloading takes ~2 s per Python model here
    if models:
        cmd += ["--model-control-mode=explicit", *(f"--load-model={m}" for m in models)]
    log_path = workdir / "tritonserver.log"
    with open(log_path, "wb") as log:
        # Own session: a Ctrl-C in the terminal reaches us only, and we stop the server in order.
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=server_env(install), start_new_session=True, preexec_fn=_die_with_parent)
    server = RunningServer(process, http_port, grpc_port, metrics_port, log_path)
    try:
        wait_ready(server, timeout)
    except BaseException:
        stop_server(server)
        raise
    return server


def wait_ready(server: RunningServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    url = f"http://{server.http_url}/v2/health/ready"
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via an http_proxy
    while True:
        code = server.process.poll()
        if code is not None:
            raise ServerError(f"tritonserver exited with status {code} while starting; "
                              f"{server.log_summary()}")
        try:
            with direct.open(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass  # not listening yet, or models still loading
        if time.monotonic() > deadline:
            raise ServerError(f"tritonserver not ready after {timeout:.0f} s; {server.log_summary()}")
        time.sleep(0.2)


def stop_server(server: RunningServer, timeout: float = 30.0) -> int | None:
    """SIGINT (Triton's graceful shutdown: unload models, stop stubs), then SIGKILL on its group."""
    p = server.process
    if p.poll() is None:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)  # its own session: the server and its stubs only
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout)  # bounded even for a process stuck in the kernel
    return p.returncode


@contextlib.contextmanager
def running_server(repos: Path | Sequence[Path], *, http_port: int = 0, grpc_port: int = 0, metrics_port: int = 0,
                   models: Sequence[str] | None = None, log_verbose: int = 0, timeout: float = 180.0,
                   workdir: Path | None = None) -> Iterator[RunningServer]:
    """A ready server for the `with` block, stopped afterwards. The log and backend copy live in
    `workdir` (default: a temp dir removed afterwards)."""
    own = workdir is None
    repo_list = _repo_list(repos)
    bytecode_before = set(_bytecode_dirs(repo_list))
    work = Path(tempfile.mkdtemp(prefix="medusa-triton-")) if own else Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    failed = True  # until the server stopped as asked: a failure keeps the log its error message cites
    try:
        server = start_server(repo_list, work, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                              models=models, log_verbose=log_verbose, timeout=timeout)
        try:
            yield server
            failed = server.process.poll() is not None  # it died on its own while serving
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: how medusa-serve is stopped
            failed = server.process.poll() is not None
            raise
        finally:
            stop_server(server)
    finally:
        for folder in set(_bytecode_dirs(repo_list)) - bytecode_before:
            shutil.rmtree(folder, ignore_errors=True)
        if own and (not failed or not (work / "tritonserver.log").exists()):
            shutil.rmtree(work, ignore_errors=True)
        elif own:
            shutil.rmtree(work / "backends", ignore_errors=True)  # a copy of the wheel's; the log is what matters


def _repo_list(repos: Path | Sequence[Path]) -> list[Path]:
    """One repository or several, as the list tritonserver's --model-repository flags take."""
    return [Path(repos)] if isinstance(repos, (str, Path)) else [Path(r) for r in repos]


def _bytecode_dirs(repos: Sequence[Path]) -> list[Path]:
    """The __pycache__ folders beside the repositories' model.py files. The Python backend's stub
    imports model.py and writes its bytecode there, whatever PYTHONDONTWRITEBYTECODE says (its
    embedded interpreter ignores PYTHON* variables); running_server removes the ones it caused, so
    serving leaves a repository as it found it."""
    return [folder for repo in repos for folder in repo.glob("*/*/__pycache__") if folder.is_dir()]
