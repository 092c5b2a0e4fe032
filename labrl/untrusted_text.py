"""Parse text a model wrote: JSON and tagged blocks, in linear time, never raising anything unexpected.

Model output is hostile input. ``json.loads`` on it can raise more than
``JSONDecodeError``: ``RecursionError`` for ``[[[[...`` nested past the
interpreter's recursion limit, and ``ValueError`` for an integer of more than
``sys.get_int_max_str_digits()`` (4,300) digits. Both would escape a caller that
catches ``JSONDecodeError`` only and crash the run (or be scored as an env
error). Here every failure is one ``UntrustedJSONError`` (a ``ValueError``)
whose message can be shown to the model.

Cost: ``loads`` and ``raw_decode`` are linear in what they read.
``last_block`` finds the last ``open ... close`` block the way
``re.findall(open + "(.*?)" + close)[-1]`` would, but stops at the first
opening that has no closing after it: a regex retries from every later
opening, each scan running to the end of the text, which is quadratic
(``<answer>`` repeated without ``</answer>``).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

_DECODER = json.JSONDecoder()


class UntrustedJSONError(ValueError):
    """Model-written JSON that cannot be used; ``msg`` is meant for the model.

    ``pos`` is where the decoder gave up (None when it is not a syntax error:
    nesting too deep, integer too long); ``reached`` is how far it read, which
    for an unterminated string is the end of the text, not ``pos``.
    """

    def __init__(self, msg: str, pos: int | None = None, reached: int | None = None) -> None:
        super().__init__(msg, pos, reached)
        self.msg = msg
        self.pos = pos
        self.reached = pos if reached is None else reached

    def __str__(self) -> str:
        return self.msg


def _translate(exc: Exception) -> UntrustedJSONError:
    if isinstance(exc, json.JSONDecodeError):
        reached = len(exc.doc) if exc.msg.startswith("Unterminated string") else exc.pos
        return UntrustedJSONError(f"{exc.msg} at char {exc.pos}", exc.pos, reached)
    if isinstance(exc, RecursionError):
        return UntrustedJSONError("JSON nested too deeply")
    # int('9' * 5000): "Exceeds the limit (4300 digits) for integer string conversion"
    return UntrustedJSONError(f"JSON value rejected: {exc}")


def loads(text: str) -> Any:
    """``json.loads`` that raises only ``UntrustedJSONError``."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise _translate(exc) from None


def raw_decode(text: str, start: int) -> tuple[Any, int]:
    """``JSONDecoder.raw_decode(text, start)`` that raises only ``UntrustedJSONError``."""
    try:
        return _DECODER.raw_decode(text, start)
    except (ValueError, RecursionError) as exc:
        raise _translate(exc) from None


def _as_pattern(tag: str | re.Pattern[str], flags: int) -> re.Pattern[str]:
    return tag if isinstance(tag, re.Pattern) else re.compile(re.escape(tag), flags)


def iter_blocks(
    text: str, open_tag: str | re.Pattern[str], close_tag: str | re.Pattern[str], *, ignore_case: bool = False
) -> Iterator[tuple[str, bool]]:
    """Yield ``(body, closed)`` for each ``open_tag ... close_tag`` block, left to right, in linear time.

    Blocks are matched like a non-greedy regex: an opening pairs with the next
    closing. An opening with no closing after it yields its remainder with
    ``closed=False`` and ends the scan (no later opening can be closed either).
    """
    flags = re.IGNORECASE if ignore_case else 0
    opener, closer = _as_pattern(open_tag, flags), _as_pattern(close_tag, flags)
    pos = 0
    while True:
        opened = opener.search(text, pos)
        if opened is None:
            return
        closed = closer.search(text, opened.end())
        if closed is None:
            yield text[opened.end() :], False
            return
        yield text[opened.end() : closed.start()], True
        pos = closed.end()


def last_block(
    text: str, open_tag: str | re.Pattern[str], close_tag: str | re.Pattern[str], *, ignore_case: bool = False
) -> str | None:
    """The body of the last closed ``open_tag ... close_tag`` block, or None (linear time)."""
    last = None
    for body, closed in iter_blocks(text, open_tag, close_tag, ignore_case=ignore_case):
        if closed:
            last = body
    return last


# Above this many characters a reply is parsed in a worker thread: parsing is
# linear, but 100+ KB of regex and JSON work still holds the loop for
# milliseconds, and a thread lets the interpreter switch back to the loop
# every ``sys.getswitchinterval()`` (5 ms).
LARGE_TEXT_CHARS = 16_384


async def parse_off_loop(parse: Callable[[str], T], text: str) -> T:
    """``parse(text)``, in a worker thread when ``text`` is longer than ``LARGE_TEXT_CHARS``."""
    if len(text) <= LARGE_TEXT_CHARS:
        return parse(text)
    return await asyncio.to_thread(parse, text)
