"""Robust extraction of structured answers from free model text.

Models wrap answers in prose, code fences and tags. ``extract_json`` finds the
answer in this order and returns the first that parses:

1. the content of the last ``<answer>...</answer>`` block;
2. the last fenced code block (```json ... ``` or ``` ... ```);
3. the last top-level JSON object or array anywhere in the text (scanned
   with ``json.JSONDecoder.raw_decode`` from every ``{`` / ``[``).

Hostile text is bounded: blocks are found in linear time
(``labrl.untrusted_text``); the scan in 3 stops with ``InvalidActionError``
once its decodes have read ``SCAN_WORK_FACTOR`` times the text (an
unclosed-bracket flood would otherwise cost quadratic time), and each decode
is handed a window of the text around what it reads, never the whole text
(see ``_decode_at``); JSON nested past
the recursion limit or holding an integer of more than 4,300 digits is
``InvalidActionError``, never another exception.

Trailing commas before ``}`` / ``]`` are tolerated. Nothing found raises
``InvalidActionError`` with a message meant for the model.

``extract_choice`` reads a multiple-choice letter: a reply that is just the
letter (``B``, ``(B)``, ``B.``), ``answer: B`` / ``Answer is B``, or
``<answer>B</answer>``. Letters are upper case: ``b`` alone is not a choice.
"""

from __future__ import annotations

import re
from typing import Any

from labrl.errors import InvalidActionError
from labrl.untrusted_text import UntrustedJSONError, last_block, loads, raw_decode

_FENCE = re.compile(r"```(?:json|JSON)?\s*")
_FENCE_CLOSE = "```"
_TRAILING_COMMA = re.compile(r",\s*([}\]])")
_VALUE_START = re.compile(r"[{\[]")

# The fallback scan tries a decode from every "{" / "[" left to right. A failed
# decode may read far before failing (an object left open), so the scan's cost
# is the sum of what its decodes read: bounded by SCAN_WORK_FACTOR * len(text)
# (plus a constant), past which the reply is refused. Ordinary replies read each
# character about once (measured <= 3x on nested prose+JSON replies).
SCAN_WORK_FACTOR = 8
SCAN_WORK_MIN = 65_536

# A decode from `start` is handed text[start : start + width], width doubling from FIRST_WINDOW
# until the decode stops LOOKAHEAD short of the window's end. A failed decode's error
# (json.JSONDecodeError) builds its line and column by scanning the string it was handed from its
# first character to the failure, so handed the whole text every failed attempt would cost its
# offset: a flood of unclosed brackets, each failing at once, was quadratic (240k "{": 9 s).
# Handed a window, an attempt that reads r characters costs at most
#     max(2 * FIRST_WINDOW, 4 * (r + LOOKAHEAD))
# (the windows of one attempt sum to at most twice the last, which is under 2 * (r + LOOKAHEAD)).
FIRST_WINDOW = 32
LOOKAHEAD = 16  # the decoder peeks at most this far past where it stops (a literal: "-Infinity")


class _Unparsable(ValueError):
    """The block holds no JSON value; try the next place."""


def _loads(text: str) -> Any:
    text = text.strip()
    try:
        return loads(text)
    except UntrustedJSONError:
        return loads(_TRAILING_COMMA.sub(r"\1", text))


def _scan(text: str, counter: list[int] | None = None) -> Any:
    """The last top-level JSON object/array in ``text``; ``_Unparsable`` if none.

    ``counter`` (a one-item list), when given, accumulates the characters the
    decodes read (tests assert the bound).
    """
    text = _TRAILING_COMMA.sub(r"\1", text)
    budget = max(SCAN_WORK_MIN, SCAN_WORK_FACTOR * len(text))
    work = 0
    found: list[Any] = []
    pos = 0
    while True:
        start_match = _VALUE_START.search(text, pos)
        if start_match is None:
            break
        start = start_match.start()
        try:
            value, end = _decode_at(text, start)
        except UntrustedJSONError as exc:
            if exc.pos is None:  # nested too deeply / integer too long: not a usable answer
                raise InvalidActionError(f"the reply's JSON cannot be read: {exc.msg}") from None
            work += exc.reached + 1
            pos = start + 1
        else:
            found.append(value)
            work += end - start
            pos = end
        if counter is not None:
            counter[0] = work
        if work > budget:
            raise InvalidActionError(
                "the reply is too malformed to search for a JSON answer (unclosed brackets); "
                "put the answer alone in <answer>...</answer>"
            )
    if not found:
        raise _Unparsable("no JSON value")
    return found[-1]


def _decode_at(text: str, start: int) -> tuple[Any, int]:
    """``raw_decode(text, start)``'s value and end, handed windows of the text (see ``FIRST_WINDOW``).

    A failure is the window's ``UntrustedJSONError``: ``pos`` and ``reached`` count from
    ``start``. The window's answer is the whole text's: a value that closes inside the window
    read nothing after it, and a failure more than ``LOOKAHEAD`` before the window's end did not
    look at what follows. An error without a position (nesting, integer length) is taken from
    the rest of the text, so its message is the one the whole text gives.
    """
    width = FIRST_WINDOW
    while True:
        window = text[start : start + width]
        try:
            value, end = raw_decode(window, 0)
        except UntrustedJSONError as exc:
            if start + width >= len(text):
                raise
            if exc.pos is None:
                width = len(text) - start
                continue
            assert exc.reached is not None  # set whenever pos is
            if exc.reached + LOOKAHEAD < len(window):
                raise
            width *= 2
        else:
            return value, start + end


def _last_fence(text: str) -> str | None:
    return last_block(text, _FENCE, _FENCE_CLOSE)


def extract_json(text: str, *, hint: str = "") -> Any:
    """The structured answer in ``text`` (see the module docstring)."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidActionError(f"empty answer. {hint}".strip())
    for block in (last_block(text, "<answer>", "</answer>", ignore_case=True), _last_fence(text)):
        if block is None:
            continue
        try:
            return _loads(block)
        except UntrustedJSONError as exc:
            if exc.pos is None:  # nested too deeply / integer too long: the model's fault, say so
                raise InvalidActionError(
                    f"the answer's JSON cannot be read: {exc.msg}. {hint}".strip()
                ) from None
            try:
                return _scan(block)
            except _Unparsable:
                continue
    try:
        return _scan(text)
    except _Unparsable:
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
