"""vLLM's error responses: ``{"error": {"message", "type", "param", "code"}}`` (and FastAPI's ``{"detail"}``)."""

from __future__ import annotations

from typing import Any

import httpx

from backends_testkit import emulator

__all__ = ["HttpError", "bad_request", "error_body", "internal_error", "json_response", "not_found", "worker_error"]


def json_response(status: int, body: Any) -> httpx.Response:
    """A JSON response, serialised compactly like FastAPI's ``JSONResponse``."""
    return httpx.Response(status, json=body)


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class HttpError(emulator.HttpError):
    """Raised inside a handler; ``status`` with the JSON ``body`` is its response."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(json_response(status, body), f"HTTP {status}: {body}")
        self.status = status
        self.body = body


def bad_request(message: str, param: str | None = None, type_: str = "BadRequestError") -> HttpError:
    """A 400 from a vLLM handler (``param`` names the offending field, when vLLM says)."""
    return HttpError(400, error_body(message, type_, 400, param))


def not_found(message: str, param: str | None = None) -> HttpError:
    return HttpError(404, error_body(message, "NotFoundError", 404, param))


def internal_error(message: str, type_: str = "InternalServerError") -> HttpError:
    return HttpError(500, error_body(message, type_, 500))


def worker_error(reason: str) -> HttpError:
    """The 500 vLLM answers when a ``collective_rpc`` call fails in the worker."""
    return internal_error(
        f"Call to collective_rpc method failed: Worker failed with error '{reason}', "
        "please check the stack trace above for the root cause"
    )
