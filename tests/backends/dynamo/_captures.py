"""Access to the real Dynamo captures copied into tests/fixtures/wire (from ../shared/wire at the time of writing):
``dynamo`` is the 1.6.1 frontend with the mocker, ``dynamo-vllm`` the frontend with Dynamo's vLLM worker."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "wire"


def capture(name: str, kind: str = "dynamo") -> dict[str, Any]:
    """A capture file: ``{"request": ..., "status": ..., "response" | "sse_events" | "response_text": ...}``."""
    data: dict[str, Any] = json.loads((FIXTURES / kind / f"{name}.json").read_text())
    return data


def request_body(cap: dict[str, Any]) -> Any:
    """The request body (some captures store it directly under ``request``)."""
    request = cap["request"]
    return request["body"] if "method" in request else request


def request_path(cap: dict[str, Any], default: str) -> str:
    """The captured request's path (``default`` for captures that did not record the URL)."""
    request = cap["request"]
    return urlsplit(str(request["url"])).path if "url" in request else default


def sse_text(name: str, kind: str = "dynamo") -> str:
    """A captured event stream: a ``.sse`` file, or the ``raw`` text / ``sse_events`` of a JSON capture."""
    path = FIXTURES / kind / f"{name}.sse"
    if path.is_file():
        return path.read_text()
    cap = capture(name, kind)
    if "raw" in cap:
        return str(cap["raw"])
    events = [e if e == "[DONE]" else json.dumps(e) for e in cap["sse_events"]]
    return "".join(f"data: {e}\n\n" for e in events)
