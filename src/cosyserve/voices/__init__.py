"""Voices a model speaks beyond its own speakers: the registry of registered voices (per model family, per tenant),
where it lives, and the per-voice states computed once at registration.

Above :mod:`cosyserve.bundle` (a registry's default place is beside the bundle; states map its files); below the
runtimes, which look voices up here, and the server's voices API.
"""
