"""The HTTP server: :func:`create_app` (ASGI) and :func:`serve` (uvicorn)."""

from cosyserve.server.main import serve

__all__ = ["serve"]
