"""The Server-Sent Events reader (``sse._EventReader``, split at blank lines in one pass per piece when the stream
is the usual one) against a line-by-line reader kept here as the reference: whatever the lines (``\\r\\n`` ends,
comments, other fields, several data lines, data without a space) and however the body is cut into pieces, the
events and the error for a body ending inside an event are the reference's. A body in a content coding is still
decoded before it is read."""

from __future__ import annotations

import gzip
from collections.abc import AsyncGenerator

import httpx
import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from backends_core import ResponseParseError, Server
from backends_core.sse import _EventReader
from backends_testkit.emulator import StreamedBody

SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def reference(pieces: list[bytes]) -> tuple[list[bytes], str | None]:
    """The events of ``pieces`` read line by line, and the message of the error at the end of the body (if any)."""
    events: list[bytes] = []
    pending = b""
    data: list[bytes] = []
    for chunk in pieces:
        pending += chunk
        while True:
            cut = pending.find(b"\n")
            if cut < 0:
                break
            line, pending = pending[:cut].rstrip(b"\r"), pending[cut + 1 :]
            if not line:
                if data:
                    events.append(b"\n".join(data))
                    data = []
                continue
            if line.startswith(b"data:"):
                value = line[5:]
                data.append(value[1:] if value.startswith(b" ") else value)
    if data or pending.strip():
        snippet = (b"\n".join(data) or pending)[:200].decode("utf-8", "replace")
        return events, f"the body ended inside an event (not an event stream?): {snippet!r}"
    return events, None


def read(pieces: list[bytes]) -> tuple[list[bytes], str | None]:
    reader = _EventReader("http://s/gen")
    events: list[bytes] = []
    for piece in pieces:
        events += reader.feed(piece)
    try:
        reader.end()
    except ResponseParseError as exc:
        return events, exc.detail
    return events, None


LINES = st.sampled_from(
    [
        b'data: {"a":1}',
        b"data:[1,2]",
        b"data: ",
        b"data:",
        b"data:  two spaces",
        b": a comment",
        b"event: message",
        b"id: 7",
        b"retry: 10",
        b"",
        b"   ",
        b"data: [DONE]",
        b"data: x\r",
        b"\r",
        b"data: caf\xc3\xa9",
    ]
)
ENDS = st.sampled_from([b"\n", b"\r\n", b"\n\n", b"\r\n\r\n"])


@st.composite
def bodies(draw: st.DrawFn) -> list[bytes]:
    """A body of SSE-like lines cut into pieces at random places (the last line may be left unfinished)."""
    lines = draw(st.lists(st.tuples(LINES, ENDS), max_size=12))
    body = b"".join(line + end for line, end in lines)
    if draw(st.booleans()):
        body += draw(LINES)
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=6)))
    return [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]


@SETTINGS
@given(bodies())
def test_the_reader_gives_the_reference_events_and_error_whatever_the_lines_and_pieces(pieces: list[bytes]) -> None:
    assert read(pieces) == reference(pieces)


@pytest.mark.parametrize(
    "pieces",
    [
        [b"data: 1\n\ndata: 2\n\n"],  # the usual stream, one piece
        [b"data: 1\n", b"\ndata: 2\n\n"],  # an event's blank line in the next piece
        [b"data: 1\r\n\r\n", b"data: 2\n\n"],  # CRLF, then LF
        [b"data: 1\n\n", b"data: 2\r\n", b"\r\n"],
        [b"data: 1\ndata: 2\n\n"],  # two data lines: one event
        [b"data: 1\n\n\n\ndata: 2\n\n"],  # extra blank lines
        [b"data: 1\n\n\ndata: 2\n\n"],
        [b"data: 1\n\n", b"data: 2"],  # ends inside an event
        [b"data: 1\n\n", b"data: 2\n"],  # ends before the event's blank line
        [b"data: 1\n\n", b"  "],  # trailing whitespace is no event
        [b"<html>surprise</html>"],
    ],
)
def test_edge_cases_match_the_reference(pieces: list[bytes]) -> None:
    assert read(pieces) == reference(pieces)


async def test_a_body_in_a_content_coding_is_decoded_before_it_is_read() -> None:
    body = gzip.compress(b'data: {"a":1}\n\ndata: [2]\n\ndata: [DONE]\n\n')

    async def pieces() -> AsyncGenerator[bytes, None]:
        for at in range(0, len(body), 7):
            yield body[at : at + 7]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-encoding": "gzip"}, stream=StreamedBody(pieces()))

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    server = Server(base_url="http://s", admin_url="http://s", data_client=client, admin_client=client)
    async with server.stream("POST", "/gen", json_body={}) as stream:
        assert [event async for event in stream.json_events()] == [{"a": 1}, [2]]
