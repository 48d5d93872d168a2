"""API keys -> tenants. With keys configured, every API route needs ``Authorization: Bearer KEY`` (401 without
one); the key's tenant then limits which models and registered voices the request can see or use. Health, metrics,
the web page, the OpenAPI document and ``/v1/startup`` stay open (probes and scrapers need no key); a valid key
sent to them still names the tenant, and they name only that tenant's models (none without a key: states and
counts only, see :meth:`cosyserve.server.app.ServerState.shown_models`).
"""

from __future__ import annotations

import hmac
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from cosyserve.server.errors import error_response

__all__ = ["AuthMiddleware", "OPEN_PATHS"]

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


class AuthMiddleware:
    """Pure ASGI (no response buffering, so streams stay streams)."""

    def __init__(self, app: ASGIApp, state: Any, paths: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.keys: dict[str, str] = dict(state.config.api_keys)
        self.metrics = state.metrics
        self._paths = paths  # the app's routes: metric labels stay bounded whatever paths clients send

    def _tenant(self, header: str) -> str | None:
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        token = token.strip()
        found = None
        for key, tenant in self.keys.items():  # compare every key in constant time
            if hmac.compare_digest(key.encode(), token.encode()):
                found = tenant
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        header = ""
        for k, v in scope.get("headers", []):
            if k == b"authorization":
                header = v.decode("latin-1")
        tenant = self._tenant(header) if header else None
        if scope["path"] in OPEN_PATHS:
            if tenant is not None:
                scope.setdefault("state", {})["tenant"] = tenant
            await self.app(scope, receive, send)
            return
        if tenant is None:
            msg = (
                "missing API key: send 'Authorization: Bearer YOUR_KEY'"
                if not header
                else "invalid API key in the Authorization header"
            )
            resp = error_response(401, msg, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            self.metrics.observe_error(
                scope["path"] if scope["path"] in self._paths else "unmatched", 401, "invalid_api_key"
            )
            await resp(scope, receive, send)
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)
