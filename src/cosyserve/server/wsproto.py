"""uvicorn's WebSocket protocol (websockets' sans-I/O one, uvicorn's default) with two ends it lacks.

- A frame over ``ws_max_size``: uvicorn sent the close frame (1009) and closed the TCP connection at once, while
  the client was still sending the frame's megabytes; unread bytes in the server's socket make the kernel answer
  with a reset, which can reach the client before the close frame and discard it: the client saw a dropped
  connection, no code. Here the server sends the close frame (1009, "message too big"), then reads and drops what
  the client still sends, and closes once the client has sent nothing for :data:`QUIET_S` (its frame is over
  and it has read the close frame: it answers with its own and waits), or closes itself, or :data:`LINGER_S`
  pass. (A FIN after the close frame would end it sooner, but the websockets library's asyncio client then fails
  on its own way out.)
- A client cut off for not reading (:mod:`cosyserve.server.transports.ws`: a send that waited ``ws_idle_timeout_s``):
  uvicorn's close queued a close frame behind the audio the client never took, and closed the transport, which
  waits for its buffer to drain first: the socket stayed open until the client read or went away. A close while
  the transport cannot take more (its buffer over the high-water mark) resets the connection instead (the unsent
  audio dropped: SO_LINGER 0, then an abort): no frame could reach that client.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

__all__ = ["LINGER_S", "WebSocketProtocol"]

LINGER_S = 5.0  # the longest the server reads and drops what a client sends after a failed frame
QUIET_S = 0.3  # then closes once the client has sent nothing for this long


class WebSocketProtocol(WebSocketsSansIOProtocol):
    """See the module docstring; uvicorn's ``ws=`` (:func:`cosyserve.server.run.uvicorn_options`)."""

    _lingering = False
    _quiet: Any = None

    def data_received(self, data: bytes) -> None:
        if self._lingering:  # after a failed frame: its rest, dropped, until the client goes quiet
            self._close_when_quiet()
            return
        super().data_received(data)

    def _close_when_quiet(self) -> None:
        if self._quiet is not None:
            self._quiet.cancel()
        self._quiet = self.loop.call_later(QUIET_S, self.transport.close)

    def handle_parser_exception(self) -> None:
        # uvicorn's, less the immediate close: the close frame goes out, then what the client still sends is read
        # and dropped until it closes (eof_received then closes the transport) or LINGER_S pass
        assert self.conn.close_sent is not None
        code, reason = self.conn.close_sent.code, self.conn.close_sent.reason
        self.queue.put_nowait({"type": "websocket.disconnect", "code": code, "reason": reason})
        self.transport.write(b"".join(self.conn.data_to_send()))
        self.close_sent = True
        self._lingering = True
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()
        # the app's end no longer closes the transport (uvicorn leaves that to a pending close timer)
        self.close_timer = self.loop.call_later(LINGER_S, self.transport.close)
        self._close_when_quiet()

    async def send(self, message: Any) -> None:
        if message["type"] == "websocket.close" and self.handshake_complete and not self.writable.is_set():
            # the client has not taken what was sent: a close frame would wait behind it forever
            self.queue.put_nowait({"type": "websocket.disconnect", "code": 1006})
            self.close_sent = True
            sock = self.transport.get_extra_info("socket")
            if sock is not None:  # a reset now, not a FIN queued behind audio the client never takes
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.transport.abort()
            return
        await super().send(message)
