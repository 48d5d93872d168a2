"""The ``cosyserve`` command line (:mod:`cosyserve.cli.commands`; its parser: :mod:`cosyserve.cli.parser`)."""

from cosyserve.cli.commands import main

__all__ = ["main"]
