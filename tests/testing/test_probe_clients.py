"""The live tests' raw probe clients survive a server that drops a kept-alive connection under the next request."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import httpx
import pytest

from backends_testkit.live import async_probe_client, probe_client

ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok"


def _serve(listener: socket.socket) -> None:
    """Answers the first request of every connection, promising keep-alive, then closes the connection as soon
    as a second request arrives on it: a router's idle timer firing just as the client reuses the connection."""
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            requests = 0
            buffer = b""
            while True:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                buffer += chunk
                while b"\r\n\r\n" in buffer:
                    _, buffer = buffer.split(b"\r\n\r\n", 1)
                    requests += 1
                    if requests > 1:
                        break
                    conn.sendall(ANSWER)
                if requests > 1:
                    break


@pytest.fixture
def dropping_server() -> Iterator[str]:
    listener = socket.create_server(("127.0.0.1", 0))
    thread = threading.Thread(target=_serve, args=(listener,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() the thread is blocked in
        listener.close()
        thread.join(10)


def test_a_pooled_client_loses_the_second_request_on_such_a_server(dropping_server: str) -> None:
    with httpx.Client(trust_env=False, timeout=10) as http:
        assert http.get(dropping_server + "/a").status_code == 200
        with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
            http.get(dropping_server + "/b")


def test_the_probe_client_sends_every_request_on_a_fresh_connection(dropping_server: str) -> None:
    with probe_client(10) as http:
        assert [http.get(f"{dropping_server}/{n}").text for n in range(5)] == ["ok"] * 5


async def test_the_async_probe_client_sends_every_request_on_a_fresh_connection(dropping_server: str) -> None:
    async with async_probe_client(10) as http:
        assert [(await http.get(f"{dropping_server}/{n}")).text for n in range(5)] == ["ok"] * 5
