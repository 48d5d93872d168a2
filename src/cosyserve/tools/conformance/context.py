"""What a conformance kind function gets: the set's paths, its parsed config and lazily loaded modules."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

__all__ = ["CaseContext"]


class CaseContext:
    """Shared, lazily built state for the cases of one fixture set (modules are loaded once per run)."""

    def __init__(self, set_dir: Path, model_dir: Path) -> None:
        self.set_dir = set_dir
        self.model_dir = model_dir
        self._modules: dict[str, Any] = {}
        self.cache: dict[str, Any] = {}  # per-family kinds keep their lazily built objects here
        self.bundle_dir: Path | None = None  # when set, modules come from this bundle instead of model_dir
        self.runtime = (
            "torch"  # "lite": the model kinds run on the bundle's lite graphs (conformance.kinds_lite)
        )
        self.llm_gemm = "auto"  # the torch LM's decode products (the llm_gemm setting, cosyserve.models.gemm)
        self._decode_linears = False

    @cached_property
    def family(self) -> Any:
        """The set's :class:`~cosyserve.families.base.Family`, from the yaml the model dir holds; a set without a
        model dir (feature kinds only) is read as CosyVoice-300M's, and its model-bound cases fail on their own."""
        from cosyserve.families import DEFAULT_FAMILY, family_named, family_of

        return family_of(self.model_dir) or family_named(DEFAULT_FAMILY)

    @cached_property
    def config(self) -> Any:
        from cosyserve.families.modelconfig import load_model_config

        return load_model_config(self.model_dir)

    def _component(self, name: str) -> Any:
        if name not in self._modules:
            if self.bundle_dir is not None:
                from cosyserve.bundle.loader import LoadOptions, open_bundle

                parts = open_bundle(self.bundle_dir).load(LoadOptions(strategy="lazy", verify="full"))
                self._modules.update(parts.modules)
            else:
                from cosyserve.bundle.official import load_component

                self._modules[name] = load_component(
                    self.model_dir, name, getattr(self.config, name), self.config.family
                )
        return self._modules[name]

    def llm(self) -> Any:
        lm = self._component("llm")
        if self.runtime == "torch" and not self._decode_linears:
            from cosyserve.models.gemm import use_decode_linears

            use_decode_linears(lm, self.llm_gemm)  # the decode steps' products as the torch runtime runs them
            self._decode_linears = True
        return lm

    def flow(self) -> Any:
        return self._component("flow")

    def hift(self) -> Any:
        return self._component("hift")

    @cached_property
    def speakers(self) -> dict[str, Any]:
        from cosyserve.bundle.official import load_speakers

        return load_speakers(self.model_dir)
