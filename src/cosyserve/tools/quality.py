"""The quality gate: how far a fast path (another bundle of the model, other load options, a chunk policy) moves
the output away from the fp32 reference path of the same model, on a fixed, seeded set of inputs. The variant
runs the path a server would take with its options: each component in the dtype chosen at load for this CPU
(:func:`cosyserve.models.precision.choose_precision`), shown in the report's variant line.

Three measurements, each against the fp32 path (the same model loaded with default options and fp32 weights):

- ``llm``: teacher forcing. The fp32 LLM samples a continuation of each fixed text (seeded, the serving sampler);
  both LLMs are then fed exactly those tokens. At every step each gives a log-probability distribution over the
  speech tokens and EOS (the full softmax, before EOS masking). ``top1`` is the share of steps where the variant's
  most likely token is the fp32 model's; ``dlogp`` is the mean over steps of ``|log p_variant(t) - log p_fp32(t)|``
  with ``t`` the teacher token (the one fp32 sampled and both were fed next).
- ``token2wav``: the flow and the vocoder, one-shot, on fixed seeded token sequences, with the same flow noise and
  the same vocoder draws injected into both (drawn once in float32), so only the compute path differs.
  ``flow_mel_l1``: mean |difference| of the flow's output mels (before the vocoder). Distances of the audio:
  ``mel_l1`` (mean absolute difference of the log-mel spectrograms, natural log, the model's own mel
  features) and ``lsd_db`` (log-spectral distance: per STFT frame the RMS over frequency of the difference of the
  power spectra in dB, averaged over frames).
- ``chunks``: streamed vs one-shot audio of the same tokens, for the ``reference`` and ``low-latency`` chunk
  policies, on the variant's modules. Every streaming call gets the slice of the one-shot draws that covers its
  frames, so the difference is the chunking alone (each window's flow sees only its own tokens; the seams are
  cross-faded). Measured over the whole utterance and over the seams: around each chunk boundary, from
  :data:`SEAM_PAD` samples before it to the end of both cross-fades after it plus :data:`SEAM_PAD`. Two ratios
  of the log-mel L1: ``seam_excess`` (seams over the whole: what the seams add) and, for the low-latency policy,
  ``vs_reference`` (its whole-utterance distance over the reference rule's).

A torch-runtime tool: it measures the torch modules' compute paths, so it holds the concrete
:class:`~cosyserve.runtime.pytorch.TorchRuntime` (loaded by that runtime's own ``load``, not through
:func:`~cosyserve.runtime.load_runtime`) and reads its public ``pipeline`` (the modules and their input assembly),
never a :class:`~cosyserve.runtime.Runtime` around its protocol. The distances, the bounds and the report are
:mod:`cosyserve.tools.quality_report`'s.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from cosyserve.runtime import RuntimeOptions
from cosyserve.tools.quality_report import BOUNDS, AudioDistance, Bound, QualityReport, audio_distance, pooled

if TYPE_CHECKING:
    from cosyserve.runtime.pytorch import TorchRuntime

__all__ = [
    "BOUNDS",
    "PARTS",
    "AudioDistance",
    "Bound",
    "QualityReport",
    "audio_distance",
    "chunk_distances",
    "compare",
    "llm_agreement",
    "parse_options",
    "run_quality",
    "token2wav_distance",
]

# the fixed inputs: texts for the LLM (sft, the model's first speaker), token sequence lengths for the flow
TEXTS = ("Hello there.", "你好，世界。", "This is a somewhat longer sentence to speak.")
LLM_MAX_TOKENS = 100  # teacher tokens per text (the rest adds time, not information)
SEQUENCE_LENGTHS = (60, 150)
CHUNK_TOKENS = 300  # streamed vs one-shot: long enough for several seams under both policies
PARTS = ("llm", "token2wav", "chunks")
SEAM_PAD = 1024  # samples on either side of a seam's cross-fades that count as the seam


# -- the three measurements ---------------------------------------------------------------------------------------


def _sft_inputs(runtime: TorchRuntime) -> list[dict[str, torch.Tensor]]:
    from cosyserve.core.request import SynthesisRequest

    pipeline = runtime.pipeline
    speaker = sorted(pipeline.speakers)[0]
    return [
        pipeline.prepare(SynthesisRequest(text=text, speaker=speaker, mode="sft")).inputs[0] for text in TEXTS
    ]


@dataclass(frozen=True)
class LLMAgreement:
    """Teacher-forced agreement of two LLMs (see the module docstring).

    Attributes:
        top1: share of steps whose most likely token is the same.
        dlogp: mean |log p_variant - log p_fp32| of the teacher token.
        steps: teacher tokens over all texts.
    """

    top1: float
    dlogp: float
    steps: int


@torch.inference_mode()
def llm_agreement(reference: TorchRuntime, variant: TorchRuntime, *, seed: int = 0) -> LLMAgreement:
    """Feed the fp32 LLM's sampled continuation of each of :data:`TEXTS` to both LLMs and compare their steps.

    Args:
        reference: the fp32 :class:`~cosyserve.runtime.pytorch.TorchRuntime`.
        variant: the runtime under test (the same model).
        seed: seeds the teacher's sampling (text ``i`` uses ``seed + i``).
    Returns:
        An :class:`LLMAgreement` over all texts.
    """
    from cosyserve.core.sampling import row_key
    from cosyserve.runtime.lm import one_shot
    from cosyserve.runtime.oneoff import generate, teacher_forced

    same = total = 0
    dlogp = 0.0
    for i, inp in enumerate(_sft_inputs(reference)):
        model_input = {"text": inp["text"], "llm_embedding": inp["llm_embedding"]}
        ref_lm, var_lm = reference.pipeline.llm, variant.pipeline.llm
        teacher: list[int] = []
        for token in generate(ref_lm, one_shot(ref_lm, model_input), row_key(seed + i)):
            teacher.append(token)
            if len(teacher) == LLM_MAX_TOKENS:
                break
        if not teacher:
            continue
        t = torch.tensor(teacher, dtype=torch.int64)
        ref = teacher_forced(ref_lm, one_shot(ref_lm, model_input), teacher).logprobs
        var = teacher_forced(var_lm, one_shot(var_lm, model_input), teacher).logprobs
        same += int((ref.argmax(-1) == var.argmax(-1)).sum())
        rows = torch.arange(t.numel())
        dlogp += float((ref[rows, t] - var[rows, t]).abs().sum())
        total += t.numel()
    return LLMAgreement(same / max(total, 1), dlogp / max(total, 1), total)


def _sequences(runtime: TorchRuntime, seed: int) -> Iterator[torch.Tensor]:
    vocab = runtime.pipeline.token2wav.flow.input_embedding.num_embeddings
    g = torch.Generator().manual_seed(seed)
    for n in SEQUENCE_LENGTHS:
        yield torch.randint(0, vocab, (n,), generator=g)


@dataclass
class _Draws:
    # one-shot draws over a few frames more than the one-shot needs (a streamed run may make a frame more)
    flow_noise: torch.Tensor  # (1, 80, M + margin)
    sine_phase: torch.Tensor  # (1, H, 1)
    sine_noise: torch.Tensor  # (1, H, (M + margin) * upsample)


def _span(draws: torch.Tensor, start: int, end: int) -> torch.Tensor:
    # contiguous: the flow's Euler loop on a strided view of the noise runs many times slower
    return draws[:, :, start:end].contiguous()


def _draws(runtime: TorchRuntime, frames: int, seed: int) -> _Draws:
    t2w = runtime.pipeline.token2wav
    g = torch.Generator().manual_seed(seed)
    frames += 16
    noise = torch.randn((1, t2w.flow.output_size, frames), generator=g)
    phase, sine = t2w.hift.draw_source_noise(1, frames * t2w.hift.cfg.upsample_factor, g)
    return _Draws(noise, phase, sine)


def _one_shot(t2w: Any, tokens: torch.Tensor, embedding: torch.Tensor, d: _Draws) -> torch.Tensor:
    from cosyserve.families.cosyvoice.token2wav import CallDraws

    m = t2w.policy.mel_frames(tokens.numel())
    draws = CallDraws(
        _span(d.flow_noise, 0, m), d.sine_phase, _span(d.sine_noise, 0, m * t2w.hift.cfg.upsample_factor)
    )
    chunks = list(t2w(tokens.tolist(), embedding=embedding, draws=iter([draws])))
    return torch.cat(chunks, dim=1)[0]


def _flow_mel(t2w: Any, tokens: torch.Tensor, embedding: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    empty, zero = torch.zeros(1, 0, dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    mel, _ = t2w.flow.inference(
        tokens.reshape(1, -1).int(),
        torch.tensor([tokens.numel()], dtype=torch.int32),
        empty,
        zero,
        torch.zeros(1, 0, 80),
        zero,
        embedding,
        torch.zeros(1, 80, 0, 2),
        noise=noise,
        n_timesteps=t2w.flow_steps,  # the variant's step count, as its requests run it
    )
    return mel  # (1, 80, M)


@dataclass(frozen=True)
class Token2WavDistance:
    """One-shot flow + vocoder of a variant vs fp32 (see :func:`token2wav_distance`).

    Attributes:
        flow_mel_l1: mean |difference| of the flow's output mels (log-mel, before the vocoder).
        audio: the :class:`AudioDistance` of the audio.
    """

    flow_mel_l1: float
    audio: AudioDistance


@torch.inference_mode()
def token2wav_distance(reference: TorchRuntime, variant: TorchRuntime, *, seed: int = 0) -> Token2WavDistance:
    """One-shot flow + vocoder of the variant vs fp32 on the fixed token sequences, the same draws in both.

    Args:
        reference, variant: runtimes of the same model (see :func:`llm_agreement`).
        seed: seeds the token sequences and the draws.
    Returns:
        A :class:`Token2WavDistance` over all sequences (frame-weighted means).
    """
    embedding = _sft_inputs(reference)[0]["flow_embedding"]
    parts: list[AudioDistance] = []
    mel_diff = 0.0
    mel_frames = 0
    ref_t2w, var_t2w = reference.pipeline.token2wav, variant.pipeline.token2wav
    if reference.pipeline.family.reruns_flow:
        return _token2wav_distance2(reference, ref_t2w, var_t2w, embedding, seed)
    for i, tokens in enumerate(_sequences(reference, seed)):
        m = ref_t2w.policy.mel_frames(tokens.numel())
        d = _draws(reference, m, seed + 100 + i)
        mel_a = _flow_mel(ref_t2w, tokens, embedding, _span(d.flow_noise, 0, m))
        mel_b = _flow_mel(var_t2w, tokens, embedding, _span(d.flow_noise, 0, m))
        mel_diff += float((mel_a - mel_b).abs().mean(dim=(0, 1)).sum())
        mel_frames += m
        a, b = _one_shot(ref_t2w, tokens, embedding, d), _one_shot(var_t2w, tokens, embedding, d)
        parts.append(audio_distance(a, b, reference.sample_rate))
    return Token2WavDistance(mel_diff / max(mel_frames, 1), pooled(parts))


def _token2wav_distance2(
    reference: TorchRuntime, ref_t2w: Any, var_t2w: Any, embedding: torch.Tensor, seed: int
) -> Token2WavDistance:
    # CosyVoice2/3: the flow's noise is its fixed buffer (nothing to inject); the vocoder's draws are shared
    # (CosyVoice3's vocoder reads fixed noise: nothing to inject either)
    random_vocoder = reference.pipeline.family.random_vocoder
    parts: list[AudioDistance] = []
    mel_diff, mel_frames = 0.0, 0
    empty = torch.zeros(1, 0, dtype=torch.int32)
    for i, tokens in enumerate(_sequences(reference, seed)):
        m = ref_t2w.policy.token_mel_ratio * tokens.numel()
        g = torch.Generator().manual_seed(seed + 100 + i)
        if random_vocoder:
            phase, sine = ref_t2w.hift.draw_source_noise(1, m * ref_t2w.hift.cfg.upsample_factor, g)
        mels, audio = [], []
        for t2w in (ref_t2w, var_t2w):
            mels.append(
                t2w.flow.inference(
                    tokens.reshape(1, -1).int(),
                    empty,
                    torch.zeros(1, 0, 80),
                    embedding,
                    streaming=False,
                    finalize=True,
                    n_timesteps=t2w.flow_steps,
                )  # fmt: skip
            )
            draws = iter([{"sine_phase": phase, "sine_noise": sine}]) if random_vocoder else None
            audio.append(torch.cat(list(t2w(tokens.tolist(), embedding=embedding, draws=draws)), dim=1)[0])
        mel_diff += float((mels[0] - mels[1]).abs().mean(dim=(0, 1)).sum())
        mel_frames += m
        parts.append(audio_distance(audio[0], audio[1], reference.sample_rate))
    return Token2WavDistance(mel_diff / max(mel_frames, 1), pooled(parts))


def _stream_draws(policy: Any, n_tokens: int, d: _Draws, upsample: int) -> tuple[list[Any], list[int]]:
    """The per-call draws of a streamed run of ``n_tokens`` (each call's slice of the one-shot draws) and the
    sample offsets of its seams."""
    from cosyserve.families.cosyvoice.token2wav import CallDraws

    p = policy
    calls, seams = [], []
    frame = 0  # where the current window's mel starts on the one-shot's frame axis
    left, hop, first = n_tokens, p.first_hop, True
    while left > 0:
        final = left < hop + p.token_overlap_len
        n = left if final else hop + p.token_overlap_len
        m = p.mel_frames(n)
        # the vocoder runs on the previous window's last mel_cache_len frames + this window's emitted frames
        start = frame if first else frame - p.mel_cache_len
        mel_len = (frame + m if final else frame + m - p.mel_overlap_len) - start
        calls.append(
            CallDraws(
                _span(d.flow_noise, frame, frame + m),
                d.sine_phase,
                _span(d.sine_noise, start * upsample, (start + mel_len) * upsample),
            )
        )
        if not first:
            seams.append(
                start * upsample
            )  # the audio emitted so far ends where this call's vocoder input starts
        if final:
            break
        frame += m - p.mel_overlap_len
        left -= hop
        hop, first = p.next_hop(hop), False
    return calls, seams


@dataclass(frozen=True)
class ChunkDistance:
    """Streamed vs one-shot audio under one chunk policy.

    Attributes:
        seam: around the chunk boundaries; overall: the whole utterance.
        seams: chunk boundaries; first_window: tokens the flow saw in the first streamed call.
    """

    seam: AudioDistance
    overall: AudioDistance
    seams: int
    first_window: int


@torch.inference_mode()
def chunk_distances(
    runtime: TorchRuntime, policy: Any, *, seed: int = 0, n_tokens: int = CHUNK_TOKENS
) -> ChunkDistance:
    """Stream ``n_tokens`` fixed tokens under ``policy`` on ``runtime``'s flow and vocoder and compare the audio
    with the one-shot audio of the same tokens and draws.

    Args:
        runtime: a :class:`~cosyserve.runtime.pytorch.TorchRuntime`.
        policy: a :class:`~cosyserve.families.cosyvoice.token2wav.StreamPolicy`.
        seed: seeds the tokens and the draws.
        n_tokens: length of the token sequence.
    Returns:
        A :class:`ChunkDistance`.
    """
    from cosyserve.families.cosyvoice.token2wav import Token2Wav

    base = runtime.pipeline.token2wav
    t2w = Token2Wav(base.flow, base.hift, policy)
    vocab = base.flow.input_embedding.num_embeddings
    tokens = torch.randint(0, vocab, (n_tokens,), generator=torch.Generator().manual_seed(seed + 200))
    embedding = _sft_inputs(runtime)[0]["flow_embedding"]
    upsample = base.hift.cfg.upsample_factor
    d = _draws(runtime, policy.mel_frames(n_tokens), seed + 300)
    one_shot = _one_shot(t2w, tokens, embedding, d)
    calls, seams = _stream_draws(policy, n_tokens, d, upsample)
    windows: list[int] = []
    flow = t2w.flow

    class _Seen:  # records the tokens of each flow call
        def __getattr__(self, name: str) -> Any:
            return getattr(flow, name)

        def inference(self, token: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            windows.append(token.shape[1])
            return flow.inference(token, *args, **kwargs)

    t2w.flow = _Seen()
    streamed = torch.cat(
        list(t2w(tokens.tolist(), embedding=embedding, stream=True, draws=iter(calls))), dim=1
    )[0]
    width = policy.source_cache_len + policy.mel_overlap_len * policy.hop_length
    regions = [(s - SEAM_PAD, s + width + SEAM_PAD) for s in seams]
    sr = runtime.sample_rate
    return ChunkDistance(
        seam=audio_distance(streamed, one_shot, sr, regions),
        overall=audio_distance(streamed, one_shot, sr),
        seams=len(seams),
        first_window=windows[0],
    )


def compare(
    reference: TorchRuntime, variant: TorchRuntime, *, seed: int = 0, parts: Sequence[str] = PARTS
) -> dict[str, float]:
    """Every figure of the gate for ``variant`` against the fp32 ``reference`` runtime.

    Args:
        reference: the fp32 runtime; variant: the runtime under test (may be ``reference`` itself).
        seed: seeds every fixed input and draw.
        parts: which of ``llm``, ``token2wav``, ``chunks`` to measure.
    Returns:
        figure name -> value (see :data:`BOUNDS` for the gated ones).
    """
    from cosyserve.families.cosyvoice.token2wav import StreamPolicy

    family = reference.pipeline.family
    if family.reruns_flow and "chunks" in parts:
        if list(parts) == list(PARTS):  # the default: what applies to this family
            parts = [p for p in parts if p != "chunks"]
        else:
            from cosyserve.core.errors import ClientError

            raise ClientError(
                f"the chunks part of the quality gate is built for CosyVoice-300M's streaming only; this is a "
                f"{family.title} model (its chunks re-run the flow with chunked attention): use --parts llm,token2wav"
            )
    out: dict[str, float] = {}
    if "llm" in parts:
        a = llm_agreement(reference, variant, seed=seed)
        out |= {"llm.top1": a.top1, "llm.dlogp": a.dlogp, "llm.steps": a.steps}
    if "token2wav" in parts:
        t = token2wav_distance(reference, variant, seed=seed)
        out |= {
            "token2wav.flow_mel_l1": t.flow_mel_l1,
            "token2wav.mel_l1": t.audio.mel_l1,
            "token2wav.lsd_db": t.audio.lsd_db,
        }
    if "chunks" in parts:
        base = variant.pipeline.token2wav.policy
        first_hop = variant.options.first_hop
        for name in ("reference", "low-latency"):
            policy = StreamPolicy.named(
                name, first_hop, input_frame_rate=base.input_frame_rate, sample_rate=base.sample_rate
            )
            c = chunk_distances(variant, policy, seed=seed)
            for where, dist in (("seam", c.seam), ("overall", c.overall)):
                out[f"chunks.{name}.{where}.mel_l1"] = dist.mel_l1
                out[f"chunks.{name}.{where}.lsd_db"] = dist.lsd_db
            out[f"chunks.{name}.seam_excess"] = c.seam.mel_l1 / max(c.overall.mel_l1, 1e-12)
            out[f"chunks.{name}.seams"] = c.seams
            out[f"chunks.{name}.first_window"] = c.first_window
        overall = out["chunks.reference.overall.mel_l1"]
        out["chunks.low-latency.vs_reference"] = out["chunks.low-latency.overall.mel_l1"] / max(
            overall, 1e-12
        )
    return out


# -- loading ------------------------------------------------------------------------------------------------------


def _cast(name: str, hint: Any, raw: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        if raw not in args:
            raise ValueError(f"--option {name}={raw}: expected one of {', '.join(map(str, args))}")
        return raw
    if args and type(None) in args:  # X | None
        if raw.lower() == "none":
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _cast(name, inner, raw)
    if hint is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"--option {name}={raw}: expected a boolean (true or false)")
    if hint in (int, float):
        try:
            return hint(raw)
        except ValueError:
            raise ValueError(
                f"--option {name}={raw}: expected {'an integer' if hint is int else 'a number'}"
            ) from None
    if hint is str:
        return raw
    raise ValueError(f"--option {name}: a {hint} option cannot be given on the command line")


def parse_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``key=value`` strings -> :class:`~cosyserve.runtime.RuntimeOptions` fields, each value cast to its field's
    declared type.

    Raises:
        ValueError: a pair without ``=``, an unknown key (the message lists the known ones) or a bad value.
    """
    hints = typing.get_type_hints(RuntimeOptions)
    names = [f.name for f in dataclasses.fields(RuntimeOptions)]
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ValueError(f"--option {pair!r}: expected KEY=VALUE")
        if key not in names:
            raise ValueError(f"--option {key}: unknown option; expected one of {', '.join(names)}")
        out[key] = _cast(key, hints[key], raw.strip())
    return out


def _load(path: str, options: RuntimeOptions) -> TorchRuntime:
    from cosyserve.runtime.pytorch import load

    return load(path, options, None)


def run_quality(
    model: str,
    *,
    against: str | None = None,
    options: dict[str, Any] | None = None,
    threads: int | None = None,
    seed: int = 0,
    parts: Sequence[str] = PARTS,
) -> QualityReport:
    """Load ``model`` in fp32 with default options but ``llm_gemm=linear`` (the reference path) and the variant
    (``against`` or ``model`` again, with ``options``), check they are the same model, and measure the gate's
    figures.

    Args:
        model: the model (bundle, official dir, hub id); it is loaded with fp32 default options as the reference.
        against: another bundle of the same model (e.g. bf16) as the variant (None: ``model``).
        options: :class:`~cosyserve.runtime.RuntimeOptions` fields of the variant.
        threads: torch threads.
        seed: seeds every fixed input and draw.
        parts: which measurements to run (``llm``, ``token2wav``, ``chunks``).
    Returns:
        A :class:`QualityReport`.
    Raises:
        ValueError: bad options, or ``against`` is another model.
    """
    # the LM's products pinned to torch's F.linear (the reference's): llm_gemm=auto times two layouts on its first
    # steps and keeps one, which moves the last bits between the gate's own runs (--option llm_gemm=... measures it)
    base = RuntimeOptions(warmup=False, threads=threads, text_tier="lazy", llm_gemm="linear")
    fp32 = dict.fromkeys(("llm_dtype", "flow_dtype", "hift_dtype"), "float32")
    try:
        variant_options = dataclasses.replace(base, **(options or {}))
    except (TypeError, ValueError) as e:
        raise ValueError(f"--option: {e}") from None
    reference_options = dataclasses.replace(base, **fp32)
    reference = _load(model, reference_options)
    variant_path = against or model
    variant = (
        reference
        if variant_path == model and variant_options == reference_options
        else _load(variant_path, variant_options)
    )
    if reference.bundle.model_key != variant.bundle.model_key:
        raise ValueError(
            f"--against {against}: another model ({variant.bundle.model_key}) than {model} "
            f"({reference.bundle.model_key}); compare bundles of the same model"
        )
    shown = ", ".join(f"{k}={v}" for k, v in (options or {}).items())
    chosen = ", ".join(f"{name} {p}" for name, p in variant.precision.items())
    label = f"{variant_path}" + (f" [{shown}]" if shown else "") + f" (computes in: {chosen})"
    return QualityReport(model, label, compare(reference, variant, seed=seed, parts=parts))
