"""Fun-CosyVoice3-0.5B (``cosyvoice3.yaml``): CosyVoice2's shape with its own modules and rules.

The modules are :mod:`cosyserve.models.cosyvoice3_lm` (the LM over 6561 speech tokens + 200 special ids),
:mod:`cosyserve.models.dit` (the DiT flow) and :mod:`cosyserve.models.causal_hift` (the causal vocoder, its noise
fixed: :mod:`.noise`); CosyVoice2's Qwen tokenizer with 278 more special tokens (280 in its special block, 151644-151923); ``speech_tokenizer_v3.onnx``;
the yaml's prompt mel (up to 12 kHz); token2wav with CosyVoice2's chunks and a vocoder re-run on the whole mel so
far, silent-token runs cut to 5 (:mod:`.token2wav`); conformance kinds in :mod:`.conformance`.

The LM needs ``<|endofprompt|>`` in its prompt text or text (the reference asserts it; callers put
``You are a helpful assistant.<|endofprompt|>`` there). A request without one is completed here with that default,
the prefix of every example of the official README, rather than refused: an OpenAI-style client knows nothing of
the marker, and the default is what the model was shown.

Tags in the text: the tokenizer's special tokens (CosyVoice2's ``[breath]``, ``[laughter]``, ``<strong>`` ...,
CosyVoice3's ``<|endofsystem|>``, ARPAbet phone tags such as ``[AA1]`` and pinyin tags) are one token each; any other
bracketed word (``[foo]``) is plain text, tokenized as its characters, as in the reference, which refuses nothing:
the model reads it, and may speak it.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from cosyserve.families.base import Flow, StreamPolicy, Token2Wav, Vocoder
from cosyserve.families.cosyvoice2 import ENDOFPROMPT, QWEN_FILES, CosyVoice2
from cosyserve.families.cosyvoice2 import SPECIALS as COSYVOICE2_SPECIALS

if TYPE_CHECKING:
    import torch

    from cosyserve.families.modelconfig import ModelConfig

__all__ = ["DEFAULT_PREFIX", "SPECIALS", "CosyVoice3"]

DEFAULT_PREFIX = "You are a helpful assistant." + ENDOFPROMPT
_SYSTEM = "You are a helpful assistant. "

# CosyVoice3's additions after CosyVoice2's, in the reference's order: English phones (ARPAbet, vowels with and
# without a stress digit), then pinyin initials and toned finals (NFC, precomposed tone marks)
_PHONES = """
AA AA0 AA1 AA2 AE AE0 AE1 AE2 AH AH0 AH1 AH2 AO AO0 AO1 AO2 AW AW0 AW1 AW2 AY AY0 AY1 AY2 B CH D DH EH EH0 EH1 EH2
ER ER0 ER1 ER2 EY EY0 EY1 EY2 F G HH IH IH0 IH1 IH2 IY IY0 IY1 IY2 JH K L M N NG OW OW0 OW1 OW2 OY OY0 OY1 OY2 P R S
SH T TH UH UH0 UH1 UH2 UW UW0 UW1 UW2 V W Y Z ZH
"""
_PINYIN = """
a ai an ang ao b c ch d e ei en eng f g h i ian in ing iu ià iàn iàng iào iá ián iáng iáo iè ié iòng ióng iù iú iā
iān iāng iāo iē iě iōng iū iǎ iǎn iǎng iǎo iǒng iǔ j k l m n o ong ou p q r s sh t u uang ue un uo uà uài uàn uàng
uá uái uán uáng uè ué uì uí uò uó uā uāi uān uāng uē uě uī uō uǎ uǎi uǎn uǎng uǐ uǒ vè w x y z zh à ài àn àng ào á
ái án áng áo è èi èn èng èr é éi én éng ér ì ìn ìng í ín íng ò òng òu ó óng óu ù ùn ú ún ā āi ān āng āo ē ēi ēn
ēng ě ěi ěn ěng ěr ī īn īng ō ōng ōu ū ūn ǎ ǎi ǎn ǎng ǎo ǐ ǐn ǐng ǒ ǒng ǒu ǔ ǔn ǘ ǚ ǜ
"""
SPECIALS = (
    *COSYVOICE2_SPECIALS,
    "<|endofsystem|>",
    *(f"[{p}]" for p in _PHONES.split()),
    *(f"[{unicodedata.normalize('NFC', p)}]" for p in _PINYIN.split()),
)


class CosyVoice3(CosyVoice2):
    name = "cosyvoice3"
    title = "CosyVoice3"
    config_classes = (
        "cosyserve.models.cosyvoice3_lm:CosyVoice3LMConfig",
        "cosyserve.models.dit:DiTFlowConfig",
        "cosyserve.models.causal_hift:CausalHiFTConfig",
    )
    module_classes: ClassVar[dict[str, str]] = {
        "llm": "cosyserve.models.cosyvoice3_lm:CosyVoice3LM",
        "flow": "cosyserve.models.dit:CausalMaskedDiffWithDiT",
        "hift": "cosyserve.models.causal_hift:CausalHiFTGenerator",
    }
    speech_tokenizer_file = "speech_tokenizer_v3.onnx"  # 25 Hz FSQ tokens (6561 codes)
    bundle_files = ("campplus.onnx", "speech_tokenizer_v3.onnx", *QWEN_FILES)
    registry_folder = "cosyvoice3"
    random_vocoder = False
    # its vocoder's stream calls and its flow's streamed chunks of as many frames stack (each its own state)
    stacks = ("flow", "hift")
    test_model = "cosyserve.families.cosyvoice3.testmodel:write_model"
    conformance_kinds: ClassVar[dict[str, str]] = dict.fromkeys(
        (
            "tokenize", "llm_logprobs", "llm_bistream_logprobs", "flow_inference", "hift_inference",
            "token2wav_stream", "token2wav_full", "mel", "whisper_logmel", "speech_token", "resample",
            "zero_shot_frontend", "cross_lingual_frontend", "instruct2_frontend", "vc_frontend",
            "silent_token_filter",
        ),
        "cosyserve.families.cosyvoice3.conformance",
    )  # fmt: skip
    lite_kinds = tuple(conformance_kinds)  # every kind: the models' graphs and the numpy frontend
    lite_kinds_table = "cosyserve.tools.conformance.kinds_lite:CV3_KINDS"
    hub_ids = ("FunAudioLLM/Fun-CosyVoice3-0.5B-2512",)
    # the model card's nine languages, and Chinese dialects (Cantonese among them)
    languages = ("zh", "en", "ja", "ko", "de", "es", "fr", "it", "ru", "yue")
    specials = SPECIALS

    def prompt_mel(self, config: ModelConfig) -> Callable[[torch.Tensor], torch.Tensor] | None:
        if config.feat_extractor is None:
            from cosyserve.core.errors import ModelConfigError

            raise ModelConfigError(
                f"{config.source}: no feat_extractor (the prompt mel); a CosyVoice3 yaml has one"
            )
        return config.feat_extractor  # type: ignore[no-any-return]

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
        from cosyserve.families.cosyvoice3.noise import VocoderNoise
        from cosyserve.families.cosyvoice3.token2wav import Token2Wav3

        return Token2Wav3(
            flow, hift, policy, flow_steps=flow_steps, noise=VocoderNoise(config), voices=voices,
            flow_context=flow_context,
        )  # fmt: skip

    def instruction(self, text: str) -> str:
        # the official examples: "You are a helpful assistant. <instruction><|endofprompt|>"
        text = text.strip()
        return text if ENDOFPROMPT in text else f"{_SYSTEM}{text}{ENDOFPROMPT}"

    def complete_instruction(self, text: str) -> str:
        return self.instruction(text)

    def complete_inputs(
        self, inputs: Iterable[dict[str, Any]], encode: Callable[[str], list[int]]
    ) -> Iterator[dict[str, Any]]:
        # Each piece is one LM run: its prompt text or text must hold the marker. A piece without it gets the first
        # piece's own prefix (a text that began with one) or the default: in its prompt text when it has one
        # (zero-shot: the transcript; instruct2: the instruction), else in its text. Text that arrives as a stream
        # (the LM's bistream) needs the marker in the prompt text: the default goes there. Ids are torch tensors or
        # numpy arrays (the runtime's): what is added is made in the same kind.
        from cosyserve.core.sampling import array_ops

        (marker,) = encode(ENDOFPROMPT)
        prefix = encode(DEFAULT_PREFIX)
        own: list[int] | None = None
        for i, x in enumerate(inputs):
            text = x.get("text")
            prompt = x.get("prompt_text")
            has_prompt = prompt is not None and prompt.shape[1] > 0
            ops = array_ops(x["text_len"])
            if not hasattr(text, "shape"):  # streamed: an iterator of each piece's ids
                if has_prompt and bool((prompt == marker).any()):
                    yield x
                    continue
                head = ops.asarray([prefix], "int32")
                x = dict(x)
                x["prompt_text"] = ops.cat([head, _int32(prompt)], 1) if has_prompt else head
                x["prompt_text_len"] = ops.asarray([x["prompt_text"].shape[1]], "int32")
                yield x
                continue
            ids = text[0].tolist()
            if i == 0 and marker in ids:
                own = ids[: ids.index(marker) + 1]
            if marker in ids or (has_prompt and bool((prompt == marker).any())):
                yield x
                continue
            x = dict(x)
            key = "prompt_text" if has_prompt and own is None else "text"
            head_ids = prefix if key == "prompt_text" or own is None else own
            ids_t = ops.cat([ops.asarray([head_ids], "int32"), _int32(x[key])], 1)
            x[key], x[f"{key}_len"] = ids_t, ops.asarray([ids_t.shape[1]], "int32")
            yield x

    def speech_tokens(self, tokens: Iterator[int]) -> Iterator[int]:
        from cosyserve.families.cosyvoice3.token2wav import filter_silent_tokens

        return filter_silent_tokens(tokens)


def _int32(ids: Any) -> Any:
    # token ids as int32: a torch tensor or a numpy array
    return ids.int() if hasattr(ids, "int") else ids.astype("int32")
