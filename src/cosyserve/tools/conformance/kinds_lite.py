"""Conformance kinds on the lite runtime (``cosyserve conformance DIR --runtime lite``).

The same cases as the torch kinds, computed by what the lite runtime runs: the ONNX graphs of a bundle converted
with ``--runtime lite`` driven by :mod:`cosyserve.runtime.lite.lm`, :mod:`cosyserve.runtime.lite.models` and
:mod:`cosyserve.runtime.lite.chunkflow` (the LM, flow and vocoder kinds of every family; the token2wav kinds run
the family's own token2wav over them), and the numpy
audio front end (:mod:`cosyserve.frontend.features_np`, :func:`cosyserve.frontend.audio.load_wav_np`,
:class:`cosyserve.runtime.lite.frontend.LiteFrontend` as a bundle of the set's family makes it: the prompt mel,
speech token and prompt frontend kinds; CosyVoice3's silent-token filter is the one torch-free filter both
runtimes run). The runner still loads fixtures and compares with torch; the
computations under test import none. Text kinds (``tokenize``, ``text_frontend``) are torch-free code both
runtimes share, so the torch kinds' functions run them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cosyserve.frontend import features_np
from cosyserve.frontend.audio import load_wav_np

__all__ = ["CV3_KINDS", "KINDS", "QWEN_KINDS"]


class _Lite:
    """The set's lite models, each made on first use (the 300M flow and vocoder, or the chunk flow and 24 kHz ones)."""

    def __init__(self, ctx: Any) -> None:
        from cosyserve.runtime.lite.models import LiteBundle

        assert ctx.bundle_dir is not None, "the lite kinds need the set converted with --runtime lite"
        self.bundle = LiteBundle(ctx.bundle_dir, verify="full", threads=1)
        self.tables = self.bundle.tables()
        self._made: dict[str, Any] = {}

    def __getitem__(self, part: str) -> Any:
        if part not in self._made:
            from cosyserve.runtime.lite.chunkflow import LiteCausalVocoder, LiteChunkFlow, LiteVocoder2
            from cosyserve.runtime.lite.lm import lite_lm
            from cosyserve.runtime.lite.models import LiteFlow, LiteVocoder

            make = {
                "llm": lite_lm, "flow": LiteFlow, "hift": LiteVocoder, "chunk_flow": LiteChunkFlow,
                "causal_hift": LiteCausalVocoder, "hift2": LiteVocoder2,
            }[part]  # fmt: skip
            self._made[part] = make(self.bundle, self.tables)
        return self._made[part]


def _lite(ctx: Any) -> _Lite:
    lite = ctx.cache.get("lite")
    if lite is None:
        lite = ctx.cache["lite"] = _Lite(ctx)
    return lite  # type: ignore[no-any-return]


def _a(t: Any) -> np.ndarray:
    return t.detach().cpu().float().numpy() if t.is_floating_point() else t.detach().cpu().numpy()


def _ids(t: Any) -> list[int]:
    return [int(x) for x in _a(t).reshape(-1)]


def run_llm_logprobs(ctx: Any, inputs: dict) -> dict:
    from cosyserve.tools.conformance.kinds_lm import llm_logprobs

    emb = _a(inputs["embedding"]).reshape(1, -1)
    model_input = {
        "text": _ids(inputs["text"]),
        "prompt_text": _ids(inputs["prompt_text"]),
        "llm_prompt_speech_token": _ids(inputs["prompt_speech_token"]),
    }
    if emb.size:
        model_input["llm_embedding"] = emb
    return llm_logprobs(_lite(ctx)["llm"], model_input, _ids(inputs["teacher_tokens"]))


def run_llm_bistream_logprobs(ctx: Any, inputs: dict) -> dict:
    from cosyserve.tools.conformance.kinds_lm import llm_bistream_logprobs

    return llm_bistream_logprobs(
        _lite(ctx)["llm"],
        *(_ids(inputs[k]) for k in ("text", "prompt_text", "prompt_speech_token", "teacher_tokens")),
    )


def run_flow_inference(ctx: Any, inputs: dict) -> dict:
    token, prompt_token, prompt_feat = (_a(inputs[k]) for k in ("token", "prompt_token", "prompt_feat"))
    mel, cache = _lite(ctx)["flow"].inference(
        token, [token.shape[1]], prompt_token, [prompt_token.shape[1]], prompt_feat, [prompt_feat.shape[1]],
        _a(inputs["embedding"]), _a(inputs["flow_cache"]), noise=_a(inputs["flow_noise"]),
    )  # fmt: skip
    return {"mel": mel, "flow_cache": cache}


def run_hift_inference(ctx: Any, inputs: dict) -> dict:
    # the recorded draws: sine_phase (1, H, 1), sine_noise (1, H, L); source_noise feeds no output
    speech, source = _lite(ctx)["hift"].inference(
        _a(inputs["speech_feat"]), _a(inputs["cache_source"]),
        sine_phase=_a(inputs["sine_phase"]), sine_noise=_a(inputs["sine_noise"]),
    )  # fmt: skip
    return {"speech": speech, "source": source}


def run_chunk_flow_inference(ctx: Any, inputs: dict) -> dict:
    # CosyVoice2/3: the flow reproduces the reference's fixed noise itself (flow_noise is not passed)
    mel = _lite(ctx)["chunk_flow"].inference(
        *(_a(inputs[k]) for k in ("token", "prompt_token", "prompt_feat", "embedding")),
        streaming=bool(inputs["streaming"]),
        finalize=bool(inputs["finalize"]),
    )
    return {"mel": mel}


def run_causal_hift_inference(ctx: Any, inputs: dict) -> dict:
    # CosyVoice3: the model's fixed noise buffers are inputs (rand_ini (1, H), sine_waves (1, L, H))
    speech, source = _lite(ctx)["causal_hift"].inference(
        _a(inputs["speech_feat"]),
        bool(inputs["finalize"]),
        _a(inputs["hift_rand_ini"]),
        _a(inputs["hift_sine_waves"]),
    )
    return {"speech": speech, "source": source}


def run_hift2_inference(ctx: Any, inputs: dict) -> dict:
    # CosyVoice2: the recorded draws sine_rand_ini (1, H), sine_noise (1, L, H); source_noise feeds no output
    speech, source = _lite(ctx)["hift2"].inference(
        _a(inputs["speech_feat"]), _a(inputs["cache_source"]),
        sine_phase=_a(inputs["sine_rand_ini"]), sine_noise=_a(inputs["sine_noise"]),
    )  # fmt: skip
    return {"speech": speech, "source": source}


def run_token2wav2(ctx: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    # CosyVoice2's own token2wav (the torch runtime's chunk rules, one code) over the lite flow and vocoder
    from cosyserve.families.cosyvoice2.token2wav import Token2Wav2

    lite = _lite(ctx)
    calls = sorted(
        {int(k[1 : k.index("_")]) for k in inputs if k.startswith("c") and k.endswith("_sine_noise")}
    )
    draws = (
        {"sine_phase": _a(inputs[f"c{c}_sine_rand_ini"]), "sine_noise": _a(inputs[f"c{c}_sine_noise"])}
        for c in calls
    )
    return _chunks(Token2Wav2(lite["chunk_flow"], lite["hift2"]), inputs, draws)


def run_token2wav3(ctx: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    # CosyVoice3's own token2wav over the lite flow and vocoder; the model's fixed noise buffers at every call
    import itertools

    from cosyserve.families.cosyvoice3.token2wav import Token2Wav3

    lite = _lite(ctx)
    noise = {"rand_ini": _a(inputs["hift_rand_ini"]), "sine_waves": _a(inputs["hift_sine_waves"])}
    return _chunks(Token2Wav3(lite["chunk_flow"], lite["causal_hift"]), inputs, itertools.repeat(noise))


def _chunks(t2w: Any, inputs: dict[str, Any], draws: Any) -> dict[str, Any]:
    # the case's outputs: the shared token2wav ``t2w`` (the reference policy: hops 25 (+ prompt pad), 50, 100) on
    # the vc branch's inputs, with ``draws``
    chunks = list(
        t2w(
            _ids(inputs["source_speech_token"]),
            embedding=_a(inputs["flow_embedding"]),
            prompt_token=_a(inputs["flow_prompt_speech_token"]),
            prompt_feat=_a(inputs["prompt_speech_feat"]),
            stream=bool(inputs["stream"]),
            speed=float(inputs["speed"]),
            draws=draws,
        )
    )
    out: dict[str, Any] = {f"chunk{i}": c for i, c in enumerate(chunks)}
    out["num_chunks"] = len(chunks)
    return out


def run_token2wav(ctx: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    # CosyVoice-300M's own token2wav (the torch runtime's windows, caches and fades, one code) over the lite flow
    # and vocoder, with the recorded draws
    from cosyserve.families.cosyvoice.token2wav import CallDraws, Token2Wav

    lite = _lite(ctx)
    calls = sorted(
        {int(k[1 : k.index("_")]) for k in inputs if k.startswith("c") and k.endswith("_flow_noise")}
    )
    draws = (
        CallDraws(*(_a(inputs[f"c{c}_{k}"]) for k in ("flow_noise", "sine_phase", "sine_noise")))
        for c in calls
    )
    return _chunks(Token2Wav(lite["flow"], lite["hift"]), inputs, draws)


def run_mel(ctx: Any, inputs: dict) -> dict:
    # the model's prompt mel: the frontend's settings (the manifest's feat_extractor; CosyVoice-300M's default)
    return {"mel": _frontend(ctx).mel(_a(inputs["speech"]))}


def run_fbank(ctx: Any, inputs: dict) -> dict:
    return {"fbank": features_np.speaker_fbank(_a(inputs["speech"]))}


def run_whisper_logmel(ctx: Any, inputs: dict) -> dict:
    return {"logmel": features_np.whisper_log_mel(_a(inputs["speech"]), n_mels=128)}


def run_resample(ctx: Any, inputs: dict) -> dict:
    return {"speech": load_wav_np(ctx.set_dir / inputs["wav"], int(inputs["target_sr"]))}


def _frontend(ctx: Any) -> Any:
    # the lite runtime's frontend as a bundle of the set's family makes it: the family's tokenizer and ONNX files,
    # the prompt mel's settings from the bundle's manifest (the config as plain data, as the lite runtime reads it)
    frontend = ctx.cache.get("lite_frontend")
    if frontend is None:
        from cosyserve.bundle.loader import open_bundle
        from cosyserve.runtime.lite.frontend import LiteFrontend

        assert ctx.bundle_dir is not None, "the lite kinds need the set converted with --runtime lite"
        family = ctx.family
        build = family.tokenizer(ctx.model_dir)
        if build is None:
            from cosyserve.frontend.tokenizer import get_tokenizer

            tokenizer = get_tokenizer()
        else:
            tokenizer = build()
        frontend = LiteFrontend.for_family(
            family,
            open_bundle(ctx.bundle_dir).manifest["config"],
            {name: ctx.model_dir / name for name in family.onnx_files},
            tokenizer.encode,
        )
        ctx.cache["lite_frontend"] = frontend
    return frontend


def _text(ctx: Any, text: str) -> tuple[np.ndarray, np.ndarray]:
    ids = _frontend(ctx).tokenize(text)
    return np.asarray([ids], dtype=np.int32).reshape(1, -1), np.asarray([len(ids)], dtype=np.int32)


def _speaker(ctx: Any, spk_id: str) -> np.ndarray:
    return _a(ctx.speakers[spk_id]["embedding"]).reshape(1, -1)


def run_zero_shot_frontend(ctx: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    from cosyserve.frontend.prompt import prompt_input

    if inputs.get("zero_shot_spk_id"):
        entry = {k: _a(v) for k, v in ctx.speakers[inputs["zero_shot_spk_id"]].items()}
    else:
        entry = _frontend(ctx).prompt_features(inputs["prompt_text"], ctx.set_dir / inputs["prompt_wav"])
    return prompt_input(_text(ctx, inputs["tts_text"]), entry, "zero_shot")


def run_cross_lingual_frontend(ctx: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    from cosyserve.frontend.prompt import prompt_input

    if inputs.get("zero_shot_spk_id"):
        entry = {k: _a(v) for k, v in ctx.speakers[inputs["zero_shot_spk_id"]].items()}
    else:
        entry = _frontend(ctx).prompt_features("", ctx.set_dir / inputs["prompt_wav"])
    return prompt_input(_text(ctx, inputs["tts_text"]), entry, "cross_lingual")


def run_instruct2_frontend(ctx: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    # the family's instruct2 input (what serving assembles) over the prompt's features: the instruction becomes the
    # LLM's prompt text, which gets no prompt speech tokens
    entry = _frontend(ctx).prompt_features("", ctx.set_dir / inputs["prompt_wav"])
    return ctx.family.model_input(  # type: ignore[no-any-return]
        "instruct2", _text(ctx, inputs["tts_text"]), entry, _text(ctx, inputs["instruct_text"])
    )


def run_vc_frontend(ctx: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    # as the shared pipeline calls it (the torch Frontend's name)
    return _frontend(ctx).frontend_vc(ctx.set_dir / inputs["source_wav"], ctx.set_dir / inputs["prompt_wav"])  # type: ignore[no-any-return]


def run_speech_token(ctx: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    tokens = _frontend(ctx).speech_tokens(load_wav_np(ctx.set_dir / inputs["wav"], 16000))
    return {
        "speech_token": np.asarray([tokens], dtype=np.int32),
        "speech_token_len": np.asarray([len(tokens)], np.int32),
    }


def run_silent_token_filter(ctx: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    # the one filter both runtimes run (torch-free), over the case's list of silent tokens
    from cosyserve.families.cosyvoice3.token2wav import filter_silent_tokens

    kept = filter_silent_tokens(_ids(inputs["tokens"]), inputs["silent_tokens"])
    return {"speech_tokens": np.asarray(list(kept), dtype=np.int32)}


def run_instruct_frontend(ctx: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    from cosyserve.frontend.prompt import instruct_input

    return instruct_input(
        _text(ctx, inputs["tts_text"]), _speaker(ctx, inputs["spk_id"]), _text(ctx, inputs["instruct_text"])
    )


KINDS = {
    "llm_logprobs": run_llm_logprobs,
    "llm_bistream_logprobs": run_llm_bistream_logprobs,
    "flow_inference": run_flow_inference,
    "hift_inference": run_hift_inference,
    "token2wav_stream": run_token2wav,
    "token2wav_full": run_token2wav,
    "mel": run_mel,
    "fbank": run_fbank,
    "whisper_logmel": run_whisper_logmel,
    "resample": run_resample,
    "zero_shot_frontend": run_zero_shot_frontend,
    "cross_lingual_frontend": run_cross_lingual_frontend,
    "instruct_frontend": run_instruct_frontend,
}
# CosyVoice2's (Family.lite_kinds_table): its flow, vocoder and token2wav kinds on the chunk flow's graphs; and
# CosyVoice3's, whose vocoder is the causal one
QWEN_KINDS = {
    **KINDS,
    "instruct2_frontend": run_instruct2_frontend,
    "flow_inference": run_chunk_flow_inference,
    "hift_inference": run_hift2_inference,
    "token2wav_stream": run_token2wav2,
    "token2wav_full": run_token2wav2,
}
CV3_KINDS = {
    **QWEN_KINDS,
    "speech_token": run_speech_token,
    "vc_frontend": run_vc_frontend,
    "silent_token_filter": run_silent_token_filter,
    "hift_inference": run_causal_hift_inference,
    "token2wav_stream": run_token2wav3,
    "token2wav_full": run_token2wav3,
}
