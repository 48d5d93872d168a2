"""Pure PyTorch CosyVoice modules, state-dict compatible with the official checkpoints."""
