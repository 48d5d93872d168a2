"""CosyVoice-300M, -300M-SFT and -300M-Instruct (``cosyvoice.yaml``).

The modules are :mod:`cosyserve.models.llm` (the transformer LM), :mod:`cosyserve.models.flow` (the conformer +
U-Net flow) and :mod:`cosyserve.models.hift` (HiFT at 22.05 kHz); the whisper tokenizer; 50 Hz speech tokens
from ``speech_tokenizer_v1.onnx``; token2wav in windows with a flow cache, mel and audio cross-fades
(:mod:`cosyserve.families.cosyvoice.token2wav`), which both runtimes run (the lite one over its graphs,
:mod:`cosyserve.runtime.lite.models`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from cosyserve.families.base import Family, Flow, StreamPolicy, Token2Wav, Vocoder

if TYPE_CHECKING:
    from cosyserve.families.modelconfig import ModelConfig

__all__ = ["INSTRUCT_MARK", "CosyVoice", "is_instruct_model_dir"]

INSTRUCT_MARK = "-Instruct"  # the reference's test: CosyVoice(model_dir).instruct = '-Instruct' in model_dir


def is_instruct_model_dir(model_dir: str | Path) -> bool:
    """Whether an official model directory holds an instruct model (CosyVoice-300M-Instruct).

    Nothing in the files tells: the -Instruct checkpoint has the same config, layout and speakers as -SFT; it
    was trained to follow instructions. So this is the reference's rule, made exact: the name of the directory
    (its real path, symlinks resolved, as the bundle cache keys it) contains ``-Instruct``, case-sensitive, as
    the official download's does. A Hugging Face cache snapshot (``models--ORG--NAME/snapshots/REV``) is named
    by its repo, NAME. ``cosyserve convert`` records the answer in the bundle's manifest; serving never looks
    at names.
    """
    path = Path(model_dir).resolve()
    name = path.name
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        name = path.parent.parent.name
    return INSTRUCT_MARK in name


class CosyVoice(Family):
    name = "cosyvoice"
    title = "CosyVoice-300M"
    config_classes = (
        "cosyserve.models.llm:LLMConfig",
        "cosyserve.models.flow:FlowConfig",
        "cosyserve.models.hift:HiFTConfig",
    )
    module_classes: ClassVar[dict[str, str]] = {
        "llm": "cosyserve.models.llm:TransformerLM",
        "flow": "cosyserve.models.flow:MaskedDiffWithXvec",
        "hift": "cosyserve.models.hift:HiFTGenerator",
    }
    speech_tokenizer_file = "speech_tokenizer_v1.onnx"  # 50 Hz, 4096 ids
    bundle_files = ("campplus.onnx", "speech_tokenizer_v1.onnx")
    registry_folder = ""  # the registry dir itself (where the voices of earlier versions are)
    modes = ("sft", "zero_shot", "cross_lingual", "instruct", "vc")
    instruct_mode = "instruct"
    lite = True
    lite_export = "cosyserve.bundle.lite.export_300m:export"
    lite_parts = ("llm", "flow", "hift")
    reruns_flow = False
    stacks = ("flow", "hift")
    test_model = "cosyserve.families.cosyvoice.testmodel:write_model"
    conformance_kinds: ClassVar[dict[str, str]] = {
        **dict.fromkeys(
            ("tokenize", "llm_logprobs", "flow_inference", "hift_inference", "token2wav_stream", "token2wav_full",
             "text_frontend", "zero_shot_frontend", "cross_lingual_frontend", "instruct_frontend"),
            "cosyserve.families.cosyvoice.conformance",
        ),
        **dict.fromkeys(("mel", "fbank", "whisper_logmel", "resample"), "cosyserve.tools.conformance.kinds_features"),
    }  # fmt: skip
    lite_kinds = tuple(conformance_kinds)
    hub_ids = (
        "iic/CosyVoice-300M",
        "iic/CosyVoice-300M-SFT",
        "iic/CosyVoice-300M-Instruct",
        "FunAudioLLM/CosyVoice-300M",
        "FunAudioLLM/CosyVoice-300M-SFT",
        "FunAudioLLM/CosyVoice-300M-Instruct",
    )
    # its tokenizer's language tags: <|zh|> <|en|> <|ja|> <|yue|> <|ko|>
    languages = ("zh", "en", "ja", "yue", "ko")

    def read_config(self, model_dir: Path) -> ModelConfig:
        from cosyserve.families.modelconfig import load_yaml_config

        return load_yaml_config(model_dir / self.yaml)

    def is_instruct_dir(self, model_dir: Path) -> bool:
        return is_instruct_model_dir(model_dir)

    def stream_policy(
        self, config: ModelConfig, flow: Any, chunk_policy: str, first_hop: int
    ) -> StreamPolicy:
        from cosyserve.families.cosyvoice import streampolicy

        return streampolicy.StreamPolicy.named(
            chunk_policy, first_hop, input_frame_rate=flow.input_frame_rate, sample_rate=config.sample_rate
        )

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
        from cosyserve.families.cosyvoice.token2wav import Token2Wav as WindowedToken2Wav

        return WindowedToken2Wav(flow, hift, policy, flow_steps=flow_steps)

    def unavailable_modes(self, instruct: bool) -> dict[str, str]:
        out = super().unavailable_modes(instruct) | {
            "instruct2": (
                "instruct2 is CosyVoice2's and CosyVoice3's instruction mode (an instruction and a voice to "
                "clone); this is a CosyVoice-300M model: use instruct with a CosyVoice-300M-Instruct model"
            )
        }
        if not instruct:
            out["instruct"] = (
                "this model is not an instruct model (a CosyVoice-300M-Instruct: as in the reference, one whose "
                "model directory's name contains '-Instruct' when it is converted); use sft mode, or an -Instruct "
                "model"
            )
        return out
