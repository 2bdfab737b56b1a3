"""The HTTP/1.1 connection protocol: uvicorn's h11 protocol plus a deadline for each request's headers.

uvicorn closes a keep-alive connection that stays idle after a response, but a connection that
sends nothing, or trickles a request's headers a byte at a time (slow-loris), is kept open for as
long as the client likes. Here a connection must deliver a complete request head within
``header_timeout`` seconds of opening, and again after each response; otherwise it is closed.
The body has its own deadline (``RequestBodyMiddleware``). A request being served has no deadline
here (a long generation or stream is fine).
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle


class HeaderDeadlineProtocol(H11Protocol):
    """``H11Protocol`` that closes connections which do not start a request in time."""

    header_timeout: float = 10.0
    _header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # A pipelined request may have started already; its headers are in.
        if not self.transport.is_closing() and self.cycle.response_complete:
            self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        self._cancel_header_deadline()
        waiting_after = self.cycle  # None on a new connection, else the request just answered
        self._header_deadline = self.loop.call_later(
            self.header_timeout, self._header_deadline_passed, waiting_after
        )

    def _cancel_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _header_deadline_passed(self, waiting_after: RequestResponseCycle | None) -> None:
        self._header_deadline = None
        if self.cycle is waiting_after and not self.transport.is_closing():
            self.transport.close()  # no new request head arrived in time


def header_deadline_protocol(header_timeout: float) -> type[HeaderDeadlineProtocol]:
    """The protocol class to give uvicorn (``Config(http=...)``) for this ``header_timeout``."""
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), {"header_timeout": header_timeout})
