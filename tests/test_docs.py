"""The README and docs/ against the code: the README's two first commands are CI's, every `cosyserve` command line
in a fenced bash block parses with the CLI's own parser, every Python example compiles, every link to a page (and
a heading of it) resolves, and the README's model table names every family's hub ids. Cheap: no network, no
model, no server."""

from __future__ import annotations

import re
import shlex
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
SETUP = "bash scripts/setup.sh"
TESTS = ".venv/bin/python -m pytest -q"


def _blocks(text: str, lang: str) -> list[str]:
    """The fenced blocks of ``lang``, those indented in a list item too (dedented)."""
    found = re.findall(rf"^([ \t]*)```{lang}\n(.*?)^[ \t]*```", text, re.S | re.M)
    return [textwrap.dedent(indent + block) for indent, block in found]


def _commands(block: str) -> list[list[str]]:
    """Each shell command of a bash block that runs cosyserve, as its words: continuation lines joined, comments,
    redirections, VAR=value prefixes and the other commands of a pipeline or list dropped."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        # quotes kept whole, `#` starts a comment
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True  # words split at blanks and operators only (not at 英文女's letters)
        words: list[str] = []
        tokens = list(lexer)
        i = 0
        while i <= len(tokens):
            token = tokens[i] if i < len(tokens) else ";"
            if token in {"|", "||", "&&", ";", "&"}:
                while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
                    words.pop(0)
                if words and Path(words[0]).name == "cosyserve":
                    out.append(words)
                words = []
            elif set(token) <= set("<>&") and ("<" in token or ">" in token):
                if words and words[-1].isdigit():  # the 2 of 2>&1
                    words.pop()
                i += 1  # the redirection's target
            else:
                words.append(token)
            i += 1
    return out


def test_readme_first_screen_holds_the_setup_and_the_test_command_ci_runs() -> None:
    """If this fails, the README's first screen no longer shows the two commands a newcomer runs (set-up and
    main job; tests), or CI (.ci/run) no longer runs exactly the README's test command."""
    first_screen = "\n".join(README.read_text(encoding="utf-8").splitlines()[:40])
    (block,) = [b for b in _blocks(first_screen, "bash") if SETUP in b]
    lines = [ln.split("  #", 1)[0].strip() for ln in block.splitlines()]
    assert lines[:2] == [SETUP, TESTS], lines
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    assert SETUP in ci and TESTS in ci, "CI must run the README's two commands"


def test_readme_activates_the_venv_before_its_first_bare_cosyserve() -> None:
    """If this fails, a newcomer following the README types `cosyserve` before being told to activate .venv (the
    command lives there) and gets `command not found`."""
    text = README.read_text(encoding="utf-8")
    assert text.index("source .venv/bin/activate") < text.index("\ncosyserve ")


def test_every_documented_command_line_parses_with_the_cli() -> None:
    """If this fails, the README or a page of docs/ shows a `cosyserve` command line (a subcommand, a flag or a
    `synth --out` extension) that the CLI does not accept: the docs have drifted from the CLI."""
    from cosyserve.cli.commands import OUT_FORMATS
    from cosyserve.cli.parser import build_parser

    parser = build_parser()
    seen: dict[str, int] = {}
    for page in PAGES:
        for block in _blocks(page.read_text(encoding="utf-8"), "bash"):
            for words in _commands(block):
                command, argv = shlex.join(words), words[1:]
                try:
                    args = parser.parse_args(argv)
                except SystemExit:
                    pytest.fail(f"{page.relative_to(ROOT)}: the CLI refuses `{command}`")
                if args.command == "synth":
                    assert Path(args.out).suffix in OUT_FORMATS, f"{page.name}: {command}"
                seen[args.command] = seen.get(args.command, 0) + 1
    # the extraction itself must find what the pages hold, or this test would pass on nothing
    wanted = {"serve", "synth", "convert", "speakers", "conformance", "startup-report", "quality"}
    assert wanted <= set(seen), seen


def test_every_python_example_compiles() -> None:
    """If this fails, a ```python example of the README or docs/ is not valid Python (a newcomer's paste fails
    before it runs)."""
    count = 0
    for page in PAGES:
        for i, block in enumerate(_blocks(page.read_text(encoding="utf-8"), "python")):
            compile(block, f"{page.name} python block {i + 1}", "exec")
            count += 1
    assert count >= 6, count


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (but - and _), blanks to -."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_link_to_a_page_resolves() -> None:
    """If this fails, the README or a page of docs/ links to a file that does not exist (a page renamed or never
    written) or to a heading that page does not have; and every page of docs/ must be linked from the README."""
    linked = set()
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            assert file.exists(), f"{page.relative_to(ROOT)} links to {target}: no such file"
            if page == README:
                linked.add(file)
            if anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", file.read_text(encoding="utf-8"), re.M)
                assert anchor in {_slug(h) for h in headings}, f"{page.relative_to(ROOT)} links to {target}"
    assert set(PAGES[1:]) <= linked, f"pages the README does not link: {set(PAGES[1:]) - linked}"


def test_readme_model_table_names_every_family_hub_id() -> None:
    """If this fails, a model family gained or renamed a hub id that the README's model table does not show."""
    from cosyserve.families import FAMILIES, family_named

    text = README.read_text(encoding="utf-8")
    table = text[: text.index("\n## ")]
    for name in FAMILIES:
        for hub_id in family_named(name).hub_ids:
            name = hub_id.split("/", 1)[1]
            assert hub_id in table or (name in table and hub_id.split("/")[0] + "/" in table), hub_id


def test_architecture_table_lists_the_layers_test_layout_checks() -> None:
    """If this fails, docs/architecture.md's table of layers no longer matches tests/test_layout.py's LAYERS (the
    layers the imports are checked against), top to bottom: a layer added, moved or renamed without the page."""
    from test_layout import LAYERS

    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = re.search(r"^\| layer \| where \|.*?\n\n", text, re.S | re.M)
    assert table is not None, "the table of layers (| layer | where | ...) is gone"
    rows = [line.split("|")[1].strip() for line in table.group(0).strip().splitlines()[2:]]
    assert rows == [layer for row in LAYERS for layer in row]
