"""The tiny models' Jinja chat template: renders conversations the way Qwen3's template does.

Behaviour (what a Qwen3 renderer must reproduce):

* ``tools`` go into the system turn (after the system message, if any) as one JSON object per line
  inside ``<tools></tools>``, followed by the tool-call format instructions.
* An assistant turn is ``<|im_start|>assistant\\n`` + content, then one
  ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` block per tool call (separated
  from the content and from each other by a newline).
* Reasoning (``reasoning_content``, or the part of ``content`` before ``</think>``) is rendered as
  ``<think>\\n...\\n</think>\\n\\n`` only for assistant turns after the last real user query; the last
  message, if it is such an assistant turn, always gets a think block (possibly empty).
* Consecutive ``tool`` messages become one user turn of ``<tool_response>`` blocks.
* ``add_generation_prompt`` appends ``<|im_start|>assistant\\n``; ``enable_thinking=false`` then
  appends an empty ``<think>\\n\\n</think>\\n\\n``.
"""

from __future__ import annotations

__all__ = ["CHAT_TEMPLATE", "VL_CHAT_TEMPLATE"]

_TOOLS_HEADER = (
    r"# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    r"You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FOOTER = (
    r"\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    r"within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    r"{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
)

_TEMPLATE_LINES = (
    # -- the system turn, with the tool list when tools are given
    "{%- set has_system = messages and messages[0].role == 'system' -%}",
    "{%- if tools -%}",
    r"{{- '<|im_start|>system\n' -}}",
    r"{%- if has_system -%}{{- messages[0].content + '\n\n' -}}{%- endif -%}",
    '{{- "' + _TOOLS_HEADER + '" -}}',
    r"{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}",
    '{{- "' + _TOOLS_FOOTER + r'<|im_end|>\n" -}}',
    "{%- elif has_system -%}",
    r"{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}",
    "{%- endif -%}",
    # -- index of the last real user query (a user turn that is not a wrapped tool response)
    "{%- set state = namespace(last_query=messages | length - 1) -%}",
    "{%- for message in messages -%}",
    "{%- set text = message.content if message.content is string else '' -%}",
    "{%- if message.role == 'user' and not (text.startswith('<tool_response>')"
    " and text.endswith('</tool_response>')) -%}",
    "{%- set state.last_query = loop.index0 -%}",
    "{%- endif -%}",
    "{%- endfor -%}",
    # -- the turns
    "{%- for message in messages -%}",
    "{%- set content = message.content if message.content is string else '' -%}",
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) -%}",
    r"{{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' -}}",
    "{%- elif message.role == 'assistant' -%}",
    "{%- set reasoning = '' -%}",
    "{%- if message.reasoning_content is string -%}",
    "{%- set reasoning = message.reasoning_content -%}",
    "{%- elif '</think>' in content -%}",
    r"{%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') -%}",
    r"{%- set content = content.split('</think>')[-1].lstrip('\n') -%}",
    "{%- endif -%}",
    r"{{- '<|im_start|>assistant\n' -}}",
    "{%- if loop.index0 > state.last_query and (loop.last or reasoning) -%}",
    r"{{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') -}}",
    "{%- else -%}",
    "{{- content -}}",
    "{%- endif -%}",
    "{%- for call in message.tool_calls or [] -%}",
    r"{%- if content or not loop.first -%}{{- '\n' -}}{%- endif -%}",
    "{%- set fn = call.function if call.function is defined else call -%}",
    r"{{- '<tool_call>\n{\"name\": \"' + fn.name + '\", \"arguments\": ' -}}",
    "{%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}",
    r"{{- '}\n</tool_call>' -}}",
    "{%- endfor -%}",
    r"{{- '<|im_end|>\n' -}}",
    "{%- elif message.role == 'tool' -%}",
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}",
    r"{{- '\n<tool_response>\n' + content + '\n</tool_response>' -}}",
    r"{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}",
    "{%- endif -%}",
    "{%- endfor -%}",
    # -- the generation prompt
    "{%- if add_generation_prompt -%}",
    r"{{- '<|im_start|>assistant\n' -}}",
    r"{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}"
    "{%- endif -%}",
    "{%- endif -%}",
)

CHAT_TEMPLATE = "\n".join(_TEMPLATE_LINES)
"""Jinja source of the chat template (stored in ``tokenizer_config.json``)."""


VISION_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
"""What the vision-language template writes for each image part (Qwen2-VL style; exactly one pad per image)."""

_VL_CONTENT_LINES = (
    # list content: text parts as text, each image part as one placeholder (vLLM sees the loop over
    # ``message.content`` and passes OpenAI-style parts)
    "{%- set parts = namespace(text='') -%}",
    "{%- if message.content is string -%}",
    "{%- set parts.text = message.content -%}",
    "{%- elif message.content is iterable and message.content is not mapping -%}",
    "{%- for part in message.content -%}",
    "{%- if part.type == 'text' -%}",
    "{%- set parts.text = parts.text + part.text -%}",
    "{%- elif part.type in ['image', 'image_url'] -%}",
    "{%- set parts.text = parts.text + '" + VISION_PLACEHOLDER + "' -%}",
    "{%- endif -%}",
    "{%- endfor -%}",
    "{%- endif -%}",
    "{%- set content = parts.text -%}",
)


def _vl_template_lines() -> tuple[str, ...]:
    text_only = "{%- set content = message.content if message.content is string else '' -%}"
    if _TEMPLATE_LINES.count(text_only) != 1:
        raise RuntimeError("the Qwen3 template changed: its per-turn content line is not where expected")
    index = _TEMPLATE_LINES.index(text_only)
    return _TEMPLATE_LINES[:index] + _VL_CONTENT_LINES + _TEMPLATE_LINES[index + 1 :]


VL_CHAT_TEMPLATE = "\n".join(_vl_template_lines())
"""The Qwen3 template whose turns also take list content: ``text`` parts are written as text and every
``image`` / ``image_url`` part as ``<|vision_start|><|image_pad|><|vision_end|>`` (one pad: the server expands
it). A system message or tool response must still be a string."""
