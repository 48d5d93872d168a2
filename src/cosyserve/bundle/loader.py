"""Open a bundle and load its components: meta construction, zero-copy mmap assignment, parallel, tiered.

Strategies (what happens to the mapped pages before READY):
- ``preload`` (default): every page is mapped in (``MADV_POPULATE_READ``: read from disk if needed) before READY:
  resident, no disk and no page faults on the request path; start pays the read (from the page cache, a small
  part of the start). Embedding tables (each model's ``ROW_TABLES``) are read into the page cache but not
  mapped: a request faults in the few rows it reads, and the unused rows of a 51866-token text vocabulary
  (212 MB fp32) cost no RSS.
- ``lazy``: nothing is read; pages fault in on first use.
- ``prefetch``: like lazy, then a background thread reads the pages after READY, so the first
  request rarely waits on the disk.

Checks, before any module is built: the manifest's format and version; each file's size; each file's header
against the manifest (names, dtypes, shapes: a missing, extra or changed tensor is named); and content
checksums (sha256 per tensor). Hashing every weight costs more than the rest of a start beyond importing torch,
so by default (``verify="stamp"``) it is done once per file version: a stamp records (inode, size, mtime, ctime)
of files that hashed clean, and a file whose stat differs is hashed again before use. ``verify="full"`` always hashes; ``verify="none"`` only checks
structure. A failed check raises :class:`BundleError` naming the file and tensor; nothing is half-loaded.
The zero-shot tier's ONNX files are checked the same way (size always, checksum per the same policy) when that
tier opens them (:meth:`Bundle.check_onnx`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from cosyserve.core.clock import PhaseClock
from cosyserve.core.errors import BundleError
from cosyserve.families import DEFAULT_FAMILY

logger = logging.getLogger(__name__)

__all__ = [
    "BUNDLE_FORMAT",
    "BUNDLE_VERSION",
    "BUNDLE_VERSIONS",
    "COMPONENTS",
    "Bundle",
    "LoadOptions",
    "LoadedParts",
    "is_bundle",
    "model_key",
    "open_bundle",
    "sha256_file",
]

# the bundle's format: what :mod:`cosyserve.bundle.convert` writes and this module reads back
BUNDLE_FORMAT = "cosyserve-bundle"
BUNDLE_VERSION = 1
BUNDLE_VERSIONS = (1, 2)  # 2: a component holds quantized (int8) tensors; written only then
COMPONENTS = ("llm", "flow", "hift")

Strategy = Literal["preload", "lazy", "prefetch"]
Verify = Literal["stamp", "full", "none"]
STAMP_FILE = ".verified.json"


@dataclass(frozen=True)
class LoadOptions:
    strategy: Strategy = "preload"
    verify: Verify = "stamp"
    threads: int = 3  # I/O threads: hashing and paging in, the GIL released in both

    def __post_init__(self) -> None:
        if self.strategy not in ("preload", "lazy", "prefetch"):
            raise ValueError(f"strategy must be preload, lazy or prefetch, got {self.strategy!r}")
        if self.verify not in ("stamp", "full", "none"):
            raise ValueError(f"verify must be stamp, full or none, got {self.verify!r}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")


@dataclass
class LoadedParts:
    modules: dict[str, Any]
    speakers: dict[str, dict[str, Any]]
    files: dict[str, Any] = field(default_factory=dict)  # component -> MappedFile
    prefetch_thread: threading.Thread | None = None
    family: str = DEFAULT_FAMILY

    def page_plan(self) -> list[tuple[Any, tuple[str, ...]]]:
        """What to page in: (file, its row tables), the largest file first."""
        return _page_plan(self.files, self.family)

    def mapped_bytes(self) -> int:
        return sum(f.size for f in self.files.values())


def is_bundle(path: str | Path) -> bool:
    return (Path(path) / "manifest.json").is_file()


def _stat_key(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


class Bundle:
    """An opened bundle: its manifest and config; :meth:`load` builds the modules."""

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path = path
        self.manifest = manifest
        self.dtype: str = manifest["dtype"]
        self.verify: Verify = "stamp"  # the checksum policy of the last load, applied to the ONNX files too
        self._config: Any = None
        self._stamp_lock = threading.Lock()

    @property
    def config(self) -> Any:
        """The :class:`cosyserve.families.modelconfig.ModelConfig` stored at conversion (built as the yaml's is)."""
        if self._config is None:
            from cosyserve.families.modelconfig import build_model_config

            src = self.path / "manifest.json"
            self._config = build_model_config(self.manifest.get("config"), source=src, where="config")
        return self._config

    def component_dtype(self, name: str) -> str:
        """The float dtype component ``name`` is stored in (a version-1 manifest's one ``dtype`` for all)."""
        return str(self.manifest["components"][name].get("dtype", self.dtype))

    def quantized(self, name: str) -> str:
        """How component ``name``'s linears are stored: ``none`` or ``int8``."""
        return str(self.manifest["components"][name].get("quantize", "none"))

    @property
    def speaker_names(self) -> list[str]:
        return list(self.manifest.get("speakers", {}).get("names", []))

    @property
    def family(self) -> Any:
        """The bundle's :class:`~cosyserve.families.base.Family`, from its manifest (builds no config: imports no
        model code)."""
        from cosyserve.families import family_named

        return family_named(self.manifest.get("family", DEFAULT_FAMILY))

    @property
    def model_key(self) -> str:
        """What identifies the model, whatever its path, folder name or storage dtype (see :func:`model_key`)."""
        return model_key(self.manifest)

    @property
    def instruct(self) -> bool:
        """Whether the model takes instruct mode (a CosyVoice-300M-Instruct), as its family's
        :meth:`~cosyserve.families.base.Family.is_instruct_dir` told at conversion; a bundle converted before that
        was recorded is judged by the same rule on the source directory its manifest names."""
        value = self.manifest.get("instruct")
        if value is None:
            source = self.manifest.get("source", {}).get("dir")
            return isinstance(source, str) and bool(source) and self.family.is_instruct_dir(Path(source))
        if not isinstance(value, bool):
            raise BundleError(f"{self.path / 'manifest.json'}: instruct must be true or false, got {value!r}")
        return value

    def onnx_path(self, name: str) -> Path | None:
        return self.path / name if name in self.manifest.get("extras", {}) else None

    def check_onnx(self, name: str) -> None:
        """Check the ONNX file ``name`` against the manifest before a session opens it, as the weights are:
        its size always, its sha256 per :attr:`verify` (``stamp``: once per file version). Raises
        :class:`BundleError` naming the file."""
        entry = self.manifest.get("extras", {}).get(name)
        if entry is None:  # not part of the bundle: nothing recorded to check against
            return
        self.check_file(name, entry)

    def check_file(
        self,
        name: str,
        entry: dict[str, Any],
        again: str = "convert the model dir again (cosyserve convert MODEL_DIR BUNDLE --force)",
    ) -> None:
        """Check the bundle's file ``name`` (a path inside it) against ``entry`` (``bytes``, ``sha256``): its size
        always, its sha256 per :attr:`verify`. Raises :class:`BundleError` naming the file and saying ``again``."""
        path = self.path / name
        public = f"the model's {name} is damaged ({{}}); its bundle must be converted again"
        try:
            key = _stat_key(path)
        except OSError as e:
            raise BundleError(
                f"{path}: cannot read it ({e.strerror}): {again}", public=public.format("unreadable")
            ) from e
        if key[1] != entry["bytes"]:
            raise BundleError(
                f"{path}: {key[1]} bytes, the manifest says {entry['bytes']}: truncated or replaced; {again}",
                public=public.format("truncated or replaced"),
            )
        if self.verify == "none" or (self.verify == "stamp" and self._read_stamps().get(name) == key):
            return
        if sha256_file(path) != entry["sha256"]:
            raise BundleError(
                f"{path}: checksum mismatch: the file is corrupt; {again}",
                public=public.format("checksum mismatch"),
            )
        if self.verify == "stamp":
            with self._stamp_lock:
                self._write_stamps({**self._read_stamps(), name: key})

    # -- checks -------------------------------------------------------------------------------------------

    def _entries(self) -> dict[str, dict[str, Any]]:
        entries = {name: self.manifest["components"][name] for name in COMPONENTS}
        if "speakers" in self.manifest:
            entries["speakers"] = self.manifest["speakers"]
        return entries

    def _open_checked(self, name: str, entry: dict[str, Any]) -> Any:
        from cosyserve.bundle.mmap_safetensors import DTYPES, MappedFile

        path = self.path / entry["file"]
        f = MappedFile(path)
        if f.size != entry["bytes"]:
            raise BundleError(
                f"{path}: {f.size} bytes, the manifest says {entry['bytes']}: truncated or replaced"
            )
        expected = entry["tensors"]
        missing = sorted(set(expected) - set(f.tensors))
        extra = sorted(set(f.tensors) - set(expected))
        if missing:
            raise BundleError(f"{path}: missing tensor(s) {', '.join(missing[:5])}")
        if extra:
            raise BundleError(f"{path}: unexpected tensor(s) {', '.join(extra[:5])} not in the manifest")
        for tname, info in f.tensors.items():
            want = expected[tname]
            if str(DTYPES[info.dtype]).removeprefix("torch.") != want["dtype"]:
                raise BundleError(
                    f"{path}: tensor {tname!r} is {info.dtype}, the manifest says {want['dtype']}"
                )
            if list(info.shape) != list(want["shape"]):
                raise BundleError(
                    f"{path}: tensor {tname!r} has shape {list(info.shape)}, the manifest says {want['shape']}"
                )
        return f

    def _stamp_path(self) -> Path:
        return self.path / STAMP_FILE

    def _read_stamps(self) -> dict[str, Any]:
        try:
            return json.loads(self._stamp_path().read_text())
        except (OSError, ValueError):
            return {}

    def _write_stamps(self, stamps: dict[str, Any]) -> None:
        tmp = self._stamp_path().with_suffix(f".{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(stamps))
            os.replace(tmp, self._stamp_path())
        except OSError as e:  # read-only bundle: verification simply repeats next start
            logger.info("cannot record verification stamp in %s: %s", self.path, e)

    def _hash_check(self, f: Any, entry: dict[str, Any]) -> None:
        view = memoryview(f._mm) if f._mm is not None else memoryview(b"")
        for tname, info in f.tensors.items():
            digest = hashlib.sha256(view[info.begin : info.end]).hexdigest()
            if digest != entry["tensors"][tname]["sha256"]:
                raise BundleError(f"{f.path}: checksum mismatch in tensor {tname!r}: the file is corrupt")
        view.release()

    # -- load ---------------------------------------------------------------------------------------------

    def load(self, options: LoadOptions | None = None, clock: PhaseClock | None = None) -> LoadedParts:
        """Check the files, build the modules and assign the mapped weights. Returns the loaded parts.

        Modules are built one after another in this thread: construction is pure Python, and threads would only
        take turns on the GIL (three threads build slower than one).
        Meanwhile I/O threads hash what needs verifying and (``preload``) one pages the files in, both with the
        GIL released; they are waited for before this returns, so a failed check still loads nothing."""
        from cosyserve.bundle.construct import assert_materialized
        from cosyserve.bundle.official import new_module

        options = options or LoadOptions()
        clock = clock or PhaseClock()
        self.verify = options.verify
        entries = self._entries()
        with clock.phase("manifest"):
            cfg = self.config
            files = {name: self._open_checked(name, entry) for name, entry in entries.items()}
            stamps = self._read_stamps() if options.verify == "stamp" else {}
            unverified = [n for n in entries if stamps.get(entries[n]["file"]) != _stat_key(files[n].path)]
            if options.verify == "none":
                unverified = []
        with ThreadPoolExecutor(max_workers=options.threads, thread_name_prefix="cosyserve-io") as io:
            try:
                hashed = [io.submit(self._hash_check, files[n], entries[n]) for n in unverified]
                # one thread pages in every file, the largest first: one reader reads a cold disk as fast as
                # several (the kernel reads ahead within a populate), and each more thread to start waits for
                # the address-space lock the populate holds
                paged = (
                    [io.submit(_read_all, _page_plan(files, cfg.family))]
                    if options.strategy == "preload"
                    else []
                )
                modules: dict[str, Any] = {}
                for name in COMPONENTS:
                    with clock.phase("construct"):
                        module = new_module(name, getattr(cfg, name), cfg.family)
                        if self.quantized(name) == "int8":
                            from cosyserve.bundle.construct import empty_modules
                            from cosyserve.models.precision import use_int8_linears

                            with empty_modules():
                                use_int8_linears(module)
                    with clock.phase("map_assign"):
                        module.load_state_dict(files[name].state_dict(), strict=True, assign=True)
                        assert_materialized(module, str(files[name].path))
                        module.eval()
                    modules[name] = module
                with clock.phase("verify"):
                    for fut in hashed:
                        fut.result()
                with clock.phase("first_touch"):
                    for fut in paged:
                        fut.result()
            except BaseException:
                io.shutdown(wait=True, cancel_futures=True)
                raise
        if unverified and options.verify == "stamp":
            with self._stamp_lock:
                stamps = {
                    **self._read_stamps(),
                    **{entries[n]["file"]: _stat_key(files[n].path) for n in unverified},
                }
                self._write_stamps(stamps)
        return LoadedParts(modules, self._speakers(files.get("speakers")), files, family=cfg.family)

    def _speakers(self, f: Any) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        if f is None:
            return out
        names = self.speaker_names
        for key in f.tensors:
            idx, fld = key.split(".", 1)
            out.setdefault(names[int(idx)], {})[fld] = f.tensor(key)
        return out


def model_key(manifest: dict[str, Any]) -> str:
    """32 hex characters that identify a bundle's model: a hash of the sha256 of the source weight files
    (llm.pt, flow.pt, hift.pt) recorded at conversion, so float32 and bfloat16 bundles of one model, or one
    model in two folders, share it; without those records, of the stored tensors' checksums."""
    files = manifest.get("source", {}).get("files", {})
    names = [f"{c}.pt" for c in COMPONENTS]
    if all(isinstance(files.get(n), dict) and "sha256" in files[n] for n in names):
        parts = [f"{n}:{files[n]['sha256']}" for n in names]
    else:
        parts = [
            f"{c}/{t}:{info['sha256']}"
            for c in COMPONENTS
            for t, info in sorted(manifest["components"][c]["tensors"].items())
        ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _page_plan(files: dict[str, Any], family: str) -> list[tuple[Any, tuple[str, ...]]]:
    from cosyserve.bundle.official import module_class

    def row_tables(name: str) -> tuple[str, ...]:
        return getattr(module_class(name, family), "ROW_TABLES", ()) if name in COMPONENTS else ()

    return [(f, row_tables(name)) for name, f in sorted(files.items(), key=lambda kv: -kv[1].size)]


def _read_all(plan: list[tuple[Any, tuple[str, ...]]]) -> None:
    for f, row_tables in plan:
        f.populate(row_tables)


def read_all(parts: LoadedParts) -> None:
    """Read the mapped pages now, in the calling thread."""
    _read_all(parts.page_plan())


def start_prefetch(parts: LoadedParts) -> threading.Thread:
    """Read the mapped pages in a background daemon thread (after READY), so requests find them resident."""
    t = threading.Thread(target=_read_all, args=(parts.page_plan(),), name="cosyserve-prefetch", daemon=True)
    t.start()
    parts.prefetch_thread = t
    return t


def open_bundle(path: str | Path) -> Bundle:
    """Read and check a bundle's manifest (format, version, components). Raises :class:`BundleError`."""
    path = Path(path)
    mpath = path / "manifest.json"
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise BundleError(
            f"{path} is not a bundle: no manifest.json (convert a model dir with `cosyserve convert`)"
        ) from e
    except (OSError, ValueError) as e:
        raise BundleError(f"cannot read {mpath}: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != BUNDLE_FORMAT:
        raise BundleError(f"{mpath}: not a cosyserve bundle manifest")
    if manifest.get("version") not in BUNDLE_VERSIONS:
        raise BundleError(
            f"{mpath}: bundle format version {manifest.get('version')!r}, this cosyserve reads versions "
            f"{', '.join(map(str, BUNDLE_VERSIONS))}: convert the model dir again"
        )
    for name in COMPONENTS:
        if name not in manifest.get("components", {}):
            raise BundleError(f"{mpath}: no {name!r} component")
        quantize = manifest["components"][name].get("quantize", "none")
        if quantize not in ("none", "int8") or (quantize != "none" and name != "llm"):
            raise BundleError(f"{mpath}: component {name!r}: unknown quantization {quantize!r}")
    from cosyserve.families import family_named

    try:
        known = set(family_named(manifest.get("family", DEFAULT_FAMILY)).bundle_files)
    except ValueError as e:
        raise BundleError(f"{mpath}: {e}") from None
    for extra in manifest.get("extras", {}):
        if extra not in known:
            raise BundleError(f"{mpath}: unknown extra file {extra!r}")
    return Bundle(path, manifest)
