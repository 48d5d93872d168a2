"""The streaming chunk rules of CosyVoice-300M (torch-free: both runtimes use them).

Streaming works on windows of tokens: while at least ``hop + overlap`` tokens are buffered, the first
``hop + overlap`` go through the flow and the window slides by ``hop`` (see
:mod:`cosyserve.families.cosyvoice.token2wav`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from cosyserve.core.settings import CHUNK_POLICY_CHOICES

__all__ = ["ONE_PASS_SECONDS", "StreamPolicy"]

# the longest speech that one-shot synthesis runs through the flow and the vocoder in one pass
ONE_PASS_SECONDS = 30


@dataclass(frozen=True)
class StreamPolicy:
    """The chunking rules, in tokens and mel frames; the defaults are the reference CosyVoiceModel's.

    ``token_min_hop_len`` is 2 s of tokens; the hop is multiplied by ``stream_scale_factor`` after each chunk up
    to ``token_max_hop_len`` (4 s). The reference ships ``stream_scale_factor = 1`` (a constant 2 s hop).
    ``first_hop_len`` (None: ``token_min_hop_len``) starts the hops shorter: the first audio then needs
    ``first_hop_len + token_overlap_len`` tokens instead of 120. Build the named policies with :meth:`named`.
    """

    input_frame_rate: int = 50
    sample_rate: int = 22050
    hop_length: int = 256
    token_overlap_len: int = 20
    mel_cache_len: int = 20
    stream_scale_factor: float = 1.0
    first_hop_len: int | None = None

    def __post_init__(self) -> None:
        if self.stream_scale_factor < 1:
            raise ValueError(f"stream_scale_factor must be >= 1, got {self.stream_scale_factor}")
        hop = self.first_hop
        if hop > self.token_max_hop_len:
            raise ValueError(f"first_hop_len must be <= {self.token_max_hop_len} tokens, got {hop}")
        # the first window's audio must fill the vocoder's context (its source cache and held speech tail): a
        # shorter window would leave no cache to cross-fade the second chunk with
        if hop < self.min_first_hop:
            raise ValueError(
                f"first_hop_len must be >= {self.min_first_hop} tokens (its window of hop + "
                f"{self.token_overlap_len} overlap tokens must leave {self.mel_cache_len} mel frames for the "
                f"vocoder's cache), got {hop}"
            )

    @classmethod
    def named(
        cls, name: str, first_hop: int | None = None, *, input_frame_rate: int = 50, sample_rate: int = 22050
    ) -> StreamPolicy:
        """The policy called ``name``.

        Args:
            name: ``reference`` (the reference's rule; ``first_hop`` is ignored) or ``low-latency`` (hops of
                ``first_hop``, then doubling up to ``token_max_hop_len``).
            first_hop: the low-latency policy's first hop in tokens.
            input_frame_rate: speech tokens per second.
            sample_rate: audio samples per second.
        Returns:
            The :class:`StreamPolicy`.
        """
        if name == "reference":
            return cls(input_frame_rate=input_frame_rate, sample_rate=sample_rate)
        if name == "low-latency":
            if first_hop is None:
                raise ValueError("the low-latency chunk policy needs its first hop (tokens)")
            return cls(
                input_frame_rate=input_frame_rate,
                sample_rate=sample_rate,
                stream_scale_factor=2.0,
                first_hop_len=first_hop,
            )
        raise ValueError(f"unknown chunk policy {name!r}; expected one of {', '.join(CHUNK_POLICY_CHOICES)}")

    @property
    def token_min_hop_len(self) -> int:
        return 2 * self.input_frame_rate

    @property
    def token_max_hop_len(self) -> int:
        return 4 * self.input_frame_rate

    @property
    def one_pass_max_len(self) -> int:
        """The most tokens one-shot synthesis runs through the flow and vocoder in one pass (30 s of speech); a
        longer piece goes through windows of the longest hop instead (see :meth:`windows`)."""
        return ONE_PASS_SECONDS * self.input_frame_rate

    @property
    def first_hop(self) -> int:
        """Tokens the first chunk advances by (it sees ``first_hop + token_overlap_len`` tokens)."""
        return self.token_min_hop_len if self.first_hop_len is None else self.first_hop_len

    @property
    def min_first_hop(self) -> int:
        """The shortest first hop whose window still fills the vocoder's cache."""
        hop = 1
        while self.mel_frames(hop + self.token_overlap_len) - self.mel_overlap_len < self.mel_cache_len:
            hop += 1
        return hop

    def next_hop(self, hop: int) -> int:
        """The hop after a chunk of ``hop`` tokens."""
        return min(self.token_max_hop_len, int(hop * self.stream_scale_factor))

    def mel_frames(self, tokens: int) -> int:
        """Mel frames the flow makes of ``tokens`` speech tokens (truncating, as the reference)."""
        return int(tokens / self.input_frame_rate * self.sample_rate / self.hop_length)

    @property
    def mel_overlap_len(self) -> int:
        return self.mel_frames(self.token_overlap_len)

    @property
    def source_cache_len(self) -> int:
        return self.mel_cache_len * self.hop_length

    def windows(self, tokens: Iterable[int], stream: bool) -> Iterator[tuple[list[int], bool]]:
        """The (window of tokens, final) calls a request makes as ``tokens`` arrive: one final call with all of
        them (``stream`` False, the reference's one-shot rule, up to :attr:`one_pass_max_len` tokens), else a
        window of ``hop + token_overlap_len`` tokens each time that many are buffered (the window then slides by
        ``hop``, which grows per :meth:`next_hop`) and a final call with the rest. Consumes ``tokens`` lazily (a
        generator's tokens are taken as they come).

        One-shot synthesis of more than :attr:`one_pass_max_len` tokens (a piece the LM ran long on) goes through
        windows of the longest hop, as streaming does: the flow's attention over a whole long piece would hold
        memory quadratic in its length (gigabytes at a minute of speech), while a window's is bounded.
        """
        if not stream:
            all_tokens = list(tokens)
            if len(all_tokens) > self.one_pass_max_len:
                yield from self._slide(all_tokens, self.token_max_hop_len)
            elif all_tokens:
                yield all_tokens, True
            return
        yield from self._slide(tokens, self.first_hop)

    def _slide(self, tokens: Iterable[int], hop: int) -> Iterator[tuple[list[int], bool]]:
        buffer: list[int] = []
        for tok in tokens:
            buffer.append(tok)
            if len(buffer) >= hop + self.token_overlap_len:
                yield buffer[: hop + self.token_overlap_len], False
                del buffer[:hop]
                hop = self.next_hop(hop)
        if buffer:
            yield buffer, True
