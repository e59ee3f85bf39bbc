"""What a client may cost the server, whatever it sends: a request body of at most `max_body_bytes` (a
larger Content-Length is answered 413 before a byte of the body is read; a body without one is counted as
it streams in and refused at the limit), a body that stalls for `body_timeout` seconds answered 408, and
request headers that must be complete within `header_timeout` seconds of the connection's opening (or of
its previous response) or the connection is closed. Each such answer closes the connection, so the rest
of an oversized body is never read. Other connections are served meanwhile (one event loop; a client
that holds its connection open holds nothing else).

Not Starlette's RequestBodyLimitMiddleware (FastAPI's max_body_size): it replaces whatever the app answers
with a plain-text 413 and keeps the connection open, reading (and discarding) the rest of the body."""

from __future__ import annotations

import asyncio
import json

import h11
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from .defaults import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, MAX_BODY_BYTES  # noqa: F401 (the limits' values)
from .errors import body, respond

CLOSE = {"Connection": "close"}


def too_large(limit: int) -> HTTPException:
    return HTTPException(413, f"the request body is larger than this server's limit of {limit:,} bytes; send a "
                              "smaller request (the limit is serve --max-body-bytes)", headers=CLOSE)


class BodyLimit:
    """ASGI middleware around the app: the size limit and the idle timeout of a request's body. A declared
    Content-Length over the limit is answered at once; otherwise the app reads the body through `receive`,
    which counts and times each chunk and raises the 413 or 408 (errors.py answers it in OpenAI's shape)."""

    def __init__(self, app, max_bytes: int = MAX_BODY_BYTES, idle_s: float = BODY_TIMEOUT_S):
        self.app, self.max_bytes, self.idle_s = app, max_bytes, idle_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"").strip()
        if length.isdigit() and int(length) > self.max_bytes:
            refusal = too_large(self.max_bytes)
            return await respond(413, refusal.detail, None, "request_too_large", CLOSE)(scope, receive, send)
        received, done = 0, False

        async def limited():
            nonlocal received, done
            if done:  # the body is in: what follows is the disconnect a streamed reply listens for, untimed
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.idle_s)
            except asyncio.TimeoutError:
                raise HTTPException(408, f"the request body stalled: no byte for {self.idle_s:g} s; send the "
                                         "whole body without pauses (the limit is serve --body-timeout)",
                                    headers=CLOSE) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise too_large(self.max_bytes)
            done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, limited, send)


class TimedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a header timeout: a connection that has not completed a request's
    headers `header_timeout` seconds after it opened or after its previous response is closed (with a
    408 where part of a request had arrived). uvicorn's own keep-alive timeout still closes idle
    connections earlier; this one also covers a request line or headers that never finish."""

    header_timeout = HEADER_TIMEOUT_S
    header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.arm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self.arm_header_timer()

    def connection_lost(self, exc) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
        super().connection_lost(exc)

    def arm_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
        self.header_timer = self.loop.call_later(self.header_timeout, self.header_timed_out)

    def header_timed_out(self) -> None:
        self.header_timer = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return  # closed already, or a request is being answered
        pending, _ = self.conn.trailing_data
        if pending and self.conn.our_state is h11.IDLE:  # a request had begun: say why it ends
            text = json.dumps(body(408, f"the request headers were not complete within {self.header_timeout:g} s; "
                                        "send the whole request at once (the limit is serve --header-timeout)",
                                   None, "request_timeout")).encode()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(text), text))
        self.transport.close()


def timed_protocol(header_timeout: float) -> type[TimedH11Protocol]:
    """The protocol class uvicorn builds per connection, with this server's header timeout."""
    return type("TimedH11Protocol", (TimedH11Protocol,), {"header_timeout": header_timeout})
