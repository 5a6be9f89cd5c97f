"""SGLang's response forms, as the 0.5.23 captures show them.

* ``/generate`` contract gate (serde): ``400 {"error": "<serde text>"}``;
* request dataclass / tokenizer-manager ``ValueError``: ``400 {"error": {"message": ...}}``;
* other request-model validation: ``400 {"object": "error", "message", "type": "Bad Request", "code": 400}``;
* FastAPI: ``404 {"detail": "Not Found"}``, ``405 {"detail": "Method Not Allowed"}``;
* auth middleware: ``401 {"error": "Unauthorized"}``;
* plain-text answers (``/flush_cache``) and empty ones (``/health``, ``/abort_request``) without a content type.
"""

from __future__ import annotations

from backends_testkit.emulator import HttpError, empty, json_reply, text_reply

__all__ = [
    "HttpError",
    "contract_error",
    "empty",
    "json_reply",
    "message_error",
    "text_reply",
    "validation_error",
]


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
