"""Tools in the Hermes format, for chat templates that do not render ``tools`` themselves.

NousResearch's Hermes 2 Pro function calling (Hermes-Function-Calling), which
Qwen2.5's and many other chat templates use as their own tool format: a
system message lists the function definitions in ``<tools></tools>`` and asks
for each call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
an assistant message's calls are written so in its content, and a ``tool``
message (a call's result) becomes a user turn ``<tool_response>...</tool_response>``.
The messages are then plain role/content pairs that any chat template renders
(SmolLM2's, say, which has no tools). Whatever the template, the gateway reads
the answer in this format (:mod:`gateway.tools`).
"""

from __future__ import annotations

import json

__all__ = ["SYSTEM", "hermes_messages"]

SYSTEM = ("You are a function calling AI model. You are provided with function signatures within <tools></tools> "
          "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions "
          "about what values to plug into functions. Here are the available tools: <tools>{tools}</tools> "
          "For each function call return a json object with function name and arguments within <tool_call>"
          "</tool_call> XML tags as follows:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
          "<args-dict>}}\n</tool_call>")
"""The Hermes 2 Pro system prompt (NousResearch/Hermes-Function-Calling); ``{tools}``: one JSON definition a line."""


def hermes_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """``messages`` (chat-template dicts: ``role``, ``content``, an assistant's ``tool_calls`` in
    OpenAI's shape with mapping arguments) as role/content pairs: the tools' system prompt first
    (merged into a leading system message) when ``tools`` is given, calls as ``<tool_call>`` blocks
    after the content, ``tool`` messages as ``<tool_response>`` user turns."""
    out = []
    for m in messages:
        role, content = m["role"], m["content"]
        calls = m.get("tool_calls") or ()
        if calls:
            blocks = ["<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": c["function"][
                "arguments"]}, ensure_ascii=False) + "\n</tool_call>" for c in calls]
            content = "\n".join(([content] if content else []) + blocks)
        if role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if tools:
        listed = "\n".join(json.dumps(t) for t in tools)
        system = SYSTEM.format(tools="\n" + listed + "\n")
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out
