"""Which message roles the served chat template renders, and the messages a harness sends mapped onto them.

Harnesses send roles a template may not know: OpenAI's ``developer`` (Codex sends its whole system prompt so),
a ``system`` message in the middle of the conversation (Claude Code's harness context). A template skips a role
it does not render without a word, so an accepted message could reach the model as nothing. The gateway probes
the template once at start and then, for every request, maps each message onto what the template renders or
refuses it by name:

* ``developer`` is rendered as itself where the template renders it, else as ``system``;
* a leading run of system messages (after that mapping) is one system message, joined by a blank line, where the
  template renders only the first;
* a ``system`` message after the conversation started is refused (400, "role system is not supported here...")
  where the template does not render it there: Claude Code retries without such messages on that answer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from backends_core import BackendError, Client
from backends_gateway.errors import GatewayError

__all__ = ["TemplateRoles"]

_MARK = "zqxroleprobe"


def _renders(client: Client, messages: list[dict[str, Any]], mark: str) -> bool:
    try:
        ids = client.render(messages)
    except BackendError:
        return False
    return mark in str(client.tokenizer.decode(ids, skip_special_tokens=False))


@attrs.frozen(kw_only=True)
class TemplateRoles:
    """What the template renders: ``developer`` messages (first, and after other messages), a second system
    message, a system message after the conversation started."""

    developer: bool
    second_system: bool
    system_later: bool

    @classmethod
    def probe(cls, client: Client) -> TemplateRoles:
        """Render one probe conversation per question with ``client``'s template."""
        hello = {"role": "user", "content": "hello"}
        reply = {"role": "assistant", "content": "hi"}
        return cls(
            developer=_renders(client, [{"role": "developer", "content": _MARK}, hello], _MARK)
            and _renders(client, [hello, reply, {"role": "developer", "content": _MARK}, hello], _MARK),
            second_system=_renders(
                client, [{"role": "system", "content": "first"}, {"role": "system", "content": _MARK}, hello], _MARK
            ),
            system_later=_renders(client, [hello, reply, {"role": "system", "content": _MARK}, hello], _MARK),
        )

    def adapt(self, messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """``messages`` as the template renders every one of them.

        :raises GatewayError: a system message after the conversation started, which the template does not render
            there (400, naming it).
        """
        out: list[Mapping[str, Any]] = []
        leading = True
        for i, message in enumerate(messages):
            role = message.get("role")
            if role == "developer" and not self.developer:
                message = {**message, "role": "system"}
                role = "system"
            if role not in ("system", "developer"):
                leading = False
                out.append(message)
                continue
            if leading:
                if out and not self.second_system:
                    out[-1] = {**out[-1], "content": _joined(out[-1].get("content"), message.get("content"))}
                else:
                    out.append(message)
                continue
            if not self.system_later:
                raise GatewayError(
                    400,
                    f"messages[{i}]: role {role} is not supported after the conversation started by the served "
                    "model's chat template (it would not reach the model): send it before the first user message",
                    param=f"messages[{i}].role",
                    code="unsupported_role",
                )
            out.append(message)
        return out


def _joined(first: Any, second: Any) -> Any:
    """Two system contents as one, a blank line between (text parts stay parts)."""
    if isinstance(first, str) and isinstance(second, str):
        return f"{first}\n\n{second}"
    parts = []
    for content in (first, second):
        if isinstance(content, str):
            parts.append({"type": "text", "text": content})
        else:
            parts.extend(content or ())
    return parts
