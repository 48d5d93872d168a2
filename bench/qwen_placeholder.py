"""Write the zero-valued ``CosyVoice-BlankEN/model.safetensors`` the reference's CosyVoice2 constructor needs.

    python bench/qwen_placeholder.py MODEL_DIR

The reference builds its LM with ``Qwen2ForCausalLM.from_pretrained(<dir>/CosyVoice-BlankEN)`` and then loads
``llm.pt`` strictly, which replaces every weight; so the file's values never matter, only its tensor names and
shapes (those of ``config.json``; tied embeddings stored once). cosyserve never reads this file; make-test-model
does not write it. Measurement only: for timing the reference on a random-weight test model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    import torch
    from safetensors.torch import save_file

    qwen = Path(sys.argv[1]) / "CosyVoice-BlankEN"
    c = json.loads((qwen / "config.json").read_text())
    h, inter, kv = c["hidden_size"], c["intermediate_size"], c["num_key_value_heads"]
    d = h // c["num_attention_heads"]
    t = {"model.embed_tokens.weight": torch.zeros(c["vocab_size"], h), "model.norm.weight": torch.zeros(h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t |= {
            p + "self_attn.q_proj.weight": torch.zeros(h, h),
            p + "self_attn.q_proj.bias": torch.zeros(h),
            p + "self_attn.k_proj.weight": torch.zeros(kv * d, h),
            p + "self_attn.k_proj.bias": torch.zeros(kv * d),
            p + "self_attn.v_proj.weight": torch.zeros(kv * d, h),
            p + "self_attn.v_proj.bias": torch.zeros(kv * d),
            p + "self_attn.o_proj.weight": torch.zeros(h, h),
            p + "mlp.gate_proj.weight": torch.zeros(inter, h),
            p + "mlp.up_proj.weight": torch.zeros(inter, h),
            p + "mlp.down_proj.weight": torch.zeros(h, inter),
            p + "input_layernorm.weight": torch.zeros(h),
            p + "post_attention_layernorm.weight": torch.zeros(h),
        }
    save_file(t, str(qwen / "model.safetensors"), metadata={"format": "pt"})
    print(f"wrote {qwen / 'model.safetensors'}")


if __name__ == "__main__":
    main()
