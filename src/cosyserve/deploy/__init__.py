"""Deployments of the cosyserve server on other hosts: :mod:`cosyserve.deploy.ray_serve` (Ray Serve)."""
