"""Process- and OS-level helpers: the page cache, the garbage collector, devices, atomic files.

Above :mod:`cosyserve.core` only; below every layer that loads or serves a model.
"""
