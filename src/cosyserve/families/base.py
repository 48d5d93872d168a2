"""What every model family declares (see :mod:`cosyserve.families`).

A :class:`Family` is a small object with class-level declarations (file names, import strings of its config and
module classes, flags) and a few methods that build its parts: its tokenizer, its speech-token-to-audio pipeline
and chunk policy, its prompt mel, its modes. Its methods import what they build when asked, so importing a family
imports no torch. Subclasses override what differs; what two families truly share lives below them, in
:mod:`cosyserve.models` and :mod:`cosyserve.frontend`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from cosyserve.families.modelconfig import ModelConfig
    from cosyserve.frontend.zeroshot import Frontend

Ids = tuple[Any, Any]  # token ids [1, n] and their length [1] (torch tensors or numpy arrays)

__all__ = [
    "CachedVocoder",
    "ChunkedFlow",
    "Family",
    "Flow",
    "Ids",
    "StreamPolicy",
    "StreamVocoder",
    "Token2Wav",
    "Tokenizer",
    "Vocoder",
    "WindowedFlow",
]

CAMPPLUS_FILE = "campplus.onnx"  # the speaker embedding model, the same in every family


class Tokenizer(Protocol):
    """A model's text tokenizer (the whisper one, a family's Qwen one)."""

    def encode(self, text: str) -> list[int]: ...


@runtime_checkable
class StreamPolicy(Protocol):
    """A family's streaming chunk rule (a strategy object: CosyVoice-300M's windows, CosyVoice2/3's chunks)."""

    @property
    def first_hop(self) -> int:
        """Speech tokens the first streamed chunk advances by."""
        ...

    @property
    def source_cache_len(self) -> int:
        """Vocoder samples kept between chunks (the cross-fade's reach)."""
        ...

    def next_hop(self, hop: int) -> int:
        """The hop after a chunk of ``hop`` tokens."""
        ...


# What a family's token2wav calls on its flow and vocoder: the torch modules (cosyserve.models), the runtime's
# stacked stand-ins for them (cosyserve.runtime.stacking) and the lite runtime's graphs implement these. Arrays are
# torch tensors or numpy arrays, as the implementation computes.


class WindowedFlow(Protocol):
    """CosyVoice-300M's flow: each window of tokens continues the previous window's ``flow_cache``
    (:class:`~cosyserve.models.flow.MaskedDiffWithXvec`)."""

    @property
    def input_frame_rate(self) -> int:
        """Speech tokens a second."""
        ...

    def inference(
        self,
        token: Any,
        token_len: Any,
        prompt_token: Any,
        prompt_token_len: Any,
        prompt_feat: Any,
        prompt_feat_len: Any,
        embedding: Any,
        flow_cache: Any,
        *,
        noise: Any = None,
        generator: Any = None,
        n_timesteps: int | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> tuple[Any, Any]:
        """(mel (1, 80, frames), the cache the next window continues) of ``token`` (1, T) after the prompt."""
        ...


class ChunkedFlow(Protocol):
    """CosyVoice2/3's flow: every call covers all the tokens so far, a streamed chunk's last
    ``pre_lookahead_len`` as lookahead (:class:`~cosyserve.models.causal_flow.ChunkFlow`)."""

    @property
    def streams(self) -> bool:
        """Whether a stream can keep its final frames: then the flow also has ``new_stream(n_timesteps)`` and its
        ``inference`` takes that state as ``stream=``, so that a chunk computes its own frames only."""
        ...

    def inference(
        self,
        token: Any,
        prompt_token: Any,
        prompt_feat: Any,
        embedding: Any,
        streaming: bool,
        finalize: bool,
        *,
        n_timesteps: int | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> Any:
        """Mel (1, 80, frames) of ``token`` (1, T) after the prompt; ``streaming``: chunk attention,
        ``finalize``: the utterance ends here (no lookahead)."""
        ...


class CachedVocoder(Protocol):
    """HiFT (CosyVoice-300M, CosyVoice2): a chunk's source excitation starts with the previous chunk's tail
    (:class:`~cosyserve.models.hift.HiFTGenerator`)."""

    def inference(
        self,
        speech_feat: Any,
        cache_source: Any = None,
        *,
        generator: Any = None,
        sine_phase: Any = None,
        sine_noise: Any = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> tuple[Any, Any]:
        """(speech (1, L), source (1, 1, L)) of mel ``speech_feat`` (1, 80, T); the draws not given come from
        ``generator``."""
        ...


class StreamVocoder(Protocol):
    """CosyVoice3's causal vocoder: a stream's state carries what its next frames need
    (:class:`~cosyserve.models.causal_hift.CausalHiFTGenerator`); ``cfg`` has its ``lookahead`` (mel frames a
    call that does not finalize holds back) and ``upsample_factor`` (samples a frame)."""

    cfg: Any

    def new_stream(self, whole: bool = False) -> Any:
        """A fresh stream's state (``whole``: re-run every frame so far at each call, as the reference)."""
        ...

    def stream(
        self,
        state: Any,
        mel: Any,
        finalize: bool,
        *,
        rand_ini: Any,
        sine_waves: Any,
        should_stop: Callable[[], bool] | None = None,
    ) -> Any:
        """The audio (1, samples) of the mel frames ``mel`` (1, 80, n) that follow the stream's."""
        ...


Flow = WindowedFlow | ChunkedFlow
Vocoder = CachedVocoder | StreamVocoder


@runtime_checkable
class Token2Wav(Protocol):
    """A family's speech tokens to audio, over its ``flow`` and ``hift`` with its ``policy``: what a runtime
    calls for every text piece (the torch modules' or the lite runtime's graphs')."""

    flow: Flow
    hift: Vocoder
    policy: Any  # the family's StreamPolicy

    def __call__(
        self,
        tokens: Iterable[int],
        *,
        embedding: Any,
        prompt_token: Any = None,
        prompt_feat: Any = None,
        stream: bool = False,
        speed: float = 1.0,
        generator: Any = None,
        draws: Any = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> Iterator[Any]:
        """Float32 audio chunks of ``tokens`` (consumed as they come; torch tensors ``[1, samples]``, the lite
        runtime's 1-D arrays), with the flow's speaker ``embedding`` and, where a voice is cloned, its
        ``prompt_token`` / ``prompt_feat``; ``generator`` draws the noise (torch's or numpy's)."""
        ...


def import_string(target: str) -> Any:
    """The object a ``module:attr`` import string names (imported now)."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


class Family:
    """One model family (abstract: see :class:`~cosyserve.families.cosyvoice.CosyVoice` and its siblings).

    Class attributes:
        name: the registry key (a bundle's manifest records it).
        title: how messages name it.
        config_classes: the llm, flow and hift config dataclasses, as import strings.
        module_classes: component (llm, flow, hift) -> its module class, as an import string.
        speech_tokenizer_file: the prompt frontend's speech tokenizer (ONNX) in a model dir.
        bundle_files: files a bundle copies unchanged from the model dir when present (besides the weights).
        required_files: of those, the ones a model dir must hold (a bundle without them cannot serve).
        registry_folder: where its registered voices live inside a registry dir shared by every model ("" is
            the dir itself): their prompt features mean nothing to another family's model.
        modes: the modes of :data:`cosyserve.core.modes.MODE_TABLE` its models offer (``instruct`` only on a model
            that follows instructions, see :meth:`unavailable_modes`); it assembles each one's model input
            (:meth:`model_input`).
        instruct_mode: the mode that follows a style instruction (``instruct``: a speaker and an instruction;
            ``instruct2``: a voice to clone and an instruction).
        lite: the lite runtime (ONNX Runtime + numpy) serves it.
        lite_export: ``module:function`` exporting its lite graphs (:mod:`cosyserve.bundle.lite.export`), or None.
        lite_parts: the parts (of llm, flow, hift) that export covers so far; the lite runtime serves a family
            whose export covers all three (``lite``).
        lite_kinds: the conformance kinds the lite runtime computes for its sets (the others are reported as not
            yet served by it).
        lite_kinds_table: ``module:attr`` of the table of those kinds' lite functions (kind -> function).
        reruns_flow: streaming calls the flow on every token so far (CosyVoice2/3: the reference's rule, which
            cosyserve computes keeping the final frames), instead of windows that carry a flow cache (CosyVoice-300M).
        prompt_mel_per_token: the prompt mel's frames per speech token its flow takes: a prompt's mel and tokens
            are trimmed to exactly that ratio (CosyVoice2/3: 2, the reference's 24 kHz rule); None keeps them as
            extracted (CosyVoice-300M).
        random_vocoder: the vocoder draws random numbers (its draws can be given); CosyVoice3's reads fixed noise.
        batch_size: the requests one of its models serves at once where the ``batch_size`` setting is unset (their
            LM steps batched): CosyVoice-300M 4 (its LM's KV cache holds 112 KiB per position and row),
            CosyVoice2/3 8 (24 KiB; a batched step of their Qwen2 LM costs little more than a lone one).
        stacks: the token2wav parts (``flow``, ``hift``) whose concurrent same-shape calls may run stacked
            (``batch_flow``, :mod:`cosyserve.runtime.stacking`): a part whose calls carry no state of their own
            between chunks, or carry it in their arguments.
        test_model: ``module:function`` writing a random-weight model dir: ``(dir, size, seed, onnx) -> info``.
        conformance_kinds: fixture kind -> the module holding its function (``KINDS``), by import string.
        hub_ids: official model ids on the hubs (Hugging Face ``owner/name``; ModelScope ``iic/name``).
        languages: the languages its models speak, as BCP 47 primary tags (``yue``: Cantonese), the first the
            model's main one: what its voices list (Wyoming's ``describe``).
    """

    name: ClassVar[str]
    title: ClassVar[str]
    config_classes: ClassVar[tuple[str, str, str]]
    module_classes: ClassVar[Mapping[str, str]]
    speech_tokenizer_file: ClassVar[str]
    bundle_files: ClassVar[tuple[str, ...]] = ()
    required_files: ClassVar[tuple[str, ...]] = ()
    registry_folder: ClassVar[str]
    modes: ClassVar[tuple[str, ...]]
    instruct_mode: ClassVar[str]
    lite: ClassVar[bool] = False
    lite_export: ClassVar[str | None] = None
    lite_parts: ClassVar[tuple[str, ...]] = ()
    lite_kinds: ClassVar[tuple[str, ...]] = ()
    lite_kinds_table: ClassVar[str] = "cosyserve.tools.conformance.kinds_lite:KINDS"
    reruns_flow: ClassVar[bool] = True
    prompt_mel_per_token: ClassVar[int | None] = None
    random_vocoder: ClassVar[bool] = True
    batch_size: ClassVar[int] = 4
    stacks: ClassVar[tuple[str, ...]] = ()
    test_model: ClassVar[str]
    conformance_kinds: ClassVar[Mapping[str, str]]
    hub_ids: ClassVar[tuple[str, ...]] = ()
    languages: ClassVar[tuple[str, ...]]

    def __repr__(self) -> str:
        return f"<family {self.name}>"

    @property
    def yaml(self) -> str:
        """The yaml file that marks its official model directories."""
        from cosyserve.families import FAMILIES

        return FAMILIES[self.name][0]

    @property
    def onnx_files(self) -> tuple[str, str]:
        """The prompt frontend's ONNX models: (speaker embedding, speech tokenizer)."""
        return (CAMPPLUS_FILE, self.speech_tokenizer_file)

    # --- config and modules ----------------------------------------------------------------------------------

    def config_class(self, component: str) -> type:
        """The config dataclass of ``component`` (llm, flow or hift)."""
        return import_string(self.config_classes[("llm", "flow", "hift").index(component)])  # type: ignore[no-any-return]

    def module_class(self, component: str) -> type:
        """The module class of ``component`` (llm, flow or hift)."""
        return import_string(self.module_classes[component])  # type: ignore[no-any-return]

    def read_config(self, model_dir: Path) -> ModelConfig:
        """The :class:`~cosyserve.families.modelconfig.ModelConfig` of an official directory of this family."""
        raise NotImplementedError

    # --- a model directory -----------------------------------------------------------------------------------

    def is_instruct_dir(self, model_dir: Path) -> bool:
        """Whether the directory holds a model trained to follow ``instruct`` mode's style instructions."""
        return False

    def check_model_dir(self, model_dir: Path) -> None:
        """Refuse at conversion what would fail on a first request (a broken tokenizer file, ...); the weights
        are checked by their strict loads."""

    # --- serving ---------------------------------------------------------------------------------------------

    def tokenizer(
        self, files: Path, check: Callable[[str], None] | None = None
    ) -> Callable[[], Tokenizer] | None:
        """A factory of the text tokenizer read from ``files`` (a model dir or a bundle; ``check(name)`` runs on
        each file it reads first), or None for the whisper tokenizer every CosyVoice-300M model uses."""
        return None

    def prompt_mel(self, config: ModelConfig) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The prompt mel extractor (waveform [1, N] at the model's rate -> [1, 80, frames]) of a model with
        ``config``; None: the frontend's default (CosyVoice-300M's)."""
        return None

    def frontend(
        self,
        files: Path,
        config: ModelConfig | None,
        speakers: dict[str, Any] | None = None,
        *,
        tokenizer: Tokenizer | None = None,
        paths: Mapping[str, Path | None] | None = None,
        check: Callable[[Path], None] | None = None,
    ) -> Frontend:
        """The prompt frontend (:class:`~cosyserve.frontend.zeroshot.Frontend`) of a model with ``config`` whose
        files are in ``files`` (a model dir or a bundle): its tokenizer (None: this family's, read from
        ``files``), prompt mel and ONNX models (``paths``: file name -> where it is, None: in ``files``;
        ``check(path)`` runs before a session opens one)."""
        from cosyserve.frontend.zeroshot import Frontend, OnnxModel

        if tokenizer is None:
            factory = self.tokenizer(files)
            tokenizer = factory() if factory is not None else None
        mel = self.prompt_mel(config) if config is not None else None
        frontend = Frontend(
            files,
            speakers or {},
            tokenizer=tokenizer,
            feat_extractor=mel,
            mel_per_token=self.prompt_mel_per_token,
        )
        paths = paths or {}
        campplus, speech_tokenizer = self.onnx_files
        frontend.campplus = OnnxModel(paths.get(campplus) or files / campplus, check)
        frontend.speech_tokenizer = OnnxModel(paths.get(speech_tokenizer) or files / speech_tokenizer, check)
        return frontend

    def stream_policy(
        self, config: ModelConfig, flow: Any, chunk_policy: str, first_hop: int
    ) -> StreamPolicy:
        """The streaming chunk policy ``chunk_policy`` (``reference`` or ``low-latency``, whose first hop is
        ``first_hop`` tokens at 50 Hz) for a model with ``config`` and ``flow``."""
        raise NotImplementedError

    def token2wav(
        self,
        config: ModelConfig,
        flow: Flow,
        hift: Vocoder,
        policy: StreamPolicy,
        flow_steps: int | None,
        voices: Any = None,
        flow_context: float = 0.0,
    ) -> Token2Wav:
        """The speech-token-to-audio pipeline over ``flow`` and ``hift`` (of a model with ``config``) with
        ``policy``: called as
        ``t2w(tokens, embedding=, prompt_token=, prompt_feat=, stream=, speed=, generator=, should_stop=)``,
        yielding ``[1, samples]`` chunks. ``voices``: precomputed voice states
        (:class:`~cosyserve.voices.voicestates.VoiceStates`) for a token2wav whose flow keeps them (``flow.streams``).
        ``flow_context``: seconds of generated speech such a flow's streams attend to beyond the prompt (0: every
        frame, the reference's result; the ``flow_context_seconds`` setting); no effect on a flow without streams."""
        raise NotImplementedError

    def unavailable_modes(self, instruct: bool) -> dict[str, str]:
        """mode -> why a model of this family cannot run it, whatever its files (``instruct``: the model
        follows ``instruct`` mode's instructions): every mode of the table it does not offer (a family says more
        where it has more to say)."""
        from cosyserve.core.modes import MODES

        offered = ", ".join(self.modes)
        return {
            m: f"this is a {self.title} model, which has no {m} mode (its modes: {offered})"
            for m in MODES
            if m not in self.modes
        }

    def model_input(
        self, mode: str, text: Ids, voice: Mapping[str, Any], instruction: Ids | None = None
    ) -> dict[str, Any]:
        """The model input (the reference frontend's dict) of one piece of ``text`` in ``mode``, a mode this family
        offers: ``voice`` is the speaker's entry (sft, instruct: its ``embedding``) or the voice to clone's prompt
        features (:meth:`~cosyserve.frontend.zeroshot.Frontend.prompt_features`, or a registered voice's);
        ``instruction`` the tokenized instruction of the modes that take one. Token ids and arrays are torch
        tensors or numpy arrays alike. The modes every family shares are assembled by
        :mod:`cosyserve.frontend.prompt`; a family with a mode of its own overrides this."""
        from cosyserve.frontend.prompt import instruct_input, prompt_input, sft_input

        if mode == "sft":
            return sft_input(text, voice["embedding"])
        if mode == "instruct" and instruction is not None:
            return instruct_input(text, voice["embedding"], instruction)
        if mode in ("zero_shot", "cross_lingual"):
            return prompt_input(text, voice, mode)  # type: ignore[arg-type]
        raise ValueError(f"{self.title} assembles no {mode} model input")

    def instruction(self, text: str) -> str:
        """A style instruction as the model is to read it (CosyVoice2/3 end theirs with a marker)."""
        return text

    def complete_instruction(self, text: str) -> str:
        """An ``instruct2`` request's instruction as the model is to read it (as given, unless the family's LM
        needs more)."""
        return text

    def complete_inputs(
        self, inputs: Iterable[dict[str, Any]], encode: Callable[[str], list[int]]
    ) -> Iterable[dict[str, Any]]:
        """The model-input dicts of a request's pieces (the reference frontend's, one per piece, as they come)
        completed as the family's LM needs them (CosyVoice3: its prompt marker); ``encode`` is the model's
        tokenizer."""
        return inputs

    def speech_tokens(self, tokens: Iterator[int]) -> Iterator[int]:
        """The LM's speech tokens as token2wav is to get them (CosyVoice3 cuts runs of silent tokens)."""
        return tokens

    # --- tools -----------------------------------------------------------------------------------------------

    def write_test_model(self, out: Path, size: str, seed: int, onnx: bool) -> dict[str, tuple[int, int]]:
        """Write a random-weight model of ``size`` (tiny or full) into the empty directory ``out``."""
        return import_string(self.test_model)(out, size, seed, onnx)  # type: ignore[no-any-return]
