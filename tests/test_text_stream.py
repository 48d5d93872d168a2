"""Text given as pieces (an LLM's output as it arrives): audio starts before the text is complete, on every family
and runtime: CosyVoice-300M speaks each finished sentence as its end arrives, CosyVoice2 and CosyVoice3 feed the
LM text as it comes (the reference's bistream) in bounded segments (issue 26, item 4)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cosyserve.core.errors import ClientError
from cosyserve.core.request import SynthesisRequest
from cosyserve.core.textfeed import TextFeed
from cosyserve.frontend.text import PIECE_MAX_N
from cosyserve.frontend.textstream import finished_sentences, segments
from cosyserve.frontend.tokenizer import get_tokenizer
from cosyserve.runtime import RuntimeOptions, load_runtime


def _encode(text: str) -> list[int]:
    return get_tokenizer().encode(text)


# --- where streamed text is cut --------------------------------------------------------------------------------


def test_finished_sentences_are_handed_on_as_their_end_arrives() -> None:
    """A sentence is handed on once more text shows it ended; "3." before "14" is not an end; the rest comes at
    the stream's end. If a chunk waited for the whole text, streamed text would start no earlier than a string."""
    seen: list[str] = []

    def feed() -> Iterator[str]:
        for piece in ["Hello the", "re. It is 3.", "14 degrees", " today! And", " more"]:
            yield piece
            seen.append(piece)

    chunks = []
    for chunk in finished_sentences(feed(), _encode):
        chunks.append((chunk, len(seen)))
    assert [c for c, _ in chunks] == ["Hello there. ", "It is 3.14 degrees today! ", "And more"]
    # each chunk came out while the next pieces were still to be read
    assert [n for _, n in chunks] == [1, 3, 5]


def test_unpunctuated_streamed_text_is_handed_on_in_bounded_chunks() -> None:
    words = ["word "] * 1000
    chunks = list(finished_sentences(iter(words), _encode))
    assert "".join(chunks) == "".join(words) and len(chunks) > 3
    assert max(len(_encode(c)) for c in chunks) <= PIECE_MAX_N


def test_segments_end_at_a_sentence_after_min_n_and_never_pass_max_n() -> None:
    text = "This is a sentence of some length, said here. " * 30
    pieces = [text[i : i + 7] for i in range(0, len(text), 7)]
    segs = ["".join(seg) for seg in segments(iter(pieces), _encode, min_n=20, max_n=60)]
    assert "".join(segs) == text and len(segs) > 5
    assert all(s.endswith(". ") for s in segs[:-1]), segs[:3]
    unpunctuated = [f"w{i} " for i in range(500)]
    segs = ["".join(seg) for seg in segments(iter(unpunctuated), _encode, min_n=20, max_n=60)]
    assert "".join(segs) == "".join(unpunctuated)
    assert max(len(_encode(s)) for s in segs) <= 60


class _Counting:
    """A tokenizer that counts the characters it is given: the work of cutting streamed text."""

    def __init__(self) -> None:
        self.chars = 0

    def __call__(self, text: str) -> list[int]:
        self.chars += len(text)
        return _encode(text)


@pytest.mark.parametrize("shape", ["one-piece", "char-by-char"])
def test_streamed_text_is_cut_in_linear_work_and_bounded_chunks_whatever_its_pieces(shape: str) -> None:
    """A huge piece (one WebSocket frame of a whole document) or text sent a character at a time is measured a
    bounded number of times per character, and no chunk the normaliser gets passes PIECE_MAX_N units. Before, the
    whole text held back was measured again per piece (quadratic) and a 1 MB piece reached the normaliser whole
    (13.8 s and 1.1 GB for 64k characters, with the server unresponsive)."""
    # half without a sentence end; 84k characters in one piece, 8.4k a character at a time (a tokenizer call each)
    k = 10 if shape == "one-piece" else 1
    text = "hello there " * 400 * k + "and one sentence. " * 200 * k
    pieces = [text] if shape == "one-piece" else list(text)
    for cut in (finished_sentences, lambda p, t: ("".join(seg) for seg in segments(p, t))):
        tok = _Counting()
        chunks = list(cut(iter(pieces), tok))
        assert "".join(chunks) == text
        assert max(len(_encode(c)) for c in chunks) <= PIECE_MAX_N
        # the text held back (up to PIECE_MAX_N tokens, ~900 characters) measured per piece is ~400 a character
        assert tok.chars <= 20 * len(text), f"{tok.chars / len(text):.1f} characters measured per character"


def test_a_huge_piece_is_read_in_windows_cut_between_words_and_never_inside_a_tag() -> None:
    from cosyserve.frontend.textstream import WINDOW_CHARS, windows

    words = "word " * 1000
    parts = list(windows([words]))
    assert "".join(parts) == words and max(map(len, parts)) <= WINDOW_CHARS
    assert all(p.endswith(" ") for p in parts[:-1]), "a window ends after a blank where it has one"
    tagged = "x" * (WINDOW_CHARS - 5) + "<|endofprompt|>" + "y" * 2000
    parts = list(windows(["", tagged]))
    assert "".join(parts) == tagged and any(p.startswith("<|endofprompt|>") for p in parts), [
        p[:20] for p in parts
    ]


# --- runtimes ---------------------------------------------------------------------------------------------------


def _first_audio_before_the_end(rt: Any, **kwargs: Any) -> tuple[np.ndarray, list[str]]:
    """Streams two sentences, then holds the rest of the text back until the first audio chunk arrives: a runtime
    that waits for the whole text never sends it, and the feed's deadline ends the test instead of a hang."""
    feed = TextFeed(deadline=_deadline())
    feed.put("Hello there, this is the first sentence. ")
    feed.put("And a second one follows. ")
    gen = rt.start(SynthesisRequest(text=feed, stream=True, seed=1, **kwargs), lambda: False)
    chunks = [next(gen)]
    assert not feed.closed, "audio came only after the text ended"
    feed.put("The last words.")
    feed.finish()
    chunks.append(next(gen))
    gen.close()  # random weights speak on to the piece's cap: the rest proves nothing more
    audio = np.concatenate(chunks)
    assert np.isfinite(audio).all() and audio.size > 0
    return audio, []


def _deadline() -> float:
    import time

    return time.monotonic() + 120  # generous: only a runtime that waits for the end of the text reaches it


@pytest.mark.parametrize("runtime", ["torch", "lite"])
def test_cosyvoice300m_speaks_streamed_text_before_it_ends(
    tiny_model_dir: Path, tiny_lite_bundle: Path, runtime: str
) -> None:
    model = tiny_model_dir if runtime == "torch" else tiny_lite_bundle
    rt = load_runtime(model, RuntimeOptions(warmup=False, flow_steps=1), runtime=runtime)
    try:
        _first_audio_before_the_end(rt)
    finally:
        rt.close()


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_a_bistream_lm_takes_text_as_it_arrives(
    cv2_model_dir: Path, cv3_model_dir: Path, family: str
) -> None:
    """CosyVoice2/3's LM decodes with the text so far (the reference's bistream): if it waited, the held-back
    text would never be released."""
    model = cv2_model_dir if family == "cosyvoice2" else cv3_model_dir
    rt = load_runtime(model, RuntimeOptions(warmup=False, flow_steps=1))
    from cosyserve.runtime.lm import Streamed

    calls: list[Any] = []
    original = rt.pipeline.decoder.generate

    def spy(spec: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(spec)
        return original(spec, *args, **kwargs)

    rt.pipeline.decoder.generate = spy
    try:
        _first_audio_before_the_end(rt)
        if family == "cosyvoice3":  # no <|endofprompt|> given: the default prefix opens the prompt
            assert 151646 in calls[0].prompt_text
    finally:
        rt.close()
    assert calls and isinstance(calls[0], Streamed), (
        "the streamed text did not go to the LM as a streamed row"
    )


def test_a_streamed_text_with_nothing_to_speak_is_refused(tiny_model_dir: Path) -> None:
    rt = load_runtime(tiny_model_dir, RuntimeOptions(warmup=False))
    try:
        feed = TextFeed()
        for piece in ["...", " !!", "  "]:
            feed.put(piece)
        feed.finish()
        with pytest.raises(ClientError, match="nothing to speak"):
            list(rt.start(SynthesisRequest(text=feed, seed=1), lambda: False))
    finally:
        rt.close()


def test_a_stopped_request_stops_reading_its_text(tiny_model_dir: Path) -> None:
    """A request stopped while its text still arrives must end without waiting for the rest of it."""
    rt = load_runtime(tiny_model_dir, RuntimeOptions(warmup=False, flow_steps=1))
    stop = threading.Event()
    try:
        feed = TextFeed(deadline=_deadline())
        feed.put("A first sentence to speak. ")
        feed.put("Then more. ")
        gen = rt.start(SynthesisRequest(text=feed, stream=True, seed=1), stop.is_set)
        next(gen)
        stop.set()
        feed.abort()  # the producer ends its feed when it cancels (TextFeed's contract)
        rest = list(gen)
    finally:
        rt.close()
    assert sum(c.size for c in rest) < 30 * rt.sample_rate


def test_a_streamed_lm_run_is_bounded_by_the_text_it_received(cv3_model_dir: Path) -> None:
    """The reference's bistream decodes until EOS: an LM that never picks it (random weights, text it cannot
    read) ran to the piece cap of a minute of speech for three words. At most 20 speech tokens per text token
    received, as one-shot synthesis allows."""
    from cosyserve.runtime.lm import Streamed
    from cosyserve.runtime.oneoff import generate

    rt = load_runtime(cv3_model_dir, RuntimeOptions(warmup=False))
    try:
        pieces = [[10, 11], [12]]
        # <|endofprompt|> alone as the prompt text; the pipeline's default ratio
        tokens = list(generate(rt.pipeline.llm, Streamed(iter(pieces), [151646], []), 0))
    finally:
        rt.close()
    assert 0 < len(tokens) <= 20 * 3
