"""The interfaces are the contracts used: read with ``ast``, no torch, no model.

- Whatever holds a :class:`cosyserve.runtime.Runtime` (an argument or attribute annotated ``Runtime``, a name
  ``runtime`` / ``rt``, an engine's or a model's ``.runtime``) reads only the members the protocol declares; a
  module that holds a concrete runtime (annotated ``TorchRuntime`` / ``LiteRuntime``: a tool of that runtime) reads
  that class's public members, never a private one.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

from cosyserve.runtime import Runtime

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "cosyserve"
CONCRETE = ("TorchRuntime", "LiteRuntime")
RUNTIME_NAMES = ("runtime", "rt")


def _protocol_members() -> set[str]:
    members = set(getattr(Runtime, "__protocol_attrs__", ()))
    if not members:  # Python < 3.12 keeps no such set: the annotations and the methods the class defines
        members = {n for n in vars(Runtime) if not n.startswith("_")} | set(Runtime.__annotations__)
    return members


def _annotation(node: ast.expr | None) -> str:
    return ast.unparse(node) if node is not None else ""


def _runtime_reads(tree: ast.Module) -> list[tuple[int, str, str]]:
    """(line, what holds it, member) for every member read on something holding a runtime."""
    found: list[tuple[int, str, str]] = []

    def holds_runtime(value: ast.expr, scope: dict[str, str]) -> tuple[bool, str]:
        # (whether it holds a runtime, the annotation that says which: "" when only its name says so)
        if isinstance(value, ast.Name):
            kind = scope.get(value.id, "")
            if any(c in kind for c in CONCRETE):
                return False, kind
            if "Runtime" in kind or value.id in RUNTIME_NAMES:
                return True, kind
        if isinstance(value, ast.Attribute) and value.attr == "runtime":
            return True, ""
        return False, ""

    def visit(node: ast.AST, scope: dict[str, str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            scope = dict(scope)
            args = node.args
            for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
                scope[a.arg] = _annotation(a.annotation)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            scope[node.target.id] = _annotation(node.annotation)
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            held, _ = holds_runtime(node.value, scope)
            if held:
                found.append((node.lineno, ast.unparse(node.value), node.attr))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and holds_runtime(node.args[0], scope)[0]
        ):
            found.append(
                (node.lineno, ast.unparse(node.args[0]), f"{node.func.id}({ast.unparse(node.args[1])})")
            )
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(tree, {})
    return found


@cache
def _tree(path: Path) -> ast.Module:
    # each module parsed once for the checks below
    return ast.parse(path.read_text(encoding="utf-8"))


def _modules_above_the_runtimes() -> list[Path]:
    # the runtimes' own modules implement the protocol (they read their own members); everything else holds one
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p.relative_to(PACKAGE).parts[0] != "runtime"]


def test_runtime_members_read_are_declared_in_the_protocol() -> None:
    """A member read on a runtime outside the runtime layer that the :class:`Runtime` protocol does not declare
    is a read around the interface (it works on one runtime and breaks on another, or on the tests' fake):
    declare it in the protocol (small, documented, every runtime implementing it) or use a declared member."""
    members = _protocol_members()
    around = []
    for path in _modules_above_the_runtimes():
        for line, holder, member in _runtime_reads(_tree(path)):
            if member not in members:
                around.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {holder}.{member}")
    assert not around, "members read around the Runtime protocol:\n" + "\n".join(around)


def test_the_check_sees_a_read_around_the_protocol() -> None:
    """The scanner above finds the reads it is meant to (else the test above could never fail)."""
    code = (
        "def f(runtime, eng, x: 'Runtime | None', t: 'TorchRuntime'):\n"
        "    runtime._lm; eng.runtime.pipeline; x.zero_shot_thread; t.pipeline\n"
        "    getattr(runtime, 'registry_root', None)\n"
    )
    got = {(holder, member) for _, holder, member in _runtime_reads(ast.parse(code))}
    assert got == {
        ("runtime", "_lm"),
        ("eng.runtime", "pipeline"),
        ("x", "zero_shot_thread"),
        ("runtime", "getattr('registry_root')"),
    }, got


def test_concrete_runtime_tools_read_no_private_member() -> None:
    """A tool of one runtime (annotated with its class) reads its public members only: a private one (``_lm``)
    is that runtime's to change."""
    private = []
    for path in _modules_above_the_runtimes():
        tree = _tree(path)
        concrete: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.arg) and any(c in _annotation(node.annotation) for c in CONCRETE):
                concrete.add(node.arg)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in concrete
                and node.attr.startswith("_")
            ):
                private.append(
                    f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.value.id}.{node.attr}"
                )
    assert not private, "\n".join(private)


# sample rates that stand for a family (CosyVoice-300M's 22.05 kHz, CosyVoice2/3's 24 kHz)
FAMILY_RATES = (22050, 24000)


def _family_tells(tree: ast.Module, families: set[str]) -> list[tuple[int, str]]:
    """(line, what) for each family named by a string and each comparison of a rate with a family's rate."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in families:
            found.append((node.lineno, f"names family {node.value!r}"))
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            rate = [s for s in sides if isinstance(s, ast.Constant) and s.value in FAMILY_RATES]
            if rate:
                found.append((node.lineno, f"compares with {rate[0].value} Hz: {ast.unparse(node)}"))
    return found


def test_no_module_outside_families_names_a_family_or_tells_it_by_its_rate() -> None:
    """Code outside ``families/`` asks a family (``family_of``, ``family_named`` of a manifest's name,
    ``DEFAULT_FAMILY``) and never compares its name or stands a sample rate for it (a 24 kHz check meaning
    "CosyVoice2/3"): a new family then is a folder and one line of ``FAMILIES``, not a hunt for every such check.
    ``models/`` is left out: its modules mirror the reference's, whose own configs switch on their rate (HiFT's
    SineGen below 22.05 kHz), which is the module's rule, not a family's."""
    from cosyserve.families import FAMILIES

    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] in ("families", "models"):
            continue
        for line, what in _family_tells(_tree(path), set(FAMILIES)):
            found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {what}")
    assert not found, "family rules outside families/:\n" + "\n".join(found)


def test_the_family_check_sees_names_and_rates() -> None:
    """The scanner above finds a family's name and a rate standing for a family (else its test could not fail)."""
    code = 'if family == "cosyvoice2" or resample_rate == 24000 or 22050 != sr:\n    pass\n'
    got = {what for _, what in _family_tells(ast.parse(code), {"cosyvoice2"})}
    assert got == {
        "names family 'cosyvoice2'",
        "compares with 24000 Hz: resample_rate == 24000",
        "compares with 22050 Hz: 22050 != sr",
    }, got


def test_every_token2wav_and_chunk_policy_implements_its_protocol() -> None:
    """The families' token2wav classes (both runtimes run them) take what the Token2Wav protocol passes, and their
    chunk policies are StreamPolicy instances: a runtime calls any of them the same way. If this fails, one
    family's token2wav grew a call the others lack (or lost one), and a runtime would need to tell them apart."""
    import inspect

    from cosyserve.families.base import StreamPolicy, Token2Wav
    from cosyserve.families.cosyvoice.streampolicy import StreamPolicy as Windows
    from cosyserve.families.cosyvoice.token2wav import Token2Wav as Windowed
    from cosyserve.families.cosyvoice2.token2wav import StreamPolicy2, Token2Wav2
    from cosyserve.families.cosyvoice3.token2wav import Token2Wav3

    assert isinstance(Windows(), StreamPolicy) and isinstance(StreamPolicy2(), StreamPolicy)
    wanted = set(inspect.signature(Token2Wav.__call__).parameters)
    for cls in (Windowed, Token2Wav2, Token2Wav3):
        assert wanted <= set(inspect.signature(cls.__call__).parameters), cls


def test_every_flow_and_vocoder_takes_what_its_protocol_passes() -> None:
    """The torch modules, the runtime's stacked stand-ins for them and the lite runtime's graphs take every
    argument a token2wav passes them (families.base's WindowedFlow, ChunkedFlow, CachedVocoder, StreamVocoder):
    the positional ones in their places, the keyword ones by name. If this fails, one of them grew or lost an argument that a family's
    token2wav relies on, and it breaks only on that runtime or with stacking on."""
    import inspect

    from cosyserve.families import base
    from cosyserve.models.causal_flow import ChunkFlow
    from cosyserve.models.causal_hift import CausalHiFTGenerator
    from cosyserve.models.flow import MaskedDiffWithXvec
    from cosyserve.models.hift import HiFTGenerator
    from cosyserve.runtime.lite.chunkflow import LiteCausalVocoder, LiteChunkFlow, LiteVocoder2
    from cosyserve.runtime.lite.models import LiteFlow, LiteVocoder
    from cosyserve.runtime.stacking import FlowBatcher, VocoderBatcher

    implementations = {
        base.WindowedFlow: (MaskedDiffWithXvec, FlowBatcher, LiteFlow),
        base.ChunkedFlow: (ChunkFlow, LiteChunkFlow),
        base.CachedVocoder: (HiFTGenerator, VocoderBatcher, LiteVocoder, LiteVocoder2),
        base.StreamVocoder: (CausalHiFTGenerator, LiteCausalVocoder),
    }
    wrong = []
    for protocol, classes in implementations.items():
        methods = [n for n, v in vars(protocol).items() if inspect.isfunction(v) and not n.startswith("_")]
        for cls in classes:
            for name in methods:
                wanted = list(inspect.signature(getattr(protocol, name)).parameters.values())
                got = list(inspect.signature(getattr(cls, name)).parameters.values())
                places = [a for a in got if a.kind is a.POSITIONAL_OR_KEYWORD]
                by_name = {a.name for a in got if a.kind in (a.POSITIONAL_OR_KEYWORD, a.KEYWORD_ONLY)}
                for i, arg in enumerate(wanted):
                    if arg.kind is arg.KEYWORD_ONLY:
                        ok = arg.name in by_name
                    else:
                        ok = i < len(places) and (
                            arg.default is arg.empty or places[i].default is not arg.empty
                        )
                    if not ok:
                        wrong.append(f"{cls.__name__}.{name}: {arg.name} ({protocol.__name__})")
    assert wrong == [], wrong
