"""Request -> model inputs -> speech tokens -> audio: the chain of generators behind every synthesis.

A :class:`SynthesisRequest` names a mode (``sft``, ``zero_shot``, ``cross_lingual``, ``instruct``, ``vc``; see
:mod:`cosyserve.core.request`). :meth:`Pipeline.prepare` turns it into the reference frontend's model-input dicts,
one per text piece, key for key (``CosyVoiceFrontEnd.frontend_*`` as ``CosyVoice.inference_*`` calls them), and
:meth:`Pipeline._tts` runs each dict as the reference's ``CosyVoiceModel.tts`` does: the LLM gets ``text``,
``prompt_text``, ``llm_prompt_speech_token`` and ``llm_embedding`` (each empty when the dict lacks it); token2wav
gets ``flow_prompt_speech_token``, ``prompt_speech_feat`` and ``flow_embedding``; with ``source_speech_token``
(vc) the LLM is bypassed and those tokens go straight to token2wav.

Which parts each mode drops (the reference's rules):

- sft: no prompt; the speaker's ``embedding`` to both LLM and flow.
- zero_shot: prompt text + prompt speech tokens to the LLM; prompt tokens + prompt mel to the flow; the prompt's
  campplus embedding to both.
- cross_lingual: zero_shot without the LLM prompt (no prompt text, no LLM prompt tokens).
- instruct: the instruction as the LLM's prompt text; no speaker embedding in the LLM (flow only).
- vc: the source recording's speech tokens to token2wav with the prompt's tokens, mel and embedding.

The zero-shot tier (the :class:`~cosyserve.frontend.zeroshot.Frontend` and its ONNX sessions) is created on the
first request that needs it; SFT and instruct never touch it. The LLM's tokens come from the model's decode loop
(:class:`~cosyserve.runtime.decode.DecodeLoop`, shared by the requests that run at once), one at a time;
:class:`~cosyserve.families.cosyvoice.token2wav.Token2Wav` consumes them as they come and yields audio chunks.
Nothing is shared between requests but the read-only modules, so concurrent requests only need their own generators.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cosyserve.core.request import Mode, SynthesisRequest, is_text_iterable
from cosyserve.core.sampling import ArrayOps, row_key
from cosyserve.core.stop import Stopped, check
from cosyserve.families import DEFAULT_FAMILY, family_named
from cosyserve.families.base import Family
from cosyserve.families.cosyvoice.streampolicy import StreamPolicy
from cosyserve.runtime import PIECE_SECONDS_MAX
from cosyserve.runtime.decode import DecodeLoop
from cosyserve.runtime.lm import Streamed, one_shot
from cosyserve.runtime.modes import ModelModes

logger = logging.getLogger(__name__)

__all__ = ["Pipeline", "PreparedRequest"]


@dataclass
class PreparedRequest:
    """A checked request and its model inputs: one reference model-input dict per text piece (vc: one). For text
    given as pieces, ``inputs`` is an iterator that builds each dict as its text arrives (and ``pieces`` stays
    empty)."""

    request: SynthesisRequest
    mode: Mode
    inputs: list[dict[str, Any]] | Iterator[dict[str, Any]] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)


def _ids(ops: ArrayOps, ids: list[int]) -> tuple[Any, Any]:
    tokens = ops.asarray([ids], "int32").reshape(1, -1)  # [1, n]
    return tokens, ops.asarray([tokens.shape[1]], "int32")


class Pipeline(ModelModes):
    """Synthesis in every mode of a model's family over its loaded LM, flow and vocoder: the torch runtime's
    modules, or the lite runtime's graphs (:mod:`cosyserve.runtime.lite`). Arrays are the token2wav's namespace
    (its :class:`~cosyserve.core.sampling.ArrayOps`: torch on the modules' device, or numpy): nothing here imports
    torch.

    Args:
        llm: the LM the decode loop drives (:class:`~cosyserve.runtime.lm.DecodeLM`: a torch
            :class:`~cosyserve.models.llm.SpeechLM`, or the lite :class:`~cosyserve.runtime.lite.lm.StepLM`).
        flow: the family's flow (a torch module, or the lite graphs' runner; ``flow.cfg.input_frame_rate``).
        hift: the family's vocoder.
        speakers: pre-defined speaker id -> ``{"embedding": [1, 192], ...}`` (spk2info).
        sample_rate: output rate in Hz (22050 for CosyVoice-300M).
        policy: streaming rules; default the reference's.
        onnx_paths: ``campplus.onnx`` / ``speech_tokenizer_v1.onnx`` -> their path, or None where the model has
            none (the prompt modes are then unavailable). Default: none.
        registry: a :class:`cosyserve.voices.registry.SpeakerRegistry` for registered speakers; default none.
        model_dir: the model directory, named in messages about missing files.
        instruct: the model follows style instructions (a CosyVoice-300M-Instruct; see
            :attr:`cosyserve.bundle.loader.Bundle.instruct`); instruct mode is refused otherwise.
        default_voice: the speaker of sft/instruct requests that name none (default: the first pre-defined one).
        flow_steps: the flow's Euler steps (default: the model's own count).
        flow_context: seconds of generated speech a CosyVoice2/3 stream's flow attends to beyond its prompt (0:
            every frame, the reference's result; see the family's ``token2wav``).
        voice_states: a :class:`~cosyserve.voices.voicestates.VoiceStates`: registered voices' and recent prompts'
            flow states, computed once, for a flow that streams by keeping its frames (CosyVoice2/3), and their
            LM prompt prefixes (:class:`~cosyserve.runtime.lm.Prefix`), for every LM whose input order allows one.
        frontend: makes the zero-shot tier's frontend on first use (default: the family's
            :meth:`~cosyserve.families.base.Family.frontend`, torch's; the lite runtime gives its numpy one).
    """

    def __init__(
        self,
        llm: Any,
        flow: Any,
        hift: Any,
        speakers: dict[str, dict[str, Any]],
        sample_rate: int,
        policy: StreamPolicy | None = None,
        *,
        onnx_paths: Mapping[str, Path | None] | None = None,
        registry: Any = None,
        model_dir: str | Path | None = None,
        instruct: bool = True,
        default_voice: str | None = None,
        flow_steps: int | None = None,
        flow_context: float = 0.0,
        family: Family | str = DEFAULT_FAMILY,
        tokenizer: Any = None,
        config: Any = None,
        voice_states: Any = None,
        frontend: Callable[[], Any] | None = None,
    ) -> None:
        self.llm = llm
        # the LM's decode loop: one row unless the runtime gives it more (TorchRuntime, batch_size)
        self.decoder = DecodeLoop(llm, 1, name="lm")
        # one piece's speech tokens at most (its LM run, and its flow and vocoder passes without streaming)
        self.max_piece_tokens = PIECE_SECONDS_MAX * int(flow.cfg.input_frame_rate)
        family = family_named(family) if isinstance(family, str) else family
        # the model's ModelConfig (what the family builds its parts from; the lite runtime: its manifest's config)
        self.config = config
        self.prompt_prefixes = voice_states
        self.voice_states = voice_states if getattr(flow, "streams", False) else None
        # the family's token2wav over the flow and vocoder (torch modules or the lite graphs)
        self.token2wav: Any = family.token2wav(
            config, flow, hift, policy, flow_steps, voices=self.voice_states, flow_context=flow_context
        )
        # the arrays' namespace and device (the token2wav's: torch on the modules' device, or numpy)
        self.ops: ArrayOps = self.token2wav.ops
        self.device = self.ops.device  # where the modules compute: every request tensor goes there
        self._make_frontend = frontend
        ModelModes.__init__(
            self,
            speakers,
            registry=registry,
            model_dir=model_dir,
            instruct=instruct,
            default_voice=default_voice,
            family=family,
            tokenizer=tokenizer,
        )
        self.sample_rate = sample_rate
        self._frontend_lock = threading.Lock()
        if onnx_paths is not None:
            self.set_onnx_paths(onnx_paths, model_dir)

    # --- the zero-shot tier ---------------------------------------------------------------------------------------

    @property
    def frontend_loaded(self) -> bool:
        return self._frontend is not None

    def frontend(self) -> Any:
        """The zero-shot tier's :class:`~cosyserve.frontend.zeroshot.Frontend`, created on first use (its ONNX
        sessions are created on their first run)."""
        if self._frontend is None:
            with self._frontend_lock:
                if self._frontend is None:
                    self._frontend = self._make_frontend() if self._make_frontend else self._family_frontend()
        return self._frontend

    def _family_frontend(self) -> Any:
        return self.family.frontend(
            self.model_dir or Path("."),
            self.config,
            self.speakers,
            tokenizer=self.tokenizer,
            paths=self.onnx_paths,
            check=self.onnx_check,
        )

    def _text_ids(self, text: str) -> tuple[Any, Any]:
        return _ids(self.ops, self.tokenizer.encode(text))

    def load_text_tier(self) -> None:
        """Build what a first request's text needs, once: the model's tokenizer (the whisper one, or the model's
        Qwen one: ~0.3 s to read its 151k-entry vocabulary at full size) and wetext's normalisers (~0.3 s). Each
        runtime calls it in its after-READY thread (a fork template: before forking) unless the text tier is lazy."""
        from cosyserve.frontend.text import load_normalizers

        _ = self.tokenizer
        load_normalizers()

    def after_ready(self) -> list[tuple[str, Callable[[], Any]]]:
        """The one-time work of this model's requests that a runtime runs after READY (each runtime in its
        after-READY thread), so that no first request pays it: ``(phase, work)`` pairs. CosyVoice3's fixed
        vocoder noise is replayed once here (numpy: its first 10 s, 23-39 ms at full size; its token2wav's
        ``noise``)."""
        noise = getattr(self.token2wav, "noise", None)
        return [] if noise is None else [("vocoder_noise", lambda: noise.draws(1))]

    # --- speakers -------------------------------------------------------------------------------------------------

    def extract_prompt(self, prompt_wav: Any, prompt_text: str, *, mode: str = "zero_shot") -> dict[str, Any]:
        """The zero-shot prompt features of a recording and its transcript: the entry the reference's
        ``add_zero_shot_spk`` stores.

        Raises:
            ModeUnavailableError: the model has no ONNX models; AudioError: unusable audio.
        """
        self.require(mode)
        return self.frontend().prompt_features(prompt_text, prompt_wav)

    def add_speaker(self, name: str, prompt_wav: Any, prompt_text: str, **kwargs: Any) -> Any:
        """:meth:`ModelModes.add_speaker`, and the voice's flow state computed when the model keeps voice states
        (registration pays for it, not the voice's first request: in the background, one voice at a time)."""
        speaker = super().add_speaker(name, prompt_wav, prompt_text, **kwargs)
        if getattr(self.token2wav, "keeps_voices", False) and speaker.kind == "zero_shot":
            self.token2wav.keep_voice(speaker.features)
        return speaker

    # --- requests -------------------------------------------------------------------------------------------------

    def prepare(self, request: SynthesisRequest) -> PreparedRequest:
        """Build the model inputs of a request that passed :meth:`SynthesisRequest.verify` (extracting prompt
        features where needed); what only the model can tell is checked here.

        Returns:
            A :class:`PreparedRequest`: ``inputs[i]`` is the reference frontend's dict for text piece ``i``.
        Raises:
            UnknownVoiceError: no such speaker; ModeUnavailableError: the model cannot run the mode;
            AudioError: unusable prompt or source audio; ClientError: nothing to speak in the text.
        """
        with self.ops.no_grad():
            prepared = self._prepare(request)
            if prepared.mode != "vc":
                completed = self.family.complete_inputs(prepared.inputs, self.tokenizer.encode)
                prepared.inputs = list(completed) if isinstance(prepared.inputs, list) else completed
        return prepared

    def _prepare(self, request: SynthesisRequest) -> PreparedRequest:
        r = self.resolved(request)
        mode = r.mode
        assert mode is not None
        prepared = PreparedRequest(r, mode)
        if mode == "vc":
            prepared.inputs.append(self.frontend().frontend_vc(r.source_wav, r.prompt_wav))
            return prepared

        make = self.input_builder(r, self._text_ids)
        if not is_text_iterable(r.text):
            prepared.pieces = self.text_pieces(
                r
            )  # at least one: nothing to speak raises here, before any audio
            prepared.inputs = [make(self._text_ids(piece)) for piece in prepared.pieces]
        elif self.llm.rules.fill is not None:
            # the LM takes text as it arrives (the reference's bistream), one run per bounded segment
            prepared.inputs = (make(self._id_stream(seg)) for seg in self.text_segments(r))
        else:
            # each finished sentence as soon as its end arrives
            prepared.inputs = (make(self._text_ids(piece)) for piece in self.text_pieces(r))
        return prepared

    def _id_stream(self, pieces: Iterator[str]) -> tuple[Iterator[Any], Any]:
        # a text stream as the LM's bistream takes it: each piece's ids as it arrives, tokenized on its own (as
        # the reference does); the length is unknown (-1)
        encode, ops = self.tokenizer.encode, self.ops
        return (_ids(ops, encode(p))[0] for p in pieces), ops.asarray([-1], "int32")

    def run(
        self, request: SynthesisRequest, should_stop: Callable[[], bool] | None = None
    ) -> Iterator[np.ndarray]:
        """Prepare ``request`` now (its errors raise here, before any audio), then return a generator of float32
        mono audio chunks (1-D numpy arrays at ``sample_rate``). ``should_stop`` is asked after every speech
        token; once it says True the generator ends."""
        prepared = self.prepare(request)
        # each step in the array ops' no_grad (torch's inference mode), as a decorated generator's
        return self.ops.each_without_grad(self._generate(prepared, should_stop))  # type: ignore[no-any-return]

    def _generate(
        self, prepared: PreparedRequest, should_stop: Callable[[], bool] | None
    ) -> Iterator[np.ndarray]:
        r = prepared.request
        # on the modules' device: every draw (sampling, noise) is made where it is used, without a copy
        # the seed keys the LM's sampler (each text piece its own key) and seeds the generator of the flow's and
        # vocoder's noise
        seed = r.seed if r.seed is not None else secrets.randbits(63)
        generator = self.ops.generator(seed)
        try:
            for n, model_input in enumerate(prepared.inputs):
                yield from self._tts(
                    model_input,
                    stream=r.stream,
                    speed=r.speed,
                    key=row_key(seed, n),
                    generator=generator,
                    should_stop=should_stop,
                )
        except Stopped:
            return  # the generators below are closed by the unwinding: the LM frees its cache (or batch row)

    def _tts(
        self,
        model_input: dict[str, Any],
        *,
        stream: bool,
        speed: float,
        key: int,
        generator: Any,
        should_stop: Callable[[], bool] | None = None,
    ) -> Iterator[np.ndarray]:
        # the reference's CosyVoiceModel.tts: absent keys are its defaults; lengths come from the shapes. The
        # frontend and the registry make their tensors on the CPU: they move to the modules' device here, once
        ops = self.ops
        if not ops.host:
            model_input = {k: v.to(ops.device) if _is_array(v) else v for k, v in model_input.items()}
        empty_ids = ops.zeros((1, 0), "int32")
        empty_embedding = ops.zeros((0, 192), "float32")
        source = model_input.get("source_speech_token", empty_ids)
        if source.shape[1] == 0:
            text = model_input["text"]
            if not _is_array(text):  # text still arriving: the LM takes its ids as they come
                spec: Any = Streamed(
                    text,
                    model_input.get("prompt_text", empty_ids).reshape(-1).tolist(),
                    model_input.get("llm_prompt_speech_token", empty_ids).reshape(-1).tolist(),
                    max_len=self.max_piece_tokens,
                )
            else:
                spec = one_shot(
                    self.llm, model_input, max_tokens=self.max_piece_tokens, prefixes=self.prompt_prefixes
                )
            # the loop asks the stop signal before the row joins, between its prefill's layers and its steps
            tokens: Iterator[int] = self.decoder.generate(spec, key, should_stop=should_stop)
            tokens = self.family.speech_tokens(tokens)
        else:  # vc: the LLM is bypassed
            tokens = source.flatten().tolist()
        for chunk in self.token2wav(
            tokens,
            embedding=model_input.get("flow_embedding", empty_embedding),
            prompt_token=model_input.get("flow_prompt_speech_token", empty_ids),
            prompt_feat=model_input.get("prompt_speech_feat", ops.zeros((1, 0, 80), "float32")),
            stream=stream,
            speed=speed,
            generator=generator,
            should_stop=should_stop,
        ):
            # one device-to-host copy per chunk ([1, samples])
            yield ops.to_host(chunk.reshape(-1)).astype(np.float32, copy=False)
            check(should_stop)


def _is_array(x: Any) -> bool:
    # a tensor or numpy array (text still arriving is an iterator of them)
    return hasattr(x, "shape")
