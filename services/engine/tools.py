"""Tool calling on chat: the tools in the prompt, ``tool_choice`` enforced by a grammar,
and the model's calls parsed out of its text.

Prompt. A chat template that takes ``tools`` itself (Qwen2.5, Qwen3, Llama 3.1 and most
recent ones) gets them as Hugging Face's ``apply_chat_template(tools=...)`` passes them.
A template that does not (SmolLM2's) gets them folded into plain messages, the Hermes
format Qwen uses: the function signatures in ``<tools>`` in the system message, earlier
calls as ``<tool_call>`` blocks in the assistant's text, tool results as a user turn of
``<tool_response>`` blocks.

Choice (as vLLM does). ``auto``: the model writes text and/or ``<tool_call>{"name": ...,
"arguments": {...}}</tool_call>`` blocks, parsed by :func:`parse_hermes`. ``required``:
the output must be a JSON array of ``{"name", "parameters"}`` objects over the given tools
(:func:`required_schema`); a named function: the output is that function's arguments,
following its parameter schema. Both are ordinary structured outputs, so they stay exact
under speculation. ``none``: the tools are left out of the prompt.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"

HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", f"call_{uuid.uuid4().hex[:24]}")


def template_takes_tools(template: str | None) -> bool:
    """Whether a chat template renders ``tools`` itself."""
    return bool(template) and "tools" in template


def fold_into_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, str]]:
    """Messages with tools, calls and results as plain text, for a template that only
    knows system / user / assistant turns of text."""
    out: list[dict[str, str]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            blocks = [_call_block(c.get("function") or {}) for c in m["tool_calls"]]
            content = "\n".join(([content] if content else []) + blocks)
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool"):  # consecutive results share one turn
                out[-1]["content"] += "\n" + block
                continue
            out.append({"role": "user", "content": block, "_tool": "1"})
            continue
        out.append({"role": role, "content": content})
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        prompt = HERMES_SYSTEM.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{prompt}"
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def _call_block(function: dict[str, Any]) -> str:
    arguments = function.get("arguments") or "{}"
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        pass  # shown as the string it is
    call = {"name": function.get("name", ""), "arguments": arguments}
    return f"{OPEN}\n{json.dumps(call, ensure_ascii=False)}\n{CLOSE}"


# -- tool_choice as a schema ------------------------------------------------------------
def parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object"}


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """``tool_choice="required"``: a non-empty array of calls to the given tools."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": parameters(t),
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


# -- parsing the output -----------------------------------------------------------------
def _dumps(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _hermes_call(body: str) -> ToolCall | None:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    return ToolCall(call["name"], _dumps(call.get("arguments", call.get("parameters", {}))))


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """``auto``: the text before the first ``<tool_call>`` and the calls (a block that
    does not parse stays in the text; an unclosed last block is parsed if it can be)."""
    parser = HermesStream()
    content = "".join(p for p in parser.feed(text) if isinstance(p, str))
    content += "".join(p for p in parser.finish() if isinstance(p, str))
    return (content.strip() or None), parser.calls


def parse_required(text: str) -> list[ToolCall]:
    """``required``: the JSON array the grammar held the output to."""
    try:
        items = json.loads(text)
    except ValueError:
        return []  # cut short by max_tokens
    return [ToolCall(i["name"], _dumps(i.get("parameters", {}))) for i in items]


class HermesStream:
    """``auto`` while streaming: text out as it comes, except what may be the start of
    a ``<tool_call>`` block, which is held until the block closes and parses."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self._held = ""  # text not yet given out: a block or what may open one
        self._in_call = False

    def feed(self, text: str) -> list[str | ToolCall]:
        self._held += text
        out: list[str | ToolCall] = []
        while True:
            if self._in_call:
                end = self._held.find(CLOSE)
                if end < 0:
                    return self._text(out)
                body, self._held = self._held[:end], self._held[end + len(CLOSE) :]
                self._in_call = False
                out.append(self._call_or_text(body))
                continue
            start = self._held.find(OPEN)
            if start >= 0:
                if start:
                    out.append(self._held[:start])
                self._held, self._in_call = self._held[start + len(OPEN) :], True
                continue
            keep = _partial_suffix(self._held, OPEN)
            if len(self._held) > keep:
                out.append(self._held[: len(self._held) - keep])
                self._held = self._held[len(self._held) - keep :]
            return self._text(out)

    def finish(self) -> list[str | ToolCall]:
        held, self._held = self._held, ""
        if not held:
            return []
        return self._text([self._call_or_text(held, closed=False) if self._in_call else held])

    def _call_or_text(self, body: str, closed: bool = True) -> str | ToolCall:
        call = _hermes_call(body.strip())
        if call is None:  # not a call after all
            return OPEN + body + (CLOSE if closed else "")
        self.calls.append(call)
        return call

    def _text(self, parts: list[str | ToolCall]) -> list[str | ToolCall]:
        """Drop the blank text between and after calls."""
        if not self.calls:
            return [p for p in parts if p != ""]
        return [p for p in parts if not isinstance(p, str) or p.strip()]


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
