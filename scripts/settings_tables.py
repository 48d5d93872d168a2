"""Write the settings tables of docs/settings.md from the declarations in ``cosyserve/core/settings.py``.

    .venv/bin/python scripts/settings_tables.py            # rewrite docs/settings.md's tables
    .venv/bin/python scripts/settings_tables.py --check    # exit 1 if they are stale

Each table sits between ``<!-- settings:GROUP -->`` and ``<!-- /settings:GROUP -->`` (groups: cli, serve, pool,
load); tests/test_settings.py fails when one is stale. The same run writes ``cosyserve serve``'s exit codes
(``cosyserve.server.run.EXIT_CODES``, also its ``--help``) into docs/http-api.md between ``<!-- exit-codes -->``
and ``<!-- /exit-codes -->``, and the ``bench/`` scripts (each one's first docstring sentence) into
docs/performance.md between ``<!-- bench-scripts -->`` and ``<!-- /bench-scripts -->``; tests/test_settings.py fails
when either is stale.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from cosyserve.core.settings import Setting, declared

GROUPS = ("cli", "serve", "pool", "load")
SETTINGS_DOC = Path(__file__).resolve().parents[1] / "docs" / "settings.md"
HTTP_DOC = Path(__file__).resolve().parents[1] / "docs" / "http-api.md"
PERF_DOC = Path(__file__).resolve().parents[1] / "docs" / "performance.md"
BENCH = Path(__file__).resolve().parents[1] / "bench"


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


def exit_codes_table() -> str:
    """The markdown table of ``cosyserve serve``'s exit codes, from the table its ``--help`` prints."""
    from cosyserve.server.run import EXIT_CODES  # light: no server framework, no torch

    lines = ["| code | `cosyserve serve` exits with it when |", "|---|---|"]
    for code, meaning in EXIT_CODES:
        flagged = re.sub(r"(--[a-z-]+)", r"`\g<1>`", meaning)  # flags in code, as the other tables show them
        lines.append(f"| {code} | {_cell(flagged)} |")
    return "\n".join(lines)


def bench_table() -> str:
    """The markdown table of the ``bench/`` scripts: each script and the first sentence of its docstring."""
    import ast

    lines = ["| script | what it measures |", "|---|---|"]
    for script in sorted(BENCH.glob("*.py")):
        doc = ast.get_docstring(ast.parse(script.read_text(encoding="utf-8"))) or ""
        first = " ".join(doc.split("\n\n", 1)[0].split())
        first = re.split(r"(?<=\.)\s", first, maxsplit=1)[0].rstrip(".")
        lines.append(f"| `bench/{script.name}` | {_cell(first)} |")
    return "\n".join(lines)


def _replace(path: Path, blocks: dict[str, str], check: bool) -> list[str]:
    """Write each ``name -> block`` between ``<!-- name -->`` and ``<!-- /name -->`` in ``path``; the names whose
    block changed (or has no markers)."""
    text = path.read_text(encoding="utf-8")
    changed = []
    for name, table in blocks.items():
        block = f"<!-- {name} -->\n{table}\n<!-- /{name} -->"
        m = re.search(rf"<!-- {name} -->.*?<!-- /{name} -->", text, re.S)
        if m is None or m.group(0) != block:
            changed.append(name)
        if m is not None:
            text = text[: m.start()] + block + text[m.end() :]
    if changed and not check:
        path.write_text(text, encoding="utf-8")
    return changed


def update(path: Path = SETTINGS_DOC, *, check: bool = False) -> list[str]:
    """Write the settings tables into ``path`` between their markers.

    Args:
        path: the page that holds the tables (docs/settings.md).
        check: only compare, write nothing.
    Returns:
        The groups whose table was (or, with ``check``, would be) changed; a group without markers counts too.
    """
    blocks = {f"settings:{group}": table for group, table in tables().items()}
    return [name.split(":", 1)[1] for name in _replace(path, blocks, check)]


def update_exit_codes(path: Path = HTTP_DOC, *, check: bool = False) -> bool:
    """Write the exit codes' table into ``path`` (docs/http-api.md); True if it was (or would be) changed."""
    return bool(_replace(path, {"exit-codes": exit_codes_table()}, check))


def update_bench(path: Path = PERF_DOC, *, check: bool = False) -> bool:
    """Write the table of the bench/ scripts into ``path`` (docs/performance.md); True if it was (or would be)
    changed."""
    return bool(_replace(path, {"bench-scripts": bench_table()}, check))


if __name__ == "__main__":
    check = "--check" in sys.argv[1:]
    stale = update(check=check)
    stale += ["exit codes (docs/http-api.md)"] if update_exit_codes(check=check) else []
    stale += ["bench scripts (docs/performance.md)"] if update_bench(check=check) else []
    if stale:
        print(f"doc tables {'stale' if check else 'rewritten'}: {', '.join(stale)}")
    sys.exit(1 if stale and check else 0)
