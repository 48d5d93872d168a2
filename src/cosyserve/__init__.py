"""cosyserve: serve CosyVoice text-to-speech models, ready in milliseconds."""
