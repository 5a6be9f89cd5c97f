"""A scripted engine for real agent programs: each reply is computed from the prompt the gateway rendered, so a
harness we do not control (its own system prompt, tools, retries, side requests) is driven through a known tool
loop on the same template, parsers and bridging as a real engine.

:class:`ShellLoop` is the loop every harness test runs: the model says something, then calls the harness's own
shell tool; calls the same command again (a harness must keep the two calls apart); then answers in text.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from backends_core import GenerateRequest, GenerateResult, Grammar, hookimpl
from scripted_stream import StreamingScript

__all__ = ["AgentEngine", "ShellLoop", "last_task", "tools_in"]

END = "<|im_end|>"
_TOOLS = re.compile(r"<tools>\n(.*?)\n</tools>", re.S)


def tools_in(prompt: str) -> list[dict[str, Any]]:
    """The tools the template rendered into ``prompt`` (the tiny Qwen3 template: one JSON object a line between
    ``<tools>`` and ``</tools>``), each as ``{"name", "parameters"}``."""
    found = _TOOLS.search(prompt)
    if found is None:
        return []
    out = []
    for line in found.group(1).split("\n"):
        tool = json.loads(line)
        fn = tool.get("function", tool)
        out.append({"name": fn["name"], "parameters": fn.get("parameters") or fn.get("input_schema") or {}})
    return out


def last_task(prompt: str) -> str:
    """The prompt from its last real user message on (not a tool response): the current task's part of it."""
    at = 0
    for found in re.finditer(r"<\|im_start\|>user\n", prompt):
        if not prompt.startswith("<tool_response>", found.end()) and not prompt.startswith(
            "\n<tool_response>", found.end()
        ):
            at = found.start()
    return prompt[at:]


class ShellLoop:
    """Say something and call the shell tool; call the same command again; answer. A prompt offering no shell
    tool (a title request, a summary) is answered with :attr:`side_reply`.

    :param command: the command the model runs (twice).
    :param shell_names: tool names taken as the harness's shell tool, most preferred first.
    """

    SHELL_NAMES = ("Bash", "shell", "exec_command", "run_shell_command", "bash", "shell_command", "run_shell")

    def __init__(self, command: str = "echo backends-probe", *, shell_names: tuple[str, ...] | None = None) -> None:
        self.command = command
        self.shell_names = shell_names or self.SHELL_NAMES
        self._runs = itertools.count(1)
        self.side_reply = "A short answer." + END
        self.answer = "Done: the command printed its output twice." + END

    def shell(self, tools: list[dict[str, Any]]) -> dict[str, Any] | None:
        by_name = {tool["name"]: tool for tool in tools}
        for name in self.shell_names:
            if name in by_name:
                return by_name[name]
        return None

    def arguments(self, tool: Mapping[str, Any]) -> dict[str, Any]:
        """The shell tool's arguments for :attr:`command`, from its schema: an array ``command`` gets
        ``["bash", "-lc", command]``, a string ``command`` / ``cmd`` the command."""
        props = (tool.get("parameters") or {}).get("properties") or {}
        for key in ("command", "cmd"):
            if key in props:
                kind = props[key].get("type")
                return {key: ["bash", "-lc", self.command] if kind == "array" else self.command}
        raise AssertionError(f"the shell tool {tool['name']!r} takes neither command nor cmd: {props}")

    def call(self, tool: Mapping[str, Any], before: str) -> str:
        body = json.dumps({"name": tool["name"], "arguments": self.arguments(tool)})
        return f"{before}\n<tool_call>\n{body}\n</tool_call>{END}"

    def __call__(self, prompt: str) -> str:
        tool = self.shell(tools_in(prompt))
        if tool is None:
            return self.side_reply
        done = last_task(prompt).count("<tool_response>")
        if done == 0:  # each run's first reply its own, as sampled ones are: runs of one task differ from here on
            return self.call(tool, f"I will run it (run {next(self._runs)}).")
        if done == 1:
            return self.call(tool, "Once more, to be sure.")
        return self.answer


class AgentEngine(StreamingScript):
    """:class:`~scripted_stream.StreamingScript` whose replies come from ``policy(prompt text)``; keeps each
    prompt's text (:attr:`prompts`) beside the requests.

    It honours what harnesses ask of a real engine by default: stop strings (the reply ends before the first
    one), and a grammar of tool calls (``tool_choice`` "required": the reply is its calls only, what an engine
    constrained to the grammar could sample)."""

    @hookimpl
    def sampling_features(self) -> frozenset[str]:
        return frozenset({"stop", "structured.grammar"})

    def _result(self, raw: str, request: GenerateRequest, server_url: str) -> GenerateResult:
        stops = [(raw.find(s), s) for s in request.sampling.stop if s in raw]
        if not stops:
            return super()._result(raw, request, server_url)
        at, stop = min(stops)
        return attrs.evolve(super()._result(raw[:at], request, server_url), finish_reason="stop", stop_reason=stop)

    def __init__(self, tokenizer: Any, policy: Callable[[str], str]) -> None:
        super().__init__(tokenizer, [])
        self.policy = policy
        self.prompts: list[str] = []

    async def _next(self, request: GenerateRequest) -> str:
        self.requests.append(request)
        self.started += 1
        self.entered.set()
        await self.gate.wait()
        prompt = self.tokenizer.decode(list(request.prompt_ids), skip_special_tokens=False)
        self.prompts.append(prompt)
        reply = self.policy(prompt)
        if isinstance(request.sampling.structured, Grammar) and "<tool_call>" in reply:
            calls = reply[reply.index("<tool_call>") : reply.rindex("</tool_call>") + len("</tool_call>")]
            reply = calls + END
        return reply
