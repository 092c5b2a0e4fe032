"""Take secrets out of text before it is logged or put in an error message.

A server may echo what it was sent: a 401 body that quotes the request's
``Authorization`` header, a proxy's error page listing headers. Every piece
of a remote answer that reaches a log line or an exception goes through
``redact`` first, with the secrets the caller holds. It removes

- each given secret value, wherever it appears (exact match, any context);
- whatever follows ``Bearer``, and the value of an ``Authorization``,
  ``api_key`` / ``api-key`` / ``apikey``, ``x-api-key``, ``token`` or
  ``access_token`` field (``: value``, ``= value``, JSON ``"key": "value"``),
  for keys the caller does not know (another client's, a rotated one).

Each is replaced with ``***``. Secrets shorter than 4 characters are not
matched as values (they would blank ordinary words); the field patterns
still apply.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

MASK = "***"
_MIN_SECRET = 4
_VALUE = r"[^\s\"',;}\]]+"
# the HTTP scheme is written "Bearer": matching it case-sensitively spares "a bearer of bad news"
_BEARER = re.compile(r"(\bBearer\s+)(?!\*\*\*)" + _VALUE)
_FIELD = re.compile(
    r"(?i)(\b(?:authorization|x-api-key|api[_-]?key|apikey|access[_-]?token|token)\b[\"']?\s*[:=]\s*[\"']?)"
    r"(?!\*\*\*)(?:(?:bearer|basic|digest|token)\s+)?" + _VALUE
)


def redact(text: str, secrets: Iterable[str | None] = ()) -> str:
    """``text`` with ``secrets`` and credential-looking fields replaced by ``***`` (see the module docstring)."""
    for secret in sorted({s for s in secrets if s and len(s) >= _MIN_SECRET}, key=len, reverse=True):
        text = text.replace(secret, MASK)
    text = _FIELD.sub(lambda m: m.group(1) + MASK, text)
    return _BEARER.sub(lambda m: m.group(1) + MASK, text)
