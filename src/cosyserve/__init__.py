"""cosyserve: serve CosyVoice text-to-speech models, ready in milliseconds.

``import cosyserve`` stays light (no torch); :func:`load` imports the runtime on first use.
"""

from typing import Any

from cosyserve.core.version import __version__

__all__ = ["__version__", "load"]


def load(path: Any, **kwargs: Any) -> Any:
    """Load a CosyVoice-300M model directory; see :func:`cosyserve.api.load`."""
    from cosyserve.api import load as _load

    return _load(path, **kwargs)
