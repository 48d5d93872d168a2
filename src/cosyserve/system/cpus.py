"""How many CPU threads a runtime computes with when the ``threads`` setting does not say.

Both runtimes follow one rule: ``OMP_NUM_THREADS`` where it is set to a positive whole number (torch reads it
for its intra-op pool; ONNX Runtime does not, so the lite runtime reads it here), else the CPUs this process may
run on (its affinity: a container's or ``taskset``'s share, not the host's count). Without the first, a lite
session on a 2-core CI worker beside another beside it spun one thread per host core."""

from __future__ import annotations

import os

__all__ = ["cpu_name", "default_threads", "usable_cpus"]


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_threads() -> int:
    """``OMP_NUM_THREADS`` if it is a positive whole number, else :func:`usable_cpus`."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if value.isdigit() and int(value) > 0:
        return int(value)
    return usable_cpus()


def cpu_name() -> str | None:
    """The CPU's model name as /proc/cpuinfo gives it (what a bench prints beside its figures), or None."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return None
