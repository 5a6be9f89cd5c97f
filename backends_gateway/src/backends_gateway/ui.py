"""The gateway's page: ``GET /ui``, a self-contained HTML page (no external assets, works offline) that lists the
sessions and shows one trajectory token by token, and the token text it reads from the trajectory route
(``?tokens=1``).

The page is a shell with no data in it; everything it shows it fetches from the trainer's routes with
``Authorization: Bearer <key>``, the key read from the URL's fragment (``/ui#key=...``, which a browser never
sends to the server) or typed into the page, and kept in the tab's ``sessionStorage``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

from aiohttp import web

from backends_gateway.errors import GatewayError

__all__ = ["add_routes", "add_token_pieces", "token_pieces", "tokens_requested"]

#: ids decoded between two yields to the event loop, so a long trajectory does not hold up the harnesses' turns
_YIELD_EVERY = 2048
#: ids held back for an unfinished character at most: a UTF-8 character is 4 bytes at most, so past that the
#: bytes are not UTF-8 (a model can sample any byte) and waiting longer would only grow each decode's window
_MAX_PENDING = 8
_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def _page() -> bytes:
    return resources.files("backends_gateway").joinpath("ui/index.html").read_bytes()


def add_routes(app: web.Application) -> None:
    """Register ``GET /ui`` on ``app``."""
    page = _page()

    async def ui(request: web.Request) -> web.Response:
        # no-store: the page is tiny, and a cached copy would outlive an upgraded gateway's routes
        return web.Response(
            body=page,
            content_type="text/html",
            charset="utf-8",
            headers={
                "Cache-Control": "no-store",
                # the page loads nothing from anywhere and talks only to this gateway
                "Content-Security-Policy": _CSP,
                "Referrer-Policy": "no-referrer",
                "X-Content-Type-Options": "nosniff",
            },
        )

    app.router.add_get("/ui", ui)


def token_pieces(decode: Callable[[list[int]], str], ids: Sequence[int]) -> list[str]:
    """Each id's piece of text, such that the pieces concatenate to ``decode(ids)``.

    Ids are decoded one at a time, each beside the ids of the piece before it (a SentencePiece tokenizer drops a
    word's leading space at the start of a decode). A byte-level id that ends inside a UTF-8 character gets ``""``
    and the id that completes the character gets all of it; bytes that are not UTF-8 at all come out as ``"\ufffd"``
    as in the full decode.
    """
    return _Pieces(decode, ids).run(0, len(ids))


async def add_token_pieces(tokenizer: Any, trajectory: dict[str, Any]) -> dict[str, Any]:
    """Add ``tokens`` (:func:`token_pieces` of ``input_ids``) to each branch of a trajectory route's answer."""

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))

    for branch in trajectory["branches"]:
        ids = branch.get("input_ids")
        if ids is None:
            continue
        pieces = _Pieces(decode, ids)
        out: list[str] = []
        for start in range(0, len(ids), _YIELD_EVERY):
            out += pieces.run(start, min(start + _YIELD_EVERY, len(ids)))
            await asyncio.sleep(0)
        branch["tokens"] = out
    return trajectory


class _Pieces:
    """Incremental detokenisation: ``prefix:read`` are the ids of the last piece given out (the context the
    next id is decoded beside), ``read:`` the ids not given out yet."""

    def __init__(self, decode: Callable[[list[int]], str], ids: Sequence[int]) -> None:
        self.decode = decode
        self.ids = list(ids)
        self.prefix = 0
        self.read = 0

    def run(self, start: int, end: int) -> list[str]:
        out = []
        ids, last = self.ids, len(self.ids) - 1
        for i in range(start, end):
            before = self.decode(ids[self.prefix : self.read]) if self.read > self.prefix else ""
            text = self.decode(ids[self.prefix : i + 1])
            pending = text.endswith("\ufffd") and i < last and i + 1 - self.read < _MAX_PENDING
            if pending:  # part of a character: the rest is in the ids after it
                out.append("")
                continue
            # the context decodes differently once followed by the new ids: the new ids alone
            out.append(text[len(before) :] if text.startswith(before) else self.decode(ids[self.read : i + 1]))
            self.prefix, self.read = self.read, i + 1
        return out


def tokens_requested(request: web.Request) -> bool:
    """Whether the trajectory route was asked for ``tokens`` (``?tokens=1``; ``0`` or absent: not).

    :raises GatewayError: any other value.
    """
    raw = request.query.get("tokens", "0")
    if raw not in ("0", "1"):
        raise GatewayError(400, f"tokens must be 0 or 1, got {raw!r}", param="tokens", code="invalid_value")
    return raw == "1"
