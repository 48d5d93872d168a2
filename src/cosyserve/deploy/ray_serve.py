"""cosyserve on Ray Serve: the same HTTP API in replicas that Ray starts, health-checks and autoscales.

    serve run cosyserve.deploy.ray_serve:app_builder model=/models/sft min_replicas=1 max_replicas=4
    serve run deploy/ray-serve.yaml                      # the same as a config file

Each replica is the whole cosyserve server (:func:`cosyserve.server.app.create_app`: model pool, engine, limits,
metrics) behind Ray Serve's HTTP proxy, which streams its responses; a client that disconnects cancels the
replica's request, which frees the generation as it does under uvicorn. A replica counts as started only once
every preload model is READY (the app's startup waits for it), and Ray's health check asks the same state, so
the proxy never routes to a replica that is loading or whose model failed.

Arguments (``key=value`` on ``serve run``, or ``args:`` in a config file), all strings:

- ``num_replicas`` (default 1), or ``min_replicas`` / ``max_replicas`` / ``target_ongoing_requests`` (default 2)
  for autoscaling on the requests in flight per replica;
- ``num_cpus`` per replica (default 1), ``max_ongoing_requests`` (Ray's default otherwise);
- every other key is a cosyserve setting by name, as ``cosyserve serve`` takes its flag (``model``,
  ``batch_size``, ``pool_config``, ``llm_quantize``, ...; ``model`` may be a list in a config file); the replica reads the rest from its environment as
  ``cosyserve serve`` does. ``host``/``port``/``workers`` are Ray's business and refused.

Several models: the pool config (``pool_config=pool.toml``) serves them from every replica, with the pool's memory
budget, LRU eviction and tenants, rather than Ray Serve's model multiplexing: multiplexing routes a model id to
the replicas that hold it and loads it on a miss, but knows nothing of a model's bytes against the replica's
memory, of tenants' quotas, or of cosyserve's warm-up; with bundles that map in well under a second, a replica
holding every model it may be asked for is both simpler and faster on a miss.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["app_builder", "deployment_options", "settings_flags"]

_RAY_KEYS = frozenset(
    {
        "num_replicas",
        "min_replicas",
        "max_replicas",
        "target_ongoing_requests",
        "num_cpus",
        "max_ongoing_requests",
    }
)
_REFUSED = frozenset({"host", "port", "workers"})


def _number(args: Mapping[str, Any], key: str, cast: Any, lo: float) -> Any:
    raw = args[key]
    try:
        value = cast(raw)
    except (TypeError, ValueError):
        raise ValueError(f"ray_serve argument {key}={raw!r}: expected a number") from None
    if value < lo:
        raise ValueError(f"ray_serve argument {key}={raw!r}: must be >= {lo}")
    return value


def deployment_options(args: Mapping[str, Any]) -> dict[str, Any]:
    """The ``serve.deployment`` options from the Ray keys of ``args`` (replicas, autoscaling, CPUs).

    Raises:
        ValueError: a bad value, or fixed and autoscaled replicas given together; the message names the key.
    """
    opts: dict[str, Any] = {"ray_actor_options": {"num_cpus": 1.0}}
    if "num_cpus" in args:
        opts["ray_actor_options"]["num_cpus"] = _number(args, "num_cpus", float, 0.0)
    if "max_ongoing_requests" in args:
        opts["max_ongoing_requests"] = _number(args, "max_ongoing_requests", int, 1)
    auto = {k for k in ("min_replicas", "max_replicas", "target_ongoing_requests") if k in args}
    if auto and "num_replicas" in args:
        raise ValueError("ray_serve arguments: give num_replicas or min_replicas/max_replicas, not both")
    if auto:
        lo = _number(args, "min_replicas", int, 0) if "min_replicas" in args else 1
        hi = _number(args, "max_replicas", int, 1) if "max_replicas" in args else max(lo, 1)
        if hi < lo:
            raise ValueError(f"ray_serve arguments: max_replicas={hi} is below min_replicas={lo}")
        target = (
            _number(args, "target_ongoing_requests", float, 0.01)
            if "target_ongoing_requests" in args
            else 2.0
        )
        opts["autoscaling_config"] = {
            "min_replicas": lo,
            "max_replicas": hi,
            "target_ongoing_requests": target,
        }
    else:
        opts["num_replicas"] = _number(args, "num_replicas", int, 1) if "num_replicas" in args else 1
    return opts


def settings_flags(args: Mapping[str, Any]) -> dict[str, Any]:
    """The cosyserve settings among ``args`` (every key that is not Ray's; ``model`` names the ``models`` setting,
    a string or, in a config file, a list), checked by loading them once.

    Raises:
        ValueError: an unknown or refused key; :class:`cosyserve.core.settings.SettingsError` for a bad value.
    """
    from cosyserve.core.settings import Settings

    flags = {("models" if k == "model" else k): v for k, v in args.items() if k not in _RAY_KEYS}
    refused = sorted(_REFUSED & flags.keys())
    if refused:
        raise ValueError(f"ray_serve arguments: {', '.join(refused)} are set by Ray Serve, not by cosyserve")
    known = {f for f in Settings.__dataclass_fields__}
    unknown = sorted(k for k in flags if k not in known)
    if unknown:
        raise ValueError(
            f"ray_serve arguments: unknown {', '.join(unknown)}; expected a cosyserve setting by name "
            f"(see `cosyserve serve --help`) or one of {', '.join(sorted(_RAY_KEYS))}"
        )
    Settings.load(flags=flags)  # every value checked here, on the driver, before a replica starts
    return flags


class CosyServeReplica:
    """One Ray Serve replica: the cosyserve app, READY before Ray routes to it."""

    def __init__(self, flags: dict[str, Any]) -> None:
        from cosyserve.core.settings import Settings
        from cosyserve.server.app import create_app

        self._app = create_app(Settings.load(flags=flags), ready_before_serving=True)

    def __serve_build_asgi_app__(self) -> Any:
        return self._app

    async def check_health(self) -> None:
        """Ray's periodic health check: raises (the replica is replaced) once a model failed."""
        state = self._app.state.cosy
        if state.startup_error is not None:
            raise RuntimeError(f"cosyserve: startup failed: {state.startup_error}")
        if state.startup_done and not state.draining and not state.ready():
            raise RuntimeError(f"cosyserve: a preload model is not ready: {state.describe_models()}")


def app_builder(args: dict[str, Any]) -> Any:
    """The Ray Serve application (``serve run cosyserve.deploy.ray_serve:app_builder key=value ...``)."""
    try:
        from ray import serve
    except ImportError as e:
        raise ImportError(
            f"cosyserve on Ray Serve needs Ray Serve: pip install 'cosyserve[ray]' ({e})"
        ) from e

    options = deployment_options(args)
    flags = settings_flags(args)

    @serve.ingress()
    class _Ingress(CosyServeReplica):
        async def __init__(self, flags: dict[str, Any]) -> None:  # type: ignore[misc]
            CosyServeReplica.__init__(self, flags)

    return serve.deployment(name="cosyserve", **options)(_Ingress).bind(flags)
