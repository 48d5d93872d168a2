"""Model ids on a hub -> a local model directory (optional: needs the ``hub`` extra).

``FunAudioLLM/...`` ids come from Hugging Face (huggingface_hub), ``iic/...`` from ModelScope. The download
lands in the hub library's own cache and is reused; conversion to a bundle happens afterwards, as for any
official directory. Never called by the tests (there is no network there).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["HubError", "download"]


class HubError(ValueError):
    """A hub id that cannot be fetched (library missing, unknown id, network)."""


def download(model_id: str) -> Path:
    """Fetch ``model_id`` (``owner/name``) and return its local directory."""
    owner = model_id.split("/", 1)[0]
    if owner == "iic":
        try:
            from modelscope import snapshot_download as ms_download  # type: ignore[import-not-found]
        except ImportError:
            raise HubError(
                f"{model_id}: ModelScope ids need the modelscope package: pip install 'cosyserve[hub]' "
                "(or download the model yourself and pass its directory; no local directory of that name exists)"
            ) from None
        try:
            return Path(ms_download(model_id))
        except Exception as e:  # noqa: BLE001 - any failure of the download names the id
            raise HubError(f"{model_id}: ModelScope download failed: {e}") from e
    try:
        from huggingface_hub import snapshot_download  # type: ignore[import-not-found]
    except ImportError:
        raise HubError(
            f"{model_id}: Hugging Face ids need huggingface_hub: pip install 'cosyserve[hub]' "
            "(or download the model yourself and pass its directory; no local directory of that name exists)"
        ) from None
    try:
        return Path(snapshot_download(model_id))
    except Exception as e:  # noqa: BLE001
        raise HubError(f"{model_id}: Hugging Face download failed: {e}") from e
