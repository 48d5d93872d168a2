"""Model ids on a hub -> a local model directory (optional: needs the ``hub`` extra).

``FunAudioLLM/...`` ids come from Hugging Face (huggingface_hub), ``iic/...`` from ModelScope; a ``modelscope:`` or
``hf:`` prefix picks the hub for any id (``modelscope:FunAudioLLM/Fun-CosyVoice3-0.5B-2512``: the ModelScope twin of
a Hugging Face repo). The download
lands in the hub library's own cache and is reused; conversion to a bundle happens afterwards, as for any
official directory. Every ``--model`` (serve, synth, speakers, startup-report) and :func:`cosyserve.load` go
through :func:`resolve_model`. Never downloads in the tests (there is no network there).
"""

from __future__ import annotations

import re
from pathlib import Path

from cosyserve.core.errors import HubError

__all__ = ["HubError", "download", "is_hub_id", "resolve_model"]

_HUB_ID = re.compile(r"^(?:(?:modelscope|hf):)?[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# files of the official releases that cosyserve never reads, so never downloads: the TorchScript / TensorRT /
# ONNX exports of the reference's GPU paths, and CosyVoice2's Qwen weights (~1 GB; llm.pt holds every LM weight)
SKIPPED = ("*.zip", "*.plan", "flow.decoder.estimator.*.onnx", "CosyVoice-BlankEN/model.safetensors")


def is_hub_id(source: str) -> bool:
    """``owner/name`` that is not a local path."""
    return not Path(source).exists() and bool(_HUB_ID.match(source))


def resolve_model(source: str | Path) -> Path:
    """A local path to load ``source`` from: a hub id's download (the hub library's cache), or the path as given."""
    return download(str(source)) if is_hub_id(str(source)) else Path(source)


def download(model_id: str) -> Path:
    """Fetch ``model_id`` (``owner/name``, optionally ``modelscope:`` or ``hf:`` first) and return its local
    directory."""
    hub, _, bare = model_id.rpartition(":")
    owner = bare.split("/", 1)[0]
    if hub == "modelscope" or (not hub and owner == "iic"):
        model_id = bare
        try:
            from modelscope import snapshot_download as ms_download  # type: ignore[import-not-found]
        except ImportError:
            raise HubError(
                f"{model_id}: ModelScope ids need the modelscope package: pip install 'cosyserve[hub]' "
                "(or download the model yourself and pass its directory; no local directory of that name exists)"
            ) from None
        try:
            return Path(ms_download(model_id, ignore_file_pattern=[_regex(p) for p in SKIPPED]))
        except Exception as e:  # noqa: BLE001 - any failure of the download names the id
            raise HubError(f"{model_id}: ModelScope download failed: {e}") from e
    model_id = bare
    try:
        from huggingface_hub import snapshot_download  # type: ignore[import-not-found]
    except ImportError:
        raise HubError(
            f"{model_id}: Hugging Face ids need huggingface_hub: pip install 'cosyserve[hub]' "
            "(or download the model yourself and pass its directory; no local directory of that name exists)"
        ) from None
    try:
        return Path(snapshot_download(model_id, ignore_patterns=list(SKIPPED)))
    except Exception as e:  # noqa: BLE001
        raise HubError(f"{model_id}: Hugging Face download failed: {e}") from e


def _regex(glob: str) -> str:
    # ModelScope takes regular expressions where Hugging Face takes globs
    import fnmatch

    return fnmatch.translate(glob)
