"""The package's layout: its layers, what each may import, no import cycle, and an entry-point-only root.

The layers are DESIGN.md's (data flows down, imports point down), as folders of ``src/cosyserve``. Every module's
imports are read with ``ast``: those at module level and those inside functions alike (a late import is still an
import: it only runs later), leaving out ``if TYPE_CHECKING:`` blocks (they never run). Import strings
(``"module:attr"`` in a registry's table: ``RUNTIMES``, ``FAMILIES``, a family's classes) are data read by the
layer that imports them; they are checked to name what exists.
"""

from __future__ import annotations

import ast
import fnmatch
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "cosyserve"

# The layers, top first. A module may import its own layer and any layer in a row below its own; layers in one row
# are siblings and import neither each other nor anything above.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("cli",),  # the command line
    ("tools", "deploy"),  # what the CLI runs beside serving; the Ray Serve deployment of the app
    ("server", "api"),  # the ASGI app and its transports; the Python API (cosyserve.load)
    ("engine",),  # the engine, its workers and streams, the model pool
    ("runtime",),  # the Runtime interface, the torch and lite runtimes, the pipeline, the decode loop
    ("voices",),  # registered voices: the registry, its place, their states, the consent ledger
    (
        "bundle",
    ),  # official dirs read, converted (graphs exported) into bundles, bundles opened; model sources
    ("families",),  # one folder per model family: what it is made of and how its parts are built
    ("frontend",),  # text, tokenizers, audio features, the prompt frontend's ONNX models
    (
        "models",
    ),  # the model math: PyTorch modules, and their numpy twins the lite runtime runs beside its graphs
    ("system",),  # process and OS helpers: the page cache, the garbage collector, devices, atomic files
    ("core",),  # the request and its limits, settings, errors, the stop signal, text feeds, the sampler
)

# What each layer holds: modules by name, a package with everything under it, or a pattern. The most specific
# entry wins (a pattern or a module over its package).
HOLDS: dict[str, tuple[str, ...]] = {
    "cli": ("cosyserve.__main__", "cosyserve.cli"),
    # a family's conformance cases are the conformance tool's, kept in the family's folder (the family names them
    # by import string; they drive the runtimes' LM interface, above the families)
    "tools": ("cosyserve.tools", "cosyserve.families.*.conformance"),
    "deploy": ("cosyserve.deploy",),
    "server": ("cosyserve.server",),
    "api": ("=cosyserve", "cosyserve.api"),  # "=": the package's own __init__ (its load() calls the API)
    "engine": ("cosyserve.engine",),
    "runtime": ("cosyserve.runtime",),
    "voices": ("cosyserve.voices",),
    # bundle sits above families: it reads and builds a model dir by asking its family (what its files, configs
    # and modules are); the families never import bundle
    "bundle": ("cosyserve.bundle",),
    "families": ("cosyserve.families",),
    "frontend": ("cosyserve.frontend",),
    "models": ("cosyserve.models",),
    "system": ("cosyserve.system",),
    "core": ("cosyserve.core",),
}

# the package root holds these modules and folders of the layers, nothing else
ENTRY_POINTS = ("cosyserve", "cosyserve.__main__", "cosyserve.api", "cosyserve.cli")

# dotted strings under "cosyserve." that are names, not modules: loggers and a model file's metadata key
NOT_MODULES = ("cosyserve.access", "cosyserve.prefork", "cosyserve.progress", "cosyserve.onnx_compat")


@cache
def modules() -> dict[str, tuple[Path, bool]]:
    """module name -> (its file, whether it is a package's __init__)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


@cache
def _source(path: Path) -> str:
    return path.read_text(encoding="utf-8")


@cache
def _tree(path: Path) -> ast.Module:
    """``path`` parsed, once for every test of this file."""
    return ast.parse(_source(path))


def _resolve(name: str) -> str:
    """The module an imported dotted name is (or is in)."""
    known = modules()
    while name not in known:
        name = name.rpartition(".")[0]
    return name


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports_of(name: str, path: Path, package: bool) -> dict[str, int]:
    """{each cosyserve module ``name`` imports: the line of its first import}, at any depth, without TYPE_CHECKING
    blocks."""
    base = name if package else name.rpartition(".")[0]
    found: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        target = _resolve(target)
        if target != name:
            found.setdefault(target, line)

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child.test):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.split(".")[0] == "cosyserve":
                        add(alias.name, child.lineno)
            elif isinstance(child, ast.ImportFrom):
                source = child.module or ""
                if child.level:
                    root = base
                    for _ in range(child.level - 1):
                        root = root.rpartition(".")[0]
                    source = f"{root}.{source}" if source else root
                if source.split(".")[0] == "cosyserve":
                    for alias in child.names:  # `from package import module` imports the module
                        full = f"{source}.{alias.name}"
                        add(full if full in modules() else source, child.lineno)
            visit(child)

    visit(_tree(path))
    return found


@cache
def imports() -> dict[str, dict[str, int]]:
    """module -> the cosyserve modules it imports (see :func:`_imports_of`)."""
    return {name: _imports_of(name, path, package) for name, (path, package) in modules().items()}


def layer_of(module: str) -> str | None:
    """The layer holding ``module`` (None: none does)."""
    best: tuple[int, str] | None = None
    for layer, held in HOLDS.items():
        for entry in held:
            if entry.startswith("="):
                score = 1000 if module == entry[1:] else -1
            elif "*" in entry:
                score = 500 if fnmatch.fnmatchcase(module, entry) else -1
            else:
                score = len(entry) if module == entry or module.startswith(entry + ".") else -1
            if score >= 0 and (best is None or score > best[0]):
                best = (score, layer)
    return best[1] if best else None


def _where(module: str, line: int) -> str:
    return f"{modules()[module][0].relative_to(PACKAGE.parents[1])}:{line}"


def test_the_layer_table_is_whole() -> None:
    """Each layer is in one row and holds something; a failure means the table above was edited wrongly."""
    rows = [layer for row in LAYERS for layer in row]
    assert sorted(rows) == sorted(HOLDS) and len(rows) == len(set(rows)), (rows, sorted(HOLDS))


def test_every_module_is_in_a_layer_and_the_root_holds_entry_points_only() -> None:
    """A new module at the package root, or in a folder no layer holds, fails here: put it in its layer's folder
    (or add the folder to the table, in its place among the layers)."""
    stray = []
    for name, (_, package) in modules().items():
        parts = name.split(".")
        if len(parts) == 2 and not package and name not in ENTRY_POINTS:
            stray.append(f"{name}: a module at the package root that is not an entry point")
        elif layer_of(name) is None:
            stray.append(f"{name}: in no layer of tests/test_layout.py's HOLDS")
    assert not stray, "\n".join(stray)


def test_imports_point_down() -> None:
    """No module imports a layer above its own or a sibling layer, at module level or inside a function: data
    flows down (DESIGN.md). A failure names the import; move what is misplaced rather than hiding the import."""
    row = {layer: i for i, layers in enumerate(LAYERS) for layer in layers}
    up = []
    for module, targets in imports().items():
        mine = layer_of(module)
        for target, line in targets.items():
            theirs = layer_of(target)
            if mine is None or theirs is None:
                continue  # a module in no layer: the test above names it
            if theirs != mine and row[theirs] <= row[mine]:
                up.append(f"{_where(module, line)}: {module} ({mine}) imports {target} ({theirs})")
    assert not up, f"{len(up)} imports point up or sideways:\n" + "\n".join(sorted(up))


def test_no_import_cycle() -> None:
    """No cycle among the modules' imports, module-level or late: each strongly connected component of the import
    graph is one module. A cycle found here is printed with the import that closes each of its edges."""
    graph = imports()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm (the graph is ~150 modules: recursion is fine)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    shown = [
        "\n".join(
            f"  {_where(a, line)}: {a} imports {b}"
            for a in cycle
            for b, line in graph[a].items()
            if b in cycle
        )
        for cycle in cycles
    ]
    assert not cycles, f"{len(cycles)} import cycles:\n" + "\n\n".join(shown)


def _defines(module: str, attr: str) -> bool:
    """Whether ``module``'s source binds ``attr`` at its top level (read, not imported: no torch)."""
    tree = _tree(modules()[module][0])
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == attr:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == attr for t in targets):
                return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name.split(".")[0]) == attr for a in node.names):
                return True
    return f"{module}.{attr}" in modules()


def test_import_strings_name_what_exists() -> None:
    """Every ``"cosyserve.x:attr"`` or ``"cosyserve.x"`` string in the package (the runtimes', families' and
    conformance kinds' tables, ``python -m`` targets) names a module that exists, and the attribute it defines: a
    move that missed a table fails here, not on the first request that reads it."""
    stale = []
    for module, (path, _) in modules().items():
        for node in ast.walk(_tree(path)):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                continue
            text = node.value
            if not text.startswith("cosyserve.") or text in NOT_MODULES or any(c in text for c in " /{%"):
                continue
            target, _, attr = text.partition(":")
            if target in modules():
                if attr and not _defines(target, attr):
                    stale.append(f"{_where(module, node.lineno)}: {text!r}: {target} defines no {attr}")
            elif attr or target.rpartition(".")[0] not in modules() or not _defines(*target.rsplit(".", 1)):
                stale.append(f"{_where(module, node.lineno)}: {text!r} names no module (or module attribute)")
    assert not stale, "\n".join(stale)


# STYLE.md §1 and issue 32 item 5: a module is one idea of at most 600 lines, a function at most 100 (from its first
# decorator to its last line; a nested function counts in its own right and in the one holding it)
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 100

# the exceptions, each with its reason: "path" for a file, "path:qualified.name" for a function. An entry that is
# no longer over its limit fails too, so the list only shrinks.
OVERSIZE: dict[str, str] = {
    "core/settings.py": "the settings declaration table: every env var, TOML key and flag declared once (issue 32)",
}


def _sizes() -> dict[str, int]:
    """'path' -> its lines, and 'path:qualified.name' -> each function's lines, for every module of the package."""
    out: dict[str, int] = {}

    def visit(body: list[ast.stmt], rel: str, prefix: str) -> None:
        # statements only: a function is always one (in a class, a function, or an if/try/with/for block)
        for node in body:
            name = prefix
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{node.name}."
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                out[f"{rel}:{name[:-1]}"] = (node.end_lineno or node.lineno) - first + 1
            for field in ("body", "orelse", "finalbody"):
                visit(getattr(node, field, []), rel, name)
            for handler in getattr(node, "handlers", []):
                visit(handler.body, rel, name)
            for case in getattr(node, "cases", []):
                visit(case.body, rel, name)

    for path, _ in modules().values():
        rel = path.relative_to(PACKAGE).as_posix()
        text = _source(path)
        out[rel] = text.count("\n") + (not text.endswith("\n") and bool(text))
        visit(_tree(path).body, rel, "")
    return out


def test_files_and_functions_stay_small() -> None:
    """No module over 600 lines and no function over 100 (STYLE.md: one idea per file; issue 32: a house that shows
    its structure). A failure names each offender and its size: split it by what it does (a module per idea, a
    helper per step, a table for what is data), or, for a justified exception, add it to OVERSIZE with the reason.
    """
    sizes = _sizes()
    over = [
        f"{key}: {n} lines (limit {MAX_FUNCTION_LINES if ':' in key else MAX_FILE_LINES})"
        for key, n in sorted(sizes.items())
        if n > (MAX_FUNCTION_LINES if ":" in key else MAX_FILE_LINES) and key not in OVERSIZE
    ]
    stale = [
        f"{key}: in OVERSIZE but {'gone' if key not in sizes else f'{sizes[key]} lines, within its limit'}"
        for key in OVERSIZE
        if sizes.get(key, 0) <= (MAX_FUNCTION_LINES if ":" in key else MAX_FILE_LINES)
    ]
    assert not over and not stale, "\n".join(over + stale)
