"""LangGraph: the prebuilt ReAct agent (``langgraph.prebuilt.create_react_agent``) over ``langchain_openai.ChatOpenAI``
with a ``run_shell`` tool and a system prompt. ``--mode invoke`` is ``graph.invoke``; ``values``, ``updates`` and
``messages`` are ``graph.stream(..., stream_mode=mode)`` consumed to the end."""

from __future__ import annotations

import argparse
import warnings
from typing import Any

from common import TASK, api_key, base_url, emit, model, run_shell
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # create_react_agent is marked deprecated in favour of langchain.agents
    from langgraph.prebuilt import create_react_agent

SYSTEM = "You are the backends probe agent. Use the run_shell tool to run shell commands for the user."

shell_tool = tool(run_shell)


def text_of(message: BaseMessage) -> str:
    content = message.content
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") if isinstance(part, dict) else str(part) for part in content)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["invoke", "values", "updates", "messages"], default="invoke")
    args = parser.parse_args()
    llm = ChatOpenAI(model=model(), base_url=base_url(), api_key=api_key())
    graph: Any = create_react_agent(llm, [shell_tool], prompt=SYSTEM)
    inputs = {"messages": [("user", TASK)]}
    messages: list[BaseMessage] = []
    chunks = 0
    if args.mode == "invoke":
        messages = graph.invoke(inputs)["messages"]
    elif args.mode == "values":
        for state in graph.stream(inputs, stream_mode="values"):
            chunks += 1
            messages = state["messages"]
    elif args.mode == "updates":
        for update in graph.stream(inputs, stream_mode="updates"):
            chunks += 1
            for node in update.values():
                messages.extend(node.get("messages", []) if isinstance(node, dict) else [])
    else:
        pieces: dict[str, Any] = {}
        for piece, _meta in graph.stream(inputs, stream_mode="messages"):
            chunks += 1
            key = piece.id or str(len(pieces))
            pieces[key] = pieces[key] + piece if key in pieces and isinstance(piece, AIMessage) else piece
        messages = list(pieces.values())
    answers = [text_of(m) for m in messages if isinstance(m, AIMessage) and not m.tool_calls]
    emit(
        final=answers[-1] if answers else "",
        system=SYSTEM,
        tool_outputs=[text_of(m) for m in messages if isinstance(m, ToolMessage)],
        kinds=[type(m).__name__ for m in messages],
        chunks=chunks,
    )


if __name__ == "__main__":
    main()
