"""The bottom layer: the request and its limits, settings, errors, the stop signal, text feeds, the sampler.

Imported by every layer and importing none above it; nothing here imports torch (or numpy) at import.
"""
