"""Turn the model's raw assistant text into an ``Action``.

Tool calls are written the way Hermes/Qwen chat templates teach models to::

    <tool_call>{"name": "simulate", "arguments": {"phase_id": "mp-123"}}</tool_call>

Parsing never raises: a block that is not valid JSON (including JSON nested
past the recursion limit or an integer too long to convert), or lacks a string
``name`` or an object ``arguments``, leaves ``Action.parse_error`` set, and the
env answers ``invalid_action`` with that message so the model can correct
itself. Call ids are positional (``call_0``, ``call_1``...), so the same text
always parses to the same action.
"""

from __future__ import annotations

import json
import re

from labrl.envs.types import Action, ToolCall
from labrl.untrusted_text import UntrustedJSONError, loads

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CALL_CLOSE) + r"|$)", re.DOTALL)


def format_tool_call(name: str, arguments: dict) -> str:
    """The text a model writes to call ``name`` (used by scripted policies and SFT data)."""
    return f"{TOOL_CALL_OPEN}{json.dumps({'name': name, 'arguments': arguments}, sort_keys=True)}{TOOL_CALL_CLOSE}"


def parse_action(text: str) -> Action:
    calls: list[ToolCall] = []
    errors: list[str] = []
    for index, match in enumerate(_BLOCK.finditer(text)):
        body = match.group(1).strip()
        if not match.group(0).endswith(TOOL_CALL_CLOSE):
            errors.append(f"tool call {index} is missing its closing {TOOL_CALL_CLOSE}")
            continue
        try:
            payload = loads(body)
        except UntrustedJSONError as exc:  # also nesting too deep, integers too long
            errors.append(f"tool call {index} is not valid JSON ({exc.msg})")
            continue
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            errors.append(f'tool call {index} must be an object with a string "name"')
            continue
        arguments = payload.get("arguments", {})
        if not isinstance(arguments, dict):
            errors.append(f'tool call {index}: "arguments" must be an object, got {type(arguments).__name__}')
            continue
        calls.append(ToolCall(id=f"call_{index}", name=payload["name"], arguments=arguments))
    return Action(text=text, tool_calls=tuple(calls), parse_error="; ".join(errors) or None)
