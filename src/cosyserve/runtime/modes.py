"""What a model serves, and how a request's mode and voice are decided: the rules both runtimes share.

:class:`ModelModes` knows a model's speakers (its spk2info), its voice registry, its family, whether it is an
-Instruct model and where the zero-shot tier's ONNX files are; from these it tells which modes a model serves (and
why not), resolves a request's mode and speaker, and normalizes and splits text with the model's tokenizer. It
holds no weights and imports no torch: the torch runtime's :class:`~cosyserve.runtime.pipeline.Pipeline` and the
lite runtime build on it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from cosyserve.core.errors import ClientError, ModeUnavailableError, RegistryError, UnknownVoiceError, shown
from cosyserve.core.modes import MODE_TABLE, MODES, PROMPT_MODES
from cosyserve.core.request import Mode, ResolvedRequest, SynthesisRequest, is_text_iterable
from cosyserve.families import DEFAULT_FAMILY, family_named
from cosyserve.families.base import Family
from cosyserve.runtime import Voice

__all__ = ["ModelModes", "RuntimeVoices"]


def _nothing_to_speak(what: str) -> ClientError:
    return ClientError(
        f"{what} has nothing to speak: no letter or digit, only punctuation, symbols, blanks or invisible "
        "characters",
        param="text",
    )


class ModelModes:
    """The modes and voices of one model (see the module docstring).

    Args:
        speakers: pre-defined speaker id -> its spk2info entry (``{"embedding": ...}``).
        registry: a :class:`cosyserve.voices.registry.SpeakerRegistry` for registered voices, or None.
        model_dir: named in messages about missing files.
        instruct: the model follows style instructions (a CosyVoice-300M-Instruct).
        default_voice: the speaker of sft/instruct requests that name none (default: the first pre-defined one).
        family: the model's :class:`~cosyserve.families.base.Family` (or its name): its modes, its prompt
            frontend's files (speaker embedding, speech tokenizer).
        tokenizer: a factory of the model's tokenizer (None: the whisper tokenizer).
    """

    def __init__(
        self,
        speakers: dict[str, dict[str, Any]],
        *,
        registry: Any = None,
        model_dir: str | Path | None = None,
        instruct: bool = True,
        default_voice: str | None = None,
        family: Family | str = DEFAULT_FAMILY,
        tokenizer: Callable[[], Any] | None = None,
    ) -> None:
        self.family = family_named(family) if isinstance(family, str) else family
        self.onnx_files = self.family.onnx_files
        self._tokenizer: Any = None  # built on first use by tokenizer_factory (None: the whisper tokenizer)
        self._tokenizer_factory: Callable[[], Any] | None = tokenizer
        self._tokenizer_lock = threading.Lock()
        self.speakers = speakers
        self.registry = registry
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self.instruct = instruct
        self.default_voice = default_voice
        self.onnx_paths: dict[str, Path | None] = dict.fromkeys(self.onnx_files)
        self.onnx_check: Callable[[Path], None] | None = None
        self._frontend: Any = None

    # --- the zero-shot tier ---------------------------------------------------------------------------------------

    def set_onnx_paths(
        self,
        paths: Mapping[str, Path | None],
        model_dir: str | Path | None = None,
        check: Callable[[Path], None] | None = None,
    ) -> None:
        """Where the zero-shot tier's ONNX models are (e.g. ``{name: bundle.onnx_path(name)}``); before use.
        ``check(path)`` runs before a session opens a file (e.g. the bundle's size and checksum check)."""
        unknown = set(paths) - set(self.onnx_files)
        if unknown:
            raise ValueError(
                f"unknown ONNX model(s) {sorted(unknown)}; expected {', '.join(self.onnx_files)}"
            )
        assert self._frontend is None, "set the ONNX paths before the zero-shot tier is created"
        self.onnx_paths.update({k: Path(v) if v is not None else None for k, v in paths.items()})
        if model_dir is not None:
            self.model_dir = Path(model_dir)
        if check is not None:
            self.onnx_check = check

    def unavailable_modes(self) -> dict[str, str]:
        """mode -> why it cannot run on this model (empty when every mode can). Checks files, loads nothing."""
        where = f"model dir {self.model_dir}" if self.model_dir is not None else "the model"
        out = self.family.unavailable_modes(self.instruct)
        missing = [name for name, p in self.onnx_paths.items() if p is None or not p.is_file()]
        if missing:
            why = f"{where} has no {' or '.join(missing)} (copy it from the official model dir to enable it)"
            out.update({m: why for m in PROMPT_MODES if m not in out})
        return out

    def available_modes(self) -> list[str]:
        """The modes this model can run: sft always, instruct on an instruct model, the prompt modes with the
        ONNX models."""
        unavailable = self.unavailable_modes()
        return [m for m in MODES if m not in unavailable]

    def require(self, mode: str) -> None:
        """Raise :class:`~cosyserve.frontend.zeroshot.ModeUnavailableError` when ``mode`` cannot run here."""
        why = self.unavailable_modes().get(mode)
        if why is not None:
            err = ModeUnavailableError(
                f"{mode} synthesis is unavailable: {why} (available modes: {', '.join(self.available_modes())})"
            )
            err.param = MODE_TABLE[mode].param if mode in MODE_TABLE else None
            raise err

    @property
    def tokenizer(self) -> Any:
        """The text tokenizer, built on first use (``cosyserve.load`` builds it after READY, see its text tier):
        the whisper one for CosyVoice-300M, the model's own Qwen tokenizer for CosyVoice2."""
        if self._tokenizer_factory is not None:
            if self._tokenizer is None:
                with self._tokenizer_lock:  # not the frontend's: frontend() asks for the tokenizer holding it
                    if self._tokenizer is None:
                        self._tokenizer = self._tokenizer_factory()
            return self._tokenizer
        from cosyserve.frontend.tokenizer import get_tokenizer

        return get_tokenizer()

    # --- text -----------------------------------------------------------------------------------------------------

    def split_text(self, text: str) -> list[str]:
        from cosyserve.frontend.text import normalize_and_split

        return normalize_and_split(text, self.tokenizer.encode)

    def _pieces_of(self, text: str, normalize: bool) -> list[str]:
        # text -> the pieces it is spoken in (normalised and split, or only bounded), none with nothing to speak
        from cosyserve.frontend.text import bound_pieces, nothing_to_speak

        if normalize:
            return self.split_text(text)  # pieces with nothing to speak are dropped there
        return [p for p in bound_pieces([text], self.tokenizer.encode) if not nothing_to_speak(p)]

    def text_pieces(self, r: SynthesisRequest) -> list[str] | Iterator[str]:
        """The pieces ``r``'s text is spoken in, one LM run each.

        Text given as one string: the list (a :class:`ClientError` when nothing in it can be spoken). Text given
        as pieces (:func:`cosyserve.core.request.is_text_iterable`): an iterator that reads them as they arrive and
        yields the pieces of each finished sentence as soon as its end arrives (see
        :func:`cosyserve.frontend.textstream.finished_sentences`); it raises the :class:`ClientError` at the end
        of a text that held nothing to speak.
        """
        if not is_text_iterable(r.text):
            assert isinstance(r.text, str)
            pieces = self._pieces_of(r.text, r.normalize)
            if not pieces:
                raise _nothing_to_speak(f"text {shown(r.text)!r}")
            return pieces
        return self._streamed_pieces(r)

    def _streamed_pieces(self, r: SynthesisRequest) -> Iterator[str]:
        from cosyserve.frontend.textstream import finished_sentences

        spoken = False
        for chunk in finished_sentences(r.text, self.tokenizer.encode):  # type: ignore[arg-type]
            for piece in self._pieces_of(chunk, r.normalize):
                spoken = True
                yield piece
        if not spoken:
            raise _nothing_to_speak("the streamed text")

    def text_segments(self, r: SynthesisRequest) -> Iterator[Iterator[str]]:
        """``r``'s text, given as pieces, as the sub-streams an LM that takes text as it arrives runs on, one LM
        run each (:func:`cosyserve.frontend.textstream.segments`); as the reference's bistream, not normalised.
        Raises the :class:`ClientError` at the end of a text that held nothing to speak."""
        from cosyserve.frontend.text import nothing_to_speak
        from cosyserve.frontend.textstream import segments

        seen: list[str] = []

        def watched(seg: Iterator[str]) -> Iterator[str]:
            for piece in seg:
                if not seen and not nothing_to_speak(piece):
                    seen.append(piece)
                yield piece

        for seg in segments(r.text, self.tokenizer.encode):  # type: ignore[arg-type]
            yield watched(seg)
        if not seen:
            raise _nothing_to_speak("the streamed text")

    def _normalize_prompt(self, text: str, normalize: bool) -> str:
        # the reference's text_normalize(..., split=False) for prompt and instruct texts
        if not normalize:
            return text
        from cosyserve.frontend.text import text_normalize

        out = text_normalize(text, split=False, tokenize=self.tokenizer.encode)
        assert isinstance(out, str)
        return out

    # --- speakers -------------------------------------------------------------------------------------------------

    def resolve_speaker(self, name: str, tenant: str = "default") -> tuple[str, dict[str, Any]]:
        """``(kind, entry)`` for a pre-defined (``sft``) or registered (``sft`` / ``zero_shot``) speaker.

        Raises:
            UnknownVoiceError: unknown speaker (the message lists the known ones).
        """
        if name in self.speakers:
            return "sft", self.speakers[name]
        try:
            speaker = self.registry.get(name, tenant) if self.registry is not None else None
        except RegistryError as e:  # a name the registry cannot hold (a path, too long) is nobody's voice
            raise UnknownVoiceError(f"unknown speaker {shown(name)}: {e}", param="speaker") from None
        if speaker is None:
            known = sorted(self.speakers)
            if self.registry is not None:
                known += [n for n in self.registry.names(tenant) if n not in self.speakers]
            listed = ", ".join(known) or "none (this model dir has no spk2info.pt and nothing is registered)"
            raise UnknownVoiceError(
                f"unknown speaker {shown(name)}; known speakers: {listed}", param="speaker"
            )
        return speaker.kind, speaker.features

    def default_speaker(self) -> str:
        """The speaker of a request that names none: the configured default voice, else the first pre-defined one."""
        if self.default_voice is not None:
            return self.default_voice
        if not self.speakers:
            raise ClientError(
                "this model has no pre-defined speakers (spk2info.pt); name a registered voice",
                param="speaker",
            )
        return sorted(self.speakers)[0]

    # --- requests -------------------------------------------------------------------------------------------------

    def _speaker_of_kind(self, speaker: str, tenant: str, mode: str, kind: str) -> dict[str, Any]:
        got, entry = self.resolve_speaker(speaker, tenant)
        if got != kind:
            if kind == "sft":
                raise ClientError(
                    f"speaker {speaker!r} is a registered zero-shot voice (prompt features, no 'embedding'): "
                    f"use it in zero_shot or cross_lingual mode, not {mode}",
                    param="speaker",
                )
            raise ClientError(
                f"speaker {speaker!r} is a pre-defined speaker (an embedding, no prompt features): use it in "
                f"sft or instruct mode, or register a voice with add_speaker for {mode}",
                param="speaker",
            )
        return entry

    def resolve(self, request: SynthesisRequest) -> SynthesisRequest:
        """``request`` as this model runs it, a :class:`~cosyserve.core.request.ResolvedRequest`: its mode decided (None:
        zero_shot for a registered zero-shot voice, else sft) and its speaker (None in sft/instruct: the default
        voice); what the model cannot serve raises. Reads no audio: cheap enough to run when a request is
        admitted.

        Raises:
            UnknownVoiceError: no such speaker; ModeUnavailableError: the model cannot run the mode;
            ClientError: a voice of the wrong kind for the mode.
        """
        r = request
        mode = r.mode
        if mode is None:
            mode = "sft"
            if r.speaker and r.speaker not in self.speakers:
                kind, _ = self.resolve_speaker(r.speaker, r.tenant)
                mode = "zero_shot" if kind == "zero_shot" else "sft"
        speaker = r.speaker
        instruct_text = r.instruct_text
        if (
            mode == "instruct"
            and self.family.instruct_mode == "instruct2"
            and speaker
            and speaker not in self.speakers
        ):
            # a style instruction with a cloned voice (OpenAI `instructions`, `--mode instruct`): on CosyVoice2
            # and 3 that is instruct2, whose instructions end with the marker the model was trained on
            self._speaker_of_kind(speaker, r.tenant, "instruct2", "zero_shot")
            mode = "instruct2"
            instruct_text = self.family.instruction(instruct_text)
        spec = MODE_TABLE[mode]
        if spec.voice == "speaker":
            speaker = speaker or self.default_speaker()
            self._speaker_of_kind(speaker, r.tenant, mode, "sft")
        elif spec.voice == "clone" and speaker:
            self._speaker_of_kind(speaker, r.tenant, mode, "zero_shot")
        if mode in self.family.unavailable_modes(self.instruct) or (
            spec.prompt_tier and not (spec.voice == "clone" and speaker)
        ):
            self.require(mode)  # before any audio is read: a missing model is the clearer error
        return r.resolved_as(mode, speaker, instruct_text)

    def resolved(self, request: SynthesisRequest) -> SynthesisRequest:
        """``request`` resolved: a :class:`~cosyserve.core.request.ResolvedRequest` as it is (the engine, or a WebSocket
        session for all its utterances, resolved it once), any other by :meth:`resolve` now."""
        return request if isinstance(request, ResolvedRequest) else self.resolve(request)

    def extract_prompt(self, prompt_wav: Any, prompt_text: str, *, mode: str = "zero_shot") -> dict[str, Any]:
        """The zero-shot prompt features of a recording and its transcript (each runtime's own frontend)."""
        raise NotImplementedError

    def input_builder(
        self, r: SynthesisRequest, ids: Callable[[str], Any]
    ) -> Callable[[Any], dict[str, Any]]:
        """The model input of one piece of ``r``'s text (its ids, or a stream of them), for a resolved request of
        a mode with text: the voice (the speaker's entry, or the prompt's features, extracted now) and the
        instruction (``ids`` tokenizes it) are resolved once, for every piece, as :data:`MODE_TABLE` says, and
        the family assembles each piece's input (:meth:`~cosyserve.families.base.Family.model_input`). The
        reference re-extracts a prompt per piece, with identical results."""
        mode = r.mode
        assert mode is not None, "resolve the request first"
        spec = MODE_TABLE[mode]
        if spec.voice == "speaker":
            assert r.speaker is not None
            voice = self._speaker_of_kind(r.speaker, r.tenant, mode, "sft")
        elif r.speaker:
            voice = self._speaker_of_kind(r.speaker, r.tenant, mode, "zero_shot")
        else:
            prompt_text = self._normalize_prompt(r.prompt_text, r.normalize) if spec.transcript else ""
            voice = self.extract_prompt(r.prompt_wav, prompt_text, mode=mode)
        instruction = None
        if spec.instruction == "normalized":
            instruction = ids(self._normalize_prompt(r.instruct_text, r.normalize))
        elif spec.instruction == "family":
            # inference_instruct2 does not normalise the instruction. With a saved voice the reference keeps the
            # voice's transcript and drops the instruction (frontend_zero_shot returns the saved entry as is);
            # here the instruction is what a caller asked for, so it applies with a registered voice too.
            instruction = ids(self.family.complete_instruction(r.instruct_text))
        family = self.family
        return lambda text: family.model_input(mode, text, voice, instruction)

    # --- the registry ---------------------------------------------------------------------------------------------

    def _registry(self) -> Any:
        if self.registry is None:
            raise ClientError("this pipeline has no speaker registry (construct it with registry=...)")
        return self.registry

    def add_speaker(
        self,
        name: str,
        prompt_wav: Any,
        prompt_text: str,
        *,
        tenant: str = "default",
        overwrite: bool = False,
        normalize: bool = True,
    ) -> Any:
        """Extract the zero-shot prompt features of ``prompt_wav`` + ``prompt_text`` and register them as ``name``
        (the reference's ``add_zero_shot_spk`` + ``save_spkinfo``). Returns the registry's ``Speaker``."""
        registry = self._registry()
        from cosyserve.voices.registry import validate_name

        validate_name(name)
        if name in self.speakers:
            raise ClientError(f"{name!r} is a pre-defined speaker of this model; choose another name")
        if not isinstance(prompt_text, str) or not prompt_text.strip():
            raise ClientError("prompt_text (the transcript of prompt_wav) is empty")
        if not overwrite and registry.get(name, tenant) is not None:
            raise ClientError(f"speaker {name!r} is already registered for tenant {tenant!r}")
        features = self.extract_prompt(prompt_wav, self._normalize_prompt(prompt_text, normalize))
        return registry.add(name, features, tenant=tenant, prompt_text=prompt_text, overwrite=overwrite)


class RuntimeVoices:
    """The voice and mode methods of :class:`cosyserve.runtime.Runtime` over a runtime's ``pipeline`` (a
    :class:`ModelModes`): what both runtimes answer alike."""

    pipeline: ModelModes

    # -- what it serves -------------------------------------------------------------------------------------------

    def speakers(self) -> list[str]:
        return sorted(self.pipeline.speakers)

    def voices(self, tenant: str = "default") -> list[Voice]:
        out = [Voice(s, "pre-defined", "sft") for s in self.speakers()]
        registry = self.pipeline.registry
        if registry is not None:
            out += [
                Voice(sp.name, "registered", "zero_shot" if sp.kind == "zero_shot" else "sft")
                for sp in registry.list(tenant)
                if sp.name not in self.pipeline.speakers
            ]
        return out

    def voice(self, name: str, tenant: str = "default") -> Voice | None:
        if name in self.pipeline.speakers:
            return Voice(name, "pre-defined", "sft")
        registry = self.pipeline.registry
        if registry is None:
            return None
        try:
            sp = registry.get(name, tenant)
        except RegistryError:  # a name the registry cannot hold (a path, too long) is no voice
            return None
        if sp is None:
            return None
        return Voice(sp.name, "registered", "zero_shot" if sp.kind == "zero_shot" else "sft")

    def languages(self) -> list[str]:
        return list(self.pipeline.family.languages)

    def modes(self) -> dict[Mode, str | None]:
        why = self.pipeline.unavailable_modes()
        return {m: why.get(m) for m in MODES}

    def resolve(self, request: SynthesisRequest) -> SynthesisRequest:
        return self.pipeline.resolve(request)

    # -- voices ---------------------------------------------------------------------------------------------------

    def _registry(self) -> Any:
        if self.pipeline.registry is None:
            raise RegistryError("this model has no voice registry")
        return self.pipeline.registry

    def add_voice(
        self,
        name: str,
        prompt_wav: Any,
        prompt_text: str,
        *,
        tenant: str = "default",
        overwrite: bool = False,
        normalize: bool = True,
    ) -> Any:
        return self.pipeline.add_speaker(
            name, prompt_wav, prompt_text, tenant=tenant, overwrite=overwrite, normalize=normalize
        )

    def remove_voice(self, name: str, *, tenant: str = "default") -> None:
        if name in self.pipeline.speakers:
            raise ClientError(
                f"{name!r} is a pre-defined speaker of the model (spk2info.pt); it cannot be removed",
                param="speaker",
            )
        self._registry().remove(name, tenant)

    def registered(self, tenant: str = "default") -> list[Any]:
        """The registered :class:`cosyserve.voices.registry.Speaker` entries of ``tenant``, sorted by name."""
        return list(self._registry().list(tenant))

    def import_voices(self, path: str | Path, *, tenant: str = "default", overwrite: bool = False) -> Any:
        return self._registry().import_spk2info(
            path, tenant=tenant, overwrite=overwrite, reserved=self.pipeline.speakers
        )

    def export_voices(
        self, path: str | Path, *, tenant: str = "default", include_builtin: bool = False
    ) -> list[str]:
        extra = self.pipeline.speakers if include_builtin else None
        return list(self._registry().export_spk2info(path, tenant=tenant, extra=extra))

    def use_registry(self, root: str | Path) -> None:
        """Keep registered voices under ``root`` instead of the default location."""
        from cosyserve.voices.registry import SpeakerRegistry

        old = self.pipeline.registry
        arrays = old.arrays if old is not None else "torch"
        rate = old.token_rate if old is not None else 50
        self.pipeline.registry = SpeakerRegistry(root, arrays=arrays, token_rate=rate)

    @property
    def registry_root(self) -> Path | None:
        registry = self.pipeline.registry
        return Path(registry.root) if registry is not None else None
