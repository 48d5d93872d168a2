"""Read an official ``cosyvoice.yaml`` as data and map it onto our config dataclasses.

The official file is a hyperpyyaml document: ``!new:pkg.Class`` builds an object, ``!name:pkg.fn`` binds a
function, ``!apply:pkg.fn`` calls one, ``!ref <key>`` points at another key. We execute none of it. A safe
YAML loader turns every tag into a :class:`Tagged` record, ``!ref`` is resolved by lookup, and
:func:`build_config` maps each record onto the dataclass declared for that field, checking the class name the
tag names, every key (unknown keys and missing required keys are errors that name the key and the file) and
every value's type.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from cosyserve.core.errors import ModelConfigError

__all__ = [
    "ModelConfig",
    "ModelConfigError",
    "Tagged",
    "build_config",
    "build_model_config",
    "config_tree",
    "load_model_config",
    "load_yaml_config",
    "read_model_yaml",
    "read_yaml",
]


@dataclass(frozen=True)
class Tagged:
    """A hyperpyyaml tag kept as data: ``kind`` is new/name/apply, ``target`` the dotted name it points at."""

    kind: str
    target: str
    value: Any


@dataclass(frozen=True)
class _Ref:
    key: str


@dataclass(frozen=True)
class _RefExpr:
    """``!ref <a> * <b>``: arithmetic over references and numbers (hyperpyyaml evaluates it as Python)."""

    text: str
    keys: tuple[str, ...]


_REF_RE = re.compile(r"^<([A-Za-z_][\w.]*)>$")
_REF_ANY = re.compile(r"<([A-Za-z_][\w.]*)>")
_ARITH_RE = re.compile(r"^[\s\d.+\-*/()]*$")


def _construct_tagged(kind: str):  # type: ignore[no-untyped-def]
    import yaml

    def construct(loader: Any, suffix: str, node: Any) -> Tagged:
        if isinstance(node, yaml.MappingNode):
            value: Any = loader.construct_mapping(node, deep=True)
        elif isinstance(node, yaml.SequenceNode):
            value = loader.construct_sequence(node, deep=True)
        else:
            raw = loader.construct_scalar(node)
            value = None if raw in ("", None) else raw
        return Tagged(kind, suffix, value)

    return construct


def _construct_ref(loader: Any, node: Any) -> _Ref | _RefExpr:
    text = str(loader.construct_scalar(node)).strip()
    m = _REF_RE.match(text)
    if m:
        return _Ref(m.group(1))
    keys = tuple(_REF_ANY.findall(text))
    if keys and _ARITH_RE.match(_REF_ANY.sub("0", text)):
        return _RefExpr(text, keys)
    raise ModelConfigError(
        f"unsupported !ref expression {text!r} at line {node.start_mark.line + 1}: "
        "only references like <key> or <a.b>, or arithmetic (+ - * /) over them and numbers, are understood"
    )


def _arith(text: str) -> int | float:
    """Evaluate ``text``, numbers and + - * / and parentheses only, without eval()."""
    import ast
    import operator

    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}

    def ev(n: ast.AST) -> int | float:
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant) and type(n.value) in (int, float):
            return n.value
        if isinstance(n, ast.BinOp) and type(n.op) in ops:
            return ops[type(n.op)](ev(n.left), ev(n.right))
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            return -ev(n.operand)
        raise ValueError(f"not arithmetic: {ast.dump(n)}")

    return ev(ast.parse(text, mode="eval"))


@functools.cache
def _loader() -> type:
    """The safe loader with the hyperpyyaml tags as data; built on first use (importing yaml costs ~15 ms, and a
    start from a bundle never reads YAML)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    for kind in ("new", "name", "apply"):
        Loader.add_multi_constructor(f"!{kind}:", _construct_tagged(kind))
    Loader.add_constructor("!ref", _construct_ref)
    return Loader


# hyperpyyaml also knows !copy, !tuple, !include, !PLACEHOLDER; none appear in CosyVoice configs. Without a
# constructor the safe loader refuses them with an error naming the tag and line, which is what we want.


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Parse a hyperpyyaml file safely into plain data with ``!ref`` resolved and tags kept as :class:`Tagged`.

    Args:
        path: the ``cosyvoice.yaml`` to read.
    Returns:
        The top-level mapping. Nothing in the file is imported, called or executed.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ModelConfigError(f"cannot read model config {path}: {e}") from e
    import yaml

    try:
        doc = yaml.load(text, Loader=_loader())  # noqa: S506 - the loader derives from SafeLoader
    except yaml.YAMLError as e:
        raise ModelConfigError(f"{path} is not valid YAML: {e}") from e
    if not isinstance(doc, dict):
        raise ModelConfigError(f"{path}: expected a mapping at the top level, got {type(doc).__name__}")
    return _resolve(doc, doc, path, "", set())


def _lookup(root: dict[str, Any], key: str, path: Path, where: str) -> Any:
    node: Any = root
    for part in key.split("."):
        if isinstance(node, Tagged):
            node = node.value
        if not isinstance(node, dict) or part not in node:
            raise ModelConfigError(f"{path}: !ref <{key}> at '{where}' points at a key that does not exist")
        node = node[part]
    return node


def _resolve(node: Any, root: dict[str, Any], path: Path, where: str, active: set[str]) -> Any:
    if isinstance(node, _Ref):
        if node.key in active:
            raise ModelConfigError(f"{path}: !ref <{node.key}> at '{where}' is circular")
        target = _lookup(root, node.key, path, where)
        return _resolve(target, root, path, where, active | {node.key})
    if isinstance(node, _RefExpr):
        expr = node.text
        for key in node.keys:
            value = _resolve(_Ref(key), root, path, where, active)
            if type(value) not in (int, float):
                raise ModelConfigError(
                    f"{path}: !ref {node.text} at '{where}': <{key}> is {value!r}, not a number"
                )
            expr = expr.replace(f"<{key}>", repr(value))
        try:
            return _arith(expr)
        except (ValueError, SyntaxError, ZeroDivisionError) as e:
            raise ModelConfigError(f"{path}: !ref {node.text} at '{where}' cannot be evaluated: {e}") from e
    if isinstance(node, Tagged):
        return Tagged(node.kind, node.target, _resolve(node.value, root, path, where, active))
    if isinstance(node, dict):
        return {
            k: _resolve(v, root, path, f"{where}.{k}" if where else str(k), active) for k, v in node.items()
        }
    if isinstance(node, list):
        return [_resolve(v, root, path, f"{where}[{i}]", active) for i, v in enumerate(node)]
    return node


def _unwrap_dictconfig(node: Tagged) -> Any:
    # `!new:omegaconf.DictConfig {content: {...}}` is only a wrapper around a mapping.
    if (
        node.target == "omegaconf.DictConfig"
        and isinstance(node.value, dict)
        and set(node.value) == {"content"}
    ):
        return node.value["content"]
    return node.value


def build_config(cls: type, node: Any, *, source: str | Path = "<config>", where: str = "") -> Any:
    """Map parsed yaml data onto the dataclass ``cls``, recursively, checking tags, keys and value types.

    Args:
        cls: a dataclass; may declare ``TARGET: ClassVar[str]``, the dotted class name the yaml tag must name.
        node: a :class:`Tagged` record or a plain mapping.
        source: the file, for error messages.
        where: the key path of ``node``, for error messages.
    Returns:
        An instance of ``cls``.
    """
    target = getattr(cls, "TARGET", None)
    if isinstance(node, Tagged):
        if target is not None and node.target != target:
            raise ModelConfigError(
                f"{source}: '{where}' is {node.target}, but cosyserve supports only {target} there"
            )
        node = _unwrap_dictconfig(node)
    if node is None:
        node = {}
    if not isinstance(node, dict):
        raise ModelConfigError(
            f"{source}: '{where}' should be a mapping of {cls.__name__} arguments, got {node!r}"
        )
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(node) - set(fields))
    if unknown:
        raise ModelConfigError(
            f"{source}: unknown key(s) {', '.join(repr(_join(where, k)) for k in unknown)} for {cls.__name__}; "
            f"known keys: {', '.join(sorted(fields))}"
        )
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        key = _join(where, name)
        if name not in node:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ModelConfigError(f"{source}: missing required key '{key}' for {cls.__name__}")
            continue
        kwargs[name] = _coerce(hints[name], node[name], source, key)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ModelConfigError(f"{source}: invalid values for '{where or cls.__name__}': {e}") from e


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _coerce(tp: Any, value: Any, source: str | Path, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, source, key)
            except ModelConfigError as e:
                errors.append(str(e))
        raise ModelConfigError(errors[-1] if errors else f"{source}: bad value for '{key}'")
    if dataclasses.is_dataclass(tp):
        return build_config(tp, value, source=source, where=key)
    if isinstance(value, Tagged):
        raise ModelConfigError(
            f"{source}: '{key}' is a !{value.kind}:{value.target} object where a {_tname(tp)} belongs"
        )
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        if not isinstance(value, list):
            raise ModelConfigError(f"{source}: '{key}' should be a list, got {value!r}")
        return [_coerce(item, v, source, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        _, val_t = typing.get_args(tp) or (str, Any)
        if not isinstance(value, dict):
            raise ModelConfigError(f"{source}: '{key}' should be a mapping, got {value!r}")
        return {str(k): _coerce(val_t, v, source, f"{key}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-06" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    elif origin is typing.Literal:
        if value in typing.get_args(tp):
            return value
        raise ModelConfigError(f"{source}: '{key}' must be one of {typing.get_args(tp)}, got {value!r}")
    else:
        return value
    raise ModelConfigError(f"{source}: '{key}' should be {_tname(tp)}, got {value!r}")


def _tname(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


# The top-level keys a CosyVoice-300M yaml carries besides the model: training, data pipeline and GAN entries.
# They are read (so a typo in them is still a YAML error) but not mapped: serving never uses them.
_IGNORED_TOP_LEVEL = re.compile(
    r"^(__set_seed\d*|text_encoder_input_size|llm_input_size|llm_output_size|spk_embed_dim|qwen_pretrain_path|"
    r"token_frame_rate|token_mel_ratio|chunk_size|num_decoding_left_chunks|mel_spec_transform\d*|hifigan|"
    r"parquet_opener|tokenize|filter|resample|truncate|feat_extractor|compute_fbank|compute_f0|parse_embedding|"
    r"shuffle|sort|batch|padding|data_pipeline\w*|train_conf\w*|get_tokenizer|allowed_special|compute_whisper_fbank)$"
)


@dataclass
class ModelConfig:
    """The parts of ``cosyvoice.yaml`` that serving needs."""

    sample_rate: int
    llm: Any
    flow: Any
    hift: Any
    source: str = ""
    family: str = "cosyvoice"  # cosyvoice (the 300M family), cosyvoice2 or cosyvoice3
    chunk_size: int = 25  # CosyVoice2/3: the streaming hop and the flow's attention chunk, in tokens
    # the yaml's prompt mel extractor (MelSpectrogramConfig) where the family reads it (CosyVoice2/3), else None
    feat_extractor: Any = None

    KNOWN: ClassVar[tuple[str, ...]] = ("sample_rate", "llm", "flow", "hift")

    @property
    def family_spec(self) -> Any:
        """The :class:`~cosyserve.families.base.Family` this config is of."""
        from cosyserve.families import family_named

        return family_named(self.family)


def build_model_config(tree: Any, *, source: str | Path, where: str = "") -> ModelConfig:
    """The :class:`ModelConfig` of a parsed config tree: the one builder for an official dir's yaml
    (:func:`load_model_config`) and a bundle's manifest, which stores the same tree as plain data.

    Args:
        tree: a mapping with ``sample_rate``, ``llm``, ``flow`` and ``hift`` (yaml records or plain mappings).
        source: the file it was read from, for errors.
        where: the key path of ``tree`` in that file (``config`` in a manifest), for errors.
    Returns:
        The :class:`ModelConfig`. Raises :class:`ModelConfigError` naming the file and key for anything unusable.
    """
    if not isinstance(tree, dict):
        raise ModelConfigError(f"{source}: '{where or 'top level'}' should be a mapping, got {tree!r}")
    from cosyserve.families import family_named

    family = tree.get("family", "cosyvoice")
    try:
        spec = family_named(family)
    except ValueError as e:
        raise ModelConfigError(f"{source}: '{_join(where, 'family')}': {e}") from None
    LLMConfig, FlowConfig, HiFTConfig = (spec.config_class(c) for c in ("llm", "flow", "hift"))
    for key in ModelConfig.KNOWN:
        if key not in tree:
            raise ModelConfigError(
                f"{source}: missing required {'top-level ' if not where else ''}key '{_join(where, key)}'"
            )
    return ModelConfig(
        sample_rate=_coerce(int, tree["sample_rate"], source, _join(where, "sample_rate")),
        llm=build_config(LLMConfig, tree["llm"], source=source, where=_join(where, "llm")),
        flow=build_config(FlowConfig, tree["flow"], source=source, where=_join(where, "flow")),
        hift=build_config(HiFTConfig, tree["hift"], source=source, where=_join(where, "hift")),
        source=str(source),
        family=family,
        chunk_size=_coerce(int, tree.get("chunk_size", 25), source, _join(where, "chunk_size")),
        feat_extractor=_feat_extractor(tree.get("feat_extractor"), source, _join(where, "feat_extractor")),
    )


def _feat_extractor(node: Any, source: str | Path, where: str) -> Any:
    if node is None:
        return None
    from cosyserve.frontend.features import MelSpectrogramConfig

    return build_config(MelSpectrogramConfig, node, source=source, where=where)


def config_tree(cfg: ModelConfig) -> dict[str, Any]:
    """``cfg`` as plain data (what a bundle's manifest stores; :func:`build_model_config` reads it back)."""
    return {
        "family": cfg.family,
        "chunk_size": cfg.chunk_size,
        "sample_rate": cfg.sample_rate,
        **{k: dataclasses.asdict(getattr(cfg, k)) for k in ("llm", "flow", "hift")},
        **(
            {"feat_extractor": dataclasses.asdict(cfg.feat_extractor)}
            if cfg.feat_extractor is not None
            else {}
        ),
    }


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read an official model directory's yaml (its family's: ``cosyvoice.yaml``, ``cosyvoice2.yaml``,
    ``cosyvoice3.yaml``; see :mod:`cosyserve.families`) and build the LLM, flow and HiFT configs.

    Args:
        model_dir: an official model directory (or a CosyVoice-300M yaml file itself).
    Returns:
        A :class:`ModelConfig`. Raises :class:`ModelConfigError` naming the file and key for anything unusable.
    """
    from cosyserve.families import family_of, family_yamls

    path = Path(model_dir)
    if not path.is_dir():
        return load_yaml_config(path)
    family = family_of(path)
    if family is None:
        names = ", ".join(family_yamls().values())
        raise ModelConfigError(f"no model config in {path}: an official model dir holds one of {names}")
    return family.read_config(path)  # type: ignore[no-any-return]


def read_model_yaml(path: Path) -> dict[str, Any]:
    """An official model dir's yaml (a family's: :meth:`~cosyserve.families.base.Family.read_config` builds its
    :class:`ModelConfig` from it), parsed; refused when it is missing, when a top-level key is neither one serving
    reads nor one of the training keys it skips, or when a key serving needs is absent."""
    if not path.is_file():
        raise ModelConfigError(f"model config not found: {path} (an official model dir holds {path.name})")
    doc = read_yaml(path)
    unknown = sorted(k for k in doc if k not in ModelConfig.KNOWN and not _IGNORED_TOP_LEVEL.match(str(k)))
    if unknown:
        raise ModelConfigError(f"{path}: unknown top-level key(s) {', '.join(map(repr, unknown))}")
    for key in ModelConfig.KNOWN:
        if key not in doc:
            raise ModelConfigError(f"{path}: missing required top-level key '{key}'")
    return doc


def load_yaml_config(path: Path) -> ModelConfig:
    """The :class:`ModelConfig` of a CosyVoice-300M ``cosyvoice.yaml``."""
    return build_model_config(read_model_yaml(path), source=path)
