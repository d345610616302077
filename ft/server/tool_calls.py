"""Tool calls in Qwen's format: parsing the generated text, streaming, and the grammar that forces
one (tool_choice "required" or a named function).

A call is a block `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; a reply may hold
several, and text around them. A block whose body is not a JSON object with a string `name` (and
`arguments` an object, or absent) is not a call: it stays in the content as generated.
"""

from __future__ import annotations

import json
import re
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# NOTE: the body holds no `<tool_call>` (a stray opening before a block is text, not its start)
_BLOCK = re.compile(re.escape(OPEN) + r"((?:(?!" + re.escape(OPEN) + r").)*?)" + re.escape(CLOSE), re.S)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(body: str) -> dict | None:
    """The OpenAI tool call of a block's body, or None when it is malformed."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": new_call_id(), "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a whole reply: the content is the text outside the parsed blocks
    (stripped; None when empty and there are calls), malformed blocks left in it verbatim."""
    calls, parts, at = [], [], 0
    for m in _BLOCK.finditer(text):
        call = _call(m.group(1).strip())
        if call is None:
            continue
        parts.append(text[at : m.start()])
        at = m.end()
        calls.append(call)
    if not calls:
        return text, []
    parts.append(text[at:])
    content = "".join(parts).strip()
    return content or None, calls


class ToolCallStream:
    """Splits a streamed reply into content deltas and complete tool calls: text that may still
    open a block (a prefix of `<tool_call>` at the end) is held back until it is decided."""

    def __init__(self) -> None:
        self._buf = ""
        self.calls = 0  # tool calls emitted so far (their indexes)

    def feed(self, delta: str) -> list[tuple[str, object]]:
        """Events ("content", text) and ("tool_call", call dict with its index) released by `delta`."""
        self._buf += delta
        out: list[tuple[str, object]] = []
        while True:
            start = self._buf.find(OPEN)
            if start < 0:
                # NOTE: whitespace after a call is held (it is dropped if nothing else follows)
                keep = _partial_open(self._buf)
                if self.calls and not self._buf[: len(self._buf) - keep].strip():
                    keep = len(self._buf)
                text, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                if text:
                    out.append(("content", text))
                return out
            end = self._buf.find(CLOSE, start)
            if end < 0:  # a block still open: what precedes it is content
                if self._buf[:start].strip() or (start and not self.calls):
                    out.append(("content", self._buf[:start]))
                self._buf = self._buf[start:]  # (whitespace between calls is dropped)
                return out
            start = self._buf.rfind(OPEN, start, end)  # the block's own opening (a stray one before is text)
            call = _call(self._buf[start + len(OPEN) : end].strip())
            block_end = end + len(CLOSE)
            if call is None:  # malformed: the whole block is content
                out.append(("content", self._buf[:block_end]))
            else:
                if self._buf[:start].strip():
                    out.append(("content", self._buf[:start]))
                call["index"] = self.calls
                self.calls += 1
                out.append(("tool_call", call))
            self._buf = self._buf[block_end:]

    def finish(self) -> list[tuple[str, object]]:
        """What is left at the end (an unfinished block, a held prefix): content."""
        rest, self._buf = self._buf, ""
        if not rest or (self.calls and not rest.strip()):
            return []
        return [("content", rest)]


def _partial_open(text: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `<tool_call>`."""
    for n in range(min(len(text), len(OPEN) - 1), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def tool_call_grammar(tools: list[dict], name: str | None = None, parallel: bool = True) -> str:
    """A Lark grammar (llguidance's dialect, with `%json` schemas) of one tool-call block, or one
    or more separated by newlines when `parallel`, for the tools allowed (`name`: only that one)."""
    options = []
    for tool in tools:
        fn = tool["function"]
        if name is not None and fn["name"] != name:
            continue
        params = fn.get("parameters") or {"type": "object"}
        options.append({"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})
    if not options:
        raise ValueError(f"tool_choice: no tool named {name!r} among the request's tools")
    schema = dict(options[0]) if len(options) == 1 else {"anyOf": options}
    schema["x-guidance"] = {"whitespace_flexible": False}  # compact JSON: no padding forever
    # NOTE: Lark string literals take JSON-style escapes; \n is a newline
    call = 'call: "<tool_call>\\n" body "\\n</tool_call>"\nbody: %json ' + json.dumps(schema)
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return start + "\n" + call + "\n"
