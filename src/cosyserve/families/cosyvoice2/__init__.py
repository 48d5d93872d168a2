"""CosyVoice2-0.5B (``cosyvoice2.yaml``).

The modules are :mod:`cosyserve.models.qwen2lm` (a Qwen2 LM over 6561 speech tokens),
:mod:`cosyserve.models.causal_flow` (the causal conformer flow with chunked attention) and :mod:`cosyserve.models.hift` (HiFT at 24 kHz, SineGen2);
the model's own Qwen tokenizer (``CosyVoice-BlankEN/``); 25 Hz speech tokens from ``speech_tokenizer_v2.onnx``;
token2wav with the reference's chunks over the whole utterance so far, each streamed chunk computing only its own
frames against the ones kept (:mod:`cosyserve.families.cosyvoice2.token2wav`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from cosyserve.families.base import Family, Flow, Ids, StreamPolicy, Token2Wav, Tokenizer, Vocoder
from cosyserve.families.cosyvoice2.config import QWEN_DIR

if TYPE_CHECKING:
    import torch

    from cosyserve.families.modelconfig import ModelConfig

__all__ = ["ENDOFPROMPT", "QWEN_DIR", "QWEN_FILES", "SPECIALS", "CosyVoice2"]

# the Qwen tokenizer's files (CosyVoice-BlankEN/model.safetensors, ~1 GB, is never read: llm.pt holds every LM
# weight); merges.txt is optional (the merges follow from the vocabulary's ranks)
QWEN_FILES = tuple(
    f"{QWEN_DIR}/{n}" for n in ("config.json", "tokenizer_config.json", "vocab.json", "merges.txt")
)
ENDOFPROMPT = "<|endofprompt|>"  # ends a CosyVoice2 instruction (a special token of its tokenizer)

# the reference's CosyVoice2Tokenizer additions, in its order
SPECIALS = (  # the special tokens its tokenizer adds to Qwen's (cosyserve.frontend.qwen_tokenizer)
    "<|endofprompt|>",
    "[breath]",
    "<strong>",
    "</strong>",
    "[noise]",
    "[laughter]",
    "[cough]",
    "[clucking]",
    "[accent]",
    "[quick_breath]",
    "<laughter>",
    "</laughter>",
    "[hissing]",
    "[sigh]",
    "[vocalized-noise]",
    "[lipsmack]",
    "[mn]",
)


class CosyVoice2(Family):
    name = "cosyvoice2"
    title = "CosyVoice2"
    config_classes = (
        "cosyserve.models.qwen2lm:Qwen2LMConfig",
        "cosyserve.models.causal_flow:CausalFlowConfig",
        "cosyserve.models.hift:HiFTConfig",
    )
    module_classes: ClassVar[dict[str, str]] = {
        "llm": "cosyserve.models.qwen2lm:Qwen2LM",
        "flow": "cosyserve.models.causal_flow:CausalMaskedDiffWithXvec",
        "hift": "cosyserve.models.hift:HiFTGenerator",
    }
    speech_tokenizer_file = "speech_tokenizer_v2.onnx"  # 25 Hz, 6561 ids
    bundle_files = ("campplus.onnx", "speech_tokenizer_v2.onnx", *QWEN_FILES)
    required_files = QWEN_FILES[:3]
    registry_folder = "cosyvoice2"
    modes = ("sft", "zero_shot", "cross_lingual", "instruct2", "vc")
    instruct_mode = "instruct2"
    prompt_mel_per_token = 2  # its flow's token_mel_ratio: 50 Hz mel over 25 Hz tokens
    # its vocoder's calls carry their state (the cached mel and source) in their arguments; its flow's streamed
    # chunks keep theirs in each request's FlowStream: chunks of as many frames stack, each row against its own
    stacks = ("flow", "hift")
    # its KV cache is 24 KiB per position and row; an 8-row step costs ~1.2x a lone one (packed weights, Zen 4)
    batch_size = 8
    test_model = "cosyserve.families.cosyvoice2.testmodel:write_model"
    conformance_kinds: ClassVar[dict[str, str]] = dict.fromkeys(
        (
            "tokenize", "llm_logprobs", "flow_inference", "hift_inference", "mel", "whisper_logmel", "resample",
            "zero_shot_frontend", "cross_lingual_frontend", "instruct2_frontend", "token2wav_stream",
            "token2wav_full",
        ),
        "cosyserve.families.cosyvoice2.conformance",
    )  # fmt: skip
    # every part exported (the flow's estimator with its stream caches as inputs and outputs); the lite runtime
    # serves it through the shared pipeline and this family's token2wav
    lite = True
    lite_export = "cosyserve.bundle.lite.export_qwen:export"
    lite_parts = ("llm", "flow", "hift")
    lite_kinds = tuple(conformance_kinds)  # every kind: the models' graphs and the numpy frontend
    lite_kinds_table = "cosyserve.tools.conformance.kinds_lite:QWEN_KINDS"
    hub_ids = ("FunAudioLLM/CosyVoice2-0.5B", "iic/CosyVoice2-0.5B")
    # the model card's: Chinese, English, Japanese, Korean and Chinese dialects (Cantonese among them)
    languages = ("zh", "en", "ja", "ko", "yue")
    # the tokens its tokenizer adds to the Qwen vocabulary, in the reference's order
    specials: ClassVar[tuple[str, ...]] = SPECIALS

    def read_config(self, model_dir: Path) -> ModelConfig:
        from cosyserve.families.cosyvoice2.config import read_config

        return read_config(model_dir, self)

    def check_model_dir(self, model_dir: Path) -> None:
        from cosyserve.core.errors import ModelDirError
        from cosyserve.frontend.qwen_tokenizer import QwenTokenizer

        for name in self.required_files:
            if not (model_dir / name).is_file():
                raise ModelDirError(
                    f"missing {model_dir / name}: a {self.title} model dir holds the Qwen config and tokenizer "
                    f"in {QWEN_DIR}/"
                )
        # the tokenizer is built from these files on the first request: a bad one is refused now, not then
        QwenTokenizer.check_dir(model_dir / QWEN_DIR, self.specials)

    def tokenizer(
        self, files: Path, check: Callable[[str], None] | None = None
    ) -> Callable[[], Tokenizer] | None:
        specials = self.specials

        def build() -> Any:
            from cosyserve.frontend.qwen_tokenizer import QwenTokenizer

            if check is not None:
                for name in QWEN_FILES:
                    check(name)
            return QwenTokenizer.from_dir(files / QWEN_DIR, specials)

        return build

    def prompt_mel(self, config: ModelConfig) -> Callable[[torch.Tensor], torch.Tensor] | None:
        if config.feat_extractor is not None:
            return config.feat_extractor  # type: ignore[no-any-return]
        from cosyserve.frontend.features import mel_spectrogram_24k

        return mel_spectrogram_24k  # a bundle written before the yaml's extractor was kept

    def stream_policy(
        self, config: ModelConfig, flow: Any, chunk_policy: str, first_hop: int
    ) -> StreamPolicy:
        from cosyserve.families.cosyvoice2.token2wav import StreamPolicy2

        # the first hop is set in 50 Hz tokens (the 300M family's); these tokens are 25 Hz
        hop = max(4, round(first_hop * config.flow.input_frame_rate / 50)) if first_hop else None
        return StreamPolicy2.named(
            chunk_policy,
            hop,
            token_hop_len=config.chunk_size,
            pre_lookahead_len=flow.pre_lookahead_len,
            token_mel_ratio=flow.token_mel_ratio,
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
        from cosyserve.families.cosyvoice2.token2wav import Token2Wav2

        return Token2Wav2(flow, hift, policy, flow_steps=flow_steps, voices=voices, flow_context=flow_context)

    def unavailable_modes(self, instruct: bool) -> dict[str, str]:
        return super().unavailable_modes(instruct) | {
            "instruct": (
                f"this is a {self.title} model, which has no speaker-instruct mode (the reference's "
                "inference_instruct is CosyVoice-300M's): use instruct2 (the instruction and a voice to clone)"
            )
        }

    def model_input(
        self, mode: str, text: Ids, voice: Mapping[str, Any], instruction: Ids | None = None
    ) -> dict[str, Any]:
        if mode != "instruct2" or instruction is None:
            return super().model_input(mode, text, voice, instruction)
        # instruct2 (the reference's frontend_instruct2): a cloned voice saying the text in the style the
        # instruction asks for; the instruction is the LLM's prompt text, the LLM gets no prompt speech tokens, the
        # flow keeps the prompt's tokens, mel and embedding
        model_input = dict(voice)
        model_input.pop("llm_prompt_speech_token", None)
        model_input.pop("llm_prompt_speech_token_len", None)
        model_input["prompt_text"], model_input["prompt_text_len"] = instruction
        model_input["text"], model_input["text_len"] = text
        return model_input

    def instruction(self, text: str) -> str:
        # instructions end with the marker the model was trained on
        text = text.rstrip()
        return text if text.endswith(ENDOFPROMPT) else text + ENDOFPROMPT
