"""Synthesis engine: token-to-audio streaming, the text-to-audio pipeline."""
