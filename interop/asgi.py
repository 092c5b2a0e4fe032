"""The few ASGI pieces a protocol server written without a web framework needs.

A framework's per-request machinery (request objects, dependency injection,
response validation, middleware stacks) cost more CPU than the env behind an
ORS server (``labrl.interop.ors_server``), so that server speaks ASGI directly
(under uvicorn): one JSON encode per answer (``pydantic_core.to_json``, which
also renders what JSON cannot hold with ``str``), no per-request logging.

- An error answer is ``{"detail": ...}`` with its status (``HttpError``), the
  shape FastAPI gives an ``HTTPException``.
- A Server-Sent Events stream is ``event: NAME`` plus one ``data: LINE`` per
  line of the data, then a blank line; ``: ping`` comment lines keep an idle
  stream alive.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from pydantic_core import to_json

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON_HEADERS = ((b"content-type", b"application/json"),)
EVENT_STREAM_HEADERS = (
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # a proxy in front must not buffer the stream
)
KEEPALIVE_COMMENT = b": ping\n\n"


class HttpError(Exception):
    """An answer other than 200: ``{"detail": detail}`` with ``status`` and extra ``headers``."""

    def __init__(self, status: int, detail: Any, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.headers = dict(headers or {})


def header(scope: Scope, name: bytes) -> str | None:
    """The request header ``name`` (lower case), or None."""
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


async def read_body(receive: Receive) -> bytes:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body", False):
            return body


async def send_json(
    send: Send, payload: Any, status: int = 200, headers: Iterable[tuple[bytes, bytes]] = ()
) -> None:
    body = to_json(payload, fallback=str)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*JSON_HEADERS, (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, error: HttpError) -> None:
    extra = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in error.headers.items()]
    await send_json(send, {"detail": error.detail}, error.status, extra)


async def start_event_stream(send: Send, first: bytes, more: bool = True) -> None:
    """The stream's status and headers, then its ``first`` events (the whole stream unless ``more``)."""
    await send({"type": "http.response.start", "status": 200, "headers": list(EVENT_STREAM_HEADERS)})
    await send({"type": "http.response.body", "body": first, "more_body": more})


async def send_events(send: Send, chunk: bytes, more: bool = True) -> None:
    """More of a started stream (its end unless ``more``)."""
    await send({"type": "http.response.body", "body": chunk, "more_body": more})


def event(name: str, data: str) -> bytes:
    """One SSE event; each line of ``data`` is its own ``data:`` field (the client joins them with newlines)."""
    lines = "".join(f"data: {line}\n" for line in data.split("\n"))
    return f"event: {name}\n{lines}\n".encode()


async def lifespan(
    receive: Receive, send: Send, startup: Callable[[], None], shutdown: Callable[[], Awaitable[None]]
) -> None:
    """ASGI's lifespan protocol: ``startup`` when the server starts, ``shutdown`` when it stops."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            startup()
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await shutdown()
            await send({"type": "lifespan.shutdown.complete"})
            return
