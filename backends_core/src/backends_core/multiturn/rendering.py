"""Chat-template rendering with transformers."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from backends_core.errors import ConfigError, InvalidRequestError, RenderError
from backends_core.images import Image
from backends_core.multiturn.messages import content_items

__all__ = ["content_format", "encode", "load_tokenizer", "render_text", "template_messages"]


@functools.lru_cache(maxsize=16)
def load_tokenizer(name_or_path: str) -> Any:
    """Load a transformers tokenizer from a local directory (or the local HF cache), never the network.

    Cached per path: building a fast tokenizer costs hundreds of milliseconds.

    :raises ConfigError: nothing loadable is there.
    """
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
    except Exception as exc:
        where = (
            "directory" if Path(name_or_path).is_dir() else "name (not a local directory; the hub is never contacted)"
        )
        raise ConfigError([f"cannot load tokenizer from {where} {name_or_path!r}: {exc} @ $.tokenizer"]) from exc
    if not getattr(tok, "chat_template", None):
        raise ConfigError([f"tokenizer {name_or_path!r} has no chat_template @ $.tokenizer"])
    return tok


def _template_source(tokenizer: Any, tools: Sequence[Mapping[str, Any]] | None) -> str | None:
    """The chat template ``apply_chat_template`` would use (a tokenizer may hold several, by name)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):
        template = template.get("tool_use") if tools and "tool_use" in template else template.get("default")
    return template if isinstance(template, str) else None


@functools.lru_cache(maxsize=32)
def _iterates_content(template: str) -> bool:
    """Whether ``template`` loops over a message's content (``for part in message.content``, ``message['content']``,
    a filtered or sliced one, or a variable named ``content``, as in templates whose macro takes the content)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes as nodes

    class Generation(jinja2.ext.Extension):
        """Parses transformers' ``{% generation %}`` blocks (assistant masks) as their bodies."""

        tags = {"generation"}  # noqa: RUF012 (jinja2's Extension declares it as an instance variable)

        def parse(self, parser: Any) -> list[nodes.Node]:
            next(parser.stream)
            body: list[nodes.Node] = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return body

    try:
        tree = jinja2.Environment(extensions=[jinja2.ext.loopcontrols, Generation]).parse(template)
    except jinja2.TemplateError:
        return False

    def is_content(node: nodes.Node | None) -> bool:
        while isinstance(node, nodes.Filter | nodes.Test) or (
            isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)
        ):
            node = node.node
        if isinstance(node, nodes.Name):
            return node.name == "content"
        if isinstance(node, nodes.Getattr):
            return node.attr == "content"
        return isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == "content"

    return any(is_content(loop.iter) for loop in tree.find_all(nodes.For))


def content_format(tokenizer: Any, tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """How the chat template takes content parts, as vLLM's chat route decides it: ``"openai"`` when the template
    iterates over a message's content (it gets the text parts), else ``"string"`` (it gets their texts joined
    with ``"\n"``)."""
    template = _template_source(tokenizer, tools)
    return "openai" if template is not None and _iterates_content(template) else "string"


def template_messages(
    messages: Sequence[Mapping[str, Any]], fmt: str, *, where: str = "messages"
) -> list[dict[str, Any]]:
    """``messages`` as the chat template sees them: content parts reduced to their text (see
    :mod:`backends_core.multiturn.messages`), joined with ``"\n"`` for a ``"string"`` template and for tool
    results (which vLLM flattens for every template), kept as ``{"type": "text"}`` parts for an ``"openai"`` one,
    where each image becomes an ``{"type": "image"}`` part (the template writes its placeholder).

    :raises InvalidRequestError: a part that is neither text nor an image, a malformed part, or an image where the
        template would drop it (a ``"string"`` template, a tool result).
    """
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        m = dict(m)
        if isinstance(content, list | tuple):
            items = content_items(content, f"{where}[{i}].content")
            flat = fmt == "string" or m.get("role") == "tool"
            if flat and any(isinstance(x, Image) for x in items):
                why = (
                    "a tool result's content is flattened to text"
                    if fmt != "string"
                    else ("the chat template reads content as a string")
                )
                raise InvalidRequestError(
                    f"{where}[{i}].content holds an image, which this chat template cannot place ({why})"
                )
            if flat:
                m["content"] = "\n".join(x for x in items if isinstance(x, str))
            else:
                m["content"] = [
                    {"type": "image"} if isinstance(x, Image) else {"type": "text", "text": x} for x in items
                ]
        out.append(m)
    return out


def render_text(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """Apply the tokenizer's chat template and return the text. Content parts reach the template as the
    engine's own chat route hands them over (:func:`template_messages`).

    :raises RenderError: the template rejected the messages.
    :raises InvalidRequestError: a content part that is not text.
    """
    if not messages:
        raise RenderError("messages is empty")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise RenderError(f"messages[{i}] must be a mapping with a string 'role', got {m!r}")
    if any(isinstance(m.get("content"), list | tuple) for m in messages):
        plain = template_messages(messages, content_format(tokenizer, tools))
    else:
        plain = [dict(m) for m in messages]
    try:
        text = tokenizer.apply_chat_template(
            plain,
            tools=[dict(t) for t in tools] if tools else None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **dict(chat_template_kwargs or {}),
        )
    except Exception as exc:
        raise RenderError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(text, str):
        raise RenderError(f"chat template returned {type(text).__name__}, expected str")
    return text


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` exactly as written (special-token strings become their ids; nothing added)."""
    return list(tokenizer.encode(text, add_special_tokens=False))
