"""A throwaway PostgreSQL server for tests and benchmarks, from the machine's installed server binaries (Debian's
``postgresql-15``: ``/usr/lib/postgresql/15/bin``; ``BACKENDS_PG_BIN`` names another folder)::

    with PostgresServer() as pg:
        dsn = pg.create_database("t1")  # postgresql://postgres:<password>@127.0.0.1:<port>/t1

``initdb`` in a new temporary folder, the server started on a free loopback port with its unix socket in that
folder, stopped (``pg_ctl -m fast``) and the folder removed on exit. Connections over the unix socket are trusted;
over TCP they need the password (SCRAM), so a DSN carries one. PostgreSQL refuses to run as root: as root, the
folder belongs to the ``postgres`` user and the server's commands run as that user (``runuser``). Settings are the
server's defaults (``fsync=on``, ``synchronous_commit=on``) unless ``settings`` changes them.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

__all__ = ["PostgresServer", "PostgresUnavailable", "find_pg_bin"]

SUPERUSER = "postgres"


class PostgresUnavailable(RuntimeError):
    """The server binaries are missing, or the server did not start (its log is in the message)."""


def find_pg_bin() -> Path:
    """The folder holding ``initdb``, ``pg_ctl`` and ``psql``: ``BACKENDS_PG_BIN``, else the newest
    ``/usr/lib/postgresql/*/bin``, else the folder of ``pg_ctl`` on ``PATH``.

    :raises PostgresUnavailable: none has them.
    """
    candidates: list[Path] = []
    if os.environ.get("BACKENDS_PG_BIN"):
        candidates.append(Path(os.environ["BACKENDS_PG_BIN"]))
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: _major(p.parent.name), reverse=True)
    candidates += versions
    on_path = shutil.which("pg_ctl")
    if on_path is not None:
        candidates.append(Path(on_path).parent)
    for folder in candidates:
        if all((folder / name).is_file() for name in ("initdb", "pg_ctl", "psql")):
            return folder
    raise PostgresUnavailable(
        "PostgreSQL server binaries (initdb, pg_ctl, psql) not found in "
        f"{[str(c) for c in candidates] or '/usr/lib/postgresql/*/bin or PATH'}: install Debian's postgresql-15 "
        "(apt-get install postgresql-15) or set BACKENDS_PG_BIN to the folder holding them"
    )


def _major(text: str) -> int:
    return int(text) if text.isdigit() else -1


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class PostgresServer:
    """One PostgreSQL server of its own (see the module's docstring).

    :param settings: server settings (``-c name=value``) beside the defaults.
    :param start_deadline_s: how long ``initdb`` plus the start may take.
    """

    def __init__(self, *, settings: Mapping[str, str] | None = None, start_deadline_s: float = 120.0) -> None:
        self.bin = find_pg_bin()
        self.settings = dict(settings or {})
        self.start_deadline_s = start_deadline_s
        self.password = secrets.token_urlsafe(12)
        self.root: Path | None = None
        self.port = 0
        self._as_postgres = os.geteuid() == 0

    @property
    def data(self) -> Path:
        assert self.root is not None, "the server is not started"
        return self.root / "data"

    def dsn(self, database: str = "postgres", *, password: bool = True) -> str:
        """A ``postgresql://`` URL of ``database`` over TCP (``password=False``: without the password, refused)."""
        secret = f":{self.password}" if password else ""
        return f"postgresql://{SUPERUSER}{secret}@127.0.0.1:{self.port}/{database}"

    # -- running the server's commands ---------------------------------------------------------------------

    def _command(self, argv: Sequence[str]) -> list[str]:
        if self._as_postgres:  # the server refuses to run as root
            return ["runuser", "-u", SUPERUSER, "--", *argv]
        return list(argv)

    def _run(self, argv: Sequence[str], *, timeout: float, what: str) -> str:
        try:
            done = subprocess.run(
                self._command(argv), cwd=self.root, capture_output=True, text=True, timeout=max(timeout, 1.0)
            )
        except subprocess.TimeoutExpired:
            raise PostgresUnavailable(f"{what} took more than {timeout:.0f} s{self._log_tail()}") from None
        if done.returncode != 0:
            raise PostgresUnavailable(
                f"{what} failed (exit {done.returncode}): {done.stderr.strip() or done.stdout.strip()}"
                f"{self._log_tail()}"
            )
        return done.stdout

    def _log_tail(self) -> str:
        log = self.root / "server.log" if self.root is not None else None
        if log is None or not log.is_file():
            return ""
        return "\nserver log:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-20:])

    def psql(self, sql: str, *, database: str = "postgres", timeout: float = 60.0) -> str:
        """Run ``sql`` through ``psql`` over the unix socket (trusted), stopping at the first error; its output."""
        return self._run(
            [
                str(self.bin / "psql"), "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-h", str(self.root),
                "-p", str(self.port), "-U", SUPERUSER, "-d", database, "-c", sql,
            ],
            timeout=timeout,
            what=f"psql {sql[:60]!r}",
        )  # fmt: skip

    def create_database(self, name: str) -> str:
        """A new empty database; its DSN (with the password)."""
        if not name.replace("_", "").isalnum():
            raise ValueError(f"database name {name!r}: letters, digits and _ only")
        self.psql(f'CREATE DATABASE "{name}"')
        return self.dsn(name)

    # -- life -----------------------------------------------------------------------------------------------

    def start(self) -> PostgresServer:
        """``initdb`` and start; returns once a connection answers.

        :raises PostgresUnavailable: the binaries are missing, or the server did not answer in time.
        """
        deadline = time.monotonic() + self.start_deadline_s
        self.root = Path(tempfile.mkdtemp(prefix="backends-pg-"))
        try:
            if self._as_postgres:
                shutil.chown(self.root, user=SUPERUSER, group=None)
            secret = self.root / "pwfile"
            secret.write_text(self.password + "\n")
            if self._as_postgres:
                shutil.chown(secret, user=SUPERUSER)
            self._run(
                [
                    str(self.bin / "initdb"), "-D", str(self.data), "-U", SUPERUSER, f"--pwfile={secret}",
                    "-A", "trust", "--auth-host=scram-sha-256", "-E", "UTF8", "--locale=C", "--no-sync",
                ],
                timeout=deadline - time.monotonic(),
                what="initdb",
            )  # fmt: skip
            secret.unlink()
            for attempt in range(3):  # another process may take the free port between the probe and the bind
                self.port = _free_port()
                options = [
                    f"-p {self.port}", f"-k {self.root}", "-c listen_addresses=127.0.0.1",
                    *(f"-c {k}={v}" for k, v in self.settings.items()),
                ]  # fmt: skip
                try:
                    self._run(
                        [
                            str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.root / "server.log"),
                            "-w", "-t", str(max(1, int(deadline - time.monotonic()))), "-o", " ".join(options),
                            "start",
                        ],
                        timeout=deadline - time.monotonic() + 5,
                        what=f"pg_ctl start on port {self.port}",
                    )  # fmt: skip
                    break
                except PostgresUnavailable:
                    if attempt == 2 or time.monotonic() > deadline or self._running():
                        raise
            self._wait_answering(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def _running(self) -> bool:
        return self.root is not None and (self.data / "postmaster.pid").is_file()

    def _wait_answering(self, deadline: float) -> None:
        """``pg_ctl -w`` returned once the server accepted connections: one query proves it answers."""
        answer = self.psql("SELECT 1", timeout=max(1.0, deadline - time.monotonic())).strip()
        if answer != "1":
            raise PostgresUnavailable(f"the server answered {answer!r} to SELECT 1{self._log_tail()}")

    def stop(self) -> None:
        """Stop the server (fast shutdown; killed if it does not stop) and remove its folder."""
        root = self.root
        if root is None:
            return
        try:
            if self._running():
                try:
                    self._run(
                        [str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop"],
                        timeout=70,
                        what="pg_ctl stop",
                    )
                except PostgresUnavailable:
                    self._kill()
        finally:
            self.root = None
            shutil.rmtree(root, ignore_errors=True)

    def _kill(self) -> None:
        """SIGKILL the server this object started (its postmaster's pid from its own pid file)."""
        with contextlib.suppress(OSError, ValueError, IndexError):
            pid = int((self.data / "postmaster.pid").read_text().splitlines()[0])
            os.kill(pid, signal.SIGKILL)

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
