"""Fun-CosyVoice3-0.5B (``cosyvoice3.yaml``): its frontend, its token-to-audio rules and its conformance kinds.

The modules are :mod:`cosyserve.models.cosyvoice3_lm` (the LM), :mod:`cosyserve.models.dit` (the flow) and
:mod:`cosyserve.models.causal_hift` (the vocoder); the config is read by :mod:`cosyserve.modelconfig`.
"""

from cosyserve.families.cosyvoice3.frontend import SPEECH_TOKENIZER_FILE, build_frontend, build_tokenizer
from cosyserve.families.cosyvoice3.token2wav import SILENT_TOKENS, Token2Wav3, filter_silent_tokens

__all__ = [
    "SILENT_TOKENS",
    "SPEECH_TOKENIZER_FILE",
    "Token2Wav3",
    "build_frontend",
    "build_tokenizer",
    "filter_silent_tokens",
]
