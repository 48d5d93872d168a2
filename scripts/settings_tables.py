"""Write the README's settings tables from the declarations in ``cosyserve/core/settings.py``.

    .venv/bin/python scripts/settings_tables.py            # rewrite README.md's tables
    .venv/bin/python scripts/settings_tables.py --check    # exit 1 if they are stale

Each table sits between ``<!-- settings:GROUP -->`` and ``<!-- /settings:GROUP -->`` (groups: cli, serve, pool,
load); tests/test_settings.py fails when one is stale.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from cosyserve.core.settings import Setting, declared

GROUPS = ("cli", "serve", "pool", "load")
README = Path(__file__).resolve().parents[1] / "README.md"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def tables() -> dict[str, str]:
    """group -> the markdown table of its settings; a column none of the group's settings has is left out."""
    columns = (
        ("variable", lambda s: s.env),
        ("flag", lambda s: s.flag),
        ("`[pool]` key", lambda s: s.key),
    )
    out = {}
    for group in GROUPS:
        rows: list[Setting] = [s for s in declared() if s.group == group]
        cols = [(title, get) for title, get in columns if any(get(s) for s in rows)]
        head = [title for title, _ in cols] + ["default", "meaning"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for s in rows:
            cells = [f"`{get(s)}`" if get(s) else "" for _, get in cols]
            cells += [_cell(s.shown_default()), _cell(s.doc)]
            lines.append("| " + " | ".join(cells) + " |")
        out[group] = "\n".join(lines)
    return out


def _block(group: str, table: str) -> str:
    return f"<!-- settings:{group} -->\n{table}\n<!-- /settings:{group} -->"


def update(path: Path = README, *, check: bool = False) -> list[str]:
    """Write the tables into ``path`` between their markers.

    Args:
        path: the README.
        check: only compare, write nothing.
    Returns:
        The groups whose table was (or, with ``check``, would be) changed; a group without markers counts too.
    """
    text = path.read_text(encoding="utf-8")
    changed = []
    for group, table in tables().items():
        m = re.search(rf"<!-- settings:{group} -->.*?<!-- /settings:{group} -->", text, re.S)
        if m is None or m.group(0) != _block(group, table):
            changed.append(group)
        if m is not None:
            text = text[: m.start()] + _block(group, table) + text[m.end() :]
    if changed and not check:
        path.write_text(text, encoding="utf-8")
    return changed


if __name__ == "__main__":
    check = "--check" in sys.argv[1:]
    stale = update(check=check)
    if stale:
        print(f"README settings tables {'stale' if check else 'rewritten'}: {', '.join(stale)}")
    sys.exit(1 if stale and check else 0)
