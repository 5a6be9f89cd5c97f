"""What cross-cutting plugins see through the ``observe`` hook."""

from __future__ import annotations

from typing import Literal

import attrs

__all__ = ["Event"]

EventKind = Literal["generate", "teacher_logprobs", "admin", "bridge", "fleet"]


@attrs.frozen(kw_only=True)
class Event:
    """One finished operation.

    :ivar kind: the family of the operation.
    :ivar operation: hook or bridge step name (``"post_generate"``, ``"admin_pause"``, ``"bridge"``); for
        ``kind="fleet"`` (``client.fleet``): ``"join"``, ``"leave"``, ``"catch_up"`` (``detail["failures"]``
        counts the failed ones) or ``"discover"``.
    :ivar backend: the backend's name.
    :ivar server: base URL of the server involved, if any.
    :ivar duration_s: wall time of the operation.
    :ivar error: the exception it raised, or ``None`` on success.
    :ivar detail: small operation-specific facts (token counts, bridge failure reason).
    """

    kind: EventKind
    operation: str
    backend: str
    server: str | None
    duration_s: float
    error: BaseException | None = None
    detail: dict[str, object] = attrs.field(factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None
