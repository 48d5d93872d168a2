"""cosyserve's version: the package's ``__version__``, what a bundle's manifest records as its converter and what
the servers report (Wyoming's ``info``). Here, at the bottom, so that the layers that need it do not import the
package's entry point (:func:`cosyserve.load` and the Python API above it)."""

__version__ = "0.1.0"
