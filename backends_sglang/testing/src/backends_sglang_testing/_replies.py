"""SGLang's response forms, as the 0.5.23 captures show them.

* ``/generate`` contract gate (serde): ``400 {"error": "<serde text>"}``;
* request dataclass / tokenizer-manager ``ValueError``: ``400 {"error": {"message": ...}}``;
* other request-model validation: ``400 {"object": "error", "message", "type": "Bad Request", "code": 400}``;
* FastAPI: ``404 {"detail": "Not Found"}``, ``405 {"detail": "Method Not Allowed"}``;
* auth middleware: ``401 {"error": "Unauthorized"}``;
* plain-text answers (``/flush_cache``) and empty ones (``/health``, ``/abort_request``) without a content type.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

__all__ = [
    "HttpError",
    "contract_error",
    "empty",
    "json_reply",
    "message_error",
    "text_reply",
    "validation_error",
]


def json_reply(status: int, body: Any) -> httpx.Response:
    """A JSON answer (``null`` included)."""
    return httpx.Response(status, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


def text_reply(status: int, text: str) -> httpx.Response:
    """A plain body without a content type, as SGLang's bare ``Response(content=...)``."""
    return httpx.Response(status, content=text.encode())


def empty(status: int = 200) -> httpx.Response:
    return httpx.Response(status)


class HttpError(Exception):
    """Raised inside a route handler; becomes its response."""

    def __init__(self, response: httpx.Response, reason: str) -> None:
        super().__init__(reason)
        self.response = response


def contract_error(text: str) -> HttpError:
    """The ``/generate`` schema gate's 400: ``{"error": "<serde-style text>"}``."""
    return HttpError(json_reply(400, {"error": text}), text)


def message_error(message: str, status: int = 400) -> HttpError:
    """A request ``ValueError``: ``{"error": {"message": ...}}``."""
    return HttpError(json_reply(status, {"error": {"message": message}}), message)


def validation_error(message: str) -> HttpError:
    """A request-model validation failure of the admin routes."""
    body = {"object": "error", "message": message, "type": "Bad Request", "code": 400}
    return HttpError(json_reply(400, body), message)
