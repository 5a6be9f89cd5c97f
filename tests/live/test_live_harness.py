"""The live-server harness itself (``backends_testkit.live``), without any inference server.

Not marked ``live``: it needs no real server, only a Python that can create a venv and a loopback port.
"""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from backends_testkit import live
from backends_testkit.live import ServerProcess, ServerStartError, VenvInstallError, ensure_venv, probe_client


@pytest.fixture
def venvs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BACKENDS_SERVER_VENVS", str(tmp_path / "venvs"))
    return tmp_path / "venvs"


def _ensure(**kwargs: Any) -> Path:
    return ensure_venv("demo", python=sys.executable, venv_args=["--without-pip"], **kwargs)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_ensure_venv_caches_rebuilds_on_recipe_change_and_redoes_failed_installs(venvs: Path) -> None:
    write = ["python", "-c", "import pathlib; pathlib.Path('{venv}', 'made').write_text('1')"]
    venv = _ensure(install=[write])
    assert venv == venvs / "demo"
    assert (venv / "made").read_text() == "1" and (venv / "bin" / "python").exists()
    assert "$ " in (venv / "install.log").read_text()

    (venv / "sentinel").write_text("kept")
    assert _ensure(install=[write]) == venv
    assert (venv / "sentinel").exists(), "an up-to-date venv was rebuilt"

    _ensure(install=[write], marker_extra="constraints v2")
    assert not (venv / "sentinel").exists(), "a changed recipe did not rebuild the venv"

    fail = ["python", "-c", "print('the install broke here'); raise SystemExit(3)"]
    with pytest.raises(VenvInstallError, match="exited with 3") as info:
        _ensure(install=[write, fail])
    assert "the install broke here" in str(info.value)
    (venv / "sentinel").write_text("half-built")
    _ensure(install=[write])
    assert not (venv / "sentinel").exists(), "a half-finished install was reused"


_SERVER = textwrap.dedent(
    """
    import http.server, subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("child", child.pid, flush=True)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
    """
)


def test_server_process_waits_until_ready_and_stops_its_whole_process_group(tmp_path: Path) -> None:
    script = tmp_path / "server.py"
    script.write_text(_SERVER)
    log = tmp_path / "server.log"
    with ServerProcess([sys.executable, str(script), "{port}"], name="toy", log_path=log) as server:
        assert server.wait_ready("/health", timeout=30) == server.url == f"http://127.0.0.1:{server.port}"
        assert server.ready_after is not None and server.running()
        with probe_client() as http:
            assert http.get(server.url + "/health").status_code == 200
        child = int(next(line for line in log.read_text().splitlines() if line.startswith("child")).split()[1])
        assert _pid_alive(child)
    assert not server.running()
    deadline = time.monotonic() + 10
    while _pid_alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _pid_alive(child), "the server's child survived stop()"
    assert server.stop() is not None  # idempotent


def test_server_process_that_dies_raises_with_its_log_tail(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import sys; print('cannot bind: model missing'); sys.exit(7)"]
    with (
        ServerProcess(argv, name="dying", log_path=tmp_path / "dying.log") as server,
        pytest.raises(ServerStartError, match="exited with code 7") as info,
    ):
        server.wait_ready(timeout=30)
    assert "cannot bind: model missing" in str(info.value)


def test_server_process_that_never_gets_ready_times_out_with_its_log_tail(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import time; print('still loading', flush=True); time.sleep(600)"]
    with (
        ServerProcess(argv, name="slow", log_path=tmp_path / "slow.log") as server,
        pytest.raises(ServerStartError, match="did not answer 200") as info,
    ):
        server.wait_ready(timeout=1.0, interval=0.1)
    assert "still loading" in str(info.value)
    assert not server.running()


def test_env_overrides_and_placeholders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIVE_TEST_DROP_ME", "x")
    argv = [
        sys.executable,
        "-c",
        "import os; print('env', os.environ.get('PORT_IS'), os.environ.get('LIVE_TEST_DROP_ME'))",
    ]
    server = ServerProcess(
        argv, name="env", log_path=tmp_path / "env.log", env={"PORT_IS": "{port}", "LIVE_TEST_DROP_ME": None}
    )
    server.start()
    assert server.wait(timeout=30) == 0
    assert server.stop() == 0
    assert f"env {server.port} None" in server.log_tail()
    assert live.log_tail(tmp_path / "missing.log") == ""
