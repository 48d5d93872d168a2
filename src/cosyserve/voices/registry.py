"""A persistent, per-tenant speaker registry: saved prompt features, so later requests skip extraction.

An entry holds what the reference's ``CosyVoice.add_zero_shot_spk`` keeps in ``spk2info`` (the zero-shot
frontend's dict without the text to speak):

- ``zero_shot`` entries: ``prompt_text`` / ``llm_prompt_speech_token`` / ``flow_prompt_speech_token`` (int32
  ``[1, n]``, each with an int32 ``[1]`` ``*_len``), ``prompt_speech_feat`` (float32 ``[1, F, 80]`` and its
  ``_len``), ``llm_embedding`` = ``flow_embedding`` (float32 ``[1, 192]``). Usable in zero_shot and cross_lingual.
- ``sft`` entries: ``embedding`` (float32 ``[1, 192]``), as the pre-defined speakers of an SFT model's
  ``spk2info.pt``. Usable in sft and instruct (imported from a ``spk2info.pt``).

Storage: ``<root>/<tenant>/<sha256(name)[:32]>.safetensors``, one file per speaker; the tensors under the keys
above and a JSON-able string header (``__metadata__``: format, version, name, tenant, kind, prompt_text,
created). Nothing is unpickled. Every write goes to a temporary file in the same folder, is fsynced and then
renamed over the target (and the folder fsynced), so a crash at any point leaves either the old or the new
entry, never a torn one. A writer holds a shared ``flock`` on the tenant's folder while its temporary exists;
the first write of a process into a folder removes the temporaries of our naming
(``.<hash>.safetensors.<pid>.<8 hex>.tmp``) when it can lock the folder exclusively without waiting, i.e. when
no writer is at work there: those were left by killed writers (a lock dies with its process, whatever pid
namespace it ran in). File names are hashes, so any speaker name is safe on any filesystem (case-insensitive
ones included); the name itself lives in the header.

The reference's ``spk2info.pt`` (a pickled ``{name: {key: tensor}}``) is imported with
``torch.load(weights_only=True)`` and exported with ``torch.save`` (both need torch). Everything else works on
numpy arrays and imports no torch: a registry made with ``arrays="numpy"`` (the lite runtime) returns numpy
arrays, one made with ``arrays="torch"`` (the default, the torch runtime) tensors over the same memory.

Location: ``COSYSERVE_REGISTRY_DIR`` if set, else ``<cache dir>/speakers/<model key>``, the key a hash of the
model's weight files' checksums, so models in folders of the same name keep separate voices (see
:func:`~cosyserve.voices.registry_location.default_registry_dir`, which also moves voices that older versions kept under
the folder's name).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
import threading
import time
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from cosyserve.core.errors import RegistryError
from cosyserve.system.atomicfile import atomic_write, clean_stale_temporaries, fsync_dir, writing
from cosyserve.voices.registry_location import default_registry_dir

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_TENANT",
    "SFT_KEYS",
    "ZERO_SHOT_KEYS",
    "ImportResult",
    "RegistryError",
    "Speaker",
    "SpeakerRegistry",
    "default_registry_dir",
    "entry_kind",
    "validate_name",
    "validate_tenant",
]

FORMAT = "cosyserve-speaker"
VERSION = "1"
DEFAULT_TENANT = "default"
MAX_NAME_CHARS = 64
EMBED_DIM = 192  # campplus output; the reference's tts() defaults assume 192
MEL_BINS = 80
MAX_FILE_BYTES = 64 * 2**20  # a 30 s prompt is ~1 MB; anything far larger is not an entry

ZERO_SHOT_KEYS = (
    "prompt_text",
    "prompt_text_len",
    "llm_prompt_speech_token",
    "llm_prompt_speech_token_len",
    "flow_prompt_speech_token",
    "flow_prompt_speech_token_len",
    "prompt_speech_feat",
    "prompt_speech_feat_len",
    "llm_embedding",
    "flow_embedding",
)
SFT_KEYS = ("embedding",)
_TOKEN_KEYS = ("prompt_text", "llm_prompt_speech_token", "flow_prompt_speech_token")
_TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# the temporary atomic_write makes for an entry (see the module docstring)
_TEMP_RE = re.compile(r"\.[0-9a-f]{32}\.safetensors\.[0-9]+\.[0-9a-f]{8}\.tmp")

Kind = Literal["zero_shot", "sft"]


@dataclass(frozen=True)
class Speaker:
    """One registered speaker.

    Attributes:
        name, tenant: where it is registered.
        kind: ``zero_shot`` (prompt features) or ``sft`` (an embedding only).
        features: the reference's spk2info entry (see the module docstring): CPU tensors, or numpy arrays from a
            registry with ``arrays="numpy"``; treat as read-only.
        prompt_text: the transcript it was registered with ("" when imported from a spk2info.pt).
        created: registration time, seconds since the epoch.
        token_rate: speech tokens per second of the model's family (50 for CosyVoice-300M, 25 for CosyVoice2/3).
    """

    name: str
    tenant: str
    kind: Kind
    features: dict[str, Any]
    prompt_text: str = ""
    created: float = 0.0
    token_rate: int = 50

    @property
    def seconds(self) -> float:
        """Prompt duration implied by the speech tokens; 0 for sft entries."""
        if self.kind != "zero_shot":
            return 0.0
        return self.features["flow_prompt_speech_token"].shape[1] / self.token_rate


@dataclass(frozen=True)
class ImportResult:
    imported: list[str]
    skipped: list[str]  # names reserved by the model (its pre-defined speakers)


# ---------------------------------------------------------------------------------------------------------------------
# names


def validate_name(name: object) -> str:
    """Return ``name`` if it can name a speaker, else raise :class:`RegistryError` saying why.

    A name is 1-64 characters, without leading/trailing blanks, path separators, control characters, and is
    not ``.`` or ``..``.
    """
    if not isinstance(name, str):
        raise RegistryError(f"speaker name must be a string, got {type(name).__name__}")
    if not name:
        raise RegistryError("speaker name is empty")
    if len(name) > MAX_NAME_CHARS:
        raise RegistryError(
            f"speaker name {name[:20]!r}... is {len(name)} characters; at most {MAX_NAME_CHARS}"
        )
    if name != name.strip():
        raise RegistryError(f"speaker name {name!r} has leading or trailing blanks")
    if "/" in name or "\\" in name:
        raise RegistryError(f"speaker name {name!r} contains a path separator ('/' or '\\')")
    if any(unicodedata.category(c).startswith("C") for c in name):
        raise RegistryError(f"speaker name {name!r} contains a control or unassigned character")
    if name in (".", ".."):
        raise RegistryError(f"speaker name {name!r} is reserved")
    return name


def validate_tenant(tenant: object) -> str:
    """Return ``tenant`` if valid: 1-64 of ``A-Z a-z 0-9 . _ -``, starting with a letter or digit."""
    if not isinstance(tenant, str) or not _TENANT_RE.fullmatch(tenant):
        raise RegistryError(
            f"tenant {tenant!r} is not valid: use 1-64 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit"
        )
    return tenant


# ---------------------------------------------------------------------------------------------------------------------
# entries


Arrays = Literal["torch", "numpy"]


def _np(value: object) -> np.ndarray | None:
    """``value`` as a numpy array (a torch tensor through its CPU memory), or None when it is no array."""
    if isinstance(value, np.ndarray):
        return value
    if type(value).__module__.startswith("torch") and hasattr(value, "detach"):
        t = value.detach().cpu()  # type: ignore[attr-defined]
        return (t.float() if t.is_floating_point() else t).numpy()  # type: ignore[no-any-return]
    return None


def _is_float(a: np.ndarray) -> bool:
    return bool(np.issubdtype(a.dtype, np.floating))


def _is_int(a: np.ndarray) -> bool:
    return bool(np.issubdtype(a.dtype, np.integer))


def _as_int_len(t: np.ndarray, key: str, where: str) -> np.ndarray:
    if t.size != 1 or not _is_int(t):
        raise RegistryError(f"{where}: {key!r} should be one integer, got {t.dtype} {list(t.shape)}")
    return t.reshape(1).astype(np.int32)


def _as(arrays: Arrays, out: dict[str, np.ndarray]) -> dict[str, Any]:
    if arrays == "numpy":
        return out
    import torch

    return {k: torch.from_numpy(v) for k, v in out.items()}


def entry_kind(
    entry: Mapping[str, object], where: str = "entry", arrays: Arrays = "torch"
) -> tuple[Kind, dict[str, Any]]:
    """Check a spk2info entry and return its kind and a clean copy (CPU, contiguous, the reference's dtypes).

    Args:
        entry: ``{key: tensor}`` as in the reference's spk2info (see the module docstring); torch tensors or
            numpy arrays.
        where: how messages name the entry.
        arrays: what the copy holds: ``torch`` tensors or ``numpy`` arrays.
    Returns:
        (``"zero_shot"`` or ``"sft"``, the checked arrays; keys outside the kind's set are dropped).
    Raises:
        RegistryError: missing keys, wrong dtypes or shapes, lengths that disagree with the tensors.
    """
    if not isinstance(entry, Mapping):
        raise RegistryError(f"{where} should be a dict of tensors, got {type(entry).__name__}")
    tensors: dict[str, np.ndarray] = {}
    for k, v in entry.items():
        a = _np(v)
        if not isinstance(k, str) or a is None:
            raise RegistryError(f"{where}: {k!r} should map a str to a tensor, got {type(v).__name__}")
        tensors[k] = a

    def embedding(key: str) -> np.ndarray:
        t = tensors[key]
        if t.size != EMBED_DIM or not _is_float(t):
            raise RegistryError(
                f"{where}: {key!r} should hold {EMBED_DIM} floats, got {t.dtype} {list(t.shape)}"
            )
        return np.array(t, dtype=np.float32).reshape(1, EMBED_DIM)

    if all(k in tensors for k in ZERO_SHOT_KEYS):
        out: dict[str, np.ndarray] = {}
        for key in _TOKEN_KEYS:
            t = tensors[key]
            if t.ndim != 2 or t.shape[0] != 1 or not _is_int(t):
                raise RegistryError(
                    f"{where}: {key!r} should be integer ids [1, n], got {t.dtype} {list(t.shape)}"
                )
            out[key] = np.array(t, dtype=np.int32)
            out[key + "_len"] = _as_int_len(tensors[key + "_len"], key + "_len", where)
            if int(out[key + "_len"][0]) != t.shape[1]:
                raise RegistryError(
                    f"{where}: {key}_len is {int(out[key + '_len'][0])} but {key} has {t.shape[1]} ids"
                )
        feat = tensors["prompt_speech_feat"]
        if feat.ndim != 3 or feat.shape[0] != 1 or feat.shape[2] != MEL_BINS or not _is_float(feat):
            raise RegistryError(
                f"{where}: 'prompt_speech_feat' should be float [1, frames, {MEL_BINS}], got {feat.dtype} "
                f"{list(feat.shape)}"
            )
        out["prompt_speech_feat"] = np.array(feat, dtype=np.float32)
        out["prompt_speech_feat_len"] = _as_int_len(
            tensors["prompt_speech_feat_len"], "prompt_speech_feat_len", where
        )
        if int(out["prompt_speech_feat_len"][0]) != feat.shape[1]:
            raise RegistryError(
                f"{where}: prompt_speech_feat_len disagrees with prompt_speech_feat's {feat.shape[1]} frames"
            )
        out["llm_embedding"] = embedding("llm_embedding")
        out["flow_embedding"] = embedding("flow_embedding")
        return "zero_shot", _as(arrays, {k: out[k] for k in ZERO_SHOT_KEYS})
    if "embedding" in tensors:
        return "sft", _as(arrays, {"embedding": embedding("embedding")})
    missing = [k for k in ZERO_SHOT_KEYS if k not in tensors]
    raise RegistryError(
        f"{where} is neither a zero-shot entry (missing {', '.join(missing)}) nor an sft entry (no 'embedding'); "
        f"it has {', '.join(sorted(tensors)) or 'no tensors'}"
    )


def _read_header(data: bytes, path: Path) -> dict[str, str]:
    if len(data) < 8:
        raise RegistryError(f"{path} is truncated ({len(data)} bytes)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise RegistryError(f"{path} is truncated (header of {n} bytes, file of {len(data)})")
    try:
        header = json.loads(data[8 : 8 + n])
    except ValueError as e:
        raise RegistryError(f"{path} has an unreadable header: {e}") from e
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise RegistryError(f"{path} is not a cosyserve speaker file (format {FORMAT!r})")
    if meta.get("version") != VERSION:
        raise RegistryError(
            f"{path} has speaker format version {meta.get('version')!r}; this cosyserve reads {VERSION!r}"
        )
    return meta


# ---------------------------------------------------------------------------------------------------------------------
# the registry


class SpeakerRegistry:
    """Registered speakers under ``root``, one folder per tenant. Cheap to construct (no I/O until used);
    safe to share between threads; several processes may use one root (last writer of a name wins).

    Args:
        root: the registry folder (created on the first write).
        arrays: what entries hold: ``torch`` tensors (the torch runtime) or ``numpy`` arrays (no torch import).
    """

    def __init__(self, root: str | os.PathLike[str], arrays: Arrays = "torch", token_rate: int = 50) -> None:
        self.root = Path(root)
        self.arrays: Arrays = arrays
        self.token_rate = token_rate  # speech tokens per second of the models whose voices it holds
        self._lock = threading.Lock()
        self._cache: dict[Path, tuple[tuple[int, int, int], Speaker]] = {}
        self._cleaned: set[Path] = set()  # folders whose leftover temporaries this registry removed

    def __repr__(self) -> str:
        return f"SpeakerRegistry({str(self.root)!r})"

    def path_for(self, name: str, tenant: str = DEFAULT_TENANT) -> Path:
        """The file that holds ``name`` in ``tenant`` (whether or not it exists)."""
        digest = hashlib.sha256(validate_name(name).encode("utf-8")).hexdigest()[:32]
        return self.root / validate_tenant(tenant) / f"{digest}.safetensors"

    # --- reading ------------------------------------------------------------------------------------------------

    def _load(self, path: Path) -> Speaker | None:
        try:
            st = path.stat()
        except FileNotFoundError:
            with self._lock:
                self._cache.pop(path, None)
            return None
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        with self._lock:
            hit = self._cache.get(path)
        if hit is not None and hit[0] == key:
            return hit[1]
        if st.st_size > MAX_FILE_BYTES:
            raise RegistryError(f"{path} is {st.st_size} bytes; a speaker file is at most {MAX_FILE_BYTES}")
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        meta = _read_header(data, path)
        from safetensors.numpy import load as load_safetensors

        try:
            tensors = load_safetensors(data)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for bad files
            raise RegistryError(f"{path} is corrupt: {e}") from e
        kind, features = entry_kind(tensors, f"speaker file {path}", self.arrays)
        if kind != meta.get("kind"):
            raise RegistryError(
                f"{path}: header says kind {meta.get('kind')!r}, the tensors are a {kind} entry"
            )
        try:
            created = float(meta.get("created", "0"))
        except ValueError:
            created = 0.0
        speaker = Speaker(
            name=meta.get("name", ""),
            tenant=meta.get("tenant", ""),
            kind=kind,
            features=features,
            prompt_text=meta.get("prompt_text", ""),
            created=created,
            token_rate=self.token_rate,
        )
        with self._lock:
            self._cache[path] = (key, speaker)
        return speaker

    def get(self, name: str, tenant: str = DEFAULT_TENANT) -> Speaker | None:
        """The registered speaker ``name`` of ``tenant``, or None.

        Raises:
            RegistryError: invalid name or tenant; the speaker's file exists but is unreadable.
        """
        path = self.path_for(name, tenant)
        speaker = self._load(path)
        if speaker is not None and speaker.name != name:
            raise RegistryError(f"{path} holds speaker {speaker.name!r}, not {name!r} (file name collision)")
        return speaker

    def list(self, tenant: str = DEFAULT_TENANT) -> list[Speaker]:
        """The speakers of ``tenant``, sorted by name. Unreadable files are skipped with a warning."""
        folder = self.root / validate_tenant(tenant)
        if not folder.is_dir():
            return []
        out = []
        for path in sorted(folder.glob("*.safetensors")):
            try:
                speaker = self._load(path)
            except RegistryError as e:
                logger.warning("skipping unreadable speaker file: %s", e)
                continue
            if speaker is not None:
                out.append(speaker)
        return sorted(out, key=lambda s: s.name)

    def names(self, tenant: str = DEFAULT_TENANT) -> list[str]:
        return [s.name for s in self.list(tenant)]

    def tenants(self) -> list[str]:
        """Tenants with a folder in the registry."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and _TENANT_RE.fullmatch(p.name))

    # --- writing ------------------------------------------------------------------------------------------------

    def add(
        self,
        name: str,
        features: Mapping[str, Any],
        *,
        tenant: str = DEFAULT_TENANT,
        prompt_text: str = "",
        overwrite: bool = False,
    ) -> Speaker:
        """Register ``features`` (a spk2info entry, see the module docstring) as ``name``.

        Raises:
            RegistryError: bad name/tenant/features, or ``name`` exists and ``overwrite`` is False.
        """
        path = self.path_for(name, tenant)
        kind, clean = entry_kind(features, f"speaker {name!r}", "numpy")
        if not overwrite and path.exists():
            raise RegistryError(
                f"speaker {name!r} is already registered for tenant {tenant!r}: remove it first or overwrite"
            )
        speaker = Speaker(
            name,
            tenant,
            kind,
            _as(self.arrays, clean),
            prompt_text=prompt_text,
            created=time.time(),
            token_rate=self.token_rate,
        )
        from safetensors.numpy import save as save_safetensors

        meta = {
            "format": FORMAT,
            "version": VERSION,
            "name": name,
            "tenant": tenant,
            "kind": kind,
            "prompt_text": prompt_text,
            "created": repr(speaker.created),
        }
        # entry_kind made each array its own copy (the reference's entries alias llm/flow tokens and embeddings)
        data = save_safetensors(clean, metadata=meta)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.parent not in self._cleaned:
            self._cleaned.add(path.parent)
            clean_stale_temporaries(path.parent, _TEMP_RE)
        with writing(path.parent):
            atomic_write(path, data)
        logger.info("registered speaker %r (%s) for tenant %r in %s", name, kind, tenant, path)
        return speaker

    def remove(self, name: str, tenant: str = DEFAULT_TENANT) -> None:
        """Delete ``name`` from ``tenant``. Raises :class:`RegistryError` when it is not registered."""
        path = self.path_for(name, tenant)
        if self.get(name, tenant) is None:
            known = ", ".join(self.names(tenant)) or "none"
            raise RegistryError(
                f"speaker {name!r} is not registered for tenant {tenant!r} (registered: {known})"
            )
        path.unlink()
        fsync_dir(path.parent)
        with self._lock:
            self._cache.pop(path, None)

    # --- spk2info.pt ----------------------------------------------------------------------------------------------

    def import_spk2info(
        self,
        path: str | os.PathLike[str],
        *,
        tenant: str = DEFAULT_TENANT,
        overwrite: bool = False,
        reserved: Iterable[str] = (),
    ) -> ImportResult:
        """Register every entry of a reference ``spk2info.pt`` (read with ``torch.load(weights_only=True)``).

        Every entry is checked before anything is written. Names in ``reserved`` (the model's pre-defined
        speakers, which an exported spk2info.pt repeats) are skipped.

        Raises:
            RegistryError: unreadable file, a bad entry or name, or names already registered (without ``overwrite``).
        """
        validate_tenant(tenant)
        path = Path(path)
        if not path.is_file():
            raise RegistryError(f"spk2info file {path} does not exist")
        torch = _torch_for("importing a spk2info.pt")
        try:
            info = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unpickling failure means a file we will not read
            raise RegistryError(_unreadable_spk2info(path, e)) from None
        if not isinstance(info, dict):
            raise RegistryError(
                f"{path} should map speaker names to dicts of tensors, got {type(info).__name__}"
            )
        reserved = set(reserved)
        todo: dict[str, dict[str, Any]] = {}
        skipped = []
        for name, entry in info.items():
            if not isinstance(name, str):
                raise RegistryError(f"{path}: speaker key {name!r} is not a string")
            if name in reserved:
                skipped.append(name)
                continue
            validate_name(name)
            entry_kind(entry, f"{path}: speaker {name!r}")
            todo[name] = entry
        if not overwrite:
            taken = sorted(n for n in todo if self.get(n, tenant) is not None)
            if taken:
                raise RegistryError(
                    f"already registered for tenant {tenant!r}: {', '.join(taken)}; remove them or overwrite"
                )
        for name, entry in todo.items():
            self.add(name, entry, tenant=tenant, overwrite=True)
        return ImportResult(sorted(todo), sorted(skipped))

    def export_spk2info(
        self,
        path: str | os.PathLike[str],
        *,
        tenant: str = DEFAULT_TENANT,
        extra: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> list[str]:
        """Write the speakers of ``tenant`` (plus ``extra`` entries, e.g. the model's pre-defined speakers) as a
        reference ``spk2info.pt`` (``torch.save`` of ``{name: {key: tensor}}``), atomically. Returns the names."""
        torch = _torch_for("exporting a spk2info.pt")
        out: dict[str, dict[str, Any]] = {k: dict(v) for k, v in (extra or {}).items()}
        for speaker in self.list(tenant):
            out[speaker.name] = {k: torch.tensor(np.asarray(v)) for k, v in speaker.features.items()}
        import io

        buf = io.BytesIO()
        torch.save(out, buf)
        path = Path(path)
        if not path.parent.is_dir():
            raise RegistryError(f"cannot write {path}: folder {path.parent} does not exist")
        atomic_write(path, buf.getvalue())
        return sorted(out)


def _unreadable_spk2info(path: Path, e: Exception) -> str:
    """One line for a spk2info.pt that ``torch.load(weights_only=True)`` refused, without torch's text (several
    lines, which suggest loading the file with ``weights_only=False``: running whatever its pickle names)."""
    text = str(e)
    found = re.search(r"GLOBAL ([\w.]+)", text)
    if found:
        return (
            f"{path} holds objects other than tensors and dicts of them (its pickle names {found[1]}): refused; a "
            "spk2info.pt holds only those, and cosyserve reads it weights-only, running nothing in it"
        )
    detail = re.search(r"Unsupported [^\n.]*", text)
    first = detail[0] if detail else (text.strip().splitlines() or [type(e).__name__])[0]
    return f"cannot read {path} as a weights-only torch file of tensors: {first}"


def _torch_for(what: str) -> Any:
    try:
        import torch
    except ImportError:
        raise RegistryError(
            f"{what} needs torch (the reference's format is a torch pickle): run it where the torch runtime is "
            "installed (pip install cosyserve)"
        ) from None
    return torch
