"""Robust extraction of structured answers from free model text.

Models wrap answers in prose, code fences and tags. ``extract_json`` finds the
answer in this order and returns the first that parses:

1. the content of the last ``<answer>...</answer>`` block;
2. the last fenced code block (```json ... ``` or ``` ... ```);
3. the last top-level JSON object or array anywhere in the text (scanned
   with ``json.JSONDecoder.raw_decode`` from every ``{`` / ``[``).

Trailing commas before ``}`` / ``]`` are tolerated. Nothing found raises
``InvalidActionError`` with a message meant for the model.

``extract_choice`` reads a multiple-choice letter: a reply that is just the
letter (``B``, ``(B)``, ``B.``), ``answer: B`` / ``Answer is B``, or
``<answer>B</answer>``. Letters are upper case: ``b`` alone is not a choice.
"""

from __future__ import annotations

import json
import re
from typing import Any

from labrl.errors import InvalidActionError

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_FENCE = re.compile(r"```(?:json|JSON)?\s*\n?(.*?)```", re.DOTALL)
_TRAILING_COMMA = re.compile(r",\s*([}\]])")
_DECODER = json.JSONDecoder()


def _loads(text: str) -> Any:
    text = text.strip()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return json.loads(_TRAILING_COMMA.sub(r"\1", text))


def _scan(text: str) -> Any:
    """The last top-level JSON object/array in ``text``, or raise ValueError."""
    text = _TRAILING_COMMA.sub(r"\1", text)
    found: list[Any] = []
    pos = 0
    while pos < len(text):
        starts = [i for i in (text.find("{", pos), text.find("[", pos)) if i >= 0]
        if not starts:
            break
        start = min(starts)
        try:
            value, end = _DECODER.raw_decode(text, start)
        except json.JSONDecodeError:
            pos = start + 1
            continue
        found.append(value)
        pos = end
    if not found:
        raise ValueError("no JSON value")
    return found[-1]


def extract_json(text: str, *, hint: str = "") -> Any:
    """The structured answer in ``text`` (see the module docstring)."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidActionError(f"empty answer. {hint}".strip())
    tags = _ANSWER_TAG.findall(text)
    fences = _FENCE.findall(text)
    for block in (tags[-1] if tags else None, fences[-1] if fences else None):
        if block is None:
            continue
        try:
            return _loads(block)
        except json.JSONDecodeError:
            try:
                return _scan(block)
            except ValueError:
                continue
    try:
        return _scan(text)
    except ValueError:
        raise InvalidActionError(f"no JSON answer found in the reply. {hint}".strip()) from None


_CHOICE_PATTERNS = (
    re.compile(r"^\s*\(?([A-Z])\)?[.:]?\s*$"),
    re.compile(r"<answer>\s*\(?([A-Z])\)?\s*</answer>", re.IGNORECASE),
    re.compile(r"\banswer(?:\s+is)?\s*[:=]?\s*\(?([A-Z])\)?(?![A-Za-z0-9])", re.IGNORECASE),
)


def extract_choice(text: str, choices: str) -> str | None:
    """The chosen letter among ``choices`` (e.g. ``"ABCD"``), or None when the text names none."""
    if not isinstance(text, str):
        return None
    for pattern in _CHOICE_PATTERNS:
        matches = [m for m in pattern.findall(text) if m in choices]
        if matches:
            return matches[-1]
    return None
