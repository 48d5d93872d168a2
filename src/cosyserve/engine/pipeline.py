"""Text -> speech tokens -> audio: the chain of generators behind every synthesis.

The LLM yields speech tokens one at a time; :class:`~cosyserve.engine.token2wav.Token2Wav` consumes them as
they come and yields audio chunks; :meth:`Pipeline.synthesize` yields those chunks to the caller. Nothing is
shared between requests but the (read-only) modules, so concurrent requests only need their own generators.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cosyserve.engine.token2wav import StreamPolicy, Token2Wav

logger = logging.getLogger(__name__)

__all__ = ["Pipeline", "SynthesisError"]


class SynthesisError(ValueError):
    """A request that cannot be synthesized as given (unknown speaker, empty text, bad option)."""


@dataclass(frozen=True)
class _SpeakerInputs:
    embedding: torch.Tensor  # [1, 192]


class Pipeline:
    """Pre-defined-speaker (SFT) synthesis over loaded modules.

    Args:
        llm: :class:`cosyserve.models.llm.TransformerLM`.
        flow: :class:`cosyserve.models.flow.MaskedDiffWithXvec`.
        hift: :class:`cosyserve.models.hift.HiFTGenerator`.
        speakers: speaker id -> ``{"embedding": [1, 192], ...}`` (spk2info).
        sample_rate: output rate in Hz (22050 for CosyVoice-300M).
        policy: streaming rules; default the reference's.
    """

    def __init__(
        self,
        llm: Any,
        flow: Any,
        hift: Any,
        speakers: dict[str, dict[str, torch.Tensor]],
        sample_rate: int,
        policy: StreamPolicy | None = None,
    ) -> None:
        from cosyserve.frontend.tokenizer import get_tokenizer

        self.llm = llm
        self.token2wav = Token2Wav(flow, hift, policy)
        self.speakers = speakers
        self.sample_rate = sample_rate
        self.tokenizer = get_tokenizer()

    def split_text(self, text: str) -> list[str]:
        from cosyserve.frontend.text import normalize_and_split

        return normalize_and_split(text, self.tokenizer.encode)

    def _verify(self, text: str, speaker: str, speed: float, stream: bool) -> None:
        if not isinstance(text, str) or not text.strip():
            raise SynthesisError("text is empty: give at least one word to speak")
        if speaker not in self.speakers:
            known = ", ".join(sorted(self.speakers)) or "none (this model dir has no spk2info.pt)"
            raise SynthesisError(f"unknown speaker {speaker!r}; known speakers: {known}")
        if not (0.5 <= speed <= 2.0):
            raise SynthesisError(f"speed must be between 0.5 and 2.0, got {speed}")
        if stream and speed != 1.0:
            raise SynthesisError("speed change is only supported with stream=False (as in the reference)")

    @torch.inference_mode()
    def synthesize(
        self,
        text: str,
        speaker: str,
        *,
        stream: bool = False,
        speed: float = 1.0,
        seed: int | None = None,
        normalize: bool = True,
    ) -> Iterator[np.ndarray]:
        """Yield float32 mono audio chunks (1-D numpy arrays at ``sample_rate``) speaking ``text``.

        Args:
            text: what to say; split into sentence pieces, each synthesized in turn.
            speaker: a pre-defined speaker id (see ``speakers``).
            stream: yield chunks as soon as ~2 s of tokens exist (True) or one chunk per piece (False).
            speed: tempo factor in [0.5, 2.0]; one-shot mode only.
            seed: seeds every random draw (token sampling, flow noise, vocoder phases): the same seed gives
                the same audio. ``None`` draws a fresh seed.
            normalize: run the text frontend (wetext normalisation and splitting); False speaks ``text`` as
                one piece (warm-up uses it so the normaliser stays off the start path).
        """
        self._verify(text, speaker, speed, stream)
        pieces = self.split_text(text) if normalize else [text]
        if not pieces:
            raise SynthesisError(f"text {text!r} has nothing to speak (only punctuation or blanks)")
        generator = torch.Generator().manual_seed(seed if seed is not None else secrets.randbits(63))
        embedding = self.speakers[speaker]["embedding"]
        empty_ids = torch.zeros(1, 0, dtype=torch.int32)
        for piece in pieces:
            ids = torch.tensor([self.tokenizer.encode(piece)], dtype=torch.int32)
            tokens = self.llm.inference(
                ids,
                torch.tensor([ids.shape[1]], dtype=torch.int32),
                empty_ids,
                torch.tensor([0], dtype=torch.int32),
                empty_ids,
                torch.tensor([0], dtype=torch.int32),
                embedding,
                generator=generator,
            )
            for chunk in self.token2wav(
                tokens, embedding=embedding, stream=stream, speed=speed, generator=generator
            ):
                yield chunk[0].numpy().astype(np.float32, copy=False)
