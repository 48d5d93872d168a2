"""Conformance kinds of CosyVoice3 sets (``KINDS-cosyvoice3.md``).

Where a kind is CosyVoice2's computation on CosyVoice3's modules (``llm_logprobs``, ``flow_inference``) or shared
by every family (``whisper_logmel``, ``resample``), the existing kind function runs; the prompt frontends are
CosyVoice2's kinds on CosyVoice3's frontend. The vocoder's noise buffers (``hift_rand_ini``, ``hift_sine_waves``)
are inputs; the flow's fixed noise is not passed (the flow reproduces it).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from cosyserve.families.cosyvoice2 import conformance as cosyvoice2
from cosyserve.families.cosyvoice3.frontend import build_tokenizer
from cosyserve.families.cosyvoice3.token2wav import Token2Wav3, filter_silent_tokens
from cosyserve.frontend.audio import load_wav
from cosyserve.tools.conformance import kinds_features, kinds_lm

__all__ = ["KINDS"]


def frontend3(ctx: Any) -> Any:
    """The set's CosyVoice3 frontend, built once per run (its ONNX sessions open on first use)."""
    if "cv3_frontend" not in ctx.cache:
        ctx.cache["cv3_frontend"] = ctx.family.frontend(ctx.model_dir, ctx.config)
    return ctx.cache["cv3_frontend"]


def run_tokenize(ctx: Any, inputs: dict) -> dict:
    return {"ids": torch.tensor(build_tokenizer(ctx.model_dir).encode(inputs["text"]), dtype=torch.int32)}


def _noise(inputs: dict) -> dict[str, torch.Tensor]:
    return {"rand_ini": inputs["hift_rand_ini"], "sine_waves": inputs["hift_sine_waves"]}


def run_hift_inference(ctx: Any, inputs: dict) -> dict:
    speech, source = ctx.hift().inference(inputs["speech_feat"], bool(inputs["finalize"]), **_noise(inputs))
    return {"speech": speech, "source": source}


def run_token2wav(ctx: Any, inputs: dict) -> dict:
    t2w = Token2Wav3(ctx.flow(), ctx.hift())  # the reference policy: hops 25 (+ prompt pad), 50, 100
    # the same fixed buffers for every call
    return cosyvoice2.vc_chunks(t2w, inputs, itertools.repeat(_noise(inputs)))


def run_mel(ctx: Any, inputs: dict) -> dict:
    return {"mel": ctx.config.feat_extractor(inputs["speech"].float())}


def run_speech_token(ctx: Any, inputs: dict) -> dict:
    tokens, length = frontend3(ctx).extract_speech_token(load_wav(ctx.set_dir / inputs["wav"], 16000))
    return {"speech_token": tokens, "speech_token_len": length}


def run_silent_token_filter(ctx: Any, inputs: dict) -> dict:
    kept = filter_silent_tokens(inputs["tokens"].tolist(), inputs["silent_tokens"])
    return {"speech_tokens": torch.tensor(list(kept), dtype=torch.int32)}


def run_vc_frontend(ctx: Any, inputs: dict) -> dict:
    return frontend3(ctx).frontend_vc(ctx.set_dir / inputs["source_wav"], ctx.set_dir / inputs["prompt_wav"])


def _on_cv3_frontend(kind: Any) -> Any:
    return lambda ctx, inputs: kind(ctx, inputs, frontend3(ctx))


KINDS = {
    "tokenize": run_tokenize,
    "llm_logprobs": kinds_lm.run_llm_logprobs,
    "llm_bistream_logprobs": kinds_lm.run_llm_bistream_logprobs,
    "flow_inference": cosyvoice2.run_flow_inference,
    "hift_inference": run_hift_inference,
    "token2wav_stream": run_token2wav,
    "token2wav_full": run_token2wav,
    "mel": run_mel,
    "whisper_logmel": kinds_features.run_whisper_logmel,
    "resample": kinds_features.run_resample,
    "speech_token": run_speech_token,
    "zero_shot_frontend": _on_cv3_frontend(cosyvoice2.run_zero_shot_frontend),
    "cross_lingual_frontend": _on_cv3_frontend(cosyvoice2.run_cross_lingual_frontend),
    "instruct2_frontend": _on_cv3_frontend(cosyvoice2.run_instruct2_frontend),
    "vc_frontend": run_vc_frontend,
    "silent_token_filter": run_silent_token_filter,
}
