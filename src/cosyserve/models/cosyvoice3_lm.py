"""CosyVoice3's speech-token LM: CosyVoice2's Qwen2 LM with 200 special ids instead of CosyVoice2's 3.

Mirrors ``cosyvoice.llm.llm.CosyVoice3LM``. The differences from :class:`~cosyserve.models.qwen2lm.Qwen2LM`:

- no ``llm_embedding``: ``sos`` (6561) and ``task_id`` (6563) are rows of ``speech_embedding`` (6561 + 200 rows);
  ``llm_decoder`` is ``Linear(hidden, 6761)`` without bias. Ids: 6562 is the real end of speech, 6564 the "fill"
  token of streaming text input; every id from 6561 up ends an utterance.
- the prompt rule: ``<|endofprompt|>`` (text id 151646, hard-coded in the reference) must occur in prompt text +
  text; the reference asserts it and so do we (a ``ValueError`` saying what to write).
- the reference's minimum-length rule masks id ``speech_token_size`` = 6561 before ``min_len`` tokens, which for
  CosyVoice3 is ``sos``, not the real EOS: the EOS stays drawable. Kept as is (:attr:`eos_token` here is the id the
  shared :class:`~cosyserve.models.llm.SpeechLM` masks and stops from, 6561; :attr:`eos` is the real one).
- streaming text input (the reference's ``inference_bistream``, run by :mod:`cosyserve.runtime.decode`): the
  prompt text splits after its first ``<|endofprompt|>`` (:attr:`CosyVoice3LM.prompt_marker`, in its stop rules).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from cosyserve.core.sampling import PromptRuleError
from cosyserve.models.llm import SpeechLM
from cosyserve.models.qwen2lm import Qwen2LM, Qwen2LMConfig, _Encoder, _mix_ratio

__all__ = ["ENDOFPROMPT", "CosyVoice3LM", "CosyVoice3LMConfig", "PromptRuleError"]

ENDOFPROMPT = 151646  # <|endofprompt|>'s text id, as the reference hard-codes it
N_SPECIAL = 200  # special ids after the speech tokens


@dataclass
class CosyVoice3LMConfig(Qwen2LMConfig):
    TARGET: ClassVar[str] = "cosyvoice.llm.llm.CosyVoice3LM"


class CosyVoice3LM(Qwen2LM):
    """CosyVoice3's LM; attribute names match the official ``llm.pt`` keys."""

    ROW_TABLES = ("llm.model.model.embed_tokens.weight", "speech_embedding.weight")
    prompt_marker = ENDOFPROMPT

    def __init__(self, cfg: CosyVoice3LMConfig) -> None:
        SpeechLM.__init__(self)
        self.cfg = cfg
        n = cfg.speech_token_size
        self.sos, self.eos, self.task_id, self.fill_token = n, n + 1, n + 2, n + 3
        self.eos_token = n  # the first stop id: masked before min_len (see the module docstring)
        self.mix_ratio = _mix_ratio(cfg)
        self.llm = _Encoder(cfg.qwen)
        self.llm_decoder = nn.Linear(cfg.llm_output_size, n + N_SPECIAL, bias=False)
        self.speech_embedding = nn.Embedding(n + N_SPECIAL, cfg.llm_input_size)
        self._register_load_state_dict_pre_hook(self._drop_text_head)

    def _row(self, token: int) -> Tensor:
        return self.speech_embedding.weight[token].reshape(1, 1, -1)

    def embed_inputs(
        self,
        text: Tensor,
        text_len: Tensor,
        prompt_text: Tensor,
        prompt_text_len: Tensor,
        prompt_speech_token: Tensor,
        prompt_speech_token_len: Tensor,
        embedding: Tensor,
    ) -> Tensor:
        """The LM's prompt (batch 1): sos, Qwen embeddings of prompt text + text, task_id, prompt speech (sos and
        task_id are speech-embedding rows). ``embedding`` (the speaker) is not used, as in the reference.

        Raises:
            PromptRuleError: ``<|endofprompt|>`` is in neither text nor prompt text.
        """
        ids = torch.cat([prompt_text, text], dim=1).to(torch.int64)
        self.rules.require_marker(ids.reshape(-1).tolist())
        dtype = self.speech_embedding.weight.dtype
        parts = [self._row(self.sos), self.stack.embed_tokens(ids).to(dtype), self._row(self.task_id)]
        if int(prompt_speech_token_len.reshape(-1)[0]) != 0:
            parts.append(self.speech_embedding(prompt_speech_token.to(torch.int64)))
        return torch.cat(parts, dim=1)

    def warmup_input(self) -> dict[str, Tensor]:
        # <|endofprompt|> and three ids: the prompt rule holds
        return {"text": torch.tensor([[ENDOFPROMPT, 1, 2, 3]], dtype=torch.int32)}
