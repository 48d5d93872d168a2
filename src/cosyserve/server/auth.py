"""API keys -> tenants. With keys configured, every API route needs ``Authorization: Bearer KEY`` (401 without
one); the key's tenant then limits which models and registered voices the request can see or use. Health, metrics,
the web page, the OpenAPI document and ``/v1/startup`` stay open (probes and scrapers need no key); a valid key
sent to them still names the tenant, and they name only that tenant's models (none without a key: states and
counts only, see :meth:`cosyserve.server.app.ServerState.shown_models`).

WebSockets are checked at the handshake, with the same keys, before the route runs: a missing or wrong key is
refused with the same 401 (as the handshake's HTTP answer), so no message of the session is ever read. A client
that can set headers sends ``Authorization: Bearer KEY``; a browser, which cannot set headers on a WebSocket, offers
the key as a subprotocol: ``bearer.`` followed by the key in base64url without padding (``Sec-WebSocket-Protocol:
cosyserve, bearer.a2V5``); the server answers with ``cosyserve`` and never with the key. Never in the URL: a URL
lands in access logs and browser history.
"""

from __future__ import annotations

import base64
import binascii
import hmac
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from cosyserve.server.errors import error_response

__all__ = ["KEY_SUBPROTOCOL", "OPEN_PATHS", "AuthMiddleware", "key_from_subprotocols"]

# the prefix of the subprotocol that carries a browser's key (the key follows in base64url)
KEY_SUBPROTOCOL = "bearer."

# Open on purpose. /openapi.json describes routes and fields only (no model, voice, tenant or key), and clients
# and API tools read it before they have a key; the others name a model only to a key that may use it.
OPEN_PATHS = (
    "/",
    "/health/live",
    "/health/ready",
    "/health/startup",
    "/metrics",
    "/openapi.json",
    "/v1/startup",
)


def key_from_subprotocols(scope: Scope) -> str | None:
    """The API key a WebSocket handshake offers as the subprotocol ``bearer.<base64url key>`` (None: none, or one
    that is not base64url)."""
    for proto in scope.get("subprotocols") or ():
        if proto.startswith(KEY_SUBPROTOCOL):
            token = proto[len(KEY_SUBPROTOCOL) :]
            try:
                return base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode("utf-8")
            except (binascii.Error, ValueError):
                return None
    return None


class AuthMiddleware:
    """Pure ASGI (no response buffering, so streams stay streams)."""

    def __init__(self, app: ASGIApp, state: Any, paths: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.keys: dict[str, str] = dict(state.config.api_keys)
        self.metrics = state.metrics
        self._paths = paths  # the app's routes: metric labels stay bounded whatever paths clients send

    def _tenant(self, token: str) -> str | None:
        token = token.strip()
        if not token:
            return None
        found = None
        for key, tenant in self.keys.items():  # compare every key in constant time
            if hmac.compare_digest(key.encode(), token.encode()):
                found = tenant
        return found

    def _bearer(self, header: str) -> str | None:
        scheme, _, token = header.partition(" ")
        return self._tenant(token) if scheme.lower() == "bearer" else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or not self.keys or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        header = ""
        for k, v in scope.get("headers", []):
            if k == b"authorization":
                header = v.decode("latin-1")
        offered = key_from_subprotocols(scope) if kind == "websocket" and not header else None
        tenant = self._bearer(header) if header else None
        if offered is not None:
            tenant = self._tenant(offered)
        if scope["path"] in OPEN_PATHS:
            if tenant is not None:
                scope.setdefault("state", {})["tenant"] = tenant
            await self.app(scope, receive, send)
            return
        if tenant is None:
            if header:
                msg = "invalid API key in the Authorization header"
            elif offered is not None:
                msg = f"invalid API key in the {KEY_SUBPROTOCOL}<key> subprotocol"
            else:
                msg = "missing API key: send 'Authorization: Bearer YOUR_KEY'" + (
                    f" (browsers: offer the subprotocol {KEY_SUBPROTOCOL}<the key in base64url>)"
                    if kind == "websocket"
                    else ""
                )
            self.metrics.observe_error(
                scope["path"] if scope["path"] in self._paths else "unmatched", 401, "invalid_api_key"
            )
            await self._refuse(scope, receive, send, msg)
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, msg: str) -> None:
        resp = error_response(401, msg, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if scope["type"] == "websocket" and "websocket.http.response" not in scope.get("extensions", {}):
            # a server without denial responses: a close before the accept, which it answers with a 403
            await send({"type": "websocket.close", "code": 1008, "reason": msg[:120]})
            return
        await resp(scope, receive, send)  # on a WebSocket, the handshake's HTTP answer
