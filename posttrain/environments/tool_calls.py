"""Tool calls as models write them and as chat templates read them.

`parse_tool_calls` reads the calls of a model's answer (Hermes tags, or a bare JSON call as Llama
3.x and Mistral write them); `ToolCall.message` gives a call in the OpenAI message form that
templates read from an assistant message's `tool_calls`; `tool_call_ids` names the calls; `tool_result_text` runs one and gives what the model reads
back (`call_pickled_tool`: in a child process). Used by
the tool environments (`posttrain.environments.custom`) and by the data formats, which turn tool
calls written as text (LLaMA-Factory's ShareGPT `function_call` turns) into that form. No torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import string
from dataclasses import dataclass, field
from typing import Any

_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
# Markers some templates put before a bare JSON call, when they survive decoding.
_BARE_CALL_PREFIXES = ("<|python_tag|>", "[TOOL_CALLS]")
# Mistral's templates refuse any other tool call id; the others take any string.
_CALL_ID = re.compile(r"[A-Za-z0-9]{9}")
_ID_ALPHABET = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ToolCall:
    """One tool call of a model's turn. `error` says why it cannot run (a malformed call, shown
    to the model); `name` is then what could be read of it, possibly ""."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    id: str | None = None  # the id the model wrote with the call (Mistral's format has one)
    error: str | None = None

    def message(self, call_id: str) -> dict[str, Any]:
        """The call in the OpenAI message format that chat templates read from an assistant
        message's `tool_calls`."""
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def tool_call_ids(calls: list[ToolCall], seed: str) -> list[str]:
    """An id per call: the model's own when it wrote a valid one, else 9 letters and digits
    derived from `seed` (the turn) and the call's position, so reruns give the same ids and
    no two calls of a conversation share one. Nine alphanumerics is the one shape every
    template accepts (Mistral's reject any other)."""
    ids = []
    for i, call in enumerate(calls):
        if call.id is not None and _CALL_ID.fullmatch(call.id) and call.id not in ids:  # a repeated one is replaced
            ids.append(call.id)
            continue
        n = int.from_bytes(hashlib.sha1(f"{seed}\0{i}".encode()).digest()[:8], "big")
        ids.append("".join(_ID_ALPHABET[(n // len(_ID_ALPHABET) ** k) % len(_ID_ALPHABET)] for k in range(9)))
    return ids


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls of `text`, malformed ones included (with their `error`).

    Two formats: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` anywhere in the text
    (Hermes: Qwen2.5, Qwen3), or, without those tags, a whole answer that is one JSON call object
    or a list of them (Llama 3.1-3.3 `{"name": ..., "parameters": {...}}`, Mistral
    `[{"name": ..., "arguments": {...}, "id": ...}]`; their marker tokens are special and dropped
    in decoding, or stripped here). "parameters" is read as "arguments", and arguments written as
    a JSON string are decoded; a tagged call cut off by the token limit is read to the end of the
    text. A bare JSON answer without a "name" and "arguments"/"parameters" is an answer, not a call.
    """
    tagged = _TOOL_CALL.findall(text)
    if not tagged:
        return _bare_calls(text)
    return [_read_tagged(body) for body in tagged]


def without_tool_calls(text: str) -> str:
    """`text` less the calls `parse_tool_calls` reads from it whole (a malformed one stays, as the
    only record of what the model wrote): the content of an assistant message whose `tool_calls`
    hold them, which a chat template writes after it (as TRL's parsed turns have it). Kept in the
    content too, every rendering of the conversation held each call twice."""
    if not _TOOL_CALL.search(text):
        return "" if _bare_calls(text) else text
    return _TOOL_CALL.sub(lambda m: m[0] if _read_tagged(m[1]).error else "", text).strip()


# What json.loads raises on a model's text: JSONDecodeError, and beyond it a ValueError for an
# integer of over 4300 digits and a RecursionError for ~1000 nested brackets, which a degenerate
# output writes too (they crashed the step, in the driver with a tool time limit).
_NOT_JSON = (ValueError, RecursionError)


def _read_tagged(body: str) -> ToolCall:
    try:
        call = json.loads(body.strip())
    except _NOT_JSON as e:
        reason = e.msg if isinstance(e, json.JSONDecodeError) else type(e).__name__ + ": " + str(e)[:100]
        return ToolCall("", error=f"malformed tool call, not JSON ({reason})")
    return _read_call(call)


def _bare_calls(text: str) -> list[ToolCall]:
    body = text.strip()
    for prefix in _BARE_CALL_PREFIXES:
        body = body.removeprefix(prefix).strip()
    if not body.startswith(("{", "[")):
        return []
    try:
        found = json.loads(body)
    except _NOT_JSON:
        return []
    objs = found if isinstance(found, list) else [found]
    looks_like_calls = objs and all(isinstance(o, dict) and "name" in o and ("arguments" in o or "parameters" in o)
                                    for o in objs)
    return [_read_call(o) for o in objs] if looks_like_calls else []


def _read_call(call: Any) -> ToolCall:
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall("", error='malformed tool call, expected {"name": ..., "arguments": {...}}')
    name, call_id = call["name"], call.get("id") if isinstance(call.get("id"), str) else None
    args = call.get("arguments", call.get("parameters", {}))
    if isinstance(args, str):
        with contextlib.suppress(*_NOT_JSON):
            args = json.loads(args)
    if not isinstance(args, dict):
        return ToolCall(name, id=call_id, error=f"malformed tool call to {name}: its arguments must be an object")
    return ToolCall(name, args, call_id)


def tool_result_text(fn: Any, name: str, arguments: dict[str, Any]) -> str:
    """What the model reads back from calling tool `name` (`fn`) with `arguments`: the result, as
    JSON unless it is a string, or what went wrong, which is the model's to see and no environment
    error (SystemExit too: `USER_CODE_ERRORS`, whose module needs torch; a result JSON cannot
    write, a dict with tuple keys, was one)."""
    try:
        result = fn(**arguments)
        return result if isinstance(result, str) else json.dumps(result, default=_json_value)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the tool's failure, shown to the model
        return f"error: {name} raised {type(e).__name__}: {e}"


def call_pickled_tool(blob: bytes, name: str, arguments: dict[str, Any]) -> str:
    """`tool_result_text` in the child process of a tool with a time limit, of the tool pickled by
    value in `blob` (cloudpickle: its file is not importable in the child). Text comes back: an
    exception or a result of a class from the tool's file would not unpickle in the parent, and
    the model read a MaybeEncodingError about pickling instead of the tool's error."""
    import pickle

    return tool_result_text(pickle.loads(blob), name, arguments)


def _json_value(value: Any) -> Any:
    """What JSON cannot write of a tool's result: a NumPy or torch scalar or array as its numbers
    (as text, np.int64(3) reached the model as "3", quoted), anything else as its text."""
    tolist = getattr(value, "tolist", None)
    return tolist() if callable(tolist) else str(value)
