"""The consent ledger: an append-only record, beside a tenant's registered voices, of who registered which
recording with what consent, and when it was deleted (``consent.jsonl``, one JSON line per event). It outlives
the voice it is about. The voices API (:mod:`cosyserve.server.transports.voices`) writes and reads it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["CONSENT_FILE", "ConsentLedger"]

CONSENT_FILE = "consent.jsonl"


class ConsentLedger:
    """The append-only consent records of a registry (one JSON line per registration or deletion, per tenant).

    Args:
        root: the registry's folder (its tenants' folders hold their ledger).
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, tenant: str) -> Path:
        from cosyserve.voices.registry import validate_tenant

        return self.root / validate_tenant(tenant) / CONSENT_FILE

    def record(self, tenant: str, entry: dict[str, Any]) -> None:
        """Append ``entry``, synced to disk before this returns (an O_APPEND write: whole lines, whoever writes)."""
        path = self.path(tenant)
        path.parent.mkdir(parents=True, exist_ok=True)
        line = (json.dumps(entry, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)

    def current(self, tenant: str) -> dict[str, dict[str, Any]]:
        """Each voice name -> its latest registration record, unless a deletion came after it."""
        try:
            text = self.path(tenant).read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        out: dict[str, dict[str, Any]] = {}
        for line in text.splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line cut by a crash mid-write: the records before and after it stand
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                continue
            if entry.get("event") == "create":
                out[entry["name"]] = entry
            elif entry.get("event") == "delete":
                out.pop(entry["name"], None)
        return out
